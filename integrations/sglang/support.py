"""Which SGLang configurations the multi-mode runner serves, and its batch sizes.

The runner covers the common single-node setups: tensor parallelism without attention-side gathering,
with or without EAGLE/EAGLE-3/STANDALONE speculation. Features whose graph inputs the runner does not
stage (two-batch overlap, pipeline parallelism, DP attention, LoRA, encoder-decoder, mrope, hybrid SWA,
mamba state, ngram/DFLASH speculation, ...) are reported here so :func:`~.patch.install` can hand those
servers to SGLang's own runner instead of replaying a graph that would read stale buffers.

Settings are read as SGLang *resolved* them (:func:`resolved_arg`), not as typed: SGLang 0.5.23 keeps the
raw input on ``ServerArgs`` and its decisions apart (``--lora-paths`` alone turns LoRA on while the raw
``enable_lora`` stays ``None``; a model can turn multi-layer EAGLE on; ``--speculative-algorithm EAGLE`` with
a Gemma-4 assistant draft becomes ``FROZEN_KV_MTP``).
"""
from __future__ import annotations

import inspect
from typing import Any, List, Tuple

from .fields import model_flag

# (server_args attribute, what it is): any of these switched on needs inputs the runner does not stage.
_UNSUPPORTED_FLAGS = (
    ("enable_two_batch_overlap", "two-batch overlap"),
    ("enable_pdmux", "PD multiplexing"),
    ("enable_torch_compile", "torch.compile of graph batch sizes"),
    ("enable_dp_attention", "DP attention"),
    ("enable_profile_cuda_graph", "CUDA graph profiling"),
    ("debug_cuda_graph", "breakable CUDA graph debugging"),
)
#: Attention inputs padded and gathered across ranks: SGLang's runner stages them, graphpool's does not.
_GATHERED = "gathered attention inputs (SGLang's require_gathered_buffer)"


def resolved_arg(server_args: Any, name: str, default: Any = None) -> Any:
    """``server_args.<name>`` as SGLang resolved it.

    SGLang 0.5.23 leaves the raw input on the record and appends its resolution's decisions to a declaration
    stash (read through its ``resolution_result``); 0.5.17 writes them onto the fields (and keeps the stash);
    0.5.14 and the classic releases assign the fields. A stand-in without either has plain attributes.
    """
    try:
        from sglang.srt.arg_groups.overrides import resolution_result  # 0.5.2x
    except ImportError:
        resolution_result = None
    if resolution_result is not None and hasattr(server_args, "_resolved_overrides"):
        try:
            return resolution_result(server_args, name, default)
        except (AttributeError, TypeError):  # a record SGLang cannot read: its plain attribute then
            pass
    for _source, declared in reversed(getattr(server_args, "_resolved_overrides", None) or ()):
        if name in declared:
            return declared[name]
    return getattr(server_args, name, default)


def server_args_refusals(server_args: Any) -> List[Tuple[str, str]]:
    """What :func:`unsupported_reasons` refuses that the server arguments alone tell: (the launch flag as
    given, what it is). The launcher refuses these before SGLang starts; the rest needs the loaded model."""
    refused = [(f"--{flag.replace('_', '-')}", what) for flag, what in _UNSUPPORTED_FLAGS
               if resolved_arg(server_args, flag, False)]
    lora = resolved_arg(server_args, "enable_lora")
    paths = resolved_arg(server_args, "lora_paths")
    if lora or (lora is None and paths):  # SGLang turns LoRA on for --lora-paths alone
        refused.append(("--enable-lora" if getattr(server_args, "enable_lora", None) else "--lora-paths", "LoRA"))
    attn_dp = resolved_arg(server_args, "attn_dp_size", 1) or 1  # 0.5.23's spelling of DP attention
    if attn_dp > 1 and not any(what == "DP attention" for _, what in refused):
        refused.append((f"--attn-dp-size {attn_dp}", "DP attention"))
    pp_size = resolved_arg(server_args, "pp_size", 1) or 1
    if pp_size > 1:
        refused.append((f"--pp-size {pp_size}", "pipeline parallelism"))
    dllm = resolved_arg(server_args, "dllm_algorithm")
    if dllm:
        refused.append((f"--dllm-algorithm {dllm}", "diffusion LLM decoding"))
    # Gathered attention inputs without DP attention: SGLang's predicate reads MoE state that only the
    # scheduler process sets up, so here the two flags it reads decide (unsupported_reasons asks SGLang).
    a2a = str(resolved_arg(server_args, "moe_a2a_backend") or "none")
    dense_tp = resolved_arg(server_args, "moe_dense_tp_size")
    if not resolved_arg(server_args, "disable_attn_tp_gather", False) and (a2a != "none" or dense_tp is not None):
        flag = f"--moe-a2a-backend {a2a}" if a2a != "none" else f"--moe-dense-tp-size {dense_tp}"
        refused.append((flag, _GATHERED))
    return refused


def sglang_requires_gathering(server_args: Any) -> bool:
    """SGLang's own ``require_gathered_buffer``: whether its runner pads and gathers attention inputs across
    ranks (DP attention, an MoE all-to-all backend, ``--moe-dense-tp-size``), which graphpool's runner does
    not stage. It takes ``server_args`` in 0.5.9 to 0.5.18; 0.5.23 reads the published runtime context."""
    try:
        from sglang.srt.utils.common import require_gathered_buffer

        takes_args = bool(inspect.signature(require_gathered_buffer).parameters)
        return bool(require_gathered_buffer(server_args) if takes_args else require_gathered_buffer())
    except (ImportError, AttributeError, ValueError, AssertionError, RuntimeError):
        # Another layout, a stand-in without SGLang's settings (or one its asserts reject), or no published
        # runtime context (0.5.23 raises RuntimeError): the flags SGLang's predicate reads decide.
        return any(what == _GATHERED for _, what in server_args_refusals(server_args))


def unsupported_reasons(model_runner: Any) -> List[str]:
    """Why :class:`~.runner.MultiModeCudaGraphRunner` cannot serve ``model_runner`` (empty: it can).

    Reads only plain attributes, with defaults, so it also works on a test stand-in for ``ModelRunner``.
    """
    args = model_runner.server_args
    reasons = [f"{what} ({flag})" for flag, what in server_args_refusals(args) if what != _GATHERED]
    if sglang_requires_gathering(args):  # in the scheduler process SGLang's own predicate knows best
        reasons.append(_GATHERED)
    config = model_runner.model_config
    if getattr(config, "is_encoder_decoder", False):
        reasons.append("encoder-decoder model")
    for attr, what in (("is_hybrid_swa", "hybrid sliding-window KV cache"), ("model_is_mrope", "mrope positions"),
                       ("use_ngram_embedding", "ngram embedding"), ("is_draft_worker", "draft worker")):
        if model_flag(model_runner, attr):
            reasons.append(what)
    if getattr(model_runner, "hisparse_coordinator", None) is not None:
        reasons.append("hierarchical sparse attention")
    if mamba_extra_buffer(args):
        reasons.append("mamba state tracking")
    spec = model_runner.spec_algorithm
    if not spec.is_none() and not (spec.is_eagle() or spec.is_standalone()):  # is_speculative() is 0.5.11+
        reasons.append(f"speculative algorithm {spec.name}")
    return reasons


def mamba_extra_buffer(server_args: Any) -> bool:
    """Whether the mamba radix cache keeps its extra state buffer (whose track indices graphs would read).

    A ``ServerArgs`` method up to 0.5.17; 0.5.23 derives it at publish (``get_exec().mamba``) from the two
    settings read here, as resolved (a mamba model's ``auto`` strategy is resolved per model).
    """
    method = getattr(server_args, "enable_mamba_extra_buffer", None)
    if callable(method):
        return bool(method())
    return (resolved_arg(server_args, "disable_radix_cache", False) is False
            and resolved_arg(server_args, "mamba_radix_cache_strategy") in ("extra_buffer", "extra_buffer_lazy"))


#: Spec-v2 workers with a ``forward_batch_generation`` of their own, which the switch does not drive.
_OWN_WORKERS = (("enable_multi_layer_eagle", "--enable-multi-layer-eagle", "multi-layer EAGLE (its own spec-v2 worker, "
                 "MultiLayerEagleWorkerV2)"),)


def switch_refusals(server_args: Any) -> List[Tuple[str, str]]:
    """Why the runner-API speculation switch (and the adaptive step-0 routing) cannot act on this server:
    (the setting as SGLang resolved it, what it is). The switch wraps ``EAGLEWorkerV2.forward_batch_generation``;
    SGLang runs multi-layer EAGLE and the frozen-KV MTP draft through workers with their own."""
    refused = [(flag, what) for attr, flag, what in _OWN_WORKERS if resolved_arg(server_args, attr, False)]
    algorithm = str(resolved_arg(server_args, "speculative_algorithm") or "").upper()
    if algorithm == "FROZEN_KV_MTP":
        refused.append(("--speculative-algorithm FROZEN_KV_MTP (as SGLang resolved it)",
                        "the frozen-KV MTP draft (its own spec-v2 worker, FrozenKVMTPWorkerV2)"))
    return refused


def capture_batch_sizes(model_runner: Any) -> List[int]:
    """The batch sizes to capture: ``--cuda-graph-bs``, capped at the request pool's size.

    Like SGLang, the request pool's size itself is added when it is smaller than the largest listed
    size, so the largest batch the server can form still replays a graph.
    """
    listed = model_runner.server_args.cuda_graph_bs
    if not listed:
        raise ValueError(
            f"server_args.cuda_graph_bs is {listed!r}: the multi-mode runner needs the list of batch sizes to "
            f"capture; pass --cuda-graph-bs 1 2 4 8 ... (SGLang fills it in ServerArgs when left unset)")
    max_requests = model_runner.req_to_token_pool.size
    sizes = [int(bs) for bs in listed]
    if max(sizes) > max_requests:
        sizes.append(max_requests)
    return sorted({bs for bs in sizes if 1 <= bs <= max_requests})

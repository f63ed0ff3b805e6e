"""Which SGLang configurations the multi-mode runner serves, and its batch sizes.

The runner covers the common single-node setups: tensor parallelism without attention-side gathering,
with or without EAGLE/EAGLE-3/STANDALONE speculation. Features whose graph inputs the runner does not
stage (two-batch overlap, pipeline parallelism, DP attention, LoRA, encoder-decoder, mrope, hybrid SWA,
mamba state, ngram/DFLASH speculation, ...) are reported here so :func:`~.patch.install` can hand those
servers to SGLang's own runner instead of replaying a graph that would read stale buffers.
"""
from __future__ import annotations

import inspect
from typing import Any, List, Tuple

# (server_args attribute, what it is): any of these switched on needs inputs the runner does not stage.
_UNSUPPORTED_FLAGS = (
    ("enable_two_batch_overlap", "two-batch overlap"),
    ("enable_pdmux", "PD multiplexing"),
    ("enable_lora", "LoRA"),
    ("enable_torch_compile", "torch.compile of graph batch sizes"),
    ("enable_dp_attention", "DP attention"),
    ("enable_profile_cuda_graph", "CUDA graph profiling"),
    ("debug_cuda_graph", "breakable CUDA graph debugging"),
)
#: Attention inputs padded and gathered across ranks: SGLang's runner stages them, graphpool's does not.
_GATHERED = "gathered attention inputs (SGLang's require_gathered_buffer)"


def server_args_refusals(server_args: Any) -> List[Tuple[str, str]]:
    """What :func:`unsupported_reasons` refuses that the server arguments alone tell: (the launch flag as
    given, what it is). The launcher refuses these before SGLang starts; the rest needs the loaded model."""
    refused = [(f"--{flag.replace('_', '-')}", what) for flag, what in _UNSUPPORTED_FLAGS
               if getattr(server_args, flag, False)]
    pp_size = getattr(server_args, "pp_size", 1) or 1
    if pp_size > 1:
        refused.append((f"--pp-size {pp_size}", "pipeline parallelism"))
    dllm = getattr(server_args, "dllm_algorithm", None)
    if dllm:
        refused.append((f"--dllm-algorithm {dllm}", "diffusion LLM decoding"))
    # Gathered attention inputs without DP attention: SGLang's predicate reads MoE state that only the
    # scheduler process sets up, so here the two flags it reads decide (unsupported_reasons asks SGLang).
    a2a = str(getattr(server_args, "moe_a2a_backend", None) or "none")
    dense_tp = getattr(server_args, "moe_dense_tp_size", None)
    if not getattr(server_args, "disable_attn_tp_gather", False) and (a2a != "none" or dense_tp is not None):
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
    reasons = [what for _, what in server_args_refusals(args) if what != _GATHERED]
    if sglang_requires_gathering(args):  # in the scheduler process SGLang's own predicate knows best
        reasons.append(_GATHERED)
    config = model_runner.model_config
    if getattr(config, "is_encoder_decoder", False):
        reasons.append("encoder-decoder model")
    for attr, what in (("is_hybrid_swa", "hybrid sliding-window KV cache"), ("model_is_mrope", "mrope positions"),
                       ("use_ngram_embedding", "ngram embedding"), ("is_draft_worker", "draft worker")):
        if getattr(model_runner, attr, False):
            reasons.append(what)
    if getattr(model_runner, "hisparse_coordinator", None) is not None:
        reasons.append("hierarchical sparse attention")
    enable_mamba = getattr(args, "enable_mamba_extra_buffer", None)
    if callable(enable_mamba) and enable_mamba():
        reasons.append("mamba state tracking")
    spec = model_runner.spec_algorithm
    if not spec.is_none() and not (spec.is_eagle() or spec.is_standalone()):  # is_speculative() is 0.5.11+
        reasons.append(f"speculative algorithm {spec.name}")
    return reasons


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

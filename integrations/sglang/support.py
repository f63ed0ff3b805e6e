"""Which SGLang configurations the multi-mode runner serves, and its batch sizes.

The runner covers the common single-node setups: tensor parallelism without attention-side gathering,
with or without EAGLE/EAGLE-3/STANDALONE speculation. Features whose graph inputs the runner does not
stage (two-batch overlap, pipeline parallelism, DP attention, LoRA, encoder-decoder, mrope, hybrid SWA,
mamba state, ngram/DFLASH speculation, ...) are reported here so :func:`~.patch.install` can hand those
servers to SGLang's own runner instead of replaying a graph that would read stale buffers.
"""
from __future__ import annotations

from typing import Any, List

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


def unsupported_reasons(model_runner: Any) -> List[str]:
    """Why :class:`~.runner.MultiModeCudaGraphRunner` cannot serve ``model_runner`` (empty: it can).

    Reads only plain attributes, with defaults, so it also works on a test stand-in for ``ModelRunner``.
    """
    args = model_runner.server_args
    reasons = [what for flag, what in _UNSUPPORTED_FLAGS if getattr(args, flag, False)]
    if getattr(args, "pp_size", 1) > 1:
        reasons.append("pipeline parallelism")
    if getattr(args, "dllm_algorithm", None):
        reasons.append("diffusion LLM decoding")
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

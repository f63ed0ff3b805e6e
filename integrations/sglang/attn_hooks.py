"""The out-of-graph / in-graph attention hooks and the forward context, shared by both adapters.

SGLang 0.5.13 moved its attention backends from ``init_forward_metadata_capture_cuda_graph`` /
``init_forward_metadata_replay_cuda_graph`` to ``init_forward_metadata_out_graph(fb, in_capture)`` (outside
the graph) and ``init_forward_metadata_in_graph(fb)`` (inside it), with the backend published to the model
through ``forward_context``; pre-planned batches say so through ``forward_batch.needs_forward_metadata_init()``.
0.5.13 keeps the classic ``CudaGraphRunner`` API (:mod:`.runner`); 0.5.14+ has the runner package
(:mod:`.runner_api`). Both adapters drive the new hooks through this module.
"""
from __future__ import annotations

import contextlib
import importlib.util
import inspect
from types import SimpleNamespace
from typing import Any

from sglang.srt.layers.dp_attention import DpPaddingMode
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from graphpool import Step


def _has_forward_context() -> bool:
    try:
        return importlib.util.find_spec("sglang.srt.model_executor.forward_context") is not None
    except ModuleNotFoundError:
        return False


#: Whether this SGLang drives attention through the out-of-graph / in-graph hooks (0.5.13+).
NEW_HOOKS = _has_forward_context()

if NEW_HOOKS:
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    # 0.5.13 / 0.5.14's forward_context(ctx) vs 0.5.2x's forward_context(ctx, forward_batch=...).
    _CONTEXT_TAKES_BATCH = "forward_batch" in inspect.signature(forward_context).parameters


def forward_context_for(attn_backend: Any, forward_batch: Any) -> Any:
    """A forward context publishing ``attn_backend`` to the model (a no-op before 0.5.13)."""
    if not NEW_HOOKS:
        return contextlib.nullcontext()
    ctx = ForwardContext(attn_backend=attn_backend)
    return forward_context(ctx, forward_batch=forward_batch) if _CONTEXT_TAKES_BATCH else forward_context(ctx)


def needs_metadata(forward_batch: ForwardBatch) -> bool:
    """``forward_batch.needs_forward_metadata_init()`` (0.5.13+); True where SGLang has no such marker."""
    needs = getattr(forward_batch, "needs_forward_metadata_init", None)
    return True if needs is None else bool(needs())


#: Per-batch fields SGLang's ``build_replay_fb_view`` hands the backend unchanged from the batch (0.5.17 to
#: 0.5.23; absent ones are None): the unified pool's virtual ids and their plan, DeepSeek-V4's write
#: locations, the host maximum length and its override.
_PASSED_THROUGH = ("max_seq_len_host", "max_seq_len_override", "kv_loc_plan", "kv_loc_cols", "out_cache_loc_virtual",
                   "origin_out_cache_loc", "out_cache_loc_dsv4")


def replay_view(forward_batch: ForwardBatch, step: Step, seq_lens_cpu: Any, seq_len_fill_value: int) -> Any:
    """What the attention backend plans a replay from (``init_forward_metadata_out_graph``), as SGLang's
    ``build_replay_fb_view`` builds it: the padded static views, the batch's own mode (a DECODE step passes
    ``spec_info=None``: to FlashInfer/FA3 a DECODE step with one is a draft decode), the per-batch fields
    :data:`_PASSED_THROUGH`. ``seq_lens_cpu`` is the runner's padded CPU copy. What graphpool refuses to serve
    stays empty: mamba track indices (the mamba extra buffer), LoRA ids, DP attention's token counts."""
    mode, bs, raw_bs, views = forward_batch.forward_mode, step.batch.bs, forward_batch.batch_size, step.batch.inputs
    seq_lens_sum = forward_batch.seq_lens_sum
    return SimpleNamespace(
        batch_size=bs, forward_mode=mode, actual_forward_mode=mode, input_ids=views["input_ids"],
        positions=views["positions"], req_pool_indices=views["req_pool_indices"], seq_lens=views["seq_lens"],
        seq_lens_cpu=None if forward_batch.seq_lens_cpu is None else seq_lens_cpu[:bs],
        seq_lens_sum=None if seq_lens_sum is None else seq_lens_sum + (bs - raw_bs) * seq_len_fill_value,
        num_padding=bs - raw_bs, encoder_lens=None, out_cache_loc=views["out_cache_loc"],
        spec_info=forward_batch.spec_info if mode == ForwardMode.TARGET_VERIFY else None,
        **{name: getattr(forward_batch, name, None) for name in _PASSED_THROUGH},
        mamba_track_indices=None, lora_ids=None, global_num_tokens_cpu=None,
        dp_padding_mode=DpPaddingMode.get_default_mode_in_cuda_graph(), can_run_decode_cuda_graph=True)

"""The dynamic speculation switch: above a batch-size threshold, run true plain-decode steps (EAGLE v1).

Speculation pays at low concurrency and loses at high concurrency, so :class:`SpeculationSwitch` turns
it off once the batch grows past ``off_above`` and back on at ``on_at_or_below`` (hysteresis). A plain
step must do what EAGLE v1 leaves undone, because ``ScheduleBatch.prepare_for_decode`` returns early
when speculation is on:

1. allocate one KV slot per sequence and record it in ``req_to_token`` at position ``seq_len``;
2. take ``input_ids`` from the last verified tokens and ``positions`` from ``seq_lens``, advance
   ``seq_lens`` by one;
3. run the target in DECODE mode with ``spec_info=None``, which the multi-mode runner routes to a
   DECODE graph (hidden states FULL, for step 4);
4. keep the draft model's KV in step: a one-token draft extend at the same position, fed the target's
   hidden state, exactly what EAGLE does after a verify, so speculation resumes cleanly.

:func:`plain_decode_batch` (steps 1-2) is plain tensors on SGLang objects and is what the CPU harness
drives; :func:`eagle_v1_plain_decode` wires all four steps into SGLang's EAGLE v1 worker.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from graphpool import SpeculationPolicy
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

log = logging.getLogger(__name__)


class SpeculationSwitch:
    """Whether each step speculates, with hysteresis, and what the switch did.

    Args:
        off_above: plain decode once the batch size exceeds this.
        on_at_or_below: speculate again once the batch size is at or below this (default ``off_above``).
    """

    def __init__(self, off_above: int, on_at_or_below: Optional[int] = None):
        self.policy = SpeculationPolicy(off_above, on_at_or_below, spec_mode="target_verify", plain_mode="decode")
        self.spec_steps = 0
        self.plain_steps = 0

    def speculate(self, batch_size: int) -> bool:
        """The decision for a decode step of ``batch_size`` sequences (counts it)."""
        spec = self.policy.choose(batch_size) == "target_verify"
        if spec:
            self.spec_steps += 1
        else:
            self.plain_steps += 1
        return spec

    @property
    def switches(self) -> int:
        return self.policy.switches


def plain_decode_batch(model_runner: Any, *, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                       seq_lens_cpu: torch.Tensor, last_tokens: torch.Tensor,
                       out_cache_loc: torch.Tensor) -> ForwardBatch:
    """The DECODE ForwardBatch of a plain step (steps 1-2 of the module docstring).

    Args:
        model_runner: the target ``ModelRunner``.
        req_pool_indices: each sequence's row in ``req_to_token``.
        seq_lens, seq_lens_cpu: tokens each sequence has in the KV cache *before* this step; the last
            verified token is not among them (it is this step's input).
        last_tokens: the last verified token of each sequence.
        out_cache_loc: one freshly allocated KV slot per sequence.

    Returns:
        A ``ForwardBatch`` in DECODE mode with ``spec_info=None``, hidden states FULL, ``seq_lens``
        advanced by one; ``req_to_token[req, seq_len]`` now holds the new slot.
    """
    bs = req_pool_indices.shape[0]
    if not (seq_lens.shape[0] == last_tokens.shape[0] == out_cache_loc.shape[0] == bs):
        raise ValueError(f"plain decode step: {bs} sequences but seq_lens {tuple(seq_lens.shape)}, last_tokens "
                         f"{tuple(last_tokens.shape)}, out_cache_loc {tuple(out_cache_loc.shape)}; pass one row "
                         f"per sequence (one KV slot each)")
    model_runner.req_to_token_pool.write((req_pool_indices, seq_lens), out_cache_loc.to(torch.int32))
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=last_tokens.to(torch.int64),
        req_pool_indices=req_pool_indices, seq_lens=seq_lens + 1, seq_lens_cpu=seq_lens_cpu + 1,
        out_cache_loc=out_cache_loc, seq_lens_sum=int(seq_lens_cpu.sum()) + bs, positions=seq_lens.to(torch.int64),
        spec_info=None, capture_hidden_mode=CaptureHiddenMode.FULL, attn_backend=model_runner.attn_backend,
        req_to_token_pool=model_runner.req_to_token_pool, token_to_kv_pool=model_runner.token_to_kv_pool,
        spec_algorithm=model_runner.spec_algorithm)


# ----------------------------------------------------------------------------------- EAGLE v1 wiring
@dataclass
class _Saved:
    forward_mode: ForwardMode
    spec_info: Any


def eagle_v1_plain_decode(worker: Any, batch: Any) -> Any:
    """One plain decode step of an EAGLE v1 ``batch`` (a ``ScheduleBatch`` in DECODE mode).

    Returns SGLang's ``GenerationBatchResult`` with one token per sequence; leaves ``batch.spec_info``
    an ``EagleDraftInput`` for the next speculative round, as a verify step would.
    """
    from sglang.srt.managers.scheduler import GenerationBatchResult
    from sglang.srt.mem_cache.common import alloc_for_decode

    draft_input = batch.spec_info
    bs = batch.batch_size()
    for req in batch.reqs:
        req.decode_batch_idx += 1
        req.kv_committed_len += 1
    prefix_lens_cpu = batch.seq_lens_cpu.clone()
    # Steps 1-2 through SGLang's own allocator; alloc_for_decode writes req_to_token at seq_lens.
    batch.out_cache_loc = alloc_for_decode(batch, token_per_req=1)
    batch.input_ids = draft_input.bonus_tokens.to(torch.int64)
    batch.forward_mode, batch.spec_info = ForwardMode.DECODE, None
    batch.seq_lens = batch.seq_lens + 1
    batch.seq_lens_cpu = batch.seq_lens_cpu + 1
    batch.orig_seq_lens = batch.orig_seq_lens + 1
    batch.seq_lens_sum += bs
    # Step 3: the target in DECODE mode; the multi-mode runner replays a DECODE graph.
    worker_batch = batch.get_model_worker_batch()
    worker_batch.capture_hidden_mode = CaptureHiddenMode.FULL
    result = worker.target_worker.forward_batch_generation(worker_batch)
    # Step 4: one-token draft extend at the same slots, fed the target hidden state; EAGLE's
    # prepare_for_extend turns input_ids into the token just produced.
    batch.forward_mode = ForwardMode.EXTEND
    batch.extend_lens = [1] * bs
    batch.prefix_lens = prefix_lens_cpu.tolist()
    batch.extend_num_tokens = bs
    batch.extend_logprob_start_lens = [0] * bs
    batch.return_logprob_backup, batch.return_logprob = batch.return_logprob, False
    try:
        worker.forward_draft_extend(batch, result.logits_output.hidden_states, result.next_token_ids,
                                    batch.seq_lens_cpu)
    finally:
        batch.return_logprob = batch.return_logprob_backup
        batch.forward_mode = ForwardMode.DECODE
    return GenerationBatchResult(logits_output=result.logits_output, next_token_ids=result.next_token_ids,
                                 num_correct_drafts=0, num_correct_drafts_per_req_cpu=[0] * bs,
                                 can_run_cuda_graph=result.can_run_cuda_graph)


_original_forward: Optional[Any] = None


def install_speculation_switch(off_above: int, on_at_or_below: Optional[int] = None) -> SpeculationSwitch:
    """Make SGLang's EAGLE v1 worker decode plainly above ``off_above`` sequences (in this process).

    Prefill batches and small decode batches keep SGLang's speculative path unchanged.
    """
    global _original_forward
    from sglang.srt.speculative.eagle_worker import EAGLEWorker

    switch = SpeculationSwitch(off_above, on_at_or_below)
    original = _original_forward or EAGLEWorker.forward_batch_generation

    @functools.wraps(original)
    def forward_batch_generation(self: Any, batch: Any) -> Any:
        is_decode = batch.forward_mode.is_decode() and not batch.is_extend_in_batch
        if is_decode and not switch.speculate(batch.batch_size()):
            return eagle_v1_plain_decode(self, batch)
        return original(self, batch)

    forward_batch_generation.graphpool_switch = switch  # type: ignore[attr-defined]  # for inspection
    _original_forward = original
    EAGLEWorker.forward_batch_generation = forward_batch_generation
    log.info("graphpool: speculation off above %d sequences, back on at <= %d", switch.policy.off_above,
             switch.policy.on_at_or_below)
    return switch


def uninstall_speculation_switch() -> None:
    """Restore SGLang's ``EAGLEWorker.forward_batch_generation``."""
    global _original_forward
    if _original_forward is not None:
        from sglang.srt.speculative.eagle_worker import EAGLEWorker

        EAGLEWorker.forward_batch_generation = _original_forward
        _original_forward = None

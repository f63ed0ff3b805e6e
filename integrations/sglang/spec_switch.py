"""The dynamic speculation switch: above a batch-size threshold, run true plain-decode steps (EAGLE v1).

Speculation pays at low concurrency and loses at high concurrency, so :class:`SpeculationSwitch` turns
it off once the batch grows past ``off_above`` and back on at ``on_at_or_below`` (hysteresis). A plain
step must do what EAGLE v1 leaves undone, because ``ScheduleBatch.prepare_for_decode`` returns early
when speculation is on:

1. allocate one KV slot per sequence and record it in ``req_to_token`` at position ``seq_len``;
2. take ``input_ids`` from the last verified tokens and ``positions`` from ``seq_lens``, advance
   ``seq_lens`` by one;
3. run the target in DECODE mode with ``spec_info=None``, which the multi-mode runner routes to a
   DECODE graph (hidden states FULL for EAGLE, for step 4);
4. no draft work: the draft model's KV falls behind, and a :class:`~.draft_lag.DraftLag` records from
   which position (with the target hidden states EAGLE's draft will read there). When speculation
   resumes, each lagging request catches up with ONE draft extend over its plainly decoded tokens
   (:func:`~.eagle_v1_catch_up.eagle_v1_catch_up`, SGLang's draft-prefill path), then drafts as usual.
   So a plain step costs the target's DECODE step only, as decoding without speculation does.

:func:`plain_decode_batch` (steps 1-2) is plain tensors on SGLang objects (the harness's engine-level
test drives it); :func:`~.eagle_v1_plain.eagle_v1_plain_decode` wires the steps into SGLang's EAGLE v1
worker together with the bookkeeping spec v1 leaves to its verify step (tokens recorded, finish checks,
draft state for unfinished rows), and :func:`install_speculation_switch` installs it with the catch-up.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Dict, Optional

import torch

from graphpool import AcceptanceGate, SpeculationPolicy
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

from .draft_lag import DEFAULT_MAX_LAG_STEPS, DraftLag
from .eagle_v1_catch_up import eagle_v1_catch_up
from .eagle_v1_plain import eagle_v1_plain_decode, process_plain_step_result
from .patch import plain_step_refusal
from .tp import LazyAgreement

log = logging.getLogger(__name__)


class SpeculationSwitch:
    """Whether each step speculates, with hysteresis, and what the switch did. The decision derives from the
    batch size and, with ``min_accept``, the verify steps' accepted drafts: state SGLang keeps identical on every
    tensor-parallel rank (:mod:`.tp`); in debug mode under TP > 1 every rank's decision is compared.

    Args:
        off_above: plain decode once the batch size exceeds this.
        on_at_or_below: speculate again once the batch size is at or below this (default ``off_above``).
        min_accept: also decode plainly while verify steps commit fewer tokens per sequence than this
            (:class:`graphpool.AcceptanceGate`; ``None``: batch size alone decides).
        pause_steps: the gate's pause; the default, the draft lag's window, lets the probe's catch-up cover
            the whole pause (a longer one would leave older draft KV stale and bias the probe low).
    """

    def __init__(self, off_above: int, on_at_or_below: Optional[int] = None, min_accept: Optional[float] = None,
                 pause_steps: int = DEFAULT_MAX_LAG_STEPS):
        self.policy = SpeculationPolicy(off_above, on_at_or_below, spec_mode="target_verify", plain_mode="decode")
        self.gate = AcceptanceGate(min_accept, pause_steps=pause_steps) if min_accept is not None else None
        self.spec_steps = 0
        self.plain_steps = 0
        # Debug mode under TP > 1: every rank's decision compared before it acts (:mod:`.tp`)
        self.agreement = LazyAgreement()

    def speculate(self, batch_size: int) -> bool:
        """The decision for a decode step of ``batch_size`` sequences (counts it)."""
        by_size = self.policy.choose(batch_size) == "target_verify"
        allowed = self.gate is None or self.gate.allow()  # every decode step counts toward a gate's pause
        spec = by_size and allowed
        self.agreement.check("target_verify" if spec else "decode", batch_size, batch_size)
        if spec:
            self.spec_steps += 1
        else:
            self.plain_steps += 1
        return spec

    def verified(self, batch_size: int, correct_drafts: Optional[int]) -> None:
        """A verify step of ``batch_size`` sequences accepted ``correct_drafts`` draft tokens in all."""
        if self.gate is None or correct_drafts is None or batch_size < 1:
            return
        if self.gate.record(1.0 + correct_drafts / batch_size):
            log.info("graphpool switch: speculation paused for %d decode steps: verify steps commit %.2f tokens "
                     "per sequence, below the break-even %.2f", self.gate.pause_steps, self.gate.last_mean,
                     self.gate.min_accept)

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
_originals: Dict[str, Any] = {}


def install_speculation_switch(off_above: int, on_at_or_below: Optional[int] = None,
                               max_lag_steps: int = DEFAULT_MAX_LAG_STEPS,
                               min_accept: Optional[float] = None) -> SpeculationSwitch:
    """Make SGLang's EAGLE v1 worker decode plainly above ``off_above`` sequences (in this process).

    Prefill batches keep SGLang's path; small decode batches keep SGLang's speculative path after a
    draft catch-up (for requests that decoded plainly since their last speculative step). Two methods
    are wrapped: ``EAGLEWorker.forward_batch_generation`` (the decision, the plain step of
    :func:`~.eagle_v1_plain.eagle_v1_plain_decode`, the catch-up) and ``Scheduler.process_batch_result_decode``
    (plain steps kept out of SGLang's speculation metrics). Installing again replaces the switch.

    ``max_lag_steps``: the draft lag's window (:mod:`.draft_lag`): at most that many plain steps' hidden
    states kept per request, and caught up; a longer plain phase leaves the draft's older KV stale.
    ``min_accept``: see :class:`SpeculationSwitch` (read from each verify step's accepted drafts, named per
    release: :attr:`~.fields.Release.accepted`).
    """
    problem = switch_support_problem()
    if problem:
        raise RuntimeError(problem)
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.speculative.eagle_worker import EAGLEWorker

    switch = SpeculationSwitch(off_above, on_at_or_below, min_accept, pause_steps=max_lag_steps)
    lag = DraftLag(keep_hidden=None, max_steps=max_lag_steps)  # EAGLE keeps hidden states, STANDALONE not
    original = _originals.get("forward") or EAGLEWorker.forward_batch_generation
    process_decode = _originals.get("process_decode") or Scheduler.process_batch_result_decode

    warned = []  # the refusal below is logged once

    @functools.wraps(original)
    def forward_batch_generation(self: Any, batch: Any) -> Any:
        is_decode = batch.forward_mode.is_decode() and not batch.is_extend_in_batch
        if not is_decode:
            lag.forget(batch.reqs)  # prefilled (again, after a retraction): the draft prefill covers them
            return original(self, batch)
        from .runner import MultiModeCudaGraphRunner  # here: spec_switch_v2 imports this module (runner API)

        target = getattr(getattr(self, "target_worker", None), "model_runner", None)
        refusal = plain_step_refusal(getattr(target, "graph_runner", None), MultiModeCudaGraphRunner)
        if refusal:  # SGLang's verify-only runner: keep speculating rather than crash on a plain step
            if not warned:
                warned.append(refusal)
                log.warning("graphpool switch: %s", refusal)
            return original(self, batch)
        lag.retain(batch.reqs)  # requests that left the batch unfinished (retracted) are prefilled again
        switches = switch.switches
        speculate = switch.speculate(batch.batch_size())
        if switch.switches != switches:
            _log_flip(self, speculate, batch.batch_size(), switch)
        if not speculate:
            return eagle_v1_plain_decode(self, batch, lag)
        if len(lag):
            eagle_v1_catch_up(self, batch, lag)
        bs = batch.batch_size()
        result = original(self, batch)
        switch.verified(bs, _correct_drafts(result))
        return result

    @functools.wraps(process_decode)
    def process_batch_result_decode(self: Any, batch: Any, result: Any) -> Any:
        return process_plain_step_result(process_decode, self, batch, result)

    forward_batch_generation.graphpool_switch = switch  # type: ignore[attr-defined]  # for inspection
    forward_batch_generation.graphpool_lag = lag  # type: ignore[attr-defined]
    _originals.update(forward=original, process_decode=process_decode)
    EAGLEWorker.forward_batch_generation = forward_batch_generation
    Scheduler.process_batch_result_decode = process_batch_result_decode
    log.info("graphpool: speculation off above %d sequences, back on at <= %d%s", switch.policy.off_above,
             switch.policy.on_at_or_below, f", and while verify steps commit < {min_accept} tokens per sequence"
             if min_accept is not None else "")
    return switch


def switch_support_problem() -> Optional[str]:
    """Why this SGLang's EAGLE v1 worker is not one the plain step follows (``None``: it is).

    The plain step does spec-v1 verify's bookkeeping itself, field by field, as each classic release
    names and splits it (:class:`~.fields.Release`: SGLang 0.5.9, 0.5.10.x, 0.5.11 and 0.5.12.x,
    each verified against its real classes). A release whose names it does not recognise is refused
    rather than guessed at.
    """
    from . import versions

    if not versions.has_eagle_v1():  # SGLang 0.5.13.x: classic runner API, but only the spec-v2 EAGLE worker
        return (f"graphpool's speculation switch (classic API) drives SGLang's EAGLE v1 worker, which SGLang "
                f"{versions.sglang_version()} does not have (it has eagle_worker_v2 only). Its runner still serves "
                f"this SGLang: drop --graphpool-spec-off-above, or use SGLang 0.5.12.post1 (EAGLE v1) or 0.5.14+ "
                f"(the spec-v2 switch)")
    from .fields import release

    try:
        release()
    except RuntimeError as exc:
        return (f"graphpool's speculation switch (classic API) runs on SGLang 0.5.12.x, 0.5.11, 0.5.10.x and 0.5.9, "
                f"whose EAGLE v1 workers its plain step follows; SGLang {versions.sglang_version()} names their "
                f"results differently ({exc}). Its runner still serves this SGLang: drop --graphpool-spec-off-above, "
                f"or use SGLang 0.5.12.post1")
    return None


def _correct_drafts(result: Any) -> Optional[int]:
    """Draft tokens the verify step accepted, summed over the batch (the field's name per release:
    :attr:`~.fields.Release.accepted`)."""
    from .fields import release

    value = getattr(result, release().accepted, None)
    return None if value is None else int(value)


def _log_flip(worker: Any, speculate: bool, batch_size: int, switch: SpeculationSwitch) -> None:
    """One log line per switch, with the target runner's replays by mode when it is graphpool's."""
    target = getattr(getattr(worker, "target_worker", None), "model_runner", None)
    runner = getattr(target, "decode_cuda_graph_runner", None) or getattr(target, "graph_runner", None)  # 0.5.14+
    replays = getattr(runner, "replay_log", None)
    # the size threshold turned speculation on while the acceptance gate's pause holds it off
    gated = not speculate and switch.gate is not None and switch.policy.speculating
    log.info("graphpool switch: speculation %s at %d running requests (off above %d, on at <= %d)%s%s",
             "ON" if speculate or gated else "OFF", batch_size, switch.policy.off_above,
             switch.policy.on_at_or_below, " but paused by the acceptance gate" if gated else "",
             f"; {replays.line()}" if replays is not None else "; target runner: SGLang's own")


def uninstall_speculation_switch() -> None:
    """Restore SGLang's ``EAGLEWorker.forward_batch_generation`` and ``Scheduler.process_batch_result_decode``."""
    if not _originals:
        return
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.speculative.eagle_worker import EAGLEWorker

    EAGLEWorker.forward_batch_generation = _originals.pop("forward")
    process_decode = _originals.pop("process_decode")
    if "process_batch_result_decode" in Scheduler.__dict__:  # inherited from SGLang's mixin before install
        del Scheduler.process_batch_result_decode
    if Scheduler.process_batch_result_decode is not process_decode:
        Scheduler.process_batch_result_decode = process_decode

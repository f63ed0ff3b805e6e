"""One plain decode step inside SGLang's EAGLE v1 worker, with the bookkeeping spec v1 leaves to verify.

With spec v1 (``EAGLEWorker``, no overlap scheduler) SGLang splits a decode step's bookkeeping between
the worker and the scheduler: ``EagleVerifyInput.verify`` appends each accepted token to
``req.output_ids`` and runs the finish check (length, stop tokens, EOS, ``ignore_eos``, aborts), the
grammar's ``accept_token`` and the reasoning-token count, commits the KV lengths, leaves
``batch.spec_info`` holding only the unfinished rows, and fills the logprobs; then the scheduler's
``process_batch_result_decode`` only releases finished requests and streams. A plain step replaces
verify, so :func:`eagle_v1_plain_decode` does all of that itself, the way SGLang's non-speculative
decode path does it for one token:

1. one KV slot per sequence (``alloc_for_decode``), ``input_ids`` = the last token, ``seq_lens + 1``;
2. the target in DECODE mode (the multi-mode runner replays a DECODE graph), sampled by SGLang's
   sampler (grammar masks, penalties, logprobs as in non-speculative decode);
3. per request, as verify does per accepted token: record the token, reasoning count, finish check,
   grammar ``accept_token``; KV lengths; logprobs as SGLang's decode path records them;
4. **no draft work**: the draft model's KV falls behind. The request's position and, for EAGLE/EAGLE3,
   the target hidden states the draft will need there (captured FULL: EAGLE3's aux hidden states) go
   to a :class:`~.draft_lag.DraftLag`; finished requests (aborts included) are forgotten, never caught
   up. ``batch.spec_info`` becomes an ``EagleDraftInput`` for the unfinished rows only (the new tokens
   as ``bonus_tokens``, ``verified_id`` up to 0.5.11; placeholder draft fields), so the scheduler's
   ``filter_batch`` and ``merge_batch`` find the draft state they expect. Before the next speculative step
   :func:`~.eagle_v1_catch_up.eagle_v1_catch_up` catches the draft up in one draft extend.

Where SGLang's classic releases (0.5.9 to 0.5.12.x) differ in names or in how verify and the scheduler
split that bookkeeping, :func:`~.fields.release` says which release this is (:class:`~.fields.Release`);
nothing else here depends on the version.

The result is marked (:data:`PLAIN_STEP`) so that :func:`process_plain_step_result` keeps it out of
SGLang's speculation metrics, which SGLang counts per decode batch in ``update_spec_metrics``.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, List, Optional

import torch

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

from .draft_lag import DraftLag
from .fields import bonus_tokens, release

log = logging.getLogger(__name__)

#: Attribute set on the ``GenerationBatchResult`` of a plain step.
PLAIN_STEP = "graphpool_plain_step"


def eagle_v1_plain_decode(worker: Any, batch: Any, lag: DraftLag) -> Any:
    """One plain decode step of an EAGLE v1 ``batch`` (a ``ScheduleBatch`` in DECODE mode), no draft work.

    Returns SGLang's ``GenerationBatchResult`` (one token per sequence, marked :data:`PLAIN_STEP`). On
    return every request holds its new token and finish state, ``lag`` holds where each unfinished
    request's draft lags (and the target hidden states there), and ``batch.spec_info`` is an
    ``EagleDraftInput`` for the unfinished rows only, as after SGLang's verify.
    """
    from sglang.srt.managers.scheduler import GenerationBatchResult
    from sglang.srt.mem_cache.common import alloc_for_decode

    draft_input = batch.spec_info
    bs = batch.batch_size()
    kv_lens = batch.seq_lens_cpu.tolist()  # the position each request's KV is written at by this step
    last_tokens = bonus_tokens(draft_input).to(torch.int64)
    # Penalties count the previous token, as SGLang's decode and EAGLE's draft preprocessing do.
    if batch.sampling_info.penalizer_orchestrator.is_required:
        batch.sampling_info.penalizer_orchestrator.cumulate_output_tokens(last_tokens)
    # Step 1 through SGLang's allocator; alloc_for_decode records the slot in req_to_token at seq_lens.
    batch.out_cache_loc = alloc_for_decode(batch, token_per_req=1)
    for req in batch.reqs:
        req.decode_batch_idx += 1
        req.kv_committed_len += 1
        req.kv_allocated_len += 1
    batch.input_ids = last_tokens
    batch.forward_mode, batch.spec_info = ForwardMode.DECODE, None
    batch.seq_lens = batch.seq_lens + 1
    batch.seq_lens_cpu = batch.seq_lens_cpu + 1
    batch.orig_seq_lens = batch.orig_seq_lens + 1
    batch.seq_lens_sum += bs

    # Step 2: the target in DECODE mode, sampled like SGLang's decode (EAGLE's catch-up needs its hidden states).
    no_hidden = worker.speculative_algorithm.is_standalone() and not release().standalone_hidden
    worker_batch = batch.get_model_worker_batch()
    worker_batch.capture_hidden_mode = CaptureHiddenMode.NULL if no_hidden else CaptureHiddenMode.FULL
    result = worker.target_worker.forward_batch_generation(worker_batch)
    next_token_ids = result.next_token_ids
    logits_output = result.logits_output
    if next_token_ids.shape[0] != bs:  # SGLang's own runner replays its TARGET_VERIFY graph for this batch
        raise RuntimeError(
            f"plain decode step: the target returned {next_token_ids.shape[0]} tokens for {bs} sequences (one "
            f"each expected). Its CUDA graph runner replayed a graph of another mode: SGLang's own CudaGraphRunner "
            f"holds TARGET_VERIFY graphs only when speculation is on. Use graphpool's runner (drop "
            f"--graphpool-keep-sglang-runner).")

    # Step 3: what spec v1's verify does per accepted token.
    unfinished = record_tokens(batch, next_token_ids.tolist())
    if batch.return_logprob:
        record_logprobs(batch, logits_output, next_token_ids.tolist())

    # Step 4: no draft work; the draft lags from here, and spec_info keeps the unfinished rows.
    _leave_draft_lagging(worker, batch, lag, draft_input, kv_lens, logits_output.hidden_states, next_token_ids,
                         unfinished)

    names = release()
    out = GenerationBatchResult(logits_output=logits_output, next_token_ids=next_token_ids,
                                can_run_cuda_graph=result.can_run_cuda_graph,
                                **{names.accepted: 0, names.accepted_per_req: [0] * bs})
    setattr(out, PLAIN_STEP, True)
    return out


def record_tokens(batch: Any, next_token_ids: List[int]) -> List[int]:
    """Append each request's new token and run its finish checks, in the order SGLang's spec-v1 verify
    does for an accepted token; returns the indices of the requests still unfinished.

    Up to 0.5.10.x verify neither counts reasoning tokens (:attr:`~.fields.Release.verify_counts_reasoning`) nor
    checks the finish again after the grammar accepted the token; the scheduler's
    ``process_batch_result_decode`` runs ``check_finished`` once more in the same step. Checking here as
    0.5.11 does ends the request in the same state, and keeps a request whose grammar just terminated out
    of the next draft input (``filter_batch`` trusts that finished rows are gone)."""
    think_end_id = getattr(batch.model_config, "think_end_id", None) if release().verify_counts_reasoning else None
    unfinished = []
    for i, (req, token) in enumerate(zip(batch.reqs, next_token_ids, strict=True)):
        req.output_ids.append(token)
        if req.require_reasoning and think_end_id is not None:
            req.update_reasoning_tokens(token, think_end_id)
        req.check_finished()
        if not req.finished() and req.grammar is not None:
            req.grammar.accept_token(token)  # a ValueError propagates, as from SGLang's verify
            req.check_finished()
        if not req.finished():
            unfinished.append(i)
    return unfinished


def record_logprobs(batch: Any, logits_output: Any, next_token_ids: List[int]) -> None:
    """Record the sampler's logprobs on each request that asked, as SGLang's non-speculative decode path
    does in ``process_batch_result_decode`` (spec v1 leaves logprobs to the worker)."""
    values = logits_output.next_token_logprobs.tolist()
    top_val, top_idx = logits_output.next_token_top_logprobs_val, logits_output.next_token_top_logprobs_idx
    ids_val, ids_idx = (logits_output.next_token_token_ids_logprobs_val,
                        logits_output.next_token_token_ids_logprobs_idx)
    for i, (req, token) in enumerate(zip(batch.reqs, next_token_ids, strict=True)):
        if not req.return_logprob:
            continue
        req.output_token_logprobs_val.append(values[i])
        req.output_token_logprobs_idx.append(token)
        if req.top_logprobs_num > 0:
            req.output_top_logprobs_val.append(_as_list(top_val[i]))
            req.output_top_logprobs_idx.append(_as_list(top_idx[i]))
        if req.token_ids_logprob is not None:
            req.output_token_ids_logprobs_val.append(_as_list(ids_val[i]))
            req.output_token_ids_logprobs_idx.append(_as_list(ids_idx[i]))


def _as_list(value: Any) -> Any:
    # The sampler leaves per-row logprob tensors on the device (no_copy_to_cpu); the request keeps lists.
    return value.tolist() if isinstance(value, torch.Tensor) else value


def _leave_draft_lagging(worker: Any, batch: Any, lag: DraftLag, previous: Any, kv_lens: List[int],
                         hidden_states: Optional[torch.Tensor], next_token_ids: torch.Tensor,
                         unfinished: List[int]) -> None:
    """Record the draft's lag for the unfinished rows, forget the finished ones, and leave
    ``batch.spec_info`` the next round's ``EagleDraftInput`` for the unfinished rows only (SGLang's
    ``filter_batch`` trims it by position, trusting that verify already dropped finished rows)."""
    reqs, bs = batch.reqs, len(batch.reqs)
    alive = set(unfinished)
    lag.forget([req for i, req in enumerate(reqs) if i not in alive])  # finished or aborted: never caught up
    if not unfinished:
        worker._draft_preprocess_idle(batch)  # all finished: an empty draft input, as after such a verify
        return
    rows = None if len(unfinished) == bs else torch.tensor(unfinished, dtype=torch.int64,
                                                            device=next_token_ids.device)

    def keep(t: torch.Tensor) -> torch.Tensor:
        return t if rows is None else t[rows]

    lag.record([reqs[i] for i in unfinished], [kv_lens[i] for i in unfinished],
               None if hidden_states is None else keep(hidden_states[:bs]))
    batch.spec_info = lagging_draft_input(previous, keep(next_token_ids), worker.topk)


def lagging_draft_input(previous: Any, bonus: torch.Tensor, topk: int) -> Any:
    """The ``EagleDraftInput`` of a batch whose draft lags: ``bonus`` (the next step's input) is
    real; ``topk_p``, ``topk_index`` and ``hidden_states`` are placeholders of the right row count, cut
    from ``previous`` (no copy): the scheduler slices and concatenates them, no forward reads them, and
    the catch-up replaces them before the next speculative step."""
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    n, device = bonus.shape[0], bonus.device

    def placeholder(t: Optional[torch.Tensor], width: int, dtype: torch.dtype) -> torch.Tensor:
        if t is not None and t.shape[0] >= n:
            return t[:n]
        shape = (n, width) if t is None else (n, *t.shape[1:])
        return torch.zeros(shape, dtype=dtype if t is None else t.dtype, device=device)

    hidden = previous.hidden_states
    return EagleDraftInput(
        **{release().bonus: bonus}, topk_p=placeholder(previous.topk_p, topk, torch.float32),
        topk_index=placeholder(previous.topk_index, topk, torch.int64),
        hidden_states=None if hidden is None else placeholder(hidden, hidden.shape[-1], hidden.dtype),
        capture_hidden_mode=previous.capture_hidden_mode)


def process_plain_step_result(original: Any, scheduler: Any, batch: Any, result: Any) -> Any:
    """SGLang's ``process_batch_result_decode`` for a result; plain steps are kept out of its
    speculation metrics (``update_spec_metrics``: accept length and rate count verify steps only)."""
    if not getattr(result, PLAIN_STEP, False):
        return original(scheduler, batch, result)
    with _verify_steps_only(scheduler):
        return original(scheduler, batch, result)


@contextlib.contextmanager
def _verify_steps_only(scheduler: Any) -> Iterator[None]:
    # Instance attributes shadow the scheduler's methods for this one call.
    report = release().report_decode_stats
    scheduler.update_spec_metrics = _skip_spec_metrics
    setattr(scheduler, report, _guarded_report(scheduler, report))
    try:
        yield
    finally:
        del scheduler.update_spec_metrics
        delattr(scheduler, report)


def _skip_spec_metrics(bs: int, num_correct_drafts: int) -> None:
    """A plain step proposes no draft: nothing to add to the acceptance counters."""


def _guarded_report(scheduler: Any, name: str) -> Any:
    """The scheduler's decode-stats method (``name``, :attr:`Release.report_decode_stats`) made to survive
    a log interval without a verify step: SGLang divides the accepted tokens by the verify count, which
    only plain steps leave at zero. That line then reports no acceptance, as for a server without
    speculation."""
    report = getattr(type(scheduler), name)

    def guarded(*args: Any, **kwargs: Any) -> Any:
        if scheduler.spec_num_forward_ct > 0:
            return report(scheduler, *args, **kwargs)
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        algorithm = scheduler.spec_algorithm
        scheduler.spec_algorithm = SpeculativeAlgorithm.NONE
        try:
            return report(scheduler, *args, **kwargs)
        finally:
            scheduler.spec_algorithm = algorithm

    return guarded

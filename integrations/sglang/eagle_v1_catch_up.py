"""The EAGLE v1 draft catch-up: one draft extend over what lagging requests decoded plainly.

Plain steps (:mod:`.eagle_v1_plain`) leave the draft model's KV behind. Before the first speculative
step after them, :func:`eagle_v1_catch_up` runs ONE draft extend for all lagging requests of the batch,
through SGLang's own draft-prefill path, ``EAGLEWorker.forward_draft_extend`` (the one SGLang runs after
a target prefill): each lagging request is an extend of its chunk ``[start, seq_len)`` over the prefix
before it, fed the tokens after each position (EAGLE reads token ``p + 1`` with the target hidden state
of ``p``; SGLang's ``prepare_for_extend`` shifts the chunk and appends the bonus token) and the hidden
states the plain steps kept. The draft writes its KV into the slots ``req_to_token`` already holds for
those positions (draft and target share the slot table), and returns the draft input (``topk_p``,
``topk_index``, hidden states) that replaces those rows' placeholders; the speculative step then runs
SGLang's draft and verify unchanged.

Not SGLang's post-verify ``forward_draft_extend_after_decode``: its CUDA graphs are captured for at
most ``speculative_num_steps + 1`` tokens per request, and its graph runner checks only the batch size.
A prefill extend takes chunks of any length (eagerly, as SGLang's draft prefill runs).

Requests that are finishing (an abort or another ``to_finish`` is pending) are not caught up: verify
finishes them on their first token. A chunk longer than the lag's window starts at the window
(:mod:`.draft_lag`).
"""
from __future__ import annotations

import copy
import logging
from typing import Any, List

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardMode

from .draft_lag import DraftLag
from .fields import bonus_tokens, req_pool_idx

log = logging.getLogger(__name__)


def eagle_v1_catch_up(worker: Any, batch: Any, lag: DraftLag) -> int:
    """Catch the draft up for every lagging request of ``batch`` (a spec-v1 DECODE ``ScheduleBatch``).

    Returns how many requests were caught up (0: nothing lagged; no draft forward ran). On return their
    rows of ``batch.spec_info`` hold the draft input a fresh draft prefill would give; other rows and
    every other field of ``batch`` are unchanged.
    """
    reqs = batch.reqs
    lag.forget([req for req in reqs if req.finished() or req.to_finish is not None])
    chunks = lag.take(reqs)
    if not chunks:
        return 0
    seq_lens_cpu = batch.seq_lens_cpu.tolist()
    idx: List[int] = []
    for i, req in enumerate(reqs):
        chunk = chunks.get(req)
        if chunk is None:
            continue
        if chunk.end != seq_lens_cpu[i]:  # never expected: plain steps and the scheduler disagree
            log.warning("graphpool draft catch-up: request %s lags up to %d but holds %d tokens; not caught up "
                        "(its draft proposes from stale state; outputs stay exact)", req.rid, chunk.end,
                        seq_lens_cpu[i])
            continue
        idx.append(i)
    if not idx:
        return 0
    view = _draft_prefill_view(batch, idx, [chunks[reqs[i]].start for i in idx], seq_lens_cpu)
    hidden = None
    if lag.keep_hidden:
        hidden = torch.cat([chunks[reqs[i]].hidden for i in idx])
        if hidden.shape[0] != view.extend_num_tokens:
            raise RuntimeError(f"graphpool draft catch-up: {hidden.shape[0]} hidden states for "
                               f"{view.extend_num_tokens} lagging positions")
    rows = torch.tensor(idx, dtype=torch.int64, device=batch.seq_lens.device)
    everyone = len(idx) == len(reqs)
    bonus = bonus_tokens(batch.spec_info) if everyone else bonus_tokens(batch.spec_info)[rows]
    _run_draft_extend(worker, view, hidden, bonus)
    caught = view.spec_info
    if everyone:
        batch.spec_info = caught
    else:
        _put_rows(batch.spec_info, rows, caught, len(reqs))
    skipped = sum(chunks[reqs[i]].skipped for i in idx)
    log.info("graphpool draft catch-up: %d requests, %d tokens in one draft extend%s", len(idx),
             view.extend_num_tokens, f" ({skipped} older positions left stale by the window)" if skipped else "")
    return len(idx)


def _draft_prefill_view(batch: Any, idx: List[int], starts: List[int], seq_lens_cpu: List[int]) -> Any:
    """A shallow copy of ``batch`` as the EXTEND batch of rows ``idx``: chunk ``[start, seq_len)`` each,
    over its prefix. ``batch`` itself is not modified (the draft extend rewrites its batch's fields)."""
    reqs, dev = batch.reqs, batch.seq_lens.device
    ends = [seq_lens_cpu[i] for i in idx]
    rows = torch.tensor(idx, dtype=torch.int64, device=dev)
    table = batch.req_to_token_pool.req_to_token
    view = copy.copy(batch)
    view.reqs = [reqs[i] for i in idx]
    view.forward_mode = ForwardMode.EXTEND
    view.req_pool_indices = batch.req_pool_indices[rows]
    view.seq_lens = view.orig_seq_lens = batch.seq_lens[rows]
    view.seq_lens_cpu = batch.seq_lens_cpu[idx]
    view.seq_lens_sum = sum(ends)
    view.prefix_lens = list(starts)
    view.extend_lens = [e - s for s, e in zip(starts, ends)]
    view.extend_num_tokens = sum(view.extend_lens)
    view.extend_logprob_start_lens = list(view.extend_lens)  # no logprobs for a draft extend
    tokens: List[int] = []
    for req, s, e in zip(view.reqs, starts, ends):
        tokens += _sequence_tokens(req, s, e)
    view.input_ids = torch.tensor(tokens, dtype=torch.int64, device=dev)
    view.out_cache_loc = torch.cat([table[req_pool_idx(req), s:e] for req, s, e in zip(view.reqs, starts, ends)]
                                   ).to(torch.int64)
    # A draft extend reads none of these; cleared so nothing shared with the running batch is touched.
    view.sampling_info = view.multimodal_inputs = view.spec_info = None
    view.return_logprob = view.return_hidden_states = False
    view.top_logprobs_nums = view.token_ids_logprobs = view.extend_input_logprob_token_ids = None
    view.input_embeds = view.replace_embeds = view.replace_positions = view.token_type_ids = None
    return view


def _sequence_tokens(req: Any, start: int, end: int) -> List[int]:
    """Tokens at positions ``[start, end)`` of a request's sequence (prompt, then output)."""
    n = len(req.origin_input_ids)
    if start >= n:
        return list(req.output_ids[start - n:end - n])
    return (list(req.origin_input_ids) + list(req.output_ids))[start:end]


def _run_draft_extend(worker: Any, view: Any, hidden: Any, bonus: torch.Tensor) -> None:
    """SGLang's draft prefill (``EAGLEWorker.forward_draft_extend``) on ``view``, in the draft's TP and
    MoE contexts as SGLang runs it; leaves the new ``EagleDraftInput`` in ``view.spec_info``."""
    from sglang.srt.layers.moe.utils import speculative_moe_a2a_backend_context, speculative_moe_backend_context

    with (worker.draft_tp_context(worker.draft_model_runner.tp_group), speculative_moe_backend_context(),
          speculative_moe_a2a_backend_context()):
        worker.forward_draft_extend(view, hidden, bonus, view.seq_lens_cpu)


def _put_rows(spec_info: Any, rows: torch.Tensor, caught: Any, bs: int) -> None:
    """Write the caught-up rows' draft fields into the batch's draft input (other rows are untouched)."""
    for name in ("topk_p", "topk_index", "hidden_states"):
        new = getattr(caught, name)
        if new is None:
            continue
        full = getattr(spec_info, name)
        if full is None or full.shape[0] != bs or full.shape[1:] != new.shape[1:]:
            full = new.new_zeros((bs, *new.shape[1:]))
        else:
            full = full.clone()  # placeholders may be views of tensors other inputs share
        full[rows] = new.to(full.dtype)
        setattr(spec_info, name, full)

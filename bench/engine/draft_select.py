"""One draft level's candidate selection in one kernel: log-softmax, top-k per beam node, scores, next beam.

A speculative step's draft tree grows a level per draft pass: each of the ``rows`` beam nodes of a
sequence (1 at the root, ``k`` after) proposes its ``k`` most likely tokens, scored by the node's
cumulative log-probability plus the token's, minus a depth penalty; the ``k`` best of those ``rows * k``
candidates are the next beam. In torch that is a log-softmax over the vocabulary, a ``topk`` over it, an
add, a reshape, a second ``topk`` and three gathers: ~8 launches per level, of which the vocabulary
``topk`` alone took 7-24 us on the H200 (run T in bench/RESULTS.md: ~0.15 ms of a 2.27 ms step went to
top-k and sort kernels). :func:`draft_level` does it in one launch, one program per sequence, which
holds all of the sequence's beam rows at once as one ``[rows, vocab]`` tile (rows padded to a power of
two, the padding masked to ``-inf`` and never selected): the max, the log-sum-exp and each of the ``k``
picks are one reduction along the vocabulary for all rows together, so a level is a chain of ``k``
dependent reductions, not ``rows * k``. (Walking the rows one after another, as the kernel did before,
took 21.6 us per launch at the beam levels on the H200 for the medium model, vocabulary 4096, ``k`` 4,
batch 1: run X, measured before this change.)

Ties: the kernel takes the lowest index first among equal values (``torch.topk`` leaves their order
unspecified), and its log-sum-exp may differ from torch's in the last bits. Either changes at most which
of two equally likely drafts is proposed; the verify step keeps the output exact whatever the draft.
The torch function is the CPU path and the test oracle; ``fused=False`` runs it anywhere. The default
selection, ``"auto"``, takes the kernel wherever it can run (:func:`resolve_draft_select`).
"""
from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: the torch path serves everywhere
    triton = tl = None

DRAFT_SELECT = ("auto", "torch", "fused")


class Level(NamedTuple):
    """One level's candidates (``[bs, rows * k]``) and the next beam (``[bs, k]``). At the root the beam
    is the candidates as they come, so ``beam_ids`` and ``best`` are ``None`` (ids ``offset .. offset+k-1``)."""

    tokens: torch.Tensor
    scores: torch.Tensor
    beam_tokens: torch.Tensor
    beam_scores: torch.Tensor
    beam_ids: Optional[torch.Tensor]
    best: Optional[torch.Tensor]  # index of each beam node among this level's candidates


def resolve_draft_select(name: str, device: torch.device | str) -> bool:
    """Whether ``name`` (one of :data:`DRAFT_SELECT`) selects the fused kernel on ``device``.

    The kernel can run with Triton on a CUDA device, or on any device under Triton's interpreter
    (``TRITON_INTERPRET=1``, the CPU tests). ``"auto"`` takes it on CUDA, where it is fast, and the torch
    ops elsewhere (the interpreter runs it several times slower than torch on a CPU); ``"fused"`` takes it
    wherever it can run and raises :class:`ValueError` elsewhere; ``"torch"`` never takes it.
    """
    if name not in DRAFT_SELECT:
        raise ValueError(f"draft_select must be one of {DRAFT_SELECT}, got {name!r}")
    if name == "torch":
        return False
    on_cuda = triton is not None and torch.device(device).type == "cuda"
    if name == "auto":
        return on_cuda
    if not (on_cuda or (triton is not None and os.environ.get("TRITON_INTERPRET") == "1")):
        raise ValueError(f"draft_select='fused' needs Triton and a CUDA device (or TRITON_INTERPRET=1); got "
                         f"{torch.device(device)}, Triton {'absent' if triton is None else 'present'}")
    return True


def draft_level(logits: torch.Tensor, beam_scores: torch.Tensor | None, k: int, penalty: float, offset: int,
                fused: bool) -> Level:
    """Select one draft level.

    Args:
        logits: ``[bs * rows, vocab]``, the draft's LM-head output of each beam node (``rows`` per sequence).
        beam_scores: ``[bs, rows]`` cumulative scores of the beam nodes, or ``None`` at the root (``rows`` 1,
            score 0; the root's children are the next beam as they come, best first).
        k: tokens per node and beam width.
        penalty: subtracted from every candidate's score (per level).
        offset: candidate id of this level's first candidate (the beam's ids are ``offset + best``).
        fused: the Triton kernel (:func:`resolve_draft_select`), else torch.
    """
    rows = 1 if beam_scores is None else beam_scores.shape[1]
    bs = logits.shape[0] // rows
    if not fused:
        return _torch_level(logits, beam_scores, k, penalty, offset, bs, rows)
    n = rows * k
    dev = logits.device
    tokens = torch.empty(bs, n, dtype=torch.long, device=dev)
    scores = torch.empty(bs, n, dtype=torch.float32, device=dev)
    rows_block, block_v = triton.next_power_of_2(rows), triton.next_power_of_2(logits.shape[1])
    shape = dict(ROWS=rows, K=k, ROWS_BLOCK=rows_block, K_BLOCK=triton.next_power_of_2(k), BLOCK_V=block_v,
                 num_warps=_num_warps(rows_block * block_v))
    if beam_scores is None:
        _level_kernel[(bs,)](logits, logits, tokens, scores, tokens, tokens, scores, tokens, logits.shape[1],
                             logits.stride(0), penalty, offset, HAS_BEAM=False, **shape)
        return Level(tokens, scores, tokens, scores, None, None)
    beam_scores = beam_scores.float().contiguous()
    best = torch.empty(bs, k, dtype=torch.long, device=dev)
    beam_tokens, beam_ids = torch.empty_like(best), torch.empty_like(best)
    beam_out = torch.empty(bs, k, dtype=torch.float32, device=dev)
    _level_kernel[(bs,)](logits, beam_scores, tokens, scores, best, beam_tokens, beam_out, beam_ids,
                         logits.shape[1], logits.stride(0), penalty, offset, HAS_BEAM=True, **shape)
    return Level(tokens, scores, beam_tokens, beam_out, beam_ids, best)


def _num_warps(elements: int) -> int:
    """Warps for a program holding ``elements`` values of the ``[ROWS_BLOCK, BLOCK_V]`` tile: enough
    threads that each keeps a few dozen of them in registers, up to 16 warps (512 threads)."""
    return 4 if elements <= 4096 else 8 if elements <= 16384 else 16


def _torch_level(logits: torch.Tensor, beam_scores: torch.Tensor | None, k: int, penalty: float, offset: int,
                 bs: int, rows: int) -> Level:
    top = torch.nn.functional.log_softmax(logits, -1, dtype=torch.promote_types(logits.dtype, torch.float32)).topk(k)
    if beam_scores is None:
        scores = top.values - penalty
        return Level(top.indices, scores, top.indices, scores, None, None)
    scores = (beam_scores[..., None] + top.values.view(bs, rows, k) - penalty).reshape(bs, rows * k)
    tokens = top.indices.view(bs, rows * k)
    best = scores.topk(k, dim=-1).indices
    return Level(tokens, scores, tokens.gather(1, best), scores.gather(1, best), offset + best, best)


if triton is not None:
    @triton.jit
    def _level_kernel(logits_ptr, beam_ptr, tokens_ptr, scores_ptr, best_ptr, beam_tok_ptr, beam_score_ptr,
                      beam_id_ptr, vocab, stride_row, penalty, offset, ROWS: tl.constexpr, K: tl.constexpr,
                      ROWS_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK_V: tl.constexpr,
                      HAS_BEAM: tl.constexpr):
        # One program per sequence; its ROWS beam rows are one [ROWS_BLOCK, BLOCK_V] tile, and every
        # reduction runs along the vocabulary (axis 1) for all rows at once.
        b = tl.program_id(0).to(tl.int64)
        rows = tl.arange(0, ROWS_BLOCK)
        cols = tl.arange(0, BLOCK_V)
        picks = tl.arange(0, K_BLOCK)
        row_ok = rows < ROWS
        # Padded rows and columns load as -inf. A padded row's max and sum are set to 0 and 1, so that its
        # log-probabilities come out -inf rather than NaN (-inf - -inf); they are never kept anyway.
        x = tl.load(logits_ptr + (b * ROWS + rows)[:, None] * stride_row + cols[None, :],
                    mask=row_ok[:, None] & (cols < vocab)[None, :], other=float("-inf")).to(tl.float32)
        top = tl.where(row_ok, tl.max(x, axis=1), 0.0)
        log_sum = tl.log(tl.where(row_ok, tl.sum(tl.exp(x - top[:, None]), axis=1), 1.0))
        if HAS_BEAM:
            base = tl.load(beam_ptr + b * ROWS + rows, mask=row_ok, other=0.0)
        else:
            base = tl.zeros([ROWS_BLOCK], dtype=tl.float32)
        # The candidates as a [ROWS_BLOCK, K_BLOCK] tile: row r's pick j is candidate slot r * K + j.
        slot = rows[:, None] * K + picks[None, :]
        valid = row_ok[:, None] & (picks < K)[None, :]
        cand_score = tl.full([ROWS_BLOCK, K_BLOCK], float("-inf"), tl.float32)
        cand_tok = tl.zeros([ROWS_BLOCK, K_BLOCK], dtype=tl.int64)
        for j in tl.static_range(K):
            # One reduction per row for the value and its column (the lowest column among equal values).
            value, best_col = tl.max(x, axis=1, return_indices=True, return_indices_tie_break_left=True)
            log_p = (value - top) - log_sum  # torch's order: (x - max) - log(sum)
            cand_score = tl.where(picks[None, :] == j, ((base + log_p) - penalty)[:, None], cand_score)
            cand_tok = tl.where(picks[None, :] == j, best_col.to(tl.int64)[:, None], cand_tok)
            x = tl.where(cols[None, :] == best_col[:, None], float("-inf"), x)
        n = ROWS * K
        tl.store(tokens_ptr + b * n + slot, cand_tok, mask=valid)
        tl.store(scores_ptr + b * n + slot, cand_score, mask=valid)
        if HAS_BEAM:  # the next beam: the K best of this level's candidates, best first
            free = valid  # candidates not yet in the beam (padding never is one)
            for j in tl.static_range(K):
                left = tl.where(free, cand_score, float("-inf"))
                best_score = tl.max(tl.max(left, axis=1), axis=0)
                # The lowest slot among equal scores, as an argmax over the slots in order would take.
                pick = tl.min(tl.min(tl.where(free & (left == best_score), slot, n), axis=1), axis=0)
                chosen = slot == pick
                tl.store(best_ptr + b * K + j, pick.to(tl.int64))
                tl.store(beam_tok_ptr + b * K + j, tl.sum(tl.sum(tl.where(chosen, cand_tok, 0), axis=1), axis=0))
                tl.store(beam_score_ptr + b * K + j, best_score)
                tl.store(beam_id_ptr + b * K + j, offset + pick.to(tl.int64))
                free = free & (slot != pick)

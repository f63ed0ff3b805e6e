"""One draft level's candidate selection in one kernel: log-softmax, top-k per beam node, scores, next beam.

A speculative step's draft tree grows a level per draft pass: each of the ``rows`` beam nodes of a
sequence (1 at the root, ``k`` after) proposes its ``k`` most likely tokens, scored by the node's
cumulative log-probability plus the token's, minus a depth penalty; the ``k`` best of those ``rows * k``
candidates are the next beam. In torch that is a log-softmax over the vocabulary, a ``topk`` over it, an
add, a reshape, a second ``topk`` and three gathers: ~8 launches per level, of which the vocabulary
``topk`` alone took 7-24 us on the H200 (run T in bench/RESULTS_HISTORY.md: ~0.15 ms of a 2.27 ms step went to
top-k and sort kernels). :func:`draft_level` does it in one launch, one program per sequence, which
holds all of the sequence's beam rows at once as one ``[rows, vocab]`` tile (rows padded to a power of
two, the padding masked to ``-inf`` and never selected): the max, the log-sum-exp and each of the ``k``
picks are one reduction along the vocabulary for all rows together, so a level is a chain of ``k``
dependent reductions, not ``rows * k``. (Walking the rows one after another, as the kernel did before,
took 21.6 us per launch at the beam levels on the H200 for the medium model, vocabulary 4096, ``k`` 4,
batch 1: run X, measured before this change.)

:func:`draft_level_into` is the engine's whole-tree form of the same kernel: each level also writes its
candidates straight into the tree's candidate buffers, their parents, and the next beam's ancestor rows, so
a speculative step builds its draft tree without the torch loop's concatenations, expand copies and gathers
(~12 launches of a few elements each; run AW in bench/RESULTS_HISTORY.md).

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
    unused = dict(prev_id_ptr=tokens, parents_ptr=tokens, anc_in_ptr=tokens, anc_out_ptr=tokens, cand_stride=n,
                  cand_col=0, anc_width=1, anc_col=0, INTO=False, ANC=False, AW_BLOCK=1)
    if beam_scores is None:
        _level_kernel[(bs,)](logits, logits, tokens, scores, tokens, tokens, scores, tokens, vocab=logits.shape[1],
                             stride_row=logits.stride(0), penalty=penalty, offset=offset, HAS_BEAM=False,
                             **unused, **shape)
        return Level(tokens, scores, tokens, scores, None, None)
    beam_scores = beam_scores.float().contiguous()
    best = torch.empty(bs, k, dtype=torch.long, device=dev)
    beam_tokens, beam_ids = torch.empty_like(best), torch.empty_like(best)
    beam_out = torch.empty(bs, k, dtype=torch.float32, device=dev)
    _level_kernel[(bs,)](logits, beam_scores, tokens, scores, best, beam_tokens, beam_out, beam_ids,
                         vocab=logits.shape[1], stride_row=logits.stride(0), penalty=penalty, offset=offset,
                         HAS_BEAM=True, **unused, **shape)
    return Level(tokens, scores, beam_tokens, beam_out, beam_ids, best)


class Beam(NamedTuple):
    """A draft level's beam as :func:`draft_level_into` leaves it (``[bs, k]`` each; ``ancestors`` ``[bs,
    k, width]``: column ``j`` set where scratch column ``n + j`` holds an ancestor of the node, or itself)."""

    tokens: torch.Tensor
    scores: torch.Tensor
    ids: torch.Tensor
    ancestors: torch.Tensor


class Candidates(NamedTuple):
    """Every candidate of a draft tree, all levels side by side (``[bs, total]``): what the tree's selection
    reads (:func:`bench.engine.tree_kernels.select_tree_fused`). Each level writes its own columns."""

    tokens: torch.Tensor
    scores: torch.Tensor
    parents: torch.Tensor

    @classmethod
    def empty(cls, bs: int, total: int, device: torch.device) -> "Candidates":
        return cls(torch.empty(bs, total, dtype=torch.long, device=device),
                   torch.empty(bs, total, dtype=torch.float32, device=device),
                   torch.empty(bs, total, dtype=torch.long, device=device))


def draft_level_into(logits: torch.Tensor, beam: Beam | None, k: int, penalty: float, offset: int,
                     cands: Candidates, anc_width: int, anc_col: int | None) -> Beam:
    """One draft level of the engine's fused path, all of it in one launch: :func:`draft_level`'s selection
    with its candidates written to columns ``offset ..`` of ``cands`` (so the levels need no concatenation),
    each candidate's parent id beside them (``-1`` at the root, else the beam node's id), and the next beam
    with its ancestor rows: the parent node's row plus column ``anc_col + j`` for node ``j`` (at the root,
    only that column). ``anc_col=None`` skips the ancestors (the last level's beam grows no further; its
    ``ancestors`` are left unwritten).

    The same values as the torch code of ``Engine._draft_tree`` (``draft_level``, the parents' expand, the
    ancestors' gather and ``|= eye``, the concatenations). Triton on CUDA, or its interpreter."""
    rows = 1 if beam is None else beam.tokens.shape[1]
    bs = logits.shape[0] // rows
    dev = logits.device
    rows_block, block_v = triton.next_power_of_2(rows), triton.next_power_of_2(logits.shape[1])
    tokens, scores = torch.empty(bs, k, dtype=torch.long, device=dev), torch.empty(bs, k, dtype=torch.float32, device=dev)
    ids, best = torch.empty_like(tokens), torch.empty_like(tokens)
    ancestors = torch.empty(bs, k, anc_width, dtype=torch.bool, device=dev)  # every element written with anc_col
    anc_out = ancestors.view(torch.int8) if anc_col is not None else tokens
    anc_in = beam.ancestors.view(torch.int8) if beam is not None and anc_col is not None else anc_out
    prev_scores = beam.scores if beam is not None else logits
    prev_ids = beam.ids if beam is not None else tokens
    _level_kernel[(bs,)](logits, prev_scores, cands.tokens, cands.scores, best, tokens, scores, ids, prev_ids,
                         cands.parents, anc_in, anc_out, vocab=logits.shape[1], stride_row=logits.stride(0),
                         penalty=penalty, offset=offset, cand_stride=cands.tokens.stride(0), cand_col=offset,
                         anc_width=anc_width, anc_col=anc_col or 0, ROWS=rows, K=k, ROWS_BLOCK=rows_block,
                         K_BLOCK=triton.next_power_of_2(k), BLOCK_V=block_v, HAS_BEAM=beam is not None, INTO=True,
                         ANC=anc_col is not None, AW_BLOCK=triton.next_power_of_2(anc_width),
                         num_warps=_num_warps(rows_block * block_v))
    return Beam(tokens, scores, ids, ancestors)


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
                      beam_id_ptr, prev_id_ptr, parents_ptr, anc_in_ptr, anc_out_ptr, vocab, stride_row, penalty,
                      offset, cand_stride, cand_col, anc_width, anc_col, ROWS: tl.constexpr, K: tl.constexpr,
                      ROWS_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK_V: tl.constexpr,
                      HAS_BEAM: tl.constexpr, INTO: tl.constexpr, ANC: tl.constexpr, AW_BLOCK: tl.constexpr):
        # One program per sequence; its ROWS beam rows are one [ROWS_BLOCK, BLOCK_V] tile, and every
        # reduction runs along the vocabulary (axis 1) for all rows at once. Candidates go to columns
        # cand_col.. of rows of cand_stride. INTO (the engine's whole-tree path) also writes each candidate's
        # parent (the beam node it grew from, prev_id; -1 at the root), at the root the beam's ids, and with
        # ANC the next beam's ancestor rows (anc_in's row of each pick's parent, plus its own column).
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
        out = b * cand_stride + cand_col + slot
        tl.store(tokens_ptr + out, cand_tok, mask=valid)
        tl.store(scores_ptr + out, cand_score, mask=valid)
        aw = tl.arange(0, AW_BLOCK)
        if INTO:
            if HAS_BEAM:
                parent = tl.load(prev_id_ptr + b * ROWS + rows, mask=row_ok, other=-1)
            else:
                parent = tl.full([ROWS_BLOCK], -1, tl.int64)
            tl.store(parents_ptr + out, (tl.zeros([ROWS_BLOCK, K_BLOCK], dtype=tl.int64) + parent[:, None]),
                     mask=valid)
            if not HAS_BEAM:  # the root's children are the next beam as they come: ids offset.., own column
                tl.store(beam_tok_ptr + b * K + picks, tl.sum(tl.where(valid, cand_tok, 0), axis=0), mask=picks < K)
                tl.store(beam_score_ptr + b * K + picks, tl.sum(tl.where(valid, cand_score, 0.0), axis=0),
                         mask=picks < K)
                tl.store(beam_id_ptr + b * K + picks, offset + picks.to(tl.int64), mask=picks < K)
                if ANC:
                    own = (aw[None, :] == (anc_col + picks)[:, None]).to(tl.int8)
                    tl.store(anc_out_ptr + (b * K + picks)[:, None] * anc_width + aw[None, :], own,
                             mask=(picks < K)[:, None] & (aw < anc_width)[None, :])
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
                if ANC:  # this node's ancestors: its parent's (beam row pick // K), and its own column
                    row = tl.load(anc_in_ptr + (b * ROWS + pick // K) * anc_width + aw, mask=aw < anc_width, other=0)
                    row = tl.where(aw == anc_col + j, 1, row)
                    tl.store(anc_out_ptr + (b * K + j) * anc_width + aw, row.to(tl.int8), mask=aw < anc_width)
                free = free & (slot != pick)

"""One draft level's candidate selection in one kernel: log-softmax, top-k per beam node, scores, next beam.

A speculative step's draft tree grows a level per draft pass: each of the ``rows`` beam nodes of a
sequence (1 at the root, ``k`` after) proposes its ``k`` most likely tokens, scored by the node's
cumulative log-probability plus the token's, minus a depth penalty; the ``k`` best of those ``rows * k``
candidates are the next beam. In torch that is a log-softmax over the vocabulary, a ``topk`` over it, an
add, a reshape, a second ``topk`` and three gathers: ~8 launches per level, of which the vocabulary
``topk`` alone took 7-24 us on the H200 (run T in bench/RESULTS.md: ~0.15 ms of a 2.27 ms step went to
top-k and sort kernels). :func:`draft_level` does it in one launch, one program per sequence.

Ties: the kernel takes the lowest index first among equal values (``torch.topk`` leaves their order
unspecified), and its log-sum-exp may differ from torch's in the last bits. Either changes at most which
of two equally likely drafts is proposed; the verify step keeps the output exact whatever the draft.
The torch function is the CPU path and the test oracle; ``fused=False`` runs it anywhere.
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

DRAFT_SELECT = ("torch", "fused")


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
    """Whether ``name`` (one of :data:`DRAFT_SELECT`) selects the fused kernel on ``device``: CUDA with
    Triton, or any device under Triton's interpreter (``TRITON_INTERPRET=1``, the CPU tests)."""
    if name not in DRAFT_SELECT:
        raise ValueError(f"draft_select must be one of {DRAFT_SELECT}, got {name!r}")
    if name == "torch":
        return False
    if triton is None or not (torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
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
    if beam_scores is None:
        _level_kernel[(bs,)](logits, logits, tokens, scores, tokens, tokens, scores, tokens, logits.shape[1],
                             logits.stride(0), penalty, offset, ROWS=1, K=k, NC=triton.next_power_of_2(n),
                             BLOCK_V=triton.next_power_of_2(logits.shape[1]), HAS_BEAM=False)
        return Level(tokens, scores, tokens, scores, None, None)
    beam_scores = beam_scores.float().contiguous()
    best = torch.empty(bs, k, dtype=torch.long, device=dev)
    beam_tokens, beam_ids = torch.empty_like(best), torch.empty_like(best)
    beam_out = torch.empty(bs, k, dtype=torch.float32, device=dev)
    _level_kernel[(bs,)](logits, beam_scores, tokens, scores, best, beam_tokens, beam_out, beam_ids,
                         logits.shape[1], logits.stride(0), penalty, offset, ROWS=rows, K=k,
                         NC=triton.next_power_of_2(n), BLOCK_V=triton.next_power_of_2(logits.shape[1]), HAS_BEAM=True)
    return Level(tokens, scores, beam_tokens, beam_out, beam_ids, best)


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
                      NC: tl.constexpr, BLOCK_V: tl.constexpr, HAS_BEAM: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_V)
        slots = tl.arange(0, NC)
        cand_score = tl.full([NC], float("-inf"), tl.float32)
        cand_tok = tl.zeros([NC], dtype=tl.int64)
        for r in tl.static_range(ROWS):
            x = tl.load(logits_ptr + (b * ROWS + r) * stride_row + cols, mask=cols < vocab,
                        other=float("-inf")).to(tl.float32)
            top = tl.max(x, axis=0)
            log_sum = tl.log(tl.sum(tl.exp(x - top), axis=0))
            base = 0.0
            if HAS_BEAM:
                base = tl.load(beam_ptr + b * ROWS + r)
            for j in tl.static_range(K):
                # One reduction for the value and its index (the lowest index among equal values).
                value, best_col = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
                log_p = (value - top) - log_sum  # torch's order: (x - max) - log(sum)
                cand_score = tl.where(slots == r * K + j, (base + log_p) - penalty, cand_score)
                cand_tok = tl.where(slots == r * K + j, best_col.to(tl.int64), cand_tok)
                x = tl.where(cols == best_col, float("-inf"), x)
        n = ROWS * K
        tl.store(tokens_ptr + b * n + slots, cand_tok, mask=slots < n)
        tl.store(scores_ptr + b * n + slots, cand_score, mask=slots < n)
        if HAS_BEAM:  # the next beam: the K best of this level's candidates, best first
            left = cand_score
            for j in tl.static_range(K):
                pick = tl.argmax(left, axis=0)
                chosen = slots == pick
                tl.store(best_ptr + b * K + j, pick.to(tl.int64))
                tl.store(beam_tok_ptr + b * K + j, tl.sum(tl.where(chosen, cand_tok, 0), axis=0))
                tl.store(beam_score_ptr + b * K + j, tl.max(tl.where(chosen, cand_score, float("-inf")), axis=0))
                tl.store(beam_id_ptr + b * K + j, offset + pick.to(tl.int64))
                left = tl.where(chosen, float("-inf"), left)

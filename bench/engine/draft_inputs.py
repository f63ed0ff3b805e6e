"""The speculative step's index arithmetic in one launch: where the draft reads and writes, from ``seq_lens``.

Before its first draft pass a speculative step derives, from each sequence's committed length ``n`` and
request row: the draft window's first position ``max(n - w, 0)``, the window's ``w`` positions and token
ids (a gather from the token table), the positions of the deeper draft levels (``n + d - 2`` for level
``d``, once per beam node), the root token (the last committed one) and ``n - 1``. In torch that is ~12
launches of a few elements each (subtractions, a clamp, adds, two gathers, the expand copies of the level
positions); on the H200 each costs ~1.5 us plus a ~0.5 us gap inside the step's graph (run AU in
bench/RESULTS_HISTORY.md), ~20 us of a 1.7 ms speculative step at C = 1. :func:`draft_inputs` computes all of
it in one launch, one program per sequence, when ``fused``; the torch code is the CPU path and the test
oracle, and both return the same tensors.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: the torch path serves everywhere
    triton = tl = None


class DraftInputs(NamedTuple):
    """What the speculative step reads before its first draft pass (``bs`` sequences)."""

    start: torch.Tensor       # [bs] first position of the draft window, max(n - window, 0)
    window_ids: torch.Tensor  # [bs * window] token ids of the window, sequence-major
    window_pos: torch.Tensor  # [bs * window] their positions
    level_pos: Sequence[torch.Tensor]  # level_pos[d - 2]: [bs * topk] positions of draft level d (n + d - 2) per node
    root: torch.Tensor        # [bs] the last committed token, token_table[row, n - 1]
    last: torch.Tensor        # [bs] n - 1


def draft_inputs(token_table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, window: int, steps: int,
                 topk: int, window_cols: torch.Tensor, fused: bool) -> DraftInputs:
    """The draft's positions and tokens for sequences of committed lengths ``seq_lens`` in ``rows``.

    ``window_cols`` is ``arange(window)`` (the torch path's index column, made once outside the graph);
    ``fused`` runs one Triton kernel (CUDA, or Triton's interpreter), else the torch ops."""
    bs = rows.shape[0]
    if not fused:
        start = (seq_lens - window).clamp(min=0)  # clamp: padded rows have n = 1
        pos = start[:, None] + window_cols
        level_pos = [(seq_lens + (d - 2))[:, None].expand(bs, topk).reshape(-1) for d in range(2, steps + 1)]
        return DraftInputs(start, token_table[rows[:, None], pos].reshape(-1), pos.reshape(-1), level_pos,
                           token_table[rows, seq_lens - 1], seq_lens - 1)
    if token_table.stride(1) != 1:
        raise ValueError("token_table needs contiguous rows")
    dev = rows.device
    start, root, last = (torch.empty(bs, dtype=torch.long, device=dev) for _ in range(3))
    window_ids = torch.empty(bs * window, dtype=torch.long, device=dev)
    window_pos = torch.empty_like(window_ids)
    level_pos = torch.empty(steps - 1, bs * topk, dtype=torch.long, device=dev)
    _draft_inputs_kernel[(bs,)](token_table, rows.contiguous(), seq_lens.contiguous(), start, window_ids, window_pos,
                                level_pos, root, last, token_table.stride(0), bs * topk, W=window,
                                WB=triton.next_power_of_2(window), LEVELS=steps - 1, K=topk,
                                KB=triton.next_power_of_2(topk))
    return DraftInputs(start, window_ids, window_pos, level_pos, root, last)


if triton is not None:
    @triton.jit
    def _draft_inputs_kernel(table_ptr, rows_ptr, lens_ptr, start_ptr, ids_ptr, pos_ptr, level_ptr, root_ptr,
                             last_ptr, stride_table, level_stride, W: tl.constexpr, WB: tl.constexpr,
                             LEVELS: tl.constexpr, K: tl.constexpr, KB: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        n = tl.load(lens_ptr + b)
        row = tl.load(rows_ptr + b)
        start = tl.maximum(n - W, 0)
        j = tl.arange(0, WB)
        inside = j < W
        pos = start + j
        tl.store(start_ptr + b, start)
        tl.store(pos_ptr + b * W + j, pos, mask=inside)
        tl.store(ids_ptr + b * W + j, tl.load(table_ptr + row * stride_table + pos, mask=inside), mask=inside)
        node = tl.arange(0, KB)
        for d in tl.static_range(LEVELS):
            tl.store(level_ptr + d * level_stride + b * K + node, tl.zeros([KB], dtype=tl.int64) + n + d,
                     mask=node < K)
        tl.store(root_ptr + b, tl.load(table_ptr + row * stride_table + n - 1))
        tl.store(last_ptr + b, n - 1)

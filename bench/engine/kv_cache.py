"""Paged KV cache: a slot pool (one K and V row per token slot and layer), a slot allocator, and a
``req_to_token`` table mapping (request row, position) to a slot, as SGLang lays them out (page size 1).

Conventions the attention and the graphs rely on:

* Slot 0 is the **dummy slot** and request row 0 the **dummy row** (its ``req_to_token`` row is all
  slot 0). Padded graph rows point at the dummy row, so whatever they write lands in slot 0, which the
  allocator never hands to a real request.
* Every real row reserves ``max_context`` slots when the table is built. A step then finds the slot of
  any position in-graph (``req_to_token[row, pos]``) with no per-step host allocation, and tree
  acceptance only *permutes* a row's slots (no KV copies, no leaks).
"""
from __future__ import annotations

import logging

import numpy as np
import torch

log = logging.getLogger(__name__)

DUMMY_SLOT = 0
DUMMY_ROW = 0


class KVCache:
    """Per-layer K and V buffers ``[num_slots, num_kv_heads, head_dim]`` (plain tensors, allocated once).

    Args:
        num_layers, num_slots, num_kv_heads, head_dim: the shape.
        dtype, device: where the cache lives.
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_slots, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class SlotAllocator:
    """A free list of KV slots; slot 0 (the dummy slot) is never handed out.

    Args:
        num_slots: slots in the pool, the dummy included.
    """

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"a slot pool needs at least 2 slots (one is the dummy), got {num_slots}")
        self._free = np.arange(num_slots - 1, DUMMY_SLOT, -1, dtype=np.int64)  # pop from the end: 1, 2, ...
        self._top = len(self._free)
        self.num_slots = num_slots

    @property
    def num_free(self) -> int:
        return self._top

    def alloc(self, n: int) -> np.ndarray:
        """``n`` free slots (int64); raises ``MemoryError`` naming the shortfall."""
        if n > self._top:
            raise MemoryError(f"KV slot pool exhausted: asked for {n} slots, {self._top} free of "
                              f"{self.num_slots - 1}; build the engine with more slots or fewer rows")
        self._top -= n
        return self._free[self._top:self._top + n][::-1].copy()

    def free(self, slots: np.ndarray) -> None:
        """Return slots to the pool."""
        slots = np.asarray(slots, dtype=np.int64)
        if slots.size and (slots.min() <= DUMMY_SLOT or slots.max() >= self.num_slots):
            raise ValueError(f"cannot free slots outside [1, {self.num_slots - 1}]: {slots.min()}..{slots.max()}")
        self._free[self._top:self._top + len(slots)] = slots[::-1]
        self._top += len(slots)


class ReqToTokenPool:
    """Request rows and the ``req_to_token`` table ``[num_rows + 1, max_context]`` (int64, row 0 dummy).

    Each real row reserves ``max_context`` slots from ``allocator`` at construction.

    Args:
        num_rows: real request rows (the most requests in flight at once).
        max_context: positions per row, i.e. prompt + output + speculative scratch.
        allocator: where the slots come from.
        device: where the table lives.
    """

    def __init__(self, num_rows: int, max_context: int, allocator: SlotAllocator, device: torch.device | str):
        self.max_context = max_context
        table = np.zeros((num_rows + 1, max_context), dtype=np.int64)
        for row in range(1, num_rows + 1):
            table[row] = allocator.alloc(max_context)
        self.req_to_token = torch.from_numpy(table).to(device)
        self._free_rows = list(range(num_rows, DUMMY_ROW, -1))
        self.num_rows = num_rows

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int:
        """A free request row (>= 1)."""
        if not self._free_rows:
            raise MemoryError(f"all {self.num_rows} request rows are in use; build the engine with more rows")
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        """Return a row; its slots stay reserved for the next request that takes it."""
        if not 1 <= row <= self.num_rows:
            raise ValueError(f"request row {row} is outside [1, {self.num_rows}]")
        self._free_rows.append(row)

"""The static input buffers every graph reads: one allocation holding one buffer per declared input.

Each input gets one tensor sized for the largest (mode, bs) key, so all graphs of all modes read and
write the same addresses; a key's views are prefixes of those tensors (``[:rows]``) computed once here.
Beside each buffer lies one *fill row* holding the input's padding value, which the stager copies into
padded rows. All buffers are carved from one block of memory, so whether a caller's input overlaps any of
them (which staging must refuse: it would read memory it is writing) is one comparison (:attr:`span`).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from .modes import GraphKey, KeyTable, StepInput


class StaticBuffers:
    """One static tensor per input, its fill row, and precomputed per-key views."""

    ALIGN = 512  # bytes between buffers' starts: the caching allocator's own granularity

    def __init__(self, specs: Sequence[StepInput], keys: KeyTable, device: torch.device):
        self.specs = tuple(specs)
        self.full: dict[str, torch.Tensor] = {}
        self.fill_rows: dict[str, torch.Tensor] = {}
        shapes = {s.name: (keys.max_rows(s), *s.trailing) for s in specs}
        sizes = [math.prod(shapes[s.name]) * torch.empty((), dtype=s.dtype).element_size() for s in specs]
        starts = [0]
        for size in sizes[:-1]:
            starts.append(starts[-1] + -(-size // self.ALIGN) * self.ALIGN)
        self._arena = torch.empty(starts[-1] + sizes[-1], dtype=torch.uint8, device=device)
        for spec, start, size in zip(specs, starts, sizes):
            self.fill_rows[spec.name] = torch.full((1, *spec.trailing), spec.fill, dtype=spec.dtype, device=device)
            self.full[spec.name] = self._arena[start:start + size].view(spec.dtype).view(shapes[spec.name])
        self.reset()
        self.views: dict[GraphKey, dict[str, torch.Tensor]] = {}
        for key in keys.keys:
            tps = keys.modes[key.mode].tokens_per_seq
            self.views[key] = {s.name: self.full[s.name][: s.rows(key.bs, tps)] for s in specs}

    def reset(self) -> None:
        """Set every row of every buffer to its input's fill value: the one place that does. The buffers start
        so (any row a graph reads before a step writes it is harmless), and every warm-up and capture run reads
        them so (:func:`graphpool.capture.capture_key`), whatever steps a recapture follows."""
        with torch.inference_mode():  # raw writes, as staging's: buffers made under inference_mode stay writable
            for name, buf in self.full.items():
                buf.copy_(self.fill_rows[name].expand(buf.shape))

    def row_bytes(self, spec: StepInput) -> int:
        buf = self.full[spec.name]
        return buf[0].numel() * buf.element_size()

    def kernel_meta(self) -> tuple[torch.Tensor, int, int]:
        """What the staging kernel needs: ``[n_inputs, 4]`` int64 on the buffers' device (dst_ptr,
        fill_ptr, row_words, per_token), the word size it copies in (the smallest element size, which
        divides every input's rows and addresses), and the most words any key stages for one input."""
        word = min(8, *(self.full[s.name].element_size() for s in self.specs))
        rows = [[self.full[s.name].data_ptr(), self.fill_rows[s.name].data_ptr(), self.row_bytes(s) // word,
                 int(s.per == "token")] for s in self.specs]
        max_words = max(self.full[s.name].shape[0] * (self.row_bytes(s) // word) for s in self.specs)
        device = next(iter(self.full.values())).device
        return torch.tensor(rows, dtype=torch.int64, device=device), word, max_words

    @property
    def span(self) -> tuple[int, int]:
        """``[start, end)`` addresses of the memory holding every static buffer."""
        start = self._arena.data_ptr()
        return start, start + self._arena.numel()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.full.values())

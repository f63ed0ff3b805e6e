"""Getting a step's inputs into the static buffers.

Two stagers with one job each:

* :class:`RingStager` (CUDA graphs): the host writes one row ``[real_bs, src_ptr...]`` of a pinned ring
  table, and a kernel captured as the graph's first node gathers and pads every input on the GPU
  (``graphpool.kernels.stage``). No extra launch from Python, no host copy, no allocation.
* :func:`stage_with_torch` (eager twin, and the reference): a slice ``copy_`` per input plus a tail fill.

Hazard the ring handles: the host may prepare step N+1 while step N is still queued on the GPU. Row
``i % slots`` is only rewritten once the GPU has published (in ``done``) that it executed step ``i - slots``;
if the host ever gets ``slots`` steps ahead it waits for the stream.
"""
from __future__ import annotations

import struct
from typing import Callable, Sequence

import torch

from .buffers import StaticBuffers
from .modes import GraphKey, KeyTable


def stage_with_torch(buffers: StaticBuffers, key: GraphKey, inputs: Sequence[torch.Tensor]) -> None:
    """Copy each input into its static view and write the fill value into the padded tail."""
    from graphpool.kernels.stage import stage_reference

    views = buffers.views[key]
    for spec, src in zip(buffers.specs, inputs):
        stage_reference(views[spec.name], src, buffers.fill_rows[spec.name])


class RingStager:
    """Host side of in-graph staging: the pinned ring table, the step counter, and the kernel launch."""

    def __init__(self, buffers: StaticBuffers, keys: KeyTable, device: torch.device,
                 synchronize: Callable[[], None], slots: int = 64):
        self._buffers, self._keys, self.slots, self._synchronize = buffers, keys, slots, synchronize
        width = 1 + len(buffers.specs)
        pinned = device.type == "cuda"
        self.ring = torch.zeros(slots, width, dtype=torch.int64, pin_memory=pinned)
        self.done = torch.zeros(1, dtype=torch.int64, pin_memory=pinned)
        self.step = torch.zeros(2, dtype=torch.int64, device=device)  # [steps executed, programs arrived]
        self.meta = buffers.kernel_meta()
        self._row = struct.Struct(f"<{width}q")
        self._ring_bytes = memoryview(self.ring.numpy()).cast("B")
        self._ring_address = self.ring.data_ptr()
        self._done = memoryview(self.done.numpy()).cast("B").cast("q")  # fast scalar reads of GPU progress
        self._max_bytes = {key: max(s.rows(key.bs, keys.modes[key.mode].tokens_per_seq) * buffers.row_bytes(s)
                                    for s in buffers.specs) for key in keys.keys}
        self.issued = 0  # steps whose staging kernel has been launched for execution (not captured)

    def next_row(self) -> int:
        """Address of the ring row the next executed staging kernel reads. Waits for the GPU first in
        the rare case that the row still belongs to a step it has not run yet."""
        if self.issued - self._done[0] >= self.slots:
            self._synchronize()
        return self._ring_address + (self.issued % self.slots) * self._row.size

    def write(self, row: int, real_bs: int, pointers: Sequence[int]) -> None:
        """Fill the row at ``row`` (from :meth:`next_row`) with the batch size and source pointers."""
        self._row.pack_into(self._ring_bytes, row - self._ring_address, real_bs, *pointers)

    def write_self_copy(self, key: GraphKey) -> None:
        """A row that stages every static view onto itself (used for warm-up runs before capture)."""
        self.write(self.next_row(), key.bs, [t.data_ptr() for t in self._buffers.views[key].values()])

    def launch(self, key: GraphKey) -> None:
        """The staging kernel and the counter advance for ``key``: call inside the graph's capture."""
        from graphpool.kernels.stage import stage_launch

        stage_launch(self.ring, self.step, self.meta, self.done, key.bs,
                     self._keys.modes[key.mode].tokens_per_seq, self._max_bytes[key])

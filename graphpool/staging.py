"""Getting a step's inputs into the static buffers: one object owns it, on every path.

Two stagers with one interface (``checked_write``, ``write``, ``launch``, ``enqueue``, ``self_copy``, ``release``,
``in_flight``, ``check_sync``):

* :class:`RingStager` (CUDA graphs): the host writes one row ``[real_bs, src_ptr...]`` of a pinned ring
  table, and a kernel captured as the graph's first node gathers and pads every input on the GPU
  (``graphpool.kernels.stage``). No extra launch from Python, no host copy, no allocation.
* :class:`TorchStager` (the eager twin, and the reference): a slice ``copy_`` per input plus a tail fill,
  from Python, when the step is staged.

What the ring stager owns, so that nothing else can get it wrong:

* **The host's step count** (``issued``). It advances exactly when a staging kernel is *enqueued for
  execution*: when :meth:`RingStager.launch` runs outside a capture (the eager twin, warm-up), or when a
  captured graph holding a staging node is enqueued (:meth:`RingStager.enqueue`). The device keeps the
  same count in its counters, so the row the kernel reads is always the row the host wrote last.
* **Run-ahead.** The host may get ``slots`` steps ahead of the GPU. Row ``i % slots`` is only rewritten
  once the kernel has published (in ``done``) that it finished step ``i - slots``; otherwise the host
  waits for the stream.
* **Input lifetime.** A row holds raw pointers; the stager keeps a reference to the caller's tensors
  until the row is rewritten, which is after the GPU consumed it. A caller may drop its inputs right
  after ``run``/``stage``.
"""
from __future__ import annotations

import os
import struct
from typing import Any, Callable, Sequence

import torch

from .buffers import StaticBuffers
from .errors import RingDesyncError
from .modes import GraphKey, KeyTable


class TorchStager:
    """Stages with torch copies at :meth:`write` time; graphs hold no staging node."""

    in_graph = False

    def __init__(self, buffers: StaticBuffers):
        self._buffers = buffers

    def checked_write(self, inputs: Any, tokens_per_seq: int, max_bs: int) -> int:
        return -1  # no C++ checker: the pool checks in Python, then calls write()

    def write(self, key: GraphKey, real_bs: int, inputs: Sequence[torch.Tensor]) -> None:
        """Copy each input into its static view of ``key`` and write the fill value into the padded tail."""
        from graphpool.kernels.stage import stage_reference

        views = self._buffers.views[key]
        # Raw copies, as the ring's kernel makes: an input that requires grad must not pull the static buffer
        # into its autograd graph (the buffer would carry a grad_fn, and a longer chain every step), and
        # buffers made under inference_mode stay writable from outside it.
        with torch.inference_mode():
            for spec, src in zip(self._buffers.specs, inputs):
                stage_reference(views[spec.name], src, self._buffers.fill_rows[spec.name])

    def launch(self, key: GraphKey) -> None:
        pass

    def enqueue(self, replay: Callable[[], None]) -> None:
        replay()

    def self_copy(self, key: GraphKey) -> None:
        pass  # the buffers already hold what a replay should read

    @property
    def in_flight(self) -> int:
        return 0

    def check_sync(self) -> None:
        pass

    def release(self) -> None:
        pass  # holds no caller tensors


class RingStager:
    """Host side of in-graph staging: the pinned ring table, both step counts, and the held inputs.

    Args:
        buffers: the pool's static buffers.
        keys: the pool's key table.
        device: the pool's device (the ring and ``done`` are pinned on CUDA).
        synchronize: waits for the device (raises the pool's typed fault error on a CUDA error).
        slots: ring rows: how many steps the host may run ahead of the GPU.
        checker: the C++ input checker (``graphpool.native``), which checks a step and writes its row in
            one call (:meth:`checked_write`), or ``None``.
    """

    in_graph = True

    def __init__(self, buffers: StaticBuffers, keys: KeyTable, device: torch.device,
                 synchronize: Callable[[], None], slots: int = 64, checker: Any = None):
        from graphpool.kernels.stage import stage_grid

        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"ring staging on a {device.type} pool runs the Triton kernel on {device.type} tensors, which "
                             f"needs Triton's interpreter (TRITON_INTERPRET=1, set before Triton is imported); use "
                             f"staging='torch' (the default there)")
        if slots < 2:
            raise ValueError(f"ring_slots must be >= 2 (the GPU publishes progress one step late), got {slots}")
        self._buffers, self._keys, self.slots, self._synchronize = buffers, keys, slots, synchronize
        width = 1 + len(buffers.specs)
        self._cuda = device.type == "cuda"
        self.ring = torch.zeros(slots, width, dtype=torch.int64, pin_memory=self._cuda)
        self.done = torch.zeros(1, dtype=torch.int64, pin_memory=self._cuda)
        self.meta, self.word, max_words = buffers.kernel_meta()
        self.grid = stage_grid(len(buffers.specs), max_words)
        self.counters = torch.zeros(self.grid[0] * self.grid[1], dtype=torch.int64, device=device)
        self._row = struct.Struct(f"<{width}q")
        self._row_size = self._row.size
        self._check = checker.check if checker is not None else None
        self._ring_bytes = memoryview(self.ring.numpy()).cast("B")
        self._ring_address = self.ring.data_ptr()
        self._done = memoryview(self.done.numpy()).cast("B").cast("q")  # fast scalar reads of GPU progress
        self._held: list[Any] = [None] * slots
        self._issued = 0  # staging kernels enqueued for execution (captures excluded)

    def _claim(self) -> int:
        """The slot of the row the next executed staging kernel reads. Waits for the GPU first in the rare
        case that the row still belongs to a step it has not consumed."""
        issued = self._issued
        if issued - self._done[0] >= self.slots:
            self._synchronize()
        return issued % self.slots

    def checked_write(self, inputs: Any, tokens_per_seq: int, max_bs: int) -> int:
        """The hot path: the C++ checker checks ``inputs`` (the caller's kwargs) and writes the row in one
        call. Returns the real batch size (``inputs`` is then held until the row is reused), or a negative
        number without the checker, when a check fails, or when the batch is larger than ``max_bs`` (no
        graph serves it): nothing is written then, and the pool's Python checks and miss policy decide."""
        check = self._check
        if check is None:
            return -1
        issued = self._issued  # _claim, inlined: a Python call less per step
        if issued - self._done[0] >= self.slots:
            self._synchronize()
        slot = issued % self.slots
        real_bs = check(inputs, tokens_per_seq, self._ring_address + slot * self._row_size, max_bs)
        if real_bs > 0:
            self._held[slot] = inputs
        return real_bs

    def write(self, key: GraphKey, real_bs: int, inputs: Sequence[torch.Tensor]) -> None:
        """Write the row of checked ``inputs`` (in declaration order) and hold them until the row is reused."""
        slot = self._claim()
        self._row.pack_into(self._ring_bytes, slot * self._row_size, real_bs, *(t.data_ptr() for t in inputs))
        self._held[slot] = inputs

    def self_copy(self, key: GraphKey) -> None:
        """Write a row that stages every static view of ``key`` onto itself: a replay then runs on the
        buffers' current contents (warm-up, direct graph replays)."""
        self.write(key, key.bs, list(self._buffers.views[key].values()))

    def launch(self, key: GraphKey) -> None:
        """The staging kernel for ``key``. Inside a capture it is recorded (the count advances at each
        replay, see :meth:`enqueue`); outside one it runs now, and the count advances now."""
        from graphpool.kernels.stage import stage_launch

        stage_launch(self.ring, self.counters, self.meta, self.done, key.bs,
                     self._keys.modes[key.mode].tokens_per_seq, self.word, self.grid)
        if not (self._cuda and torch.cuda.is_current_stream_capturing()):
            self._issued += 1

    def enqueue(self, replay: Callable[[], None]) -> None:
        """Enqueue a captured graph that holds a staging node, and count the step."""
        replay()
        self._issued += 1

    def release(self) -> None:
        """Drop the caller tensors held for ring rows (the pool is closed: the device has consumed them)."""
        self._held = [None] * self.slots

    @property
    def in_flight(self) -> int:
        """Staging steps enqueued that the GPU has not reported finished (it reports one step late)."""
        return max(0, self._issued - self._done[0])

    def check_sync(self) -> None:
        """Debug mode: wait for the device and compare its step counters with the host's count."""
        self._synchronize()
        device = self.counters.tolist()
        if any(c != self._issued for c in device):
            raise RingDesyncError(
                f"the host enqueued {self._issued} staging steps but the device executed {device[0]} "
                f"(per program: {sorted(set(device))}): every later step would stage another step's inputs. "
                f"Cause: a graph of this pool was replayed, or its staging kernel launched, outside "
                f"GraphPool.run/replay/graph(...).replay(). Rebuild the pool.")


def make_stager(staging: str, cuda_graphs: bool, buffers: StaticBuffers, keys: KeyTable, rules: Any,
                synchronize: Callable[[], None], ring_slots: int, fast_checks: bool) -> RingStager | TorchStager:
    """The pool's stager for ``staging`` (``"auto"``: ring for CUDA graphs, torch for the eager twin), with
    the C++ input checker only for ring staging of CUDA graphs with ``fast_checks``, where a step costs
    microseconds (and only where the extension builds)."""
    if staging == "auto":
        staging = "ring" if cuda_graphs else "torch"
    if staging not in ("ring", "torch"):
        raise ValueError(f"staging must be 'auto', 'ring' or 'torch', got {staging!r}")
    if staging == "torch":
        return TorchStager(buffers)
    checker = None
    if fast_checks and cuda_graphs:
        from .native import make_input_checker
        checker = make_input_checker(rules)
    return RingStager(buffers, keys, rules.device, synchronize, ring_slots, checker)

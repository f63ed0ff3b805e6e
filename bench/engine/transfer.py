"""Copies between host and device that do not stall the host.

A plain ``tensor.to("cuda")`` from pageable memory synchronises the stream, which would stop the host
from running ahead of the GPU at every step. :class:`HostToDevice` copies through a small ring of pinned
buffers with ``non_blocking=True`` and only waits on a buffer's event before reusing it (by then the copy
has long finished unless the host is a whole ring ahead). :func:`advance_lengths` goes the other way after a
verify step: the accept lengths to pinned host memory and the next ``seq_lens`` on the device, in one launch.
"""
from __future__ import annotations

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: the torch ops serve everywhere
    triton = tl = None


class HostToDevice:
    """Copy small int64 numpy arrays to ``device`` without a host sync.

    Args:
        device: the target device (on CPU the array is simply wrapped).
        max_elems: the most elements one copy may carry.
        slots: ring depth (pinned buffers and device buffers).
    """

    def __init__(self, device: torch.device, max_elems: int, slots: int = 8):
        self.device, self.max_elems = torch.device(device), max_elems
        self._cuda = self.device.type == "cuda"
        self._i = 0
        if self._cuda:
            self._host = [torch.empty(max_elems, dtype=torch.int64).pin_memory() for _ in range(slots)]
            self._dev = [torch.empty(max_elems, dtype=torch.int64, device=self.device) for _ in range(slots)]
            self._events: list[torch.cuda.Event | None] = [None] * slots

    def __call__(self, array: np.ndarray) -> torch.Tensor:
        """A device tensor with ``array``'s shape and contents (valid until the ring wraps around)."""
        array = np.ascontiguousarray(array, dtype=np.int64)
        if not self._cuda:
            return torch.from_numpy(array.copy())
        if array.size > self.max_elems:
            raise ValueError(f"HostToDevice holds {self.max_elems} elements per copy, got {array.size}")
        i = self._i = (self._i + 1) % len(self._host)
        if self._events[i] is not None:
            self._events[i].synchronize()  # the copy that last used this pinned buffer has finished
        host = self._host[i][:array.size]
        host.numpy()[:] = array.reshape(-1)
        dev = self._dev[i][:array.size]
        dev.copy_(host, non_blocking=True)
        event = self._events[i] = torch.cuda.Event()
        event.record()
        return dev.view(array.shape)


if triton is not None:
    @triton.jit
    def _advance_kernel(lens_ptr, accepted_ptr, next_ptr, host_addr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = i < n
        accepted = tl.load(accepted_ptr + i, mask=inside)
        tl.store(next_ptr + i, tl.load(lens_ptr + i, mask=inside) + accepted, mask=inside)
        tl.store(host_addr.to(tl.pointer_type(tl.int64)) + i, accepted, mask=inside)  # pinned: over PCIe


def advance_kernel_available(device: torch.device | str) -> bool:
    """Whether :func:`advance_lengths` can take its one-launch kernel for tensors on ``device`` (CUDA, Triton)."""
    return torch.device(device).type == "cuda" and triton is not None


def advance_lengths(seq_lens: torch.Tensor, accepted: torch.Tensor, next_lens: torch.Tensor, host: torch.Tensor,
                    kernel: bool) -> None:
    """``next_lens = seq_lens + accepted`` on the device and ``host = accepted`` in pinned host memory.

    With ``kernel`` one Triton launch does both, storing straight into the pinned buffer: after a verify
    graph, an add kernel then a device-to-host copy cost the GPU ~7 us of waits each (a copy-engine job
    between two kernels, run AK in bench/RESULTS_HISTORY.md). Without it (CPU, no Triton): ``torch.add`` and a
    non-blocking ``copy_``. All four are int64 ``[bs]``; ``host`` is pinned (on CUDA) and read by the host
    only after an event recorded behind this call."""
    if not kernel:
        torch.add(seq_lens, accepted, out=next_lens)
        host.copy_(accepted, non_blocking=host.is_pinned())
        return
    n = accepted.shape[0]
    for t in (seq_lens, accepted, next_lens, host):
        assert t.dtype == torch.int64 and t.is_contiguous() and t.shape == (n,), (t.dtype, t.shape)
    block = max(16, triton.next_power_of_2(min(n, 1024)))
    _advance_kernel[(triton.cdiv(n, block),)](seq_lens, accepted, next_lens, host.data_ptr(), n, BLOCK=block)

"""Two backends behind one small interface: real CUDA graphs, and an eager twin.

The twin "captures" by remembering the function and "replays" by calling it on the same static views,
so every rule of the pool (routing, padding, buffers, slicing, errors) runs on a CPU in CI. Like a graph,
it writes every replay's outputs into the tensors its capture returned, so code that keeps a result past
the next run without ``copy=True`` breaks on the CPU as it would on a GPU. It is no substitute for the
CUDA backend: only that one proves capture, replay and memory sharing.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .errors import DeviceFaultError, StepOutputError
from .outputs import leaves_of

Captured = Any  # torch.cuda.CUDAGraph for the CUDA backend, the step function itself for the twin


class EagerBackend:
    """Runs steps eagerly; works on any device."""

    name = "eager"

    def __init__(self, device: torch.device):
        self.device = device

    def warmup(self, fn: Callable[[], Any]) -> Any:
        return fn()

    def capture(self, fn: Callable[[], Any]) -> tuple[Captured, Any, int]:
        """"Records" ``fn``: runs it once, as a capture would, for its outputs; the replay it returns runs
        ``fn`` again and copies what it returns into those outputs."""
        out = fn()
        targets = leaves_of(out)

        def replay() -> None:
            produced = leaves_of(fn())
            if len(produced) != len(targets) or any(
                    (t is None) != (p is None) or t is not None and t.shape != p.shape
                    for t, p in zip(targets, produced)):
                raise StepOutputError(
                    f"the step's outputs changed between its capture and a replay ({_shapes(targets)} became "
                    f"{_shapes(produced)}); a graph's outputs are fixed: return tensors of the same structure and "
                    f"shapes on every run")
            with torch.inference_mode():  # raw writes, as a graph's: no autograd, and capture-time tensors stay writable
                for target, new in zip(targets, produced):
                    if target is not None and target is not new:
                        target.copy_(new)

        return replay, out, 0

    def synchronize(self) -> None:
        pass


def _shapes(leaves: list[Any]) -> list[Any]:
    return [None if t is None else tuple(t.shape) for t in leaves]


class CudaGraphBackend:
    """Captures ``torch.cuda.CUDAGraph``s on one side stream into one shared memory pool."""

    name = "cuda"

    def __init__(self, device: torch.device, memory_pool: Any = None):
        if device.type != "cuda":
            raise ValueError(f"the CUDA graph backend needs a CUDA device, got {device}; use backend='eager'")
        self.device = device
        # One pool for every graph: later (smaller) captures reuse blocks the earlier ones freed.
        self._own_pool = memory_pool is None
        self.memory_pool = memory_pool if memory_pool is not None else torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def release(self) -> None:
        """Forget the pool's graphs. A pool of our own is replaced by a fresh handle: once its last graph
        is gone the caching allocator frees it, and capturing into the stale handle again trips an
        allocator assertion (seen with torch 2.11 after a failed capture)."""
        if self._own_pool:
            self.synchronize()
            self.memory_pool = torch.cuda.graph_pool_handle()

    def warmup(self, fn: Callable[[], Any]) -> Any:
        # Warm up on the capture stream, so lazy initialisation (cuBLAS handles, Triton compiles,
        # allocator blocks) happens outside the graph, where it is allowed.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            out = fn()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return out

    def capture(self, fn: Callable[[], Any]) -> tuple[Captured, Any, int]:
        """Capture ``fn``; returns the graph, its static outputs, and the bytes the pool grew by."""
        self.synchronize()
        reserved = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.memory_pool)
            try:
                out = fn()
            except BaseException:
                try:
                    graph.capture_end()
                except Exception:  # the capture is already invalid; the first error is the one to report
                    pass
                raise
            graph.capture_end()
        self.synchronize()
        return graph, out, torch.cuda.memory_reserved(self.device) - reserved

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def wait_for_device(backend: EagerBackend | CudaGraphBackend) -> None:
    """``backend.synchronize()``, with a CUDA error (from any step enqueued before) as :class:`DeviceFaultError`."""
    try:
        backend.synchronize()
    except RuntimeError as exc:
        raise DeviceFaultError(
            f"a step enqueued earlier failed on the device ({str(exc).splitlines()[0]}). The CUDA context is "
            f"unusable now: restart the process. To find the step and the cause, rerun with GRAPHPOOL_DEBUG=1 "
            f"(checks declared input bounds, waits after every replay) and CUDA_LAUNCH_BLOCKING=1") from exc


def make_backend(name: str, device: torch.device, memory_pool: Any = None) -> EagerBackend | CudaGraphBackend:
    """``"auto"`` picks CUDA graphs on a CUDA device and the eager twin elsewhere."""
    if name == "auto":
        name = "cuda" if device.type == "cuda" else "eager"
    if name == "cuda":
        return CudaGraphBackend(device, memory_pool)
    if name == "eager":
        return EagerBackend(device)
    raise ValueError(f"backend must be 'auto', 'cuda' or 'eager', got {name!r}")

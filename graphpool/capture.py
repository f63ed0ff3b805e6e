"""Capturing one key: warm-up, the graph(s), the outputs pre-sliced for every real batch size.

Each captured key becomes an :class:`Entry` whose ``run`` enqueues its graph the only correct way (for a
graph holding a staging node, telling the stager that one more staging step was enqueued), so the pool's
hot path and :class:`CapturedGraph` cannot get the ring's count wrong.
"""
from __future__ import annotations

import functools
import gc
import logging
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from .backends import CudaGraphBackend, EagerBackend
from .buffers import StaticBuffers
from .errors import CaptureError
from .modes import GraphKey, KeyTable, Mode
from .outputs import OutputLayout, Outputs
from .stats import KeyStats

log = logging.getLogger("graphpool")


@dataclass(frozen=True)
class StepBatch:
    """What a step function sees.

    Attributes:
        mode: the step's mode.
        bs: the padded batch size of the graph (the real batch size on the eager miss path).
        num_tokens: ``bs * mode.tokens_per_seq``.
        inputs: name -> tensor: the static views of the graph (``captured``), or the caller's own
            tensors on the eager miss path (not captured, not padded).
        captured: whether this batch belongs to a captured graph.
    """

    mode: Mode
    bs: int
    num_tokens: int
    inputs: Any  # Mapping[str, torch.Tensor]
    captured: bool = True


StepFn = Callable[[StepBatch], Outputs]
PrepareFn = Callable[[StepBatch, int], None]


@dataclass
class Entry:
    """One captured key."""

    key: GraphKey
    batch: StepBatch
    stats: KeyStats
    run: Callable[[], Any] = lambda: None          # enqueue the graph; the eager twin returns its outputs
    stage_run: Optional[Callable[[], Any]] = None  # staging as its own graph, run before `prepare`
    layout: Optional[OutputLayout] = None
    sliced: list = field(default_factory=list)     # [real_bs] -> outputs for layout.fresh


class Step:
    """A validated, routed and staged step, returned by :meth:`GraphPool.stage`; pass it to :meth:`GraphPool.replay`.

    Attributes: ``mode``, ``real_bs``, ``batch`` (the graph's :class:`StepBatch`, or one holding the
    caller's tensors on the eager miss path), ``key`` (the graph's key, ``None`` on a miss). The steps of
    captured graphs are made once, at capture, and shared: treat them as read-only.
    """

    __slots__ = ("mode", "real_bs", "batch", "entry", "padded_rows")

    def __init__(self, mode: Mode, real_bs: int, batch: StepBatch, entry: Entry | None):
        self.mode, self.real_bs, self.batch, self.entry = mode, real_bs, batch, entry
        self.padded_rows = (batch.bs - real_bs) * mode.tokens_per_seq

    @property
    def key(self) -> GraphKey | None:
        return self.entry.key if self.entry is not None else None

    def copy(self) -> "Step":
        """A new step object with the same fields (what :meth:`GraphPool.stage` hands out, so that a stale
        step is never the same object as the latest one)."""
        new = Step.__new__(Step)
        new.mode, new.real_bs, new.batch, new.entry, new.padded_rows = (
            self.mode, self.real_bs, self.batch, self.entry, self.padded_rows)
        return new


def capture_all(keys: KeyTable, buffers: StaticBuffers, step_fn: StepFn, prepare: Optional[PrepareFn], warmup: int,
                backend: CudaGraphBackend | EagerBackend, stager: Any, progress: bool) -> dict[GraphKey, Entry]:
    """Capture every key, largest token count first (later, smaller graphs reuse the earlier ones' freed
    blocks of the shared memory pool). Raises :class:`CaptureError` (the cause attached) on any failure."""
    order = keys.capture_order()
    started = time.perf_counter()
    entries: dict[GraphKey, Entry] = {}
    try:
        with _frozen_gc():
            for i, key in enumerate(order, 1):
                batch = StepBatch(keys.modes[key.mode], key.bs, keys.num_tokens(key), buffers.views[key])
                entries[key] = capture_key(key, batch, step_fn, prepare, warmup, backend, stager)
                if progress:
                    _progress(f"capturing graphs {i}/{len(order)}: {key.mode} bs={key.bs}", i == len(order))
    except Exception as exc:
        raise CaptureError(_capture_failure_message(key, exc)) from exc
    log.info("captured %d graphs (%s backend) in %.2f s, graph memory %.1f MiB", len(order), backend.name,
             time.perf_counter() - started, sum(e.stats.graph_bytes for e in entries.values()) / 2**20)
    return entries


def capture_key(key: GraphKey, batch: StepBatch, step_fn: StepFn, prepare: Optional[PrepareFn], warmup: int,
                backend: CudaGraphBackend | EagerBackend, stager: Any) -> Entry:
    """Warm up and capture ``key``. With ``prepare``, staging is its own small graph (``prepare`` must see
    the staged inputs); without, it is the first node of the step's graph."""
    entry = Entry(key, batch, KeyStats())
    in_graph = stager.in_graph and prepare is None
    where = f"mode {key.mode!r} bs {key.bs}"

    def stage_and_step() -> Outputs:
        stager.launch(key)
        return step_fn(batch)

    def stage_only() -> None:
        stager.launch(key)

    started = time.perf_counter()
    for _ in range(warmup):
        stager.self_copy(key)  # a row that stages every static view onto itself: valid pointers, no change
        if stager.in_graph:
            backend.warmup(stage_only)
        if prepare is not None:
            prepare(batch, key.bs)
        OutputLayout(backend.warmup(lambda: step_fn(batch)), where)
    graph_bytes = 0
    if stager.in_graph and not in_graph:
        stager.self_copy(key)
        stage_graph, _, graph_bytes = backend.capture(stage_only)
        entry.stage_run = _enqueue(backend, stage_graph, stager, stages=True)
    if prepare is not None:
        prepare(batch, key.bs)
    stager.self_copy(key)
    graph, out, nbytes = backend.capture(stage_and_step if in_graph else lambda: step_fn(batch))
    entry.layout = OutputLayout(out, where)
    entry.run = _enqueue(backend, graph, stager, stages=in_graph)
    entry.stats.capture_s = time.perf_counter() - started
    entry.stats.graph_bytes = graph_bytes + nbytes
    # Both backends rewrite the same output tensors every replay: the views for each real batch size are made once.
    tps = batch.mode.tokens_per_seq
    entry.sliced = [()] + [entry.layout.prepare(entry.layout.sliced_leaves(batch.num_tokens, key.bs, real * tps, real))
                           for real in range(1, key.bs + 1)]
    return entry


def _enqueue(backend: CudaGraphBackend | EagerBackend, graph: Any, stager: Any, stages: bool) -> Callable[[], Any]:
    """How to run a captured graph. A CUDA graph that stages is enqueued through the stager, which counts
    the step; the eager twin's staging kernel counts itself when it runs (inside ``graph``)."""
    if isinstance(backend, CudaGraphBackend):
        replay = _bound_replay(graph)
        return functools.partial(stager.enqueue, replay) if stages else replay  # a partial: no Python frame of ours
    return graph


def _bound_replay(graph: Any) -> Callable[[], None]:
    """``graph.replay``, minus torch's Python wrapper where it only forwards to the C++ method (it checks
    a pool tracker when one is set; then the wrapper stays): ~0.2 us of a ~5 us step."""
    base = getattr(getattr(torch._C, "_CUDAGraph", None), "replay", None)
    if base is None or getattr(graph, "_tracker", None) is not None:
        return graph.replay
    return base.__get__(graph)


class CapturedGraph:
    """One captured key's graph, as :meth:`GraphPool.graph` hands it out (benchmarks, debugging).

    :meth:`replay` runs the graph on the *current contents* of the static buffers: whatever the last step
    staged, or what you wrote into ``pool.static_inputs``. It keeps the pool's staging ring in step, so
    pool steps before and after it stay correct, and it counts as a step of the pool: one thread at a
    time (:class:`ConcurrentUseError`), and a step staged before it and not yet replayed is stale
    (:class:`StaleStepError`). It does not run ``prepare``, and its outputs are only reachable through
    the step function's own tensors (or a later ``pool.run``). After ``pool.close()`` or a new capture,
    it raises :class:`NotCapturedError`.
    """

    def __init__(self, entry: Entry, replay: Callable[[Entry], None]):
        self.key = entry.key
        self._entry, self._replay = entry, replay

    def replay(self) -> None:
        """Enqueue the graph once, on the static buffers' current contents."""
        self._replay(self._entry)

    def __repr__(self) -> str:
        return f"CapturedGraph(mode={self.key.mode!r}, bs={self.key.bs})"


@contextmanager
def _frozen_gc() -> Iterator[None]:
    """Collect once, then keep the collector out of the capture: a collection during capture is slow and
    can free tensors whose memory the graph being captured is about to use."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def _progress(message: str, last: bool) -> None:
    if sys.stderr.isatty():
        sys.stderr.write(f"\r{message}" + ("\n" if last else ""))
    elif last:
        sys.stderr.write(f"{message}\n")
    sys.stderr.flush()


def _capture_failure_message(key: GraphKey, exc: BaseException) -> str:
    return (f"capture of graph (mode {key.mode!r}, bs {key.bs}) failed: {type(exc).__name__}: {exc}. "
            f"No graph of this pool was kept. Possible solutions:\n"
            f"1. run the step eagerly (GraphPool(..., backend='eager')) to see if it fails outside a graph;\n"
            f"2. remove host synchronisation (.item(), .tolist(), printing CUDA tensors) and data-dependent "
            f"shapes from the step function (see graphpool.pool's graph-safety rules);\n"
            f"3. lower the largest batch size if the GPU ran out of memory;\n"
            f"4. if a library allocates lazily, make sure the warm-up run (warmup >= 1) touches it.")

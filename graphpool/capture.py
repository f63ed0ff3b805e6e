"""Capturing one key: warm-up, the graph(s), the outputs cut to the real rows for every real batch size.

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
from typing import Any, Callable, Collection, Iterator, Optional

import torch

from .backends import CudaGraphBackend, EagerBackend
from .buffers import StaticBuffers
from .errors import CaptureError, StepOutputError
from .modes import GraphKey, KeyTable, Mode
from .outputs import FreshViews, OutputLayout, OutputRules, Outputs
from .stats import KeyStats

log = logging.getLogger("graphpool")


class StepInputs(dict):
    """``StepBatch.inputs``: name -> tensor, read-only. A graph reads the tensors it was captured with, so
    rebinding or adding an entry (in ``prepare`` or the step) could only work on the eager twin; keep other
    per-step state in your own objects (allocated once, before capture)."""

    __slots__ = ()

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("StepBatch.inputs is read-only: a captured graph reads the static buffers it was captured "
                        "with, so an entry added or replaced here would reach the eager twin but never a CUDA "
                        "graph; write into the tensors in place, or keep extra state in your own objects")

    __setitem__ = __delitem__ = __ior__ = _refuse
    pop = popitem = clear = update = setdefault = _refuse  # type: ignore[assignment]


@dataclass(frozen=True)
class StepBatch:
    """What a step function sees.

    Attributes:
        mode: the step's mode.
        bs: the padded batch size of the graph (the real batch size on the eager miss path).
        num_tokens: ``bs * mode.tokens_per_seq``.
        inputs: name -> tensor (read-only): the static views of the graph (``captured``), or the
            caller's own tensors on the eager miss path (not captured, not padded).
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
    views: list = field(default_factory=list)      # [real_bs] -> the output leaves cut to the real rows
    fresh: Callable[[tuple], Any] = lambda views: None  # a run's result from views (layout.fresh_function)


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


def capture_all(keys: KeyTable, buffers: StaticBuffers, step_fn: StepFn, prepare: Optional[PrepareFn],
                outputs: OutputRules, warmup: int, backend: CudaGraphBackend | EagerBackend, stager: Any,
                progress: bool, fresh: Optional[FreshViews] = None,
                modes: Optional[Collection[str]] = None) -> dict[GraphKey, Entry]:
    """Capture every key (of ``modes`` only, when given), largest token count first (later, smaller graphs reuse
    the earlier ones' freed blocks of the shared memory pool). Raises :class:`CaptureError` (the cause attached) on
    any failure."""
    order = [k for k in keys.capture_order() if modes is None or k.mode in modes]
    started = time.perf_counter()
    entries: dict[GraphKey, Entry] = {}
    try:
        with _frozen_gc():
            for i, key in enumerate(order, 1):
                batch = StepBatch(keys.modes[key.mode], key.bs, keys.num_tokens(key), StepInputs(buffers.views[key]))
                entries[key] = capture_key(key, batch, buffers, step_fn, prepare, outputs, warmup, backend, stager,
                                           fresh)
                if progress:
                    _progress(f"capturing graphs {i}/{len(order)}: {key.mode} bs={key.bs}", i == len(order))
    except Exception as exc:
        kept = ("No graph of this pool was kept" if modes is None else
                f"No graph of mode(s) {', '.join(sorted(modes))} was kept (the pool's other modes keep theirs)")
        raise CaptureError(_capture_failure_message(key, exc, backend.name, kept)) from exc
    log.info("captured %d graphs (%s backend) in %.2f s, graph memory %.1f MiB", len(order), backend.name,
             time.perf_counter() - started, sum(e.stats.graph_bytes for e in entries.values()) / 2**20)
    return entries


def capture_key(key: GraphKey, batch: StepBatch, buffers: StaticBuffers, step_fn: StepFn,
                prepare: Optional[PrepareFn], outputs: OutputRules, warmup: int,
                backend: CudaGraphBackend | EagerBackend, stager: Any, fresh: Optional[FreshViews] = None) -> Entry:
    """Warm up and capture ``key``, every run (``prepare`` too) on every row at its fill value. With
    ``prepare``, staging is its own small graph (``prepare`` must see the staged inputs); without, it is the
    first node of the step's graph."""
    entry = Entry(key, batch, KeyStats())
    in_graph = stager.in_graph and prepare is None
    where = f"mode {key.mode!r} bs {key.bs}"

    def at_fills() -> None:
        # The buffers hold the last step's real inputs after steps have run (a recapture after close() or a
        # failed capture, a new step function): warm-up and capture must never run on them (a real sequence's
        # KV slots would be written). Then a ring row that stages the static views onto themselves.
        buffers.reset()
        stager.self_copy(key)

    def stage_and_step() -> Outputs:
        stager.launch(key)
        return step_fn(batch)

    def stage_only() -> None:
        stager.launch(key)

    started = time.perf_counter()
    for _ in range(warmup):
        at_fills()
        if stager.in_graph:
            backend.warmup(stage_only)
        if prepare is not None:
            prepare(batch, key.bs)
        _checked_layout(backend.warmup(lambda: step_fn(batch)), outputs, batch, where)
    graph_bytes = 0
    if stager.in_graph and not in_graph:
        at_fills()
        stage_graph, _, graph_bytes = backend.capture(stage_only)
        entry.stage_run = _enqueue(backend, stage_graph, stager, stages=True)
    at_fills()
    if prepare is not None:
        prepare(batch, key.bs)
    graph, out, nbytes = backend.capture(stage_and_step if in_graph else lambda: step_fn(batch))
    entry.layout = _checked_layout(out, outputs, batch, where, fresh)
    entry.fresh = entry.layout.fresh_function
    entry.run = _enqueue(backend, graph, stager, stages=in_graph)
    entry.stats.capture_s = time.perf_counter() - started
    entry.stats.graph_bytes = graph_bytes + nbytes
    # Both backends rewrite the same output tensors every replay: the cut leaves of each real batch size are
    # made once (each run hands out new tensor objects viewing them: OutputLayout.fresh).
    tps = batch.mode.tokens_per_seq
    entry.views = [()] + [entry.layout.views(real * tps, real) for real in range(1, key.bs + 1)]
    return entry


def _checked_layout(out: Outputs, outputs: OutputRules, batch: StepBatch, where: str,
                    fresh: Optional[FreshViews] = None) -> OutputLayout:
    layout = OutputLayout(out, outputs, where, fresh)
    layout.check_rows(layout.leaves, batch.num_tokens, batch.bs, where)
    return layout


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
    can free tensors whose memory the graph being captured is about to use.

    Objects the caller froze before (``gc.freeze()``, as servers do after start-up to make collections
    cheap) stay frozen: ``gc.unfreeze()`` would release the caller's too, so the pool only freezes, and
    unfreezes, when nothing was frozen."""
    gc.collect()
    was_enabled = gc.isenabled()
    ours = gc.get_freeze_count() == 0
    gc.disable()
    if ours:
        gc.freeze()
    try:
        yield
    finally:
        if ours:
            gc.unfreeze()
        if was_enabled:
            gc.enable()


def _progress(message: str, last: bool) -> None:
    if sys.stderr.isatty():
        sys.stderr.write(f"\r{message}" + ("\n" if last else ""))
    elif last:
        sys.stderr.write(f"{message}\n")
    sys.stderr.flush()


def _capture_failure_message(key: GraphKey, exc: BaseException, backend: str,
                             kept: str = "No graph of this pool was kept") -> str:
    cause = str(exc).rstrip().rstrip(".")
    failed = f"capture of graph (mode {key.mode!r}, bs {key.bs}) failed on the {backend} backend"
    if isinstance(exc, StepOutputError):  # what the step returns, not how it runs: the message says the fix
        return f"{failed}: {cause}. {kept}."
    remedies = [
        "state sized by its first call breaks at the next batch size: transformers' StaticCache, for one, takes "
        "its batch size from its first write (an index_copy_ shape error at the second key); allocate such state "
        "once, for the largest batch size, before capture (graphpool.integrations.transformers.SlotCache does)",
        "every key runs the step with all rows at their inputs' fill values first (padding): those values must be "
        "valid for every kernel the step runs (a dummy KV slot, a length of 1)",
    ]
    if backend == "cuda":
        remedies[:0] = [
            "run the step eagerly (GraphPool(..., backend='eager')) to see if it fails outside a graph",
            "remove host synchronisation (.item(), .tolist(), printing CUDA tensors) and data-dependent shapes from "
            "the step function (see graphpool.pool's graph-safety rules)",
        ]
        remedies += ["lower the largest batch size if the GPU ran out of memory",
                     "if a library allocates lazily, make sure the warm-up run (warmup >= 1) touches it"]
    listed = "".join(f"\n{i}. {r};" for i, r in enumerate(remedies, 1))[:-1] + "."
    return f"{failed}: {type(exc).__name__}: {cause}. {kept}. Possible solutions:{listed}"

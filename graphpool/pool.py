"""GraphPool: one CUDA graph per (mode, batch size) over shared static buffers and one memory pool.

Graph-safety rules a step function must keep (they are CUDA graph rules; the eager twin does not enforce
them, so a step that breaks one passes on the CPU and fails or goes silently wrong on the GPU):

* **Raises at capture:** no host synchronisation (``.item()``, ``.tolist()``, ``print`` of a CUDA tensor,
  ``torch.cuda.synchronize``) and no data-dependent shapes (``nonzero``, boolean-mask indexing).
* **Silently wrong:** every replay reads and writes the same addresses. Read inputs only through
  ``batch.inputs``; keep any other state (KV cache, weights, metadata buffers) in tensors allocated once,
  before capture; never rebind them. Padded rows hold each input's fill value and must be harmless
  (e.g. ``out_cache_loc`` pointing at a dummy KV slot).
* **Outputs are views into graph memory:** the next :meth:`GraphPool.run` overwrites them. Use
  ``run(..., copy=True)`` or clone what you keep.
"""
from __future__ import annotations

import gc
import logging
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from .backends import CudaGraphBackend, make_backend
from .buffers import StaticBuffers
from .errors import (BatchTooLargeError, CaptureError, InputDeviceError, InputDtypeError, InputRowsError,
                     InputShapeError, MissingInputError, NotCapturedError)
from .modes import GraphKey, KeyTable, Mode, StepInput
from .native import make_input_checker
from .outputs import Outputs, clone_outputs, slice_outputs
from .staging import RingStager, stage_with_torch
from .stats import KeyStats, PoolStats

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
    inputs: Mapping[str, torch.Tensor]
    captured: bool = True


StepFn = Callable[[StepBatch], Outputs]
PrepareFn = Callable[[StepBatch, int], None]


@dataclass
class _Entry:
    """One captured key: its batch, graph(s), outputs pre-sliced for every real batch size."""

    key: GraphKey
    batch: StepBatch
    stats: KeyStats
    graph: Any = None
    stage_graph: Any = None  # ring staging as its own graph, replayed before `prepare`
    stages_in_graph: bool = False  # ring staging is the first node of `graph`
    sliced: list | None = None  # sliced[real_bs] -> outputs (static-output backends only)


class Step:
    """A validated, routed and staged step, returned by :meth:`GraphPool.stage`.

    Attributes: ``mode``, ``real_bs``, ``batch`` (the graph's :class:`StepBatch`, or one holding the
    caller's tensors on the eager miss path), ``key`` (the graph's key, ``None`` on a miss). The steps of
    captured graphs are made once, at capture, and shared: treat them as read-only.
    """

    __slots__ = ("mode", "real_bs", "batch", "entry", "padded_rows")

    def __init__(self, mode: Mode, real_bs: int, batch: StepBatch, entry: _Entry | None):
        self.mode, self.real_bs, self.batch, self.entry = mode, real_bs, batch, entry
        self.padded_rows = (batch.bs - real_bs) * mode.tokens_per_seq

    @property
    def key(self) -> GraphKey | None:
        return self.entry.key if self.entry is not None else None


@dataclass
class _ModePlan:
    """Per mode, everything the hot path looks up by the real batch size (index 0 unused)."""

    mode: Mode
    shapes: list[tuple[tuple[int, ...], ...]]  # [real_bs] -> expected shape of every input
    steps: list[Step | None]                   # [real_bs] -> the step of the graph that serves it


class GraphPool:
    """Graphs for several step shapes ("modes"), routed by mode and padded batch size.

    Args:
        modes: the step shapes, e.g. ``[Mode("decode", 1), Mode("verify", 16)]``.
        inputs: the declared inputs every step passes (see :class:`StepInput`).
        batch_sizes: the batch sizes to capture for modes that name none.
        device: where the static buffers and graphs live (default: the current CUDA device, else CPU).
        backend: ``"auto"`` (CUDA graphs on CUDA, the eager twin elsewhere), ``"cuda"`` or ``"eager"``.
        on_miss: a batch larger than the largest captured size runs eagerly (``"eager"``, counted in
            ``stats.misses``) or raises :class:`BatchTooLargeError` (``"raise"``).
        memory_pool: a graph memory pool handle to share (e.g. SGLang's global pool); default: a new one.
        staging: how inputs reach the static buffers: ``"ring"`` (a Triton kernel in the graph reads source
            pointers from a pinned ring table: no extra launch), ``"torch"`` (a slice copy and a tail fill
            per input, from Python), or ``"auto"`` (ring for CUDA graphs, torch for the eager twin).
        ring_slots: how many steps the host may run ahead of the GPU before :meth:`run` waits.
        fast_checks: check inputs with the C++ checker (``graphpool.native``) where it builds; the
            Python checks raise the same errors, ~0.5 us slower per input.

    .. warning:: read the graph-safety rules in this module's docstring before writing a step function.
    """

    def __init__(self, modes: Sequence[Mode], inputs: Sequence[StepInput], batch_sizes: Sequence[int],
                 device: torch.device | str | None = None, backend: str = "auto", on_miss: str = "eager",
                 memory_pool: Any = None, staging: str = "auto", ring_slots: int = 64, fast_checks: bool = True):
        if on_miss not in ("eager", "raise"):
            raise ValueError(f"on_miss must be 'eager' or 'raise', got {on_miss!r}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.keys = KeyTable(modes, batch_sizes)
        self.buffers = StaticBuffers(inputs, self.keys, self.device)
        self.backend = make_backend(backend, self.device, memory_pool)
        self.on_miss = on_miss
        self.stats = PoolStats(backend=self.backend.name, buffer_bytes=self.buffers.nbytes)
        if staging == "auto":
            staging = "ring" if isinstance(self.backend, CudaGraphBackend) else "torch"
        if staging not in ("ring", "torch"):
            raise ValueError(f"staging must be 'auto', 'ring' or 'torch', got {staging!r}")
        self._ring = RingStager(self.buffers, self.keys, self.device, self.backend.synchronize, ring_slots) \
            if staging == "ring" else None
        self._device_index = self.device.index if self.device.type == "cuda" else -1
        self._specs = self.buffers.specs
        self._names = tuple(s.name for s in self._specs)
        self._dtypes = tuple(s.dtype for s in self._specs)
        # The real batch size is read off one input: a per-sequence one if any, else a per-token one.
        self._bs_index = next((i for i, s in enumerate(self._specs) if s.per == "seq"), 0)
        self._plans: dict[str, _ModePlan] = {}  # filled by capture(); empty means "not captured"
        self._checker = make_input_checker(self._specs, self._device_index, self._bs_index) if fast_checks else None
        self._step_fn: StepFn | None = None
        self._prepare: PrepareFn | None = None
        self._failure: str | None = None

    # ----------------------------------------------------------------------------------------- capture
    @property
    def memory_pool(self) -> Any:
        """The graph memory pool handle every graph of this pool is captured into (CUDA backend)."""
        return getattr(self.backend, "memory_pool", None)

    @property
    def static_inputs(self) -> dict[str, torch.Tensor]:
        """Name -> the one static buffer of each input, sized for the largest (mode, bs)."""
        return dict(self.buffers.full)

    @property
    def captured(self) -> bool:
        """Whether :meth:`capture` has succeeded (and no later capture failed)."""
        return bool(self._plans)

    @property
    def modes(self) -> dict[str, Mode]:
        """Name -> :class:`Mode`, as the pool was built."""
        return dict(self.keys.modes)

    @property
    def batch_sizes(self) -> dict[str, tuple[int, ...]]:
        """Mode name -> the batch sizes its graphs are captured at, ascending."""
        return dict(self.keys.sizes)

    @property
    def graph_keys(self) -> tuple[GraphKey, ...]:
        """Every (mode, batch size) key the pool captures, in capture order (largest token count first)."""
        return tuple(self.keys.capture_order())

    @property
    def steps_in_flight(self) -> int:
        """Staged steps whose staging the device has not executed yet (0 without ring staging)."""
        ring = self._ring
        return 0 if ring is None else ring.issued - int(ring.done[0])

    def capture(self, step_fn: StepFn, prepare: PrepareFn | None = None, warmup: int = 1,
                progress: bool = True) -> None:
        """Capture one graph per (mode, bs), largest token count first, into one memory pool.

        Args:
            step_fn: the step; called as ``step_fn(batch)`` (see :class:`StepBatch`).
            prepare: optional ``prepare(batch, real_bs)``, run outside the graph after the inputs are
                staged and before every replay (and before capture), e.g. attention metadata. With a
                ``prepare``, staging is its own small graph replayed first; without, it is the first
                node of the step's graph.
            warmup: eager runs of each key before its capture.
            progress: print one progress line per graph to stderr.

        Raises:
            CaptureError: a key failed to capture; no graph of this pool is kept, and :meth:`run`
                raises until a capture succeeds.
        """
        self._release()
        self._step_fn, self._prepare = step_fn, prepare
        order = self.keys.capture_order()
        started = time.perf_counter()
        entries: dict[GraphKey, _Entry] = {}
        try:
            with _frozen_gc():
                for i, key in enumerate(order, 1):
                    entries[key] = self._capture_key(key, step_fn, prepare, warmup)
                    if progress:
                        _progress(f"capturing graphs {i}/{len(order)}: {key.mode} bs={key.bs}", i == len(order))
        except Exception as exc:
            entries.clear()
            self._release()
            self._failure = f"{type(exc).__name__}: {exc}"
            raise CaptureError(_capture_failure_message(key, exc)) from exc
        self._failure = None
        self.stats.keys = {key: entries[key].stats for key in self.keys.keys}
        for name, mode in self.keys.modes.items():
            sizes = range(1, self.keys.max_bs[name] + 1)
            serving = [entries[GraphKey(name, self.keys.route(name, real_bs))] for real_bs in sizes]
            self._plans[name] = _ModePlan(
                mode, [()] + [self._shapes(mode, real_bs) for real_bs in sizes],
                [None] + [Step(mode, real_bs, e.batch, e) for real_bs, e in zip(sizes, serving)])
        log.info("captured %d graphs (%s backend) in %.2f s, graph memory %.1f MiB", len(order),
                 self.backend.name, time.perf_counter() - started, self.stats.graph_bytes / 2**20)

    def _capture_key(self, key: GraphKey, step_fn: StepFn, prepare: PrepareFn | None, warmup: int) -> _Entry:
        mode = self.keys.modes[key.mode]
        batch = StepBatch(mode, key.bs, self.keys.num_tokens(key), self.buffers.views[key])
        ring = self._ring
        in_graph = ring is not None and prepare is None
        entry = _Entry(key, batch, KeyStats(), stages_in_graph=in_graph)

        def stage_and_step() -> Outputs:
            if in_graph:
                ring.launch(key)
            return step_fn(batch)

        started = time.perf_counter()
        for _ in range(warmup):
            if ring is not None:
                ring.write_self_copy(key)  # stage every view onto itself: real buffers, valid pointers
                self.backend.warmup(lambda: ring.launch(key))
                ring.issued += 1
            if prepare is not None:
                prepare(batch, key.bs)
            self.backend.warmup(lambda: step_fn(batch))
        graph_bytes = 0
        if ring is not None and not in_graph:
            entry.stage_graph, _, graph_bytes = self.backend.capture(lambda: ring.launch(key))
        if prepare is not None:
            prepare(batch, key.bs)
        entry.graph, out, nbytes = self.backend.capture(stage_and_step if in_graph else lambda: step_fn(batch))
        entry.stats.capture_s = time.perf_counter() - started
        entry.stats.graph_bytes = graph_bytes + nbytes
        if self.backend.static_outputs:
            tps = mode.tokens_per_seq
            entry.sliced = [None] + [slice_outputs(out, batch.num_tokens, key.bs, real * tps, real)
                                     for real in range(1, key.bs + 1)]
        return entry

    def _release(self) -> None:
        self._plans = {}
        self.stats.keys = {}
        if isinstance(self.backend, CudaGraphBackend):
            self.backend.release()

    def _shapes(self, mode: Mode, real_bs: int) -> tuple[tuple[int, ...], ...]:
        return tuple((s.rows(real_bs, mode.tokens_per_seq), *s.trailing) for s in self._specs)

    # ------------------------------------------------------------------------------------------- steps
    def run(self, mode: str, copy: bool = False, **inputs: torch.Tensor) -> Outputs:
        """Run one step of ``mode`` on ``inputs`` and return ``step_fn``'s outputs sliced to the real rows.

        Validates the inputs, routes to the smallest captured batch size >= the real one, stages the
        inputs into the static buffers (padding the tail with each input's fill value), runs ``prepare``,
        and replays.

        .. warning:: the returned tensors are views into graph memory that the next run overwrites;
            pass ``copy=True`` for private copies.

        Raises:
            UnknownModeError, MissingInputError, InputRowsError, InputDtypeError, InputDeviceError,
            InputShapeError: the step does not fit the pool; nothing was touched.
            BatchTooLargeError: with ``on_miss="raise"``, the batch is larger than every captured size.
            NotCapturedError, CaptureError: :meth:`capture` has not succeeded.
        """
        out = self.replay(self._stage(mode, inputs))
        return clone_outputs(out) if copy else out

    def stage(self, mode: str, **inputs: torch.Tensor) -> Step:
        """Validate and route a step and stage its inputs; :meth:`replay` runs it.

        For the CUDA backend without ``prepare`` the copy itself happens in the graph's first node at
        :meth:`replay`; otherwise ``step.batch.inputs`` hold the staged, padded inputs on return.

        .. warning:: replay each staged step before staging the next: a step's inputs live in buffers
            (and a ring-table row) that the next ``stage`` rewrites.
        """
        return self._stage(mode, inputs)

    def _stage(self, mode: str, inputs: Mapping[str, torch.Tensor]) -> Step:
        plan = self._plans.get(mode)
        if plan is None:
            self._check_ready(mode)
        ring = self._ring
        row = ring.next_row() if ring is not None else 0
        # The C++ checker validates and writes the ring row in one call; on any mismatch (or without it)
        # the Python checks run, and they raise the typed error that explains it.
        real_bs = self._checker.check(inputs, plan.mode.tokens_per_seq, row) if self._checker is not None else -1
        if real_bs < 0:
            real_bs, pointers = self._validate(plan, inputs)
            if ring is not None:
                ring.write(row, real_bs, pointers)
        steps = plan.steps
        step = steps[real_bs] if real_bs < len(steps) else None
        if step is None:
            return self._miss_step(plan.mode, real_bs, inputs)
        entry = step.entry
        if ring is None:
            stage_with_torch(self.buffers, entry.key, [inputs[name] for name in self._names])
        elif entry.stage_graph is not None:
            self.backend.replay(entry.stage_graph)
            ring.issued += 1
        return step

    def replay(self, step: Step) -> Outputs:
        """Run a staged step: ``prepare``, then the graph (or the eager miss path); outputs sliced."""
        entry, real_bs = step.entry, step.real_bs
        if entry is None:
            if self._prepare is not None:
                self._prepare(step.batch, real_bs)
            return self._step_fn(step.batch)
        if self._prepare is not None:
            self._prepare(entry.batch, real_bs)
        stats = entry.stats
        stats.replays += 1
        stats.padded_rows += step.padded_rows
        if entry.sliced is not None:
            entry.graph.replay()
            if entry.stages_in_graph:
                self._ring.issued += 1
            return entry.sliced[real_bs]
        out = self.backend.replay(entry.graph)
        if entry.stages_in_graph:
            self._ring.issued += 1
        tps = step.mode.tokens_per_seq
        return slice_outputs(out, entry.batch.num_tokens, entry.batch.bs, real_bs * tps, real_bs)

    def graph(self, mode: str, bs: int) -> Any:
        """The captured graph object of key (mode, bs) (a ``torch.cuda.CUDAGraph`` on the CUDA backend),
        for benchmarks and debugging: replaying it directly skips staging and slicing."""
        plan = self._plans.get(self.keys.mode(mode).name)
        step = plan.steps[bs] if plan is not None and 0 < bs < len(plan.steps) else None
        entry = step.entry if step is not None else None
        if entry is None or entry.key.bs != bs:
            raise KeyError(f"no graph for mode {mode!r} bs {bs}; captured: {self.keys.sizes[mode]}")
        return entry.graph

    def can_run(self, mode: str, real_bs: int) -> bool:
        """Whether a captured graph serves ``real_bs`` sequences of ``mode``."""
        return self.route(mode, real_bs) is not None

    def route(self, mode: str, real_bs: int) -> int | None:
        """Padded batch size of the graph that would serve the step, ``None`` for a miss."""
        self.keys.mode(mode)
        return self.keys.route(mode, real_bs) if real_bs >= 1 else None

    # ------------------------------------------------------------------------------------- validation
    def _check_ready(self, mode: str) -> None:
        self.keys.mode(mode)  # raises UnknownModeError for a bad name
        if self._failure is not None:
            raise CaptureError(f"this pool's last capture failed ({self._failure}); it holds no graphs. "
                               f"Fix the cause and call pool.capture(step_fn) again before running steps")
        raise NotCapturedError(f"mode {mode!r} has no graphs yet: call pool.capture(step_fn) before pool.run")

    def _validate(self, plan: _ModePlan, inputs: Mapping[str, torch.Tensor]) -> tuple[int, list[int]]:
        """Check every input against its declaration (dtype, shape, device, contiguity) and raise the
        typed error for the first that does not fit; returns the real batch size and the data pointers.
        The hot path where the C++ checker is unavailable: expected shapes are looked up, not computed.
        """
        mode = plan.mode
        try:
            ordered = [inputs[name] for name in self._names]
        except KeyError:
            ordered = []
        if len(ordered) != len(inputs) or not ordered:
            self._raise_names(mode, inputs)
        try:
            rows = ordered[self._bs_index].shape[0]
        except (AttributeError, IndexError):
            rows = 0
        real_bs = rows if self._specs[self._bs_index].per == "seq" else rows // mode.tokens_per_seq
        if real_bs < 1:
            self._raise_rows(mode, self._specs[self._bs_index], ordered[self._bs_index], None)
        shapes = plan.shapes[real_bs] if real_bs < len(plan.shapes) else self._shapes(mode, real_bs)
        device, pointers = self._device_index, []
        try:
            for t, dtype, shape in zip(ordered, self._dtypes, shapes):
                if t.dtype is not dtype or t.shape != shape or t.get_device() != device or not t.is_contiguous():
                    raise ValueError
                pointers.append(t.data_ptr())
        except (AttributeError, ValueError):
            spec = self._specs[len(pointers)]
            self._raise_input(mode, spec, ordered[len(pointers)], real_bs)
        return real_bs, pointers

    def _raise_names(self, mode: Mode, inputs: Mapping[str, Any]) -> None:
        missing = [s.name for s in self._specs if s.name not in inputs]
        unknown = sorted(set(inputs) - set(self._names))
        raise MissingInputError(
            f"mode {mode.name!r} step: missing inputs {missing}, unknown inputs {unknown}; this pool declares "
            f"{[s.name for s in self._specs]} and every step must pass each of them by keyword")

    def _raise_input(self, mode: Mode, spec: StepInput, t: Any, real_bs: int) -> None:
        if not isinstance(t, torch.Tensor):
            raise InputDtypeError(f"input {spec.name!r} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype is not spec.dtype:
            raise InputDtypeError(f"input {spec.name!r} has dtype {t.dtype}, declared {spec.dtype}; "
                                  f"convert it with .to({spec.dtype}) before the step")
        if t.get_device() != self._device_index:
            raise InputDeviceError(f"input {spec.name!r} is on {t.device}, the pool on {self.device}; "
                                   f"move it with .to({str(self.device)!r})")
        if t.dim() != 1 + len(spec.trailing) or (t.dim() > 1 and tuple(t.shape[1:]) != spec.trailing):
            raise InputShapeError(f"input {spec.name!r} has shape {tuple(t.shape)}: declared rows x "
                                  f"{spec.trailing}, so its trailing shape must be {spec.trailing}")
        if t.shape[0] != spec.rows(real_bs, mode.tokens_per_seq):
            self._raise_rows(mode, spec, t, real_bs)
        raise InputDeviceError(f"input {spec.name!r} is not contiguous (strides {t.stride()}); "
                               f"pass {spec.name}.contiguous()")

    def _raise_rows(self, mode: Mode, spec: StepInput, t: Any, real_bs: int | None) -> None:
        tps, got = mode.tokens_per_seq, (t.shape[0] if isinstance(t, torch.Tensor) and t.dim() else 0)
        source = self._specs[self._bs_index].name
        if real_bs is None:
            raise InputRowsError(
                f"mode {mode.name!r} takes {tps} token(s) per sequence: input {spec.name!r} has {got} rows, "
                f"which is not a positive multiple of {tps if spec.per == 'token' else 1}")
        expected = spec.rows(real_bs, tps)
        per = f"{real_bs} x {tps} = {expected}" if spec.per == "token" else f"{expected}"
        fits = [f"{m.name!r} ({m.tokens_per_seq} token(s) per sequence)" for m in self.keys.modes.values()
                if m is not mode and spec.rows(real_bs, m.tokens_per_seq) == got]
        hint = f"; the rows fit mode {' or '.join(fits)}: route the step there" if fits else ""
        raise InputRowsError(
            f"mode {mode.name!r} takes {tps} token(s) per sequence: input {spec.name!r} needs {per} rows for "
            f"batch size {real_bs} (read from {source!r}), got {got}{hint}")

    def _miss_step(self, mode: Mode, real_bs: int, inputs: Mapping[str, torch.Tensor]) -> Step:
        largest = self.keys.max_bs[mode.name]
        if self.on_miss == "raise":
            raise BatchTooLargeError(
                f"mode {mode.name!r}: batch size {real_bs} is larger than the largest captured size {largest}; "
                f"capture larger sizes (Mode({mode.name!r}, ..., batch_sizes=[..., {real_bs}])) or build the "
                f"pool with on_miss='eager'")
        self.stats.misses[f"{mode.name}: bs > {largest}"] += 1
        batch = StepBatch(mode, real_bs, real_bs * mode.tokens_per_seq, dict(inputs), captured=False)
        return Step(mode, real_bs, batch, None)


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

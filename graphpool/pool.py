"""GraphPool: one CUDA graph per (mode, batch size) over shared static buffers and one memory pool.

Rules a step function must keep (they are CUDA graph rules; the eager twin does not enforce them, so a
step that breaks one passes on the CPU and fails or goes silently wrong on the GPU):

* **Raises at capture:** no host synchronisation (``.item()``, ``.tolist()``, ``print`` of a CUDA tensor,
  ``torch.cuda.synchronize``) and no data-dependent shapes (``nonzero``, boolean-mask indexing).
* **Silently wrong:** every replay reads and writes the same addresses. Read inputs only through
  ``batch.inputs``; keep any other state (KV cache, weights, metadata buffers) in tensors allocated once,
  before capture; never rebind them. Padded rows hold each input's fill value, and every warm-up and
  capture run (a recapture after steps too) reads every row at it: fills must be harmless (e.g.
  ``out_cache_loc`` pointing at a dummy KV slot).

Rules a caller must keep:

* **Outputs: rows are declared, never guessed.** ``pool.capture(step, outputs=...)`` says which outputs
  have one row per token (``"token"``: a run returns ``real_bs * tokens_per_seq`` rows) or per sequence
  (``"seq"``: ``real_bs`` rows); every other output is returned whole, whatever its shape. A declaration
  that cannot hold is a :class:`StepOutputError` at capture. The same rule runs on every path (CUDA graph,
  eager twin, eager miss); :mod:`graphpool.outputs` states how a path names an output (whole components).
* **Outputs are views into graph memory**: each run returns a new container of the step's own type around
  new tensor objects, but the next :meth:`GraphPool.run` overwrites their values. Use
  ``run(..., copy=True)`` or clone what you keep.
* **Input lifetime:** with ring staging (CUDA graphs) the GPU reads your input tensors when the step
  *executes*, possibly well after ``run`` returned. The pool holds a reference to them until then, so
  you may drop them; but do not write into them in place before the step has executed.
* **Streams:** produce inputs on the current stream, or make it wait for yours
  (``torch.cuda.current_stream().wait_stream(s)``) and call ``t.record_stream(current)`` before ``run``.
* **Threads:** one caller at a time. ``run``/``stage``/``replay`` raise :class:`ConcurrentUseError` when a
  second thread enters while one is inside, or replays a step another thread staged. Use one pool per
  thread, or a lock around each stage+replay pair.
* **Device faults:** a kernel that faults (an out-of-range index, say) surfaces as a CUDA error at a later
  synchronisation, not at its ``run``; the CUDA context is then unusable. :meth:`GraphPool.synchronize`
  and the pool's own waits raise :class:`DeviceFaultError` saying so. Debug mode finds the step.

**Debug mode** (``GraphPool(..., debug=True)`` or ``GRAPHPOOL_DEBUG=1``) checks what the fast path trusts:
every input's declared ``bounds`` before the replay (:class:`IndexBoundsError`, naming input and row),
then waits for each replay, turning a CUDA error into :class:`DeviceFaultError` naming the key, and
compares the host's and device's staging counts (:class:`RingDesyncError`). It syncs every step: slow.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Mapping, Sequence

import torch

from .backends import CudaGraphBackend, make_backend, wait_for_device
from .buffers import StaticBuffers
from .capture import CapturedGraph, Entry, PrepareFn, Step, StepFn, capture_all
from .errors import (CONCURRENT_USE, CaptureError, ConcurrentUseError, DeviceFaultError, NotCapturedError,
                     StaleStepError)
from .modes import GraphKey, KeyTable, Mode, StepInput
from .native import fresh_functions
from .outputs import OutputLayout, OutputRules, Outputs
from .staging import make_stager
from .routing import Router
from .stats import PoolStats
from .validation import InputRules


def debug_from_env() -> bool:
    """Whether ``GRAPHPOOL_DEBUG`` turns debug mode on (the pools' default): unset, empty, 0, false, no and off
    are off."""
    return os.environ.get("GRAPHPOOL_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")


log = logging.getLogger("graphpool")


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
        staging: ``"ring"`` (a Triton kernel in the graph reads source pointers from a pinned ring table:
            no extra launch), ``"torch"`` (a slice copy and a tail fill per input, from Python), or
            ``"auto"`` (ring for CUDA graphs, torch for the eager twin).
        ring_slots: how many steps the host may run ahead of the GPU before :meth:`run` waits (>= 2).
        fast_checks: on CUDA pools, check inputs with the C++ checker (``graphpool.native``) where it
            builds; the Python checks accept and refuse the same steps, ~3 us slower per step.
        debug: check what the fast path trusts, every step (see the module docstring); default from
            the ``GRAPHPOOL_DEBUG`` environment variable.

    .. warning:: read this module's docstring (step-function, lifetime, stream and thread rules) first.
    """

    def __init__(self, modes: Sequence[Mode], inputs: Sequence[StepInput], batch_sizes: Sequence[int],
                 device: torch.device | str | None = None, backend: str = "auto", on_miss: str = "eager",
                 memory_pool: Any = None, staging: str = "auto", ring_slots: int = 64, fast_checks: bool = True,
                 debug: bool | None = None):
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._keys = KeyTable(modes, batch_sizes)
        self._rules = InputRules(inputs, self.device, modes)
        self.buffers = StaticBuffers(self._rules.specs, self._keys, self.device)
        full = self.buffers.full
        self._rules.bind_static(self.buffers.span, [full[n].data_ptr() for n in self._rules.names],
                                [full[n].numel() * full[n].element_size() for n in self._rules.names])
        self.backend = make_backend(backend, self.device, memory_pool)
        self.debug = debug_from_env() if debug is None else debug
        self.stats = PoolStats(backend=self.backend.name, buffer_bytes=self.buffers.nbytes)
        self._stager = make_stager(staging, isinstance(self.backend, CudaGraphBackend), self.buffers, self._keys,
                                   self._rules, self.synchronize, ring_slots, fast_checks)
        self._router = Router(self._keys, on_miss, self.stats)
        # New tensor objects per result at C++ speed where the C++ checker is built (CUDA pools, fast_checks).
        self._fresh = fresh_functions() if fast_checks and isinstance(self.backend, CudaGraphBackend) else None
        self._entries: dict[GraphKey, Entry] = {}
        self._step_fn: StepFn | None = None
        self._prepare: PrepareFn | None = None
        self._outputs: OutputRules = None
        self._busy = threading.Lock()  # held inside run/stage/replay; a second thread raises at once
        self._pending: Step | None = None    # the latest staged step, not yet replayed
        self._pending_thread = 0              # the thread that staged it

    # ------------------------------------------------------------------------------------ inspection
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
        return bool(self._router.plans)

    @property
    def modes(self) -> dict[str, Mode]:
        """Name -> :class:`Mode`, as the pool was built."""
        return dict(self._keys.modes)

    @property
    def batch_sizes(self) -> dict[str, tuple[int, ...]]:
        """Mode name -> the batch sizes its graphs are captured at, ascending."""
        return dict(self._keys.sizes)

    @property
    def graph_keys(self) -> tuple[GraphKey, ...]:
        """Every (mode, batch size) key the pool captures, in capture order (largest token count first)."""
        return tuple(self._keys.capture_order())

    @property
    def steps_in_flight(self) -> int:
        """Staged steps the GPU has not reported finished (0 without ring staging); at most ``ring_slots``."""
        return self._stager.in_flight

    # ------------------------------------------------------------------------------------ capture
    def capture(self, step_fn: StepFn, prepare: PrepareFn | None = None, warmup: int = 1,
                progress: bool = True, *, outputs: OutputRules = None,
                modes: Sequence[str | Mode] | None = None) -> None:
        """Capture one graph per (mode, bs), largest token count first, into one memory pool.

        Args:
            step_fn: the step; called as ``step_fn(batch)`` (see :class:`StepBatch`). It returns a tensor,
                or a tuple, namedtuple, list or dict (nested, subclasses included) of tensors or ``None``.
            prepare: optional ``prepare(batch, real_bs)``, run outside the graph after the inputs are
                staged and before every replay (and before capture), e.g. attention metadata. With a
                ``prepare``, staging is its own small graph replayed first; without, it is the first
                node of the step's graph.
            warmup: eager runs of each key before its capture.
            progress: report progress on stderr: on a terminal one line, rewritten per graph; elsewhere
                (logs, CI) one line when the last graph is captured.
            outputs: which outputs have rows (the output rule, see the module docstring): ``None`` (every
                output returned whole), ``"token"`` or ``"seq"`` (every output), or a mapping from output
                paths (``"logits"``, ``"hidden.0"``) to ``"token"``, ``"seq"`` or ``None``.
            modes: capture only these modes (names or the pool's :class:`Mode`), keeping the graphs this pool
                holds of every other mode; ``None``: every mode, anew. For modes that arrive one at a time (a
                server that builds one speculation tier after another, each with its own attention state): the
                buffers are already sized for every mode the pool was built with, and the later graphs go into
                the same memory pool. Until its first capture a mode's steps raise :class:`NotCapturedError`.
                Every capture of a pool passes the same ``step_fn``, ``prepare`` and ``outputs`` (one step
                function serves every mode, and the eager path of a batch too large).

        Raises:
            CaptureError: a key failed to capture (or the step's outputs break the output rule, see
                :class:`StepOutputError`, its cause); no graph of the modes being captured is kept (without
                ``modes``: none of this pool), and their steps raise until a capture of them succeeds.
            ValueError: ``modes`` is empty, or a later capture passes another ``step_fn``, ``prepare`` or
                ``outputs`` than the graphs this pool keeps.
            ConcurrentUseError: another thread is inside this pool.
        """
        OutputLayout.check_declaration(outputs)
        names = None if modes is None else {self._keys.mode(m).name for m in modes}
        if names is not None and not names:
            raise ValueError("capture(modes=...) names no mode: pass the modes to capture, or modes=None for all")
        if not self._busy.acquire(False):
            raise ConcurrentUseError(CONCURRENT_USE)
        try:
            kept = self._kept_entries(names, step_fn, prepare, outputs)
            if not kept:
                self._release()
            try:
                entries = capture_all(self._keys, self.buffers, step_fn, prepare, outputs, warmup, self.backend,
                                      self._stager, progress, self._fresh, modes=names)
            except CaptureError as exc:
                if not kept:
                    self._release()
                self._install(kept)
                self._router.failure = f"{type(exc.__cause__).__name__}: {exc.__cause__}"
                raise
            self._step_fn, self._prepare, self._outputs = step_fn, prepare, outputs
            self._install({**kept, **entries})
        finally:
            self._busy.release()

    def _kept_entries(self, names: set[str] | None, step_fn: StepFn, prepare: PrepareFn | None,
                      outputs: OutputRules) -> dict[GraphKey, Entry]:
        """The graphs a capture of ``names`` keeps (those of every other mode; none for a capture of all)."""
        kept = {k: e for k, e in self._entries.items() if names is not None and k.mode not in names}
        if kept and (step_fn, prepare, outputs) != (self._step_fn, self._prepare, self._outputs):
            raise ValueError(f"capture(modes={sorted(names)}) passes another step_fn, prepare or outputs than the "
                             f"graphs this pool keeps of {sorted({k.mode for k in kept})}: one step function serves "
                             f"every mode of a pool; pass the same ones, or capture every mode anew (modes=None)")
        return kept

    def _install(self, entries: dict[GraphKey, Entry]) -> None:
        """Route steps to ``entries`` (the modes whose graphs they all hold) and count their stats."""
        self._entries = entries
        self.stats.keys = {key: entries[key].stats for key in self._keys.keys if key in entries}
        self._router.build(entries, self._rules)

    def close(self) -> None:
        """Wait for queued steps, then free every graph and drop the inputs the pool held for them (the
        pool can be captured again). Call it before tearing down what the graphs use, e.g.
        ``torch.distributed.destroy_process_group()``: graphs that hold collectives and outlive their process
        group can hang the process at exit.

        Raises:
            ConcurrentUseError: another thread is inside this pool.
        """
        if not self._busy.acquire(False):
            raise ConcurrentUseError(CONCURRENT_USE)
        try:
            if self.captured:
                self.synchronize()
            self._release()
            self._stager.release()
            self._step_fn = self._prepare = None
            self._router.failure = None  # closed, not failed: run() says "not captured"
        finally:
            self._busy.release()

    def _release(self) -> None:
        self._router.plans, self._entries, self._pending = {}, {}, None
        self.stats.keys = {}
        if isinstance(self.backend, CudaGraphBackend):
            self.backend.release()

    # ------------------------------------------------------------------------------------ steps
    def run(self, mode: str | Mode, copy: bool = False, **inputs: torch.Tensor) -> Outputs:
        """Run one step of ``mode`` on ``inputs`` and return ``step_fn``'s outputs, the declared ones cut
        to the real rows (the output rule: see the module docstring and :meth:`capture`).

        Validates the inputs, routes to the smallest captured batch size >= the real one, stages the
        inputs into the static buffers (padding the tail with each input's fill value), runs ``prepare``,
        and replays. Each run returns a new container of the step's type around new tensor objects.

        Args:
            mode: the mode's name (or the pool's :class:`Mode` itself).
            copy: return private copies instead of views of graph memory.
            inputs: every declared input, by name.

        .. warning:: the returned tensors are views into graph memory that the next run overwrites;
            pass ``copy=True`` for private copies.

        Raises:
            UnknownModeError, MissingInputError, InputTypeError, InputDtypeError, InputDeviceError,
            InputShapeError, InputRowsError, InputLayoutError: the step does not fit; nothing was touched.
            BatchTooLargeError: with ``on_miss="raise"``, the batch is larger than every captured size.
            NotCapturedError, CaptureError: :meth:`capture` has not succeeded.
            ConcurrentUseError: another thread is inside this pool. Debug mode adds IndexBoundsError,
            DeviceFaultError and RingDesyncError.
        """
        if not self._busy.acquire(False):  # a plain lock, not a `with` object: two Python calls less per step
            raise ConcurrentUseError(CONCURRENT_USE)
        try:
            step = self._stage(mode, inputs)  # a step it refuses leaves a staged one intact
            self._pending = None  # a step staged earlier is stale now (this one rewrote its ring row)
            # Copies are enqueued before another thread may replay a graph over these outputs.
            return self._replay(step, copy)
        finally:
            self._busy.release()

    def stage(self, mode: str | Mode, **inputs: torch.Tensor) -> Step:
        """Validate and route a step and stage its inputs; :meth:`replay` runs it.

        With ring staging (the default for CUDA graphs) and no ``prepare``, the copy itself happens in the
        graph's first node at :meth:`replay`; otherwise ``step.batch.inputs`` hold the staged, padded
        inputs on return. Each call returns a new :class:`Step`. A step this refuses (any input error)
        leaves the previously staged step intact.

        .. warning:: replay each staged step once, before staging the next (the next ``stage``, ``run`` or
            ``graph(...).replay()`` rewrites its inputs: replaying it then raises :class:`StaleStepError`).
        """
        if not self._busy.acquire(False):
            raise ConcurrentUseError(CONCURRENT_USE)
        try:
            step = self._stage(mode, inputs)
            if step.entry is not None:  # graphs' steps are shared per (mode, real_bs): hand out this stage's own
                step = step.copy()
            # The step replay() may run next, staged by this thread (attributes, not a tuple: no allocation).
            self._pending, self._pending_thread = step, threading.get_ident()
            return step
        finally:
            self._busy.release()

    def replay(self, step: Step, copy: bool = False) -> Outputs:
        """Run the step from the latest :meth:`stage`: ``prepare``, then its graph (or the eager miss path).
        Returns what :meth:`run` returns (``copy``: private copies)."""
        if not self._busy.acquire(False):
            raise ConcurrentUseError(CONCURRENT_USE)
        try:
            if self._pending is not step:
                raise StaleStepError("this step is not the latest staged one (a later stage() rewrote its inputs, or "
                                     "it was already replayed): stage it again, then replay it once")
            if self._pending_thread != threading.get_ident():
                raise ConcurrentUseError(CONCURRENT_USE)
            self._pending = None
            return self._replay(step, copy)
        finally:
            self._busy.release()

    def _stage(self, mode: str | Mode, inputs: Mapping[str, torch.Tensor]) -> Step:
        try:
            plan = self._router.plans.get(mode)
        except TypeError:  # an unhashable mode: not_ready raises UnknownModeError
            plan = None
        if plan is None:
            plan = self._router.plan_of(mode)  # a Mode object, or raises why there is no table
        mode_obj, shapes, steps = plan
        stager = self._stager
        # Every check that can refuse a step runs before its ring row is written, so a refused step leaves
        # the row of a staged one intact. The C++ checker validates and writes the row in one call when a
        # graph serves the step; on any mismatch, a miss, in debug mode (bounds are checked first) or
        # without it, the Python checks run, and they raise the typed error that explains a refusal.
        real_bs = -1 if self.debug else stager.checked_write(inputs, mode_obj.tokens_per_seq, len(steps) - 1)
        ordered = None
        if real_bs < 0:
            real_bs, ordered = self._rules.check(mode_obj, inputs, shapes)
        if self.debug:
            self._rules.check_bounds([inputs[n] for n in self._rules.names])
        step = steps[real_bs] if real_bs < len(steps) else None
        if step is None:
            return self._router.miss(mode_obj, real_bs, inputs)
        entry = step.entry
        if ordered is not None:  # the Python path writes the row here (the C++ checker wrote it already)
            stager.write(entry.key, real_bs, ordered)
        if entry.stage_run is not None:
            entry.stage_run()
        return step

    def _replay(self, step: Step, copy: bool) -> Outputs:
        entry, real_bs = step.entry, step.real_bs
        batch = step.batch if entry is None else entry.batch
        if self._prepare is not None:
            self._prepare(batch, real_bs)
        if entry is None:
            return self._run_miss(step, copy)
        entry.run()
        stats = entry.stats  # counted once the step ran: a step that raised served nothing
        stats.replays += 1
        stats.padded_rows += step.padded_rows
        if self.debug:
            self._debug_after(entry.key)
        views = entry.views[real_bs]
        return entry.layout.copied(views) if copy else entry.fresh(views)

    def _run_miss(self, step: Step, copy: bool) -> Outputs:
        """The eager miss path, under the same output rule as the graphs (checked on the real sizes)."""
        batch = step.batch
        out = self._step_fn(batch)
        self._router.count_miss(step.mode)
        where = f"eager step (mode {step.mode.name!r}, bs {batch.bs}, larger than every graph)"
        layout = OutputLayout(out, self._outputs, where)
        layout.check_rows(layout.leaves, batch.num_tokens, batch.bs, where)
        return layout.copied(layout.leaves) if copy else layout.fresh(tuple(layout.leaves))

    def graph(self, mode: str | Mode, bs: int) -> CapturedGraph:
        """The captured graph of key (mode, bs), for benchmarks and debugging: its ``replay()`` runs on the
        current static buffers and keeps the staging ring in step (see :class:`CapturedGraph`)."""
        name = self._keys.mode(mode).name
        entry = self._entries.get(GraphKey(name, bs))
        if entry is None:
            raise KeyError(f"no graph for mode {name!r} bs {bs}; captured: {self._keys.sizes[name]}"
                           + ("" if self.captured else " (capture has not succeeded)"))
        return CapturedGraph(entry, self._replay_graph)

    def _replay_graph(self, entry: Entry) -> None:
        """:meth:`CapturedGraph.replay`: one step on the buffers' current contents, under the pool's rules."""
        if not self._busy.acquire(False):
            raise ConcurrentUseError(CONCURRENT_USE)
        try:
            if self._entries.get(entry.key) is not entry:
                raise NotCapturedError(f"graph (mode {entry.key.mode!r}, bs {entry.key.bs}) was freed by close() or a "
                                       f"later capture(); get a new handle with pool.graph(mode, bs)")
            self._pending = None  # it rewrites the ring row a staged step would read: that step is stale
            if entry.stage_run is None:  # staging is this graph's first node: a row that stages the views onto themselves
                self._stager.self_copy(entry.key)
            entry.run()
        finally:
            self._busy.release()

    def can_run(self, mode: str | Mode, real_bs: int) -> bool:
        """Whether a captured graph serves ``real_bs`` sequences of ``mode`` (``False`` before a capture).

        Raises:
            UnknownModeError: ``mode`` is not one of the pool's modes (before a capture too).
        """
        route = self.route(mode, real_bs)
        return route is not None and self._keys.mode(mode).name in self._router.plans

    def route(self, mode: str | Mode, real_bs: int) -> int | None:
        """Padded batch size of the graph that would serve the step, ``None`` for a miss."""
        return self._router.route(mode, real_bs)

    def synchronize(self) -> None:
        """Wait for every queued step; raises :class:`DeviceFaultError` if one faulted on the device."""
        wait_for_device(self.backend)

    def _debug_after(self, key: GraphKey) -> None:
        try:
            self.synchronize()
        except DeviceFaultError as exc:
            raise DeviceFaultError(f"graph (mode {key.mode!r}, bs {key.bs}) faulted: {exc}") from exc.__cause__
        self._stager.check_sync()

"""Which graph serves a step: per-mode tables built once at capture, and the miss policy.

:class:`KeyTable` (in :mod:`.modes`) says which keys exist; the :class:`Router` turns the captured keys
into per-mode tables indexed by the real batch size (the expected input shapes and the pre-made
:class:`Step` of the graph that serves it), so routing on the hot path is two list lookups.
"""
from __future__ import annotations

from typing import Mapping

import torch

from .capture import Entry, Step, StepBatch, StepInputs
from .errors import BatchTooLargeError, CaptureError, NotCapturedError
from .modes import GraphKey, KeyTable, Mode
from .stats import PoolStats
from .validation import InputRules

Plan = tuple  # (mode, shapes[real_bs], steps[real_bs]); index 0 unused


class Router:
    """Routing tables of a captured pool, and what a step larger than every graph gets."""

    def __init__(self, keys: KeyTable, on_miss: str, stats: PoolStats):
        if on_miss not in ("eager", "raise"):
            raise ValueError(f"on_miss must be 'eager' or 'raise', got {on_miss!r}")
        self.keys, self.on_miss, self.stats = keys, on_miss, stats
        self.plans: dict[str, Plan] = {}  # empty: not captured
        self.failure: str | None = None   # why the last capture failed, if it did

    def build(self, entries: Mapping[GraphKey, Entry], rules: InputRules) -> None:
        """Tables for every mode whose graphs are all in ``entries`` (a pool may capture its modes one at a time:
        a mode not captured yet keeps no table)."""
        keys = self.keys
        self.plans = {}
        for name, mode in keys.modes.items():
            if any(GraphKey(name, bs) not in entries for bs in keys.sizes[name]):
                continue
            sizes = range(1, keys.max_bs[name] + 1)
            serving = [entries[GraphKey(name, keys.route(name, real_bs))] for real_bs in sizes]
            self.plans[name] = (mode, [()] + [rules.shapes(mode, real_bs) for real_bs in sizes],
                                [None] + [Step(mode, real_bs, e.batch, e) for real_bs, e in zip(sizes, serving)])
        self.failure = None

    def plan_of(self, mode: object) -> Plan:
        """The table of a step named by a :class:`Mode` object (the pool's own), or raise why there is none."""
        if isinstance(mode, Mode):
            plan = self.plans.get(self.keys.mode(mode).name)  # raises for a Mode the pool was not built with
            if plan is not None:
                return plan
            mode = mode.name
        self.not_ready(mode)
        raise AssertionError("unreachable")  # not_ready always raises

    def not_ready(self, mode: str) -> None:
        """Raise why ``mode`` has no table: an unknown name, a failed capture, or no capture yet."""
        self.keys.mode(mode)  # raises UnknownModeError (with "did you mean") for a bad name
        if self.failure is not None:
            raise CaptureError(f"this pool's last capture failed ({self.failure}); it holds no graphs of mode "
                               f"{mode!r}. Fix the cause and call pool.capture(step_fn) again before running steps")
        raise NotCapturedError(f"mode {mode!r} has no graphs yet: call pool.capture(step_fn) before pool.run")

    def miss(self, mode: Mode, real_bs: int, inputs: Mapping[str, torch.Tensor]) -> Step:
        """The step of a batch larger than every captured size: eager (counted), or an error."""
        largest = self.keys.max_bs[mode.name]
        if self.on_miss == "raise":
            raise BatchTooLargeError(
                f"mode {mode.name!r}: batch size {real_bs} is larger than the largest captured size {largest}; "
                f"capture larger sizes (Mode({mode.name!r}, ..., batch_sizes=[..., {real_bs}])) or build the "
                f"pool with on_miss='eager'")
        batch = StepBatch(mode, real_bs, real_bs * mode.tokens_per_seq, StepInputs(inputs), captured=False)
        return Step(mode, real_bs, batch, None)

    def count_miss(self, mode: Mode) -> None:
        """Count one eager step of ``mode`` (when it runs: a staged miss never replayed is not counted)."""
        self.stats.misses[f"{mode.name}: bs > {self.keys.max_bs[mode.name]}"] += 1

    def route(self, mode: str, real_bs: int) -> int | None:
        """Padded batch size of the graph that would serve the step, ``None`` for a miss."""
        name = self.keys.mode(mode).name
        return self.keys.route(name, real_bs) if real_bs >= 1 else None

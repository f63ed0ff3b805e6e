"""Every rule a step's inputs must keep, in one place.

:data:`RULES` is the table: which property of an input is checked, in which order, and which typed
error reports it. The fast checks (Python here, or the C++ checker in ``csrc/input_check.cpp``, which is
built from the same declarations) only say *whether* a step fits; on any failure :meth:`InputRules.explain`
walks the table and raises the error of the first rule broken, with a message that names the value, the
rule and the fix. So both checkers accept the same steps and every failure reads the same.

Values are not checked on the fast path: :meth:`InputRules.check_bounds` (debug mode) does that.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from .errors import (IndexBoundsError, InputDeviceError, InputDtypeError, InputLayoutError, InputRowsError,
                     InputShapeError, InputTypeError, MissingInputError)
from .modes import Mode, StepInput

#: Names :meth:`GraphPool.run` and :meth:`GraphPool.stage` take themselves; an input cannot have them.
RESERVED = ("self", "mode", "copy")

#: (rule, error raised when an input breaks it), checked in this order, input by input.
RULES = (
    ("declared", MissingInputError),   # every declared input passed, nothing else
    ("tensor", InputTypeError),        # a torch.Tensor
    ("dense", InputLayoutError),       # strided: not sparse, not nested (staging copies flat rows)
    ("dtype", InputDtypeError),        # the declared dtype
    ("device", InputDeviceError),      # the pool's device
    ("trailing", InputShapeError),     # rows x the declared trailing shape
    ("rows", InputRowsError),          # bs x tokens_per_seq rows (per token) or bs rows (per sequence)
    ("contiguous", InputLayoutError),  # one block of memory
    ("resolved", InputLayoutError),    # no lazy conjugate/negative bit (in-graph staging copies raw memory)
    ("distinct", InputLayoutError),    # no overlap with the static buffers staging writes (its own from row 0 is fine)
)


class InputRules:
    """The declared inputs of a pool and the checks every step's inputs go through.

    Args:
        specs: the declarations.
        device: the pool's device.
        modes: every mode of the pool (to say which mode a wrong row count would fit).
    """

    def __init__(self, specs: Sequence[StepInput], device: torch.device, modes: Sequence[Mode]):
        names = [s.name for s in specs]
        if not specs or len(set(names)) != len(names):
            raise ValueError(f"GraphPool needs a non-empty list of uniquely named StepInputs, got {names}")
        clash = [n for n in names if n in RESERVED]
        if clash:
            raise ValueError(f"input name(s) {clash} collide with GraphPool.run's own parameters {list(RESERVED)}; "
                             f"rename the input (e.g. {clash[0]!r} -> {clash[0] + '_in'!r})")
        self.specs = tuple(specs)
        self.names = tuple(names)
        self.device = device
        self.device_index = device.index if device.type == "cuda" else -1
        self.modes = tuple(modes)
        # The real batch size is read off one input: a per-sequence one if any, else a per-token one.
        self.bs_index = next((i for i, s in enumerate(specs) if s.per == "seq"), 0)
        self.bounded = tuple((i, s) for i, s in enumerate(specs) if s.bounds is not None)
        self._dtypes = tuple(s.dtype for s in specs)
        self._cpu = device.type != "cuda"
        self.static_span = (0, 0)  # [start, end) of the static buffers (bind_static)
        self.static_starts: tuple[int, ...] = (0,) * len(specs)
        self._near = (0,) * len(specs)  # per input: above this start address it may overlap the buffers

    def bind_static(self, span: tuple[int, int], starts: Sequence[int], max_bytes: Sequence[int]) -> None:
        """The static buffers staging writes: their memory ``span``, each input's own buffer start, and
        the most bytes a staged input can have (its buffer's size): what the overlap rule needs."""
        self.static_span, self.static_starts = tuple(span), tuple(starts)
        self._near = tuple(span[0] - n for n in max_bytes)

    def shapes(self, mode: Mode, real_bs: int) -> tuple[tuple[int, ...], ...]:
        """The exact shape every input must have in a step of ``real_bs`` sequences of ``mode``."""
        return tuple((s.rows(real_bs, mode.tokens_per_seq), *s.trailing) for s in self.specs)

    # -------------------------------------------------------------------------------- fast path
    def check(self, mode: Mode, inputs: Mapping[str, Any], shapes: Sequence | None) -> tuple[int, list[torch.Tensor]]:
        """Whether ``inputs`` fit; returns the real batch size and the tensors in declaration order.

        ``shapes`` is ``shapes[real_bs]`` precomputed per mode (looked up, not computed, on the hot path).
        Raises the typed error of the first broken rule (via :meth:`explain`).
        """
        try:
            ordered = [inputs[name] for name in self.names]
            rows = ordered[self.bs_index].shape[0]
        except (KeyError, AttributeError, IndexError, RuntimeError):  # RuntimeError: a nested tensor has no shape
            self._refuse(mode, inputs)
        spec = self.specs[self.bs_index]
        real_bs = rows if spec.per == "seq" else rows // mode.tokens_per_seq
        if len(ordered) != len(inputs) or real_bs < 1:
            self._refuse(mode, inputs)
        expected = shapes[real_bs] if shapes is not None and real_bs < len(shapes) else self.shapes(mode, real_bs)
        index, cpu, end = self.device_index, self._cpu, self.static_span[1]
        for t, dtype, shape, near in zip(ordered, self._dtypes, expected, self._near):
            try:
                if (t.dtype is not dtype or t.shape != shape or t.get_device() != index or (cpu and not t.is_cpu)
                        or not t.is_contiguous() or t.is_conj() or t.is_neg() or near < t.data_ptr() < end):
                    self.explain(mode, inputs)  # the last test only says "maybe overlapping": explain decides
            except (AttributeError, RuntimeError):  # not a tensor; a nested tensor has no shape
                self._refuse(mode, inputs)
        return real_bs, ordered

    def _refuse(self, mode: Mode, inputs: Mapping[str, Any]) -> None:
        self.explain(mode, inputs)
        raise AssertionError(f"the fast checks refused a step that breaks none of the rules {[r for r, _ in RULES]}")

    # -------------------------------------------------------------------------------- explaining
    def explain(self, mode: Mode, inputs: Mapping[str, Any]) -> None:
        """Raise the typed error of the first rule of :data:`RULES` that ``inputs`` break; return if none
        is broken (the fast checks only suspected an overlap with the static buffers)."""
        missing = [n for n in self.names if n not in inputs]
        unknown = sorted(set(inputs) - set(self.names))
        if missing or unknown:
            raise MissingInputError(
                f"mode {mode.name!r} step: missing inputs {missing}, unknown inputs {unknown}; this pool declares "
                f"{list(self.names)} and every step must pass each of them by keyword")
        real_bs = None
        order = [self.bs_index] + [i for i in range(len(self.specs)) if i != self.bs_index]
        for i in order:
            spec, t = self.specs[i], inputs[self.names[i]]
            for rule, error in RULES[1:]:
                problem = self._problem(rule, mode, spec, t, real_bs)
                if problem:
                    raise error(problem)
            if real_bs is None:
                rows = t.shape[0]
                real_bs = rows if spec.per == "seq" else rows // mode.tokens_per_seq
        return None  # every rule holds (an input only near the static buffers, not overlapping them)

    def _problem(self, rule: str, mode: Mode, spec: StepInput, t: Any, real_bs: int | None) -> str:
        name = spec.name
        if rule == "tensor" and not isinstance(t, torch.Tensor):
            return f"input {name!r} must be a torch.Tensor, got {type(t).__name__}"
        if rule == "dense" and (t.layout is not torch.strided or t.is_nested):
            kind = "nested" if t.is_nested else f"{t.layout} (sparse)"
            return (f"input {name!r} is a {kind} tensor; the pool stages dense rows: pass a strided tensor "
                    f"({name}.to_dense() for a sparse one)")
        if rule == "dtype" and t.dtype is not spec.dtype:
            return f"input {name!r} has dtype {t.dtype}, declared {spec.dtype}; convert it with .to({spec.dtype})"
        if rule == "device" and (t.get_device() != self.device_index or (self._cpu and not t.is_cpu)):
            return f"input {name!r} is on {t.device}, the pool on {self.device}; move it with .to({str(self.device)!r})"
        if rule == "trailing" and (t.dim() != 1 + len(spec.trailing) or tuple(t.shape[1:]) != spec.trailing):
            return self._trailing_problem(spec, t)
        if rule == "rows":
            return self._rows_problem(mode, spec, t, real_bs)
        if rule == "contiguous" and not t.is_contiguous():
            return f"input {name!r} is not contiguous (strides {t.stride()}); pass {name}.contiguous()"
        if rule == "distinct":
            return self._overlap_problem(spec, t)
        if rule == "resolved" and (t.is_conj() or t.is_neg()):
            return (f"input {name!r} is a lazily {'conjugated' if t.is_conj() else 'negated'} view (its memory holds "
                    f"the values before {'conj()' if t.is_conj() else 'negation'}); pass "
                    f"{name}.{'resolve_conj' if t.is_conj() else 'resolve_neg'}()")
        return ""

    @staticmethod
    def _trailing_problem(spec: StepInput, t: torch.Tensor) -> str:
        name, trailing, shape = spec.name, spec.trailing, tuple(t.shape)
        if t.dim() < 1 + len(trailing):  # no row dimension at all (a 0-dim tensor, say): the rule, then the fix
            row = "token" if spec.per == "token" else "sequence"
            want = f"(rows, {', '.join(map(str, trailing))})" if trailing else "(rows,)"
            fix = (f"for one {row}, pass {name}.unsqueeze(0)" if shape == trailing else
                   f"pass a tensor of shape {want}")
            return (f"input {name!r} has shape {shape}, without the row dimension every input starts with: it is "
                    f"declared with one row per {row} and trailing shape {trailing}, so its shape must be {want}; "
                    f"{fix}")
        flat = ""
        if t.dim() > 1 + len(trailing) and shape[len(shape) - len(trailing):] == trailing:
            rows = "tokens of every sequence, bs x tokens_per_seq" if spec.per == "token" else "sequences"
            flat = f"; rows are flat ({rows}): pass {name}.reshape({', '.join(['-1', *map(str, trailing)])})"
        return (f"input {name!r} has shape {shape}: declared rows x {trailing}, so its trailing shape must be "
                f"{trailing}{flat}")

    def _overlap_problem(self, spec: StepInput, t: torch.Tensor) -> str:
        start, end = self.static_span
        p = t.data_ptr()
        if not (p < end and p + t.numel() * t.element_size() > start):
            return ""
        own = self.static_starts[self.names.index(spec.name)]
        if p == own:
            return ""  # its own static buffer from row 0: staging copies each row onto itself
        return (f"input {spec.name!r} shares memory with the pool's static buffers (a view of pool.static_inputs at "
                f"an offset, or of another input's buffer): staging would overwrite what it reads. Pass a copy "
                f"({spec.name}.clone()), or, to stage without a copy, write into "
                f"pool.static_inputs[{spec.name!r}] from row 0 and pass that view")

    def _rows_problem(self, mode: Mode, spec: StepInput, t: torch.Tensor, real_bs: int | None) -> str:
        tps, got = mode.tokens_per_seq, t.shape[0]
        if real_bs is None:  # the input the batch size is read from
            step = tps if spec.per == "token" else 1
            if got >= step and got % step == 0:
                return ""
            return (f"mode {mode.name!r} takes {tps} token(s) per sequence: input {spec.name!r} has {got} rows, "
                    f"which is not a positive multiple of {step}")
        expected = spec.rows(real_bs, tps)
        if got == expected:
            return ""
        per = f"{real_bs} x {tps} = {expected}" if spec.per == "token" else f"{expected}"
        fits = [f"{m.name!r} ({m.tokens_per_seq} token(s) per sequence)" for m in self.modes
                if m.name != mode.name and spec.rows(real_bs, m.tokens_per_seq) == got]
        hint = f"; the rows fit mode {' or '.join(fits)}: route the step there" if fits else ""
        return (f"mode {mode.name!r} takes {tps} token(s) per sequence: input {spec.name!r} needs {per} rows for "
                f"batch size {real_bs} (read from {self.names[self.bs_index]!r}), got {got}{hint}")

    # -------------------------------------------------------------------------------- debug mode
    def check_bounds(self, ordered: Sequence[torch.Tensor]) -> None:
        """Raise :class:`IndexBoundsError` for the first value outside its input's ``bounds`` (syncs)."""
        for i, spec in self.bounded:
            low, high = spec.bounds
            t = ordered[i]
            bad = ~((t >= low) & (t < high))  # NaN fails both comparisons: out of bounds
            if bool(bad.any()):
                row = int(bad.reshape(t.shape[0], -1).any(1).nonzero()[0, 0])
                raise IndexBoundsError(
                    f"input {spec.name!r} row {row} holds {t[row].tolist()}, outside its bounds [{low}, {high}); "
                    f"a kernel indexing with it would fault or write out of bounds. Fix the value, or widen "
                    f"StepInput({spec.name!r}, ..., bounds=...)")

"""Modes, declared step inputs, and the key table that says which graphs exist.

A *mode* is one step shape: ``Mode("decode", 1)`` carries one token per sequence,
``Mode("verify", 16)`` carries 16. A *key* is one (mode, padded batch size) pair; the pool captures one
graph per key. :class:`KeyTable` is the single source of truth for the keys: the capture order and the
routing table of every mode are both derived from it, once, at construction.
"""
from __future__ import annotations

import difflib
import math
import operator
from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence, Tuple

import torch

from .errors import UnknownModeError

PER_TOKEN = "token"
PER_SEQ = "seq"


@dataclass(frozen=True)
class Mode:
    """One step shape.

    Args:
        name: the name steps are routed by, e.g. ``"decode"`` or ``"verify"``.
        tokens_per_seq: tokens each sequence carries in a step of this mode (1 for plain decode,
            ``num_draft_tokens`` for target verify).
        batch_sizes: the batch sizes to capture for this mode; ``None`` takes the pool's list.
    """

    name: str
    tokens_per_seq: int
    batch_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"Mode name must be a non-empty string, got {self.name!r}")
        if not _is_whole(self.tokens_per_seq) or self.tokens_per_seq < 1:
            raise ValueError(f"Mode {self.name!r}: tokens_per_seq must be an int >= 1, got {self.tokens_per_seq!r}")
        if self.batch_sizes is not None:
            object.__setattr__(self, "batch_sizes", _check_sizes(self.batch_sizes, f"Mode {self.name!r}"))


@dataclass(frozen=True)
class StepInput:
    """One declared input of a step.

    Args:
        name: the keyword the caller passes to :meth:`GraphPool.run` (not ``mode`` or ``copy``, which
            are ``run``'s own parameters).
        dtype: the dtype every step must pass.
        per: ``"token"`` (``bs * tokens_per_seq`` rows, e.g. ``input_ids``) or ``"seq"``
            (``bs`` rows, e.g. ``seq_lens``).
        fill: the value written into padded rows, e.g. 1 for ``seq_lens`` or a dummy KV slot for
            ``out_cache_loc``. It must be harmless for every kernel the step runs, and representable
            in ``dtype`` (an integer input takes an integer fill).
        trailing: the shape after the row dimension (``()`` for one value per row).
        bounds: ``(low, high)``: every value must lie in ``[low, high)``, e.g. ``(0, num_kv_slots)`` for
            ``out_cache_loc``, or ``(0.0, float("inf"))`` for a float input (ints or floats, compared as given). The pool's debug mode checks it before each replay; the fast path trusts
            it (an out-of-range index then faults or corrupts memory inside the step's kernels).
    """

    name: str
    dtype: torch.dtype
    per: Literal["token", "seq"] = PER_TOKEN
    fill: int | float = 0
    trailing: Tuple[int, ...] = field(default=())
    bounds: Optional[Tuple[float, float]] = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"StepInput name must be a non-empty string, got {self.name!r}")
        if self.per not in (PER_TOKEN, PER_SEQ):
            raise ValueError(f"StepInput {self.name!r}: per must be 'token' or 'seq', got {self.per!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"StepInput {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}")
        if not isinstance(self.trailing, (tuple, list, torch.Size)) or not all(map(_is_whole, self.trailing)):
            raise TypeError(f"StepInput {self.name!r}: trailing must be a tuple of ints, got {self.trailing!r}")
        object.__setattr__(self, "trailing", tuple(operator.index(d) for d in self.trailing))
        if any(d < 1 for d in self.trailing):
            raise ValueError(f"StepInput {self.name!r}: every trailing dimension must be >= 1, got {self.trailing}")
        _check_fill(self)
        if self.bounds is not None:
            low, high = _check_bounds(self)
            if not low < high:
                raise ValueError(f"StepInput {self.name!r}: bounds must be (low, high) with low < high, "
                                 f"got {self.bounds!r}")
            if not low <= self.fill < high:
                raise ValueError(f"StepInput {self.name!r}: the fill value {self.fill!r} lies outside the bounds "
                                 f"[{low}, {high}); padded rows would break the bound they are meant to keep")
            object.__setattr__(self, "bounds", (low, high))

    def rows(self, bs: int, tokens_per_seq: int) -> int:
        """Rows this input has in a step of ``bs`` sequences of ``tokens_per_seq`` tokens."""
        return bs * tokens_per_seq if self.per == PER_TOKEN else bs


def _is_whole(value: object) -> bool:
    """An integer (Python or NumPy), not a bool, float or string that int() would quietly convert."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _check_bounds(spec: StepInput) -> tuple[float, float]:
    """``bounds`` as two real numbers, kept as given: an int() would move a float bound (0.5 -> 0)."""
    bounds = spec.bounds
    ok = isinstance(bounds, (tuple, list)) and len(bounds) == 2 and all(
        isinstance(b, (int, float)) and not isinstance(b, bool) and not math.isnan(b) for b in bounds)
    if not ok:
        raise TypeError(f"StepInput {spec.name!r}: bounds must be (low, high), two ints or floats (not NaN), "
                        f"got {bounds!r}")
    return bounds[0], bounds[1]


def _check_fill(spec: StepInput) -> None:
    """Refuse a fill value that ``spec.dtype`` would silently change (0.7 in an int64 input becomes 0)."""
    fill, dtype = spec.fill, spec.dtype
    if isinstance(fill, bool) and dtype != torch.bool or not isinstance(fill, (int, float)):
        raise TypeError(f"StepInput {spec.name!r}: fill must be an int or float (a bool only for a bool input), "
                        f"got {type(fill).__name__}")
    if dtype == torch.bool:
        ok = fill in (0, 1)
    elif dtype.is_floating_point:
        # Floats round (0.9 in float32 is 0.899999976...): refuse only a finite value the dtype cannot hold.
        try:
            ok = not math.isfinite(fill) or abs(float(fill)) <= torch.finfo(dtype).max
        except OverflowError:  # an int beyond every float
            ok = False
    elif dtype.is_complex:
        ok = True
    else:
        info = torch.iinfo(dtype)
        ok = float(fill).is_integer() and info.min <= fill <= info.max
    if not ok:
        try:
            becomes = f"it would become {torch.tensor(fill).to(dtype).item()!r}"
        except (OverflowError, RuntimeError, ValueError):  # torch cannot even hold it
            becomes = "it does not fit"
        raise ValueError(f"StepInput {spec.name!r}: fill {fill!r} is not representable in {dtype} ({becomes}); "
                         f"pick a fill value of that dtype")


@dataclass(frozen=True, order=True)
class GraphKey:
    """One captured graph: a mode and a padded batch size."""

    mode: str
    bs: int


def _check_sizes(sizes: Sequence[int], what: str) -> tuple[int, ...]:
    whole = not isinstance(sizes, (str, bytes)) and all(map(_is_whole, sizes))
    out = tuple(sorted({operator.index(s) for s in sizes})) if whole else ()
    if not out or out[0] < 1:
        raise ValueError(f"{what}: batch sizes must be a non-empty list of ints >= 1, got {sizes!r}")
    return out


class KeyTable:
    """Which graphs exist, in what order to capture them, and which one serves a step.

    ``route(mode, real_bs)`` is a list index into a table precomputed here: the smallest captured bs
    that is >= ``real_bs``, or ``None`` past the largest. Nothing is searched on the hot path.
    """

    def __init__(self, modes: Sequence[Mode], batch_sizes: Sequence[int]):
        if not modes:
            raise ValueError("GraphPool needs at least one Mode")
        names = [m.name for m in modes]
        if len(set(names)) != len(names):
            raise ValueError(f"Mode names must be unique, got {names}")
        default = _check_sizes(batch_sizes, "GraphPool batch_sizes")
        self.modes: dict[str, Mode] = {m.name: m for m in modes}
        self.sizes: dict[str, tuple[int, ...]] = {m.name: m.batch_sizes or default for m in modes}
        self.keys: list[GraphKey] = [GraphKey(m, bs) for m, sizes in self.sizes.items() for bs in sizes]
        self.max_bs: dict[str, int] = {m: sizes[-1] for m, sizes in self.sizes.items()}
        # route[mode][real_bs] -> padded bs; index 0 is unused (a step has at least one sequence).
        self._route: dict[str, list[int]] = {}
        for name, sizes in self.sizes.items():
            table, i = [0], 0
            for real in range(1, sizes[-1] + 1):
                while sizes[i] < real:
                    i += 1
                table.append(sizes[i])
            self._route[name] = table

    def mode(self, name: str | Mode) -> Mode:
        """The mode called ``name`` (or the pool's own :class:`Mode` object); raises :class:`UnknownModeError`
        naming the known modes."""
        if isinstance(name, Mode):
            own = self.modes.get(name.name)
            if own is not None and (own.name, own.tokens_per_seq) == (name.name, name.tokens_per_seq):
                return own
            raise UnknownModeError(
                f"{name} is not one of this pool's modes {list(self.modes.values())}: pass a mode's name (a str) "
                f"or a Mode from pool.modes")
        try:
            return self.modes[name]
        except (KeyError, TypeError):
            raise UnknownModeError(_unknown_mode_message(name, list(self.modes))) from None

    def route(self, name: str, real_bs: int) -> int | None:
        """Padded batch size of the graph that serves ``real_bs`` sequences, ``None`` if too large."""
        table = self._route[name]
        return table[real_bs] if real_bs < len(table) else None

    def num_tokens(self, key: GraphKey) -> int:
        return key.bs * self.modes[key.mode].tokens_per_seq

    def capture_order(self) -> list[GraphKey]:
        """Largest token count first across all modes, so later (smaller) graphs reuse the first
        graphs' freed blocks in the shared memory pool instead of growing it."""
        return sorted(self.keys, key=lambda k: (-self.num_tokens(k), -k.bs, k.mode))

    def max_rows(self, spec: StepInput) -> int:
        """Rows of the one allocation of ``spec``: the most any key needs."""
        return max(spec.rows(k.bs, self.modes[k.mode].tokens_per_seq) for k in self.keys)


def _unknown_mode_message(name: object, known: list[str]) -> str:
    close = [m for m in known if isinstance(name, str) and m.lower() == name.lower()]
    close = close or difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
    if close:
        return (f"unknown mode {name!r}: did you mean {close[0]!r}? This pool was built with modes {known} "
                f"(mode names are case-sensitive)")
    return (f"unknown mode {name!r}: this pool was built with modes {known}; "
            f"add Mode({name!r}, tokens_per_seq) to GraphPool(...) or route the step to one of them")

"""Modes, declared step inputs, and the key table that says which graphs exist.

A *mode* is one step shape: ``Mode("decode", 1)`` carries one token per sequence,
``Mode("verify", 16)`` carries 16. A *key* is one (mode, padded batch size) pair; the pool captures one
graph per key. :class:`KeyTable` is the single source of truth for the keys: the capture order and the
routing table of every mode are both derived from it, once, at construction.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

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
        if not isinstance(self.tokens_per_seq, int) or self.tokens_per_seq < 1:
            raise ValueError(f"Mode {self.name!r}: tokens_per_seq must be an int >= 1, got {self.tokens_per_seq!r}")
        if self.batch_sizes is not None:
            object.__setattr__(self, "batch_sizes", _check_sizes(self.batch_sizes, f"Mode {self.name!r}"))


@dataclass(frozen=True)
class StepInput:
    """One declared input of a step.

    Args:
        name: the keyword the caller passes to :meth:`GraphPool.run`.
        dtype: the dtype every step must pass.
        per: ``"token"`` (``bs * tokens_per_seq`` rows, e.g. ``input_ids``) or ``"seq"``
            (``bs`` rows, e.g. ``seq_lens``).
        fill: the value written into padded rows, e.g. 1 for ``seq_lens`` or a dummy KV slot for
            ``out_cache_loc``. It must be harmless for every kernel the step runs.
        trailing: the shape after the row dimension (``()`` for one value per row).
    """

    name: str
    dtype: torch.dtype
    per: Literal["token", "seq"] = PER_TOKEN
    fill: int | float = 0
    trailing: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.per not in (PER_TOKEN, PER_SEQ):
            raise ValueError(f"StepInput {self.name!r}: per must be 'token' or 'seq', got {self.per!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"StepInput {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}")
        object.__setattr__(self, "trailing", tuple(int(d) for d in self.trailing))

    def rows(self, bs: int, tokens_per_seq: int) -> int:
        """Rows this input has in a step of ``bs`` sequences of ``tokens_per_seq`` tokens."""
        return bs * tokens_per_seq if self.per == PER_TOKEN else bs


@dataclass(frozen=True, order=True)
class GraphKey:
    """One captured graph: a mode and a padded batch size."""

    mode: str
    bs: int


def _check_sizes(sizes: Sequence[int], what: str) -> tuple[int, ...]:
    out = tuple(sorted(set(int(s) for s in sizes)))
    if not out or out[0] < 1:
        raise ValueError(f"{what}: batch sizes must be a non-empty list of ints >= 1, got {list(sizes)!r}")
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

    def mode(self, name: str) -> Mode:
        """The mode called ``name``; raises :class:`UnknownModeError` naming the known modes."""
        try:
            return self.modes[name]
        except (KeyError, TypeError):
            raise UnknownModeError(
                f"unknown mode {name!r}: this pool was built with modes {list(self.modes)}; "
                f"add Mode({name!r}, tokens_per_seq) to GraphPool(...) or route the step to one of them"
            ) from None

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

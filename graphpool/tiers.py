"""Speculation tiers: the draft length of each step chosen by batch size, with hysteresis, lowered by acceptance.

A verify step carries ``num_draft_tokens`` tokens per sequence, so its cost per sequence grows with the draft
while the tokens it commits grow more slowly (the deeper a draft token, the less often it is accepted). At a
small batch the step is bound by reading the weights and a long draft is nearly free; as the batch grows the
verify step turns compute-bound, and a shorter draft, then none, wins. A :class:`TierSchedule` is that choice:
an ordered list of :class:`Tier` (longest draft first, plain decode last), each serving the batch sizes up to
its bound, with hysteresis at every boundary so that a batch hovering at a bound does not flip tiers every
step. Optionally a tier whose recent acceptance says its draft does not pay drops to the next tier
(an :class:`~graphpool.AcceptanceGate` per tier). :class:`~graphpool.SpeculationPolicy` is the two-tier case.

The schedule only names modes: one :class:`~graphpool.GraphPool` holds every tier's verify graphs and the
decode graphs over one set of static buffers, sized by the largest tier (``docs/tiers.md``). Its state changes
only in :meth:`TierSchedule.choose` and :meth:`TierSchedule.record`, from the batch sizes and acceptances the
caller passes: ranks of a tensor-parallel server that pass the same values take the same tiers.
"""
from __future__ import annotations

import difflib
import numbers
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .acceptance import AcceptanceGate
from .modes import Mode


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class Tier:
    """One tier of a :class:`TierSchedule`: the mode its steps run in and the batch sizes it serves.

    Args:
        mode: the pool mode of this tier's steps (e.g. ``"verify_8"``; the last tier's is plain decode).
        off_above: leave this tier for the next (shorter) one once the batch size exceeds this. Every tier but
            the last needs one; the last tier serves every larger batch and takes none.
        on_at_or_below: come back to this tier once a batch that outgrew it shrinks to this size or below
            (default ``off_above``: no hysteresis). Must be ``<= off_above``.
        min_accept: break-even tokens a verify step of this tier must commit per sequence (> 1); while the
            schedule's recent measure is below it, this tier's steps drop to the next tier (see
            :class:`~graphpool.AcceptanceGate`). ``None``: batch size alone decides.
    """

    mode: str
    off_above: float | None = None
    on_at_or_below: float | None = None
    min_accept: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str) or not self.mode:
            raise ValueError(f"Tier mode must be a non-empty mode name, got {self.mode!r}")
        for name in ("off_above", "on_at_or_below"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and value >= 0):
                raise ValueError(f"Tier {self.mode!r}: {name} must be a batch size >= 0, got {value!r}")
        if self.on_at_or_below is not None and self.off_above is None:
            raise ValueError(f"Tier {self.mode!r}: on_at_or_below={self.on_at_or_below} needs an off_above (the "
                             f"size above which the tier is left); a tier without one is the last")
        if self.min_accept is not None and not (_is_number(self.min_accept) and self.min_accept > 1):
            raise ValueError(f"Tier {self.mode!r}: min_accept must be > 1 (a verify step commits at least one token "
                             f"per sequence), got {self.min_accept!r}")

    @property
    def resume_at(self) -> float | None:
        """The batch size at or below which this tier is taken again (``on_at_or_below``, else ``off_above``)."""
        return self.off_above if self.on_at_or_below is None else self.on_at_or_below


class TierSchedule:
    """Chooses each step's tier by batch size: the longest draft while the batch is small, shorter ones as it grows,
    plain decode last; with hysteresis at every boundary, optionally lowered by acceptance.

    Each step, the tier the batch size says moves down the list while the batch exceeds the tier's
    ``off_above``, and back up while the batch is at or below the previous tier's ``on_at_or_below``. Then, if
    that tier has a ``min_accept`` and its draft's recent acceptance is below it (:meth:`record`), the step
    drops to the next tier, and so on (the last tier has no gate). A lowered tier sits out ``pause_steps`` of
    the steps it would have run, then probes ``window`` steps again.

    Args:
        tiers: the tiers, longest draft first, plain decode last; bounds rising down the list.
        modes: the pool's modes (``pool.modes``, or a list of :class:`~graphpool.Mode`) to check the tiers
            against: each tier's mode exists, the drafts shorten down the list, the last tier carries one
            token per sequence. ``None``: not checked here.
        window: verify steps per acceptance measurement (tiers with ``min_accept`` only).
        pause_steps: steps a lowered tier sits out before it probes again.

    Raises:
        ValueError: at construction, naming the tier, the rule and the fix: fewer than two tiers, a repeated
            mode, a missing or superfluous bound, bounds that do not rise down the list (overlapping or
            unordered), hysteresis that cannot hold (``on_at_or_below`` above ``off_above``, or not rising down the
            list), a mode the pool lacks, drafts that do not shorten, a last tier that is not plain decode.

    Example::

        schedule = TierSchedule([Tier("verify_16", off_above=4, on_at_or_below=2),
                                 Tier("verify_8", off_above=16, on_at_or_below=12),
                                 Tier("verify_4", off_above=32, on_at_or_below=24),
                                 Tier("decode")], modes=pool.modes)
        mode = schedule.choose(batch_size)       # "verify_16" up to 4 sequences, ... "decode" above 32
        if schedule.resumed:                     # plain steps ran since the last verify step:
            catch_up_the_draft()                 # the draft's state must be restored first
        out = pool.run(mode, **inputs)
        schedule.record(mode, committed_per_seq)  # verify steps only; feeds the tiers' min_accept
    """

    def __init__(self, tiers: Sequence[Tier], modes: Mapping[str, Mode] | Iterable[Mode] | None = None,
                 window: int = 4, pause_steps: int = 512):
        self.tiers: tuple[Tier, ...] = tuple(tiers)
        _check_tiers(self.tiers)
        if modes is not None:
            self.check_modes(modes)
        if any(t.min_accept is not None for t in self.tiers) and (window < 1 or pause_steps < 1):
            raise ValueError(f"need window >= 1 and pause_steps >= 1 for the tiers' min_accept, got window={window}, "
                             f"pause_steps={pause_steps}")
        self._gates = [None if t.min_accept is None else AcceptanceGate(t.min_accept, window, pause_steps)
                       for t in self.tiers]
        self._index_of = {t.mode: i for i, t in enumerate(self.tiers)}
        self._size = 0          # the tier the batch sizes alone lead to (the hysteresis state)
        self.index = 0          # the tier of the latest choice: the size's tier, lowered by acceptance
        self.previous: int | None = None  # the tier of the choice before it (None before the first)
        self.switches = 0       # choices whose tier differs from the one before

    # ------------------------------------------------------------------------------------------ the choice
    def choose(self, batch_size: int) -> str:
        """The mode for a step of ``batch_size`` sequences (updates the schedule's state: call it once per step)."""
        tiers, last, size = self.tiers, len(self.tiers) - 1, self._size
        while size < last and batch_size > tiers[size].off_above:
            size += 1
        # on_at_or_below rises down the list (checked), so this stops at the first tier that takes the batch back.
        while size > 0 and batch_size <= tiers[size - 1].resume_at:
            size -= 1
        self._size = chosen = size
        while self._gates[chosen] is not None and not self._gates[chosen].allow():
            chosen += 1  # this tier's draft does not pay now: the next, shorter one (the last has no gate)
        self.previous, self.index = self.index, chosen
        if chosen != self.previous:
            self.switches += 1
        return tiers[chosen].mode

    def record(self, mode: str, committed_per_seq: float) -> bool:
        """Account one verify step of tier ``mode``: the mean tokens it committed per sequence (1 + accepted draft
        tokens). Returns True when this measurement lowered the tier. Steps of a tier without ``min_accept``
        change nothing; a step recorded late (issued before the tier was lowered) is not counted."""
        i = self._index_of.get(mode)
        if i is None or i == len(self.tiers) - 1:
            spec = ", ".join(self.modes[:-1])
            raise ValueError(f"record() takes the mode of a verify step of this schedule ({spec}), got {mode!r}"
                             + ("" if i is None else ": a plain step accepts no draft"))
        gate = self._gates[i]
        return gate.record(committed_per_seq) if gate is not None else False

    # ---------------------------------------------------------------------------------------- inspection
    @property
    def modes(self) -> tuple[str, ...]:
        """The tiers' modes, longest draft first."""
        return tuple(t.mode for t in self.tiers)

    @property
    def plain_mode(self) -> str:
        """The last tier's mode: plain decode."""
        return self.tiers[-1].mode

    @property
    def mode(self) -> str:
        """The latest choice's mode (the first tier's before any choice)."""
        return self.tiers[self.index].mode

    @property
    def speculating(self) -> bool:
        """Whether the latest choice is a speculative tier (not the last)."""
        return self.index < len(self.tiers) - 1

    @property
    def changed(self) -> bool:
        """Whether the latest choice's tier differs from the one before it."""
        return self.previous is not None and self.previous != self.index

    @property
    def resumed(self) -> bool:
        """Whether the latest choice speculates after a plain step: the draft missed the plain steps' tokens, so
        its state (KV) must be caught up before it drafts. Changes between speculative tiers set ``changed`` only."""
        return self.previous == len(self.tiers) - 1 and self.speculating

    @property
    def lowered(self) -> bool:
        """Whether acceptance lowered the latest choice below the tier its batch size says."""
        return self.index > self._size

    def check_modes(self, modes: Mapping[str, Mode] | Iterable[Mode]) -> None:
        """Check the tiers against a pool's modes (what ``modes=`` checks at construction): every tier's mode
        exists, the drafts shorten down the list, the last tier carries one token per sequence.

        Raises:
            ValueError: naming the tier, the rule and the fix.
        """
        _check_modes(self.tiers, modes)

    def gate(self, mode: str) -> AcceptanceGate | None:
        """The acceptance gate of tier ``mode`` (``None`` without ``min_accept``): its ``pauses``, ``last_mean``."""
        return self._gates[self._index_of[mode]]

    def describe(self) -> str:
        """One line: each tier with the batch sizes it serves and where it is taken back, e.g.
        ``verify_16 <= 4 (back at <= 2) | verify_8 <= 16 | decode``."""
        parts = []
        for t in self.tiers[:-1]:
            back = f" (back at <= {t.on_at_or_below})" if t.resume_at != t.off_above else ""
            gate = f" while accepting >= {t.min_accept}" if t.min_accept is not None else ""
            parts.append(f"{t.mode} <= {t.off_above}{back}{gate}")
        return " | ".join(parts + [self.plain_mode])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"


def _check_tiers(tiers: tuple[Tier, ...]) -> None:
    """The rules between tiers (each tier checked its own values)."""
    if len(tiers) < 2 or not all(isinstance(t, Tier) for t in tiers):
        raise ValueError(f"a TierSchedule takes two or more Tier objects (speculative tiers, longest draft first, "
                         f"then plain decode), got {list(tiers)!r}; for one mode, run that mode directly")
    seen: dict[str, int] = {}
    for i, t in enumerate(tiers):
        if t.mode in seen:
            raise ValueError(f"tiers {seen[t.mode]} and {i} both name mode {t.mode!r}: each tier runs its own mode")
        seen[t.mode] = i
    *spec, last = tiers
    if last.off_above is not None or last.min_accept is not None:
        raise ValueError(f"the last tier ({last.mode!r}) is plain decode: it serves every larger batch and has no "
                         f"shorter tier to drop to, so it takes no off_above, on_at_or_below or min_accept; append the "
                         f"plain-decode tier, e.g. Tier('decode')")
    for i, t in enumerate(spec):
        if t.off_above is None:
            raise ValueError(f"tier {i} ({t.mode!r}) needs off_above (the largest batch it serves): only the last tier "
                             f"serves every batch size")
        if t.resume_at > t.off_above:
            raise ValueError(f"tier {i} ({t.mode!r}): on_at_or_below={t.on_at_or_below} is above off_above="
                             f"{t.off_above}, so the hysteresis cannot hold (a batch between them would leave the tier "
                             f"and come back every step); set on_at_or_below <= {t.off_above}")
        if i == 0:
            continue
        before = spec[i - 1]
        if t.off_above <= before.off_above:
            raise ValueError(f"tier {i} ({t.mode!r}) off_above={t.off_above} is not above tier {i - 1} "
                             f"({before.mode!r}) off_above={before.off_above}: bounds must rise down the list (longest "
                             f"draft first, at the smallest batches), each tier serving the sizes above the previous "
                             f"tier's bound; "
                             f"reorder the tiers or raise tier {i}'s off_above above {before.off_above}")
        if t.resume_at <= before.resume_at:
            raise ValueError(f"tier {i} ({t.mode!r}) is taken back at <= {t.resume_at}, not above tier {i - 1} "
                             f"({before.mode!r}) at <= {before.resume_at}: a shrinking batch would pass tier {i} by "
                             f"for tier {i - 1}, so the hysteresis cannot hold; set tier {i}'s on_at_or_below above "
                             f"{before.resume_at} (and <= its off_above {t.off_above})")


def _check_modes(tiers: tuple[Tier, ...], modes: Mapping[str, Mode] | Iterable[Mode]) -> None:
    """The tiers against the pool's modes: every mode exists, drafts shorten down the list, plain decode last."""
    table = dict(modes) if isinstance(modes, Mapping) else {m.name: m for m in modes}
    for i, t in enumerate(tiers):
        if t.mode not in table:
            near = difflib.get_close_matches(t.mode, list(table), n=1)
            raise ValueError(f"tier {i} names mode {t.mode!r}, which the pool lacks (its modes: {', '.join(table)})"
                             + (f"; did you mean {near[0]!r}?" if near else "")
                             + f"; add Mode({t.mode!r}, tokens_per_seq) to the pool or drop the tier")
    tokens = [table[t.mode].tokens_per_seq for t in tiers]
    for i in range(1, len(tiers)):
        if tokens[i] >= tokens[i - 1]:
            raise ValueError(f"tier {i} ({tiers[i].mode!r}, {tokens[i]} tokens per sequence) does not carry fewer "
                             f"tokens than tier {i - 1} ({tiers[i - 1].mode!r}, {tokens[i - 1]}): list the tiers "
                             f"longest draft first")
    if tokens[-1] != 1:
        raise ValueError(f"the last tier ({tiers[-1].mode!r}) carries {tokens[-1]} tokens per sequence: the last tier "
                         f"is plain decode, one token per sequence; append the pool's decode mode as the last tier")

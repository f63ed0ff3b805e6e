"""Choosing the mode of each step: speculation off above a batch size (with hysteresis), and off while
the draft's acceptance is below break-even.

Speculation wins at low concurrency and loses at high concurrency (the verify step does
``num_draft_tokens`` times the work of a plain decode step per sequence). Hysteresis keeps a batch size
that hovers around the threshold from flapping between modes every step. :class:`SpeculationPolicy` is the
two-tier case of :class:`~graphpool.TierSchedule` (one speculative tier, then plain decode), which chooses
among several draft lengths. :class:`AcceptanceGate` covers the other way speculation loses: a draft whose
tokens the target rarely accepts.
"""
from __future__ import annotations

from .acceptance import AcceptanceGate
from .tiers import Tier, TierSchedule

__all__ = ["SpeculationPolicy", "AcceptanceGate"]


class SpeculationPolicy(TierSchedule):
    """Speculate while the batch is small, decode plainly once it is large.

    Args:
        off_above: switch speculation off when the batch size exceeds this.
        on_at_or_below: switch it back on once the batch size is at or below this (default:
            ``off_above``, i.e. no hysteresis). Must be <= ``off_above``.
        spec_mode: the mode name returned while speculating.
        plain_mode: the mode name returned while not speculating.
    """

    def __init__(self, off_above: int, on_at_or_below: int | None = None, spec_mode: str = "verify",
                 plain_mode: str = "decode"):
        on = off_above if on_at_or_below is None else on_at_or_below
        if off_above < 0 or on < 0 or on > off_above:
            raise ValueError(f"need 0 <= on_at_or_below <= off_above, got on_at_or_below={on}, off_above={off_above}")
        super().__init__([Tier(spec_mode, off_above, on), Tier(plain_mode)])
        self.off_above, self.on_at_or_below = off_above, on

    @property
    def spec_mode(self) -> str:
        """The mode name returned while speculating."""
        return self.tiers[0].mode

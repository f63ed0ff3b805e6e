"""Choosing the mode of each step: speculation off above a batch size, with hysteresis.

Speculation wins at low concurrency and loses at high concurrency (the verify step does
``num_draft_tokens`` times the work of a plain decode step per sequence). Hysteresis keeps a batch size
that hovers around the threshold from flapping between modes every step.
"""
from __future__ import annotations


class SpeculationPolicy:
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
        self.off_above, self.on_at_or_below = off_above, on
        self.spec_mode, self.plain_mode = spec_mode, plain_mode
        self.speculating = True
        self.switches = 0

    def choose(self, batch_size: int) -> str:
        """The mode for a step of ``batch_size`` sequences (updates the on/off state)."""
        if self.speculating and batch_size > self.off_above:
            self.speculating, self.switches = False, self.switches + 1
        elif not self.speculating and batch_size <= self.on_at_or_below:
            self.speculating, self.switches = True, self.switches + 1
        return self.spec_mode if self.speculating else self.plain_mode

"""Choosing the mode of each step: speculation off above a batch size (with hysteresis), and off while
the draft's acceptance is below break-even.

Speculation wins at low concurrency and loses at high concurrency (the verify step does
``num_draft_tokens`` times the work of a plain decode step per sequence). Hysteresis keeps a batch size
that hovers around the threshold from flapping between modes every step. :class:`AcceptanceGate` covers
the other way speculation loses: a draft whose tokens the target rarely accepts.
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


class AcceptanceGate:
    """Speculate only while it pays: the tokens a verify step commits per sequence must reach ``min_accept``.

    A verify step costs more than a plain decode step (the draft passes, and ``num_draft_tokens`` rows per
    sequence through the target), so below a break-even acceptance speculation loses at *every* batch
    size, e.g. with a draft that does not match the target. The gate watches the mean committed tokens
    per sequence over the last ``window`` verify steps; below ``min_accept`` it pauses speculation for
    ``pause_steps`` decode steps, then lets ``window`` verify steps through to measure again (a probe).

    Args:
        min_accept: break-even tokens per sequence per verify step (> 1: a verify step always commits one).
        window: verify steps per measurement.
        pause_steps: decode steps to stay plain after a measurement below ``min_accept``.
    """

    def __init__(self, min_accept: float, window: int = 4, pause_steps: int = 512):
        if not min_accept > 1.0 or window < 1 or pause_steps < 1:
            raise ValueError(f"need min_accept > 1 (a verify step commits at least one token per sequence), "
                             f"window >= 1, pause_steps >= 1; got {min_accept}, {window}, {pause_steps}")
        self.min_accept, self.window, self.pause_steps = min_accept, window, pause_steps
        self._recent: list[float] = []
        self._paused_for = 0   # decode steps left in the current pause
        self.pauses = 0        # measurements that paused speculation
        self.last_mean: float | None = None

    @property
    def paused(self) -> bool:
        return self._paused_for > 0

    def allow(self) -> bool:
        """Whether a step the batch-size policy would speculate on may speculate (counts paused steps)."""
        if self._paused_for > 0:
            self._paused_for -= 1
            return False
        return True

    def record(self, committed_per_seq: float) -> bool:
        """Account one verify step's mean committed tokens per sequence; returns True when this step's
        measurement paused speculation. A verify step recorded during a pause (one issued before it, whose
        result arrives late) is not counted: the probe after the pause measures ``window`` fresh steps."""
        if self._paused_for > 0:
            return False
        self._recent.append(committed_per_seq)
        if len(self._recent) < self.window:
            return False
        self.last_mean = sum(self._recent) / len(self._recent)
        self._recent.pop(0)
        if self.last_mean >= self.min_accept:
            return False
        self._recent.clear()  # the next probe measures afresh
        self._paused_for, self.pauses = self.pause_steps, self.pauses + 1
        return True

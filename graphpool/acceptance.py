"""Acceptance feedback: speculation only while the draft's tokens pay for the verify step.

Speculation can lose at *every* batch size: a draft the target rarely agrees with commits about one token per
verify step, which costs more than a plain decode step. :class:`AcceptanceGate` watches the tokens each verify
step commits and pauses speculation while they are below break-even. :class:`~graphpool.TierSchedule` keeps one
per tier, so a tier whose draft does not pay drops to the next shorter one.
"""
from __future__ import annotations


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

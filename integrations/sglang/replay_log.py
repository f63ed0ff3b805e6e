"""Replays per forward mode, in the server log: what shows that each step reached the graph of its mode.

SGLang's decode log says ``cuda graph: True`` but not which graph. :class:`ReplayLog` counts the
multi-mode runner's replays by forward mode and logs one line at the first replay of each mode and every
``every`` replays after, with the eager fallbacks (``can_run`` refusals) by reason::

    graphpool replays by mode: DECODE=1500 TARGET_VERIFY=820; eager fallbacks: none
"""
from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Dict, MutableMapping, Optional, Union

from sglang.srt.model_executor.forward_batch_info import ForwardMode

log = logging.getLogger(__name__)

#: Replays between two log lines; the environment variable overrides it (e.g. for short benchmarks).
DEFAULT_EVERY = int(os.environ.get("GRAPHPOOL_REPLAY_LOG_EVERY", "500"))


class ReplayLog:
    """Replay counts by forward mode, logged periodically.

    Args:
        refusals: the runner's eager fallbacks by reason (the runner's dict; :meth:`refused` counts into it).
        every: replays between two log lines (at least 1).
    """

    def __init__(self, refusals: MutableMapping[str, int], every: int = DEFAULT_EVERY):
        if every < 1:
            raise ValueError(f"ReplayLog: every must be >= 1 replay, got {every}")
        self.refusals, self.every = refusals, every
        self.counts: Dict[Union[ForwardMode, str], int] = {}
        self.total = 0
        self._last_refused: Optional[weakref.ref] = None

    def refused(self, forward_batch: Any, reason: str) -> None:
        """Count one step that runs eagerly for ``reason`` (a warning at each reason's first). Spec v2 asks twice
        for one step (on the plan stream, then in ``_forward_raw``): the same batch is counted once."""
        last = self._last_refused
        if last is not None and last() is forward_batch:
            return
        self._last_refused = weakref.ref(forward_batch)  # weak: a refused batch's tensors are not kept
        self.refusals[reason] = self.refusals.get(reason, 0) + 1
        if self.refusals[reason] == 1:
            log.warning("graphpool: a %s step runs eagerly (%s); counted in the periodic replay log line",
                        forward_batch.forward_mode.name, reason)

    def count(self, mode: Union[ForwardMode, str]) -> None:
        """One replay of ``mode`` (a forward mode, or the label of a speculation tier's verify graphs, e.g.
        ``TARGET_VERIFY_4x3:8``); logs at the mode's first replay and every ``every`` replays."""
        n = self.counts[mode] = self.counts.get(mode, 0) + 1
        self.total += 1
        if n == 1 or self.total % self.every == 0:
            log.info("%s", self.line())

    def line(self) -> str:
        """The log line: replays by mode, then eager fallbacks by reason."""
        named = sorted((getattr(m, "name", m), n) for m, n in self.counts.items())
        modes = " ".join(f"{m}={n}" for m, n in named)
        fallbacks = ", ".join(f"{reason}: {n}" for reason, n in sorted(self.refusals.items())) or "none"
        return f"graphpool replays by mode: {modes or 'none'}; eager fallbacks: {fallbacks}"

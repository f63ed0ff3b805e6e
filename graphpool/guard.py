"""One caller at a time: the pool's guard against a second thread entering ``run``/``stage``/``replay``."""
from __future__ import annotations

import threading

from .errors import ConcurrentUseError

CONCURRENT_USE = ("two threads used one GraphPool at once (or one replayed a step another staged); a pool serves "
                  "one caller at a time: use one pool per thread, or hold a lock around each run / stage+replay")


class ExclusiveUse:
    """``with``: enter, or raise :class:`ConcurrentUseError` at once if another thread is inside. A
    non-blocking acquire cannot miss an overlap (a plain flag could) and costs well under a microsecond."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        if not self._lock.acquire(False):
            raise ConcurrentUseError(CONCURRENT_USE)

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

"""Timed throughput windows for the live benchmark: a closed loop of ``concurrency`` clients, each sending its
next request as soon as its last one is answered, for at least ``seconds``; then every request in flight is
let finish. The window's tokens/s is all tokens of all its (whole) requests over the time from the first send
to the last answer, so it holds many whole requests and no partial one."""
from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from .client import Answer, Request, post_generate


@dataclass
class Window:
    """One timed window of one server at one concurrency."""

    config: str
    concurrency: int
    round: int
    wall_s: float = 0.0
    answers: List[Answer] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(a.output_ids) for a in self.answers if a.ok)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def failed(self) -> int:
        return sum(1 for a in self.answers if not a.ok)

    def as_dict(self) -> Dict[str, object]:
        return {"config": self.config, "concurrency": self.concurrency, "round": self.round, "wall_s": self.wall_s,
                "requests": len(self.answers), "failed": self.failed, "tokens": self.tokens, "tok_s": self.tok_s}


def run_window(url: str, config: str, concurrency: int, seconds: float, make: Callable[[str], Request],
               round_no: int = 0, timeout: float = 120.0) -> Window:
    """``concurrency`` clients in a closed loop for ``seconds`` (``make(rid)`` builds each request)."""
    win, lock, count = Window(config, concurrency, round_no), threading.Lock(), [0]
    t0 = time.perf_counter()
    stop = t0 + seconds

    def client() -> None:
        while time.perf_counter() < stop:
            with lock:
                rid = f"{config}-c{concurrency}-r{round_no}-{count[0]}"
                count[0] += 1
            answer = post_generate(url, make(rid), timeout)
            with lock:
                win.answers.append(answer)
            if not answer.ok:  # a dead server answers at once: do not spin
                return

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + timeout)
    win.wall_s = time.perf_counter() - t0
    return win


def summary(windows: List[Window]) -> Optional[Dict[str, float]]:
    """Median tokens/s over a configuration's windows at one concurrency, with their spread (min, max) and the
    number of rounds and requests; None without a window that failed no request."""
    good = [w.tok_s for w in windows if w.answers and not w.failed]
    if not good:
        return None
    return {"median": statistics.median(good), "min": min(good), "max": max(good), "rounds": len(good),
            "requests": sum(len(w.answers) for w in windows)}

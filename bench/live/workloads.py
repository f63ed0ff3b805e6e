"""The request sets of the live benchmark, identical for every server so outputs can be compared by id.

* ``warmup``: a few short requests, so first-use compilation does not land in a measurement;
* ``speed``: fixed-length requests (``ignore_eos``) at concurrency 1, 8 and 32;
* ``ramp``: concurrency 1 -> 32 -> 1 in phases, max_new_tokens 16..256 staggered so every phase's batch
  shrinks one request at a time; every fifth request may end at a stop token instead (``ignore_eos`` off), and
  with ``abort_every`` some are aborted mid-stream;
* ``burst``: one wave above the switch's threshold, the requests that crash SGLang's own runner.
"""
from __future__ import annotations

import random
from typing import List, Tuple

from .client import Request

RAMP_PHASES: Tuple[Tuple[int, int], ...] = (
    (1, 4), (2, 6), (4, 10), (8, 20), (16, 40), (32, 64), (16, 32), (8, 12), (4, 8), (2, 4), (1, 4))
RAMP_LENGTHS = (16, 48, 96, 160, 256, 32, 64, 128, 200, 24)
SPEED_CONCURRENCY = (1, 8, 32)
VOCAB = 31000  # prompt ids stay below the tiny model's 32000 and above the special ids


def prompt(rid: str, length: int = 16) -> Tuple[int, ...]:
    """A deterministic pseudo-random prompt for a request id."""
    rng = random.Random(rid)
    return tuple(rng.randrange(3, VOCAB) for _ in range(length + rng.randrange(0, 9)))


def warmup(n: int = 8, max_new: int = 16) -> List[Request]:
    return [Request(f"warm{i}", prompt(f"warm{i}"), max_new) for i in range(n)]


def speed(concurrency: int, max_new: int = 128, waves: int = 2, minimum: int = 4) -> List[Request]:
    """``waves`` full waves at ``concurrency`` (at least ``minimum`` requests)."""
    n = max(minimum, waves * concurrency)
    return [Request(f"speed{concurrency}-{i}", prompt(f"speed{concurrency}-{i}"), max_new) for i in range(n)]


def ramp(scale: float = 1.0, abort_every: int = 0, abort_after: int = 8) -> List[Tuple[int, List[Request]]]:
    """The ramp's phases as (concurrency, requests); ``scale`` < 1 shortens it (dry runs). ``abort_every`` > 0:
    every such request (none of the stop-token ones) of at least twice ``abort_after`` tokens is streamed and
    aborted after ``abort_after`` tokens (half its length if shorter)."""
    phases, k = [], 0
    for concurrency, count in RAMP_PHASES:
        reqs = []
        for _ in range(max(1, round(count * scale))):
            rid = f"ramp{k}"
            max_new = RAMP_LENGTHS[k % len(RAMP_LENGTHS)]
            if concurrency <= 2:  # keep the sequential phases short
                max_new = min(max_new, 64)
            max_new = max(4, round(max_new * scale)) if scale < 1 else max_new
            if k % 5 == 4:
                stops = tuple(random.Random(rid + "stop").randrange(3, 1000) for _ in range(3))
                reqs.append(Request(rid, prompt(rid), max_new, ignore_eos=False, stop_token_ids=stops))
            elif abort_every and k % abort_every == abort_every - 1 and max_new >= 2 * min(abort_after, 8):
                reqs.append(Request(rid, prompt(rid), max_new, abort_after=min(abort_after, max_new // 2)))
            else:
                reqs.append(Request(rid, prompt(rid), max_new))
            k += 1
        phases.append((concurrency, reqs))
    return phases


def burst(n: int = 16, max_new: int = 64) -> List[Request]:
    return [Request(f"burst{i}", prompt(f"burst{i}"), max_new) for i in range(n)]

"""Speculation tiers for bench/decode_loop.py: the ``--tiers`` and ``--tier-bounds`` options, and the bounds a GPU
run chooses from its own fixed-tier figures (``docs/tiers.md``).

A run with ``--tiers 4x2:8,4x1:4`` builds the engine with two shorter tiers besides the main one (``--topk`` x
``--draft-steps``, ``--num-draft-tokens``), runs each tier fixed (variants ``spec``, ``spec_8``, ``spec_4``), and a
:class:`graphpool.TierSchedule` over all of them with plain decode last (variant ``tiers``).
"""
from __future__ import annotations

import itertools
import re
from dataclasses import replace

from graphpool import Tier, TierSchedule

from bench.engine.config import SpecConfig

_TIER = re.compile(r"^(\d+)x(\d+):(\d+)$")


def parse_tiers(text: str, main: SpecConfig) -> list[SpecConfig]:
    """``"4x2:8,1x3:4"`` (``TOPKxSTEPS:TOKENS`` each, longest draft first) -> the shorter tiers, with ``main``'s draft
    model settings. Raises ValueError naming the bad entry."""
    tiers = []
    for entry in filter(None, text.split(",")):
        m = _TIER.match(entry.strip())
        if not m:
            raise ValueError(f"takes a comma list of TOPKxSTEPS:TOKENS, e.g. 4x2:8,1x3:4; got {entry!r}")
        topk, steps, tokens = map(int, m.groups())
        tiers.append(replace(main, topk=topk, steps=steps, num_draft_tokens=tokens))
    return tiers


def variants(tiers: list[SpecConfig]) -> list[str]:
    """The variants a tiered run adds: each shorter tier fixed (``spec_<tokens>``), then the schedule (``tiers``)."""
    return [f"spec_{t.num_draft_tokens}" for t in tiers] + (["tiers"] if tiers else [])


def parse_bounds(text: str, count: int) -> list[tuple[int, int]]:
    """``"2/1,8/4,32"`` -> ``[(2, 1), (8, 4), (32, 32)]``: each speculative tier's ``off_above[/on_at_or_below]``
    (``count`` of them, longest draft first)."""
    bounds = []
    for entry in text.split(","):
        parts = entry.split("/")
        if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"takes auto or a comma list of OFF_ABOVE[/ON_AT_OR_BELOW], one per speculative tier, "
                             f"e.g. 2/1,8/4,32; got {entry!r}")
        off = int(parts[0])
        bounds.append((off, int(parts[-1])))
    if len(bounds) != count:
        raise ValueError(f"names {len(bounds)} bounds for {count} speculative tiers (the main one and each of "
                         f"--tiers): give one per tier")
    schedule([(f"tier {i}", off, on) for i, (off, on) in enumerate(bounds)])  # the schedule's own rules, now
    return bounds


def schedule(bounds: list[tuple[str, int, int]], pool_modes=None) -> TierSchedule:
    """A fresh :class:`TierSchedule` of ``(mode, off_above, on_at_or_below)`` per speculative tier (longest first),
    plain decode last, checked against ``pool_modes`` if given."""
    return TierSchedule([Tier(m, off, on) for m, off, on in bounds] + [Tier("decode")], modes=pool_modes)


def choose_bounds(results: dict, cs: list[int], fixed: list[str]) -> list[tuple[str, int, int]]:
    """Each tier's ``(variant, off_above, on_at_or_below)`` from this run's figures of the ``fixed`` variants
    (longest draft first; plain decode after them).

    Every swept C gets one variant, drafts shortening as C grows; of those assignments the one that loses the
    least throughput summed over the sweep (each C's tokens/s relative to its best variant) wins, and on a tie
    the one with shorter drafts (one noisy win of a long draft at a large C cannot drag its bound up). A tier
    that serves no C is left out. ``on_at_or_below`` is the swept C below the bound (above the previous tier's),
    else the bound: hysteresis as wide as the sweep resolves. With ``fixed=["spec"]`` this is the on/off
    threshold of :func:`bench.decode_loop.choose_threshold`."""
    ladder = [*fixed, "plain"]
    measured = [c for c in cs if all((v, c) in results for v in ladder)]
    if not measured:
        raise ValueError(f"automatic bounds need the runs of {', '.join(ladder)} at some C; pass the bounds instead")

    def tps(v: str, c: int) -> float:
        return results[(v, c)]["tokens_per_s"]

    best = {c: max(tps(v, c) for v in ladder) for c in measured}
    # A monotone assignment: the tier index of each measured C, non-decreasing as C grows.
    pick = max(itertools.combinations_with_replacement(range(len(ladder)), len(measured)),
               key=lambda idx: (sum(tps(ladder[i], c) / best[c] for i, c in zip(idx, measured)), idx))
    out: list[tuple[str, int, int]] = []
    for i, v in enumerate(fixed):
        served = [c for c, j in zip(measured, pick) if j == i]
        if not served:
            continue
        off = max(served)
        below = [c for c in measured if c < off and (not out or c > out[-1][2])]
        out.append((v, off, max(below, default=off)))
    return out


def cpu_bounds(cs: list[int], count: int) -> list[tuple[int, int]]:
    """A CPU smoke run's fixed bounds: the ``count`` smallest swept C (then one apart), so that across the sweep
    the tiered runs take every tier, whatever the eager twin's timings say."""
    bounds = sorted(cs)[:count]
    while len(bounds) < count:
        bounds.append(bounds[-1] + 1)
    return [(b, b) for b in bounds]

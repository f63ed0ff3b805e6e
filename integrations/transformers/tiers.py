"""Speculation tiers for prompt lookup: each step's draft length chosen by batch size (docs/tiers.md).

A :class:`~.loop.PoolGenerator` built with several draft lengths (``num_draft_tokens=(8, 4, 2)``) holds one verify
mode per length in its one pool beside ``decode`` (:func:`~.step.verify_modes`: ``verify`` for the longest,
``verify_<k>`` for each shorter one). A :class:`~graphpool.TierSchedule` over those modes picks each step's; the
step's drafts, their acceptance and the per-row ``drafts`` column follow the mode. :func:`draft_schedule` builds
the schedule from (draft length, largest batch size) pairs; :func:`check_policy` checks one a caller built.

Prompt lookup needs no catch-up of a draft when speculation resumes after plain steps, or when the tier changes:
its draft is the request's own history, which every step (a plain one too) extends with the tokens it committed,
so there is no draft state to fall behind (``TierSchedule.resumed`` asks nothing of this integration).
"""
from __future__ import annotations

import numbers
from typing import Mapping, Sequence

import graphpool as gp

from .step import DECODE, VERIFY

def verify_lengths(modes: Mapping[str, gp.Mode]) -> dict[str, int]:
    """The verify modes of a generator's pool and their draft lengths (``tokens_per_seq - 1``), longest first."""
    verify = {name: m.tokens_per_seq - 1 for name, m in modes.items() if name != DECODE}
    return dict(sorted(verify.items(), key=lambda item: -item[1]))


def _describe(modes: Mapping[str, gp.Mode]) -> str:
    verify = verify_lengths(modes)
    return ", ".join([f"{name} ({k} drafts)" for name, k in verify.items()] + [DECODE])


def _lengths_with(modes: Mapping[str, gp.Mode], extra: int) -> tuple[int, ...]:
    return tuple(sorted(set(verify_lengths(modes).values()) | {extra}, reverse=True))


def draft_schedule(modes: Mapping[str, gp.Mode], bounds: Sequence[tuple[int, float] | tuple[int, float, float]], *,
                   min_accept: Mapping[int, float] | None = None, window: int = 4,
                   pause_steps: int = 512) -> gp.TierSchedule:
    """A :class:`~graphpool.TierSchedule` over a generator's verify modes, from draft lengths and batch sizes.

    Args:
        modes: the generator's pool modes (``generator.pool.modes``).
        bounds: one ``(draft length, off_above)`` or ``(draft length, off_above, on_at_or_below)`` per speculative
            tier, longest draft first: a tier serves batch sizes up to ``off_above`` and is taken back once a
            larger batch shrinks to ``on_at_or_below`` (default ``off_above``). Plain decode serves every larger
            batch (it is appended; do not list it).
        min_accept: break-even tokens per sequence per verify step, by draft length (e.g. ``{8: 1.8, 2: 1.2}``):
            below it, a tier's steps drop to the next tier for a while (:class:`~graphpool.Tier`).
        window, pause_steps: the acceptance measurement (:class:`~graphpool.TierSchedule`).

    Raises:
        ValueError: at construction, naming the fix: a bound that is not such a pair or triple, a draft length
            the generator has no verify mode for, draft lengths not shortening down the list, a ``min_accept``
            for a length not listed; and the schedule's own rules (bounds rising down the list, hysteresis that
            holds).
    """
    by_length = {k: name for name, k in verify_lengths(modes).items()}
    if not by_length:
        raise ValueError("speculation tiers need verify modes: build the PoolGenerator with num_draft_tokens > 0 "
                         "(several draft lengths for several tiers, e.g. num_draft_tokens=(8, 4, 2))")
    bounds = list(bounds)
    if not bounds:
        raise ValueError("a tier schedule needs at least one speculative tier, e.g. [(8, 4)]: 8 drafts while at most "
                         "4 requests run, plain decode above")
    tiers, lengths = [], []
    for i, bound in enumerate(bounds):
        if not (isinstance(bound, (tuple, list)) and len(bound) in (2, 3)
                and all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in bound)):
            raise ValueError(f"tier {i}: {bound!r} is not (draft length, off_above) or (draft length, off_above, "
                             f"on_at_or_below), e.g. (8, 4): 8 drafts while at most 4 requests run")
        length, *sizes = bound
        if not isinstance(length, numbers.Integral):
            raise ValueError(f"tier {i}: {bound!r} starts with {length!r}, not a draft length (an int)")
        if length not in by_length:
            raise ValueError(f"tier {i}: the generator has no verify mode of {length} drafts (its modes: "
                             f"{_describe(modes)}); build the PoolGenerator with num_draft_tokens="
                             f"{_lengths_with(modes, int(length))} to add one, or use one of its draft lengths")
        if lengths and length >= lengths[-1]:
            raise ValueError(f"tier {i} drafts {length} tokens, not fewer than tier {i - 1} ({lengths[-1]}): list the "
                             f"tiers longest draft first (at the smallest batches), each serving larger batches")
        lengths.append(length)
        tiers.append(gp.Tier(by_length[length], *sizes, min_accept=(min_accept or {}).get(length)))
    unknown = sorted(set(min_accept or {}) - set(lengths))
    if unknown:
        raise ValueError(f"min_accept names draft lengths {unknown} that no tier of this schedule drafts (its tiers: "
                         f"{lengths}); key min_accept by the tiers' draft lengths")
    return gp.TierSchedule(tiers + [gp.Tier(DECODE)], modes=modes, window=window, pause_steps=pause_steps)


def check_policy(policy: object, modes: Mapping[str, gp.Mode]) -> None:
    """Check a ``generate(policy=...)`` against the generator's modes, before anything runs.

    Raises:
        TypeError: the policy is not a :class:`~graphpool.TierSchedule`.
        ValueError: the generator has no verify mode; a tier names a mode the generator lacks; the schedule's
            modes break its rules (drafts shortening down the list, plain decode last).
    """
    if not isinstance(policy, gp.TierSchedule):
        raise TypeError(f"policy must be a graphpool.TierSchedule (SpeculationPolicy is its two-tier case; "
                        f"PoolGenerator.tier_schedule builds one from draft lengths), got {type(policy).__name__}")
    if not verify_lengths(modes):
        raise ValueError("a speculation policy needs a verify mode: build the PoolGenerator with num_draft_tokens > 0 "
                         "(several for tiers), or pass policy=None for plain decode")
    for i, mode in enumerate(policy.modes):
        if mode in modes:
            continue
        name, _, suffix = mode.partition("_")
        named = {k: m for m, k in verify_lengths(modes).items()}
        if name == VERIFY and suffix.isdigit() and int(suffix) in named:
            fix = (f"the generator's mode of {suffix} drafts is {named[int(suffix)]!r} (the longest draft length's "
                   f"mode is {VERIFY!r}); PoolGenerator.tier_schedule names the modes by draft length")
        elif name == VERIFY and suffix.isdigit():
            fix = (f"build the PoolGenerator with num_draft_tokens={_lengths_with(modes, int(suffix))} to add it, or "
                   f"build the schedule with PoolGenerator.tier_schedule, which names the modes by draft length")
        else:
            fix = "build the schedule with PoolGenerator.tier_schedule, which names the modes by draft length"
        raise ValueError(f"policy tier {i} names mode {mode!r}, which this generator lacks (its modes: "
                         f"{_describe(modes)}); {fix}")
    policy.check_modes(modes)

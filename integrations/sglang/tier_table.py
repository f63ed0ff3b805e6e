"""The launcher's speculation tiers (``--graphpool-tiers``): parsed and checked without SGLang, in the launcher process.

A table is the speculative tiers, longest draft first, each ``TOPKxSTEPS:TOKENS@OFF_ABOVE[/ON_AT_OR_BELOW]``: ``STEPS``
draft steps of ``TOPK`` branches verifying ``TOKENS`` tokens per request, run while the decode batch has at most
``OFF_ABOVE`` requests (and taken again once a batch that outgrew it shrinks to ``ON_AT_OR_BELOW``); plain decode (no
draft work at all) serves every larger batch. E.g. ``4x3:16@2,4x2:8@8/6,4x1:4@16/12``: 16 tokens up to 2 requests,
8 up to 8 (back at 6), 4 up to 16 (back at 12), plain decode above 16. :class:`graphpool.TierSchedule` chooses
the tier of each step (:meth:`TierTable.schedule`); its rules (bounds rising down the list, hysteresis that can hold)
are checked here, before the server loads anything, together with what SGLang's spec-v2 worker needs of each tier:

* one ``topk`` for every tier: SGLang's worker carries ``topk`` wide draft state between steps (its future map, the
  draft inputs, the draft graphs' shared buffers), so a tier of another ``topk`` would need a fork of the worker;
* ``STEPS`` falling down the list: the worker swaps a tier's state in by its step count
  (``EAGLEWorkerV2.apply_runtime_state`` returns early for a state of the step count it runs);
* ``TOKENS`` at most ``1 + TOPK + (STEPS - 1) * TOPK^2``: the draft tree offers ``TOPK`` candidates at its first step
  and ``TOPK^2`` at each later one, and a verify step takes the root plus ``TOKENS - 1`` of them; at ``TOPK`` 1 the
  draft is a chain of exactly ``STEPS + 1`` tokens (SGLang rewrites any other count to that);
* the first tier is the server's own speculation shape (``--speculative-eagle-topk``, ``--speculative-num-steps``,
  ``--speculative-num-draft-tokens``): SGLang sizes its buffers and KV reservation from it at start-up, and it is the
  largest.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from graphpool import Mode, Tier, TierSchedule

#: The schedule's mode of plain decode steps (the last tier).
PLAIN = "decode"

FORMAT = ("TOPKxSTEPS:TOKENS@OFF_ABOVE[/ON_AT_OR_BELOW] per speculative tier, longest draft first, comma-separated, "
          "e.g. 4x3:16@2,4x2:8@8/6,4x1:4@16/12 (plain decode above the last bound)")

_TIER = re.compile(r"^(\d+)x(\d+):(\d+)@(\d+)(?:/(\d+))?$")


@dataclass(frozen=True)
class SpecTier:
    """One speculative tier: ``steps`` draft steps of ``topk`` branches verifying ``num_draft_tokens`` tokens per
    request, for decode batches of at most ``off_above`` requests (taken back at ``on_at_or_below``)."""

    topk: int
    steps: int
    num_draft_tokens: int
    off_above: int
    on_at_or_below: Optional[int] = None

    @property
    def label(self) -> str:
        """``TOPKxSTEPS:TOKENS``: the tier's name in the schedule, the logs and graphpool's graphs."""
        return f"{self.topk}x{self.steps}:{self.num_draft_tokens}"

    @property
    def max_committed(self) -> int:
        """Tokens a verify step of this tier commits per request at most: every draft step accepted (as deep as its
        tree reaches), plus the target's own next token."""
        return min(self.steps, self.num_draft_tokens - 1) + 1

    @property
    def max_draft_tokens(self) -> int:
        """The most tokens a verify step of this shape can carry: the root and every candidate of the draft tree."""
        return 1 + self.topk + (self.steps - 1) * self.topk ** 2

    def __str__(self) -> str:
        back = "" if self.on_at_or_below is None else f"/{self.on_at_or_below}"
        return f"{self.label}@{self.off_above}{back}"


@dataclass(frozen=True)
class TierTable:
    """The speculative tiers of ``--graphpool-tiers``, longest draft first (plain decode above the last bound).

    Build it with :meth:`parse`, which checks every rule that needs no server (see the module docstring); the
    rules against the server's own settings are :meth:`server_problems`.
    """

    tiers: Tuple[SpecTier, ...]

    @classmethod
    def parse(cls, text: str) -> "TierTable":
        """``"4x3:16@2,4x2:8@8/6"`` -> the table.

        Raises:
            ValueError: a tier that does not parse, or a table that breaks a rule; the message names the tier, the
                rule and the fix.
        """
        tiers = []
        for part in [p.strip() for p in str(text).split(",")]:
            match = _TIER.match(part)
            if match is None:
                raise ValueError(f"--graphpool-tiers: cannot read tier {part!r}: expected {FORMAT}")
            topk, steps, tokens, off, on = match.groups()
            tiers.append(SpecTier(int(topk), int(steps), int(tokens), int(off), None if on is None else int(on)))
        table = cls(tuple(tiers))
        table.check()
        return table

    def check(self) -> None:
        """The rules between the tiers and within each (see the module docstring), then the schedule's own."""
        if not self.tiers:
            raise ValueError(f"--graphpool-tiers names no tier: expected {FORMAT}")
        topk = self.tiers[0].topk
        for i, t in enumerate(self.tiers):
            if t.topk < 1 or t.steps < 1:
                raise ValueError(f"--graphpool-tiers tier {i} ({t}): a speculative tier drafts at least one step of at "
                                 f"least one branch (plain decode is the tier above the last bound, not a tier of 0 "
                                 f"steps)")
            if t.topk != topk:
                raise ValueError(f"--graphpool-tiers tier {i} ({t}) drafts topk {t.topk}, tier 0 topk {topk}: every "
                                 f"tier drafts the server's --speculative-eagle-topk (SGLang's worker keeps topk-wide "
                                 f"draft state between steps, so tiers of another topk would need a fork of it); "
                                 f"give every tier topk {topk}")
            if t.topk == 1 and t.num_draft_tokens != t.steps + 1:
                raise ValueError(f"--graphpool-tiers tier {i} ({t}): at topk 1 the draft is a chain and a verify step "
                                 f"carries steps + 1 = {t.steps + 1} tokens; write 1x{t.steps}:{t.steps + 1}")
            if not 2 <= t.num_draft_tokens <= t.max_draft_tokens:
                raise ValueError(f"--graphpool-tiers tier {i} ({t}): {t.num_draft_tokens} draft tokens, but a verify "
                                 f"step of {t.steps} draft step(s) at topk {t.topk} carries 2 to 1 + topk + (steps - 1) * "
                                 f"topk^2 = {t.max_draft_tokens} (the root and the draft tree's candidates); choose "
                                 f"TOKENS in that range")
            if i and t.steps >= self.tiers[i - 1].steps:
                raise ValueError(f"--graphpool-tiers tier {i} ({t}) drafts {t.steps} steps, tier {i - 1} "
                                 f"{self.tiers[i - 1].steps}: steps must fall down the list (SGLang's worker swaps a "
                                 f"tier in by its step count); give each tier fewer steps than the one before")
        try:
            self.schedule()
        except ValueError as exc:
            raise ValueError(f"--graphpool-tiers {self}: {exc}") from None

    def schedule(self) -> TierSchedule:
        """A new :class:`graphpool.TierSchedule` of these tiers (modes: their labels, then :data:`PLAIN`)."""
        tiers = [Tier(t.label, t.off_above, t.on_at_or_below) for t in self.tiers] + [Tier(PLAIN)]
        modes = [Mode(t.label, t.num_draft_tokens) for t in self.tiers] + [Mode(PLAIN, 1)]
        return TierSchedule(tiers, modes=modes)

    def server_problems(self, algorithm: str, topk: Optional[int], steps: Optional[int],
                        num_draft_tokens: Optional[int]) -> List[str]:
        """What the server's speculation settings (as SGLang resolved them) must change to serve these tiers; each
        problem names the flag and the fix (empty: none)."""
        first, problems = self.tiers[0], []
        if algorithm not in ("EAGLE", "EAGLE3", "STANDALONE"):
            problems.append(f"--speculative-algorithm is {algorithm or None!r}: tiers swap the states of SGLang's "
                            f"EAGLE-family spec-v2 worker; pass --speculative-algorithm EAGLE, EAGLE3 or STANDALONE")
        want = (("--speculative-eagle-topk", topk, first.topk), ("--speculative-num-steps", steps, first.steps),
                ("--speculative-num-draft-tokens", num_draft_tokens, first.num_draft_tokens))
        wrong = [(flag, got, value) for flag, got, value in want if got != value]
        if wrong:
            problems.append(
                f"the first tier ({first.label}) must be the server's own speculation shape (SGLang sizes its buffers "
                f"and KV reservation from it at start-up), but the server resolved "
                + ", ".join(f"{flag} {got}" for flag, got, _ in wrong)
                + "; pass " + " ".join(f"{flag} {value}" for flag, _, value in want))
        return problems

    def batch_sizes(self, captured: Sequence[int]) -> List[Tuple[int, ...]]:
        """Each tier's batch sizes among ``captured``: those up to the smallest one that holds its ``off_above``
        (a tier never runs a larger batch); every size where none does."""
        sizes = sorted(captured)
        out = []
        for t in self.tiers:
            cover = next((bs for bs in sizes if bs >= t.off_above), sizes[-1])
            out.append(tuple(bs for bs in sizes if bs <= cover))
        return out

    def __str__(self) -> str:
        return ",".join(str(t) for t in self.tiers)

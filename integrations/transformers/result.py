"""What :meth:`~.loop.PoolGenerator.generate` returns: the tokens, why each request ended, per-step records."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .step import DECODE


@dataclass(frozen=True)
class StepRecord:
    """One decode step of :meth:`PoolGenerator.generate`.

    Attributes:
        mode: ``"decode"``, ``"verify"``, or with speculation tiers ``"verify_<k>"`` (``k`` drafts per row): the
            step's tier.
        batch_size: the running requests it carried.
        graph_bs: the padded batch size of the graph that served it; ``None`` for an eager miss (a batch
            larger than every graph of the mode).
        committed: tokens it added to the outputs, over all rows (after cutting at EOS and max tokens).
        drafted: draft tokens it verified (0 for decode).
        accepted: of those, the ones accepted (greedy rows: equal to the model's token; sampled rows: by
            speculative sampling's rule).
        seconds: host wall time of the step, its wait for the tokens included.
    """

    mode: str
    batch_size: int
    graph_bs: int | None
    committed: int
    drafted: int
    accepted: int
    seconds: float


@dataclass
class GenerationResult:
    """What :meth:`PoolGenerator.generate` returns.

    Attributes:
        tokens: each prompt's new tokens, in prompt order (an EOS or the token completing a stop string that
            ended one is included, as ``generate`` includes it).
        finish: why each request ended: ``"eos"``, ``"length"`` (its ``max_new_tokens``) or ``"stop_string"``.
        logprobs: with ``output_logprobs=True``, each new token's log-probability under the distribution it
            was chosen from (``generate``'s processed scores: after the logits processors and, when sampling,
            the warpers); ``None`` otherwise.
        steps: one :class:`StepRecord` per decode step, in order.
        pad_token_id: the pad token :meth:`padded` fills with (``generate``'s: the first EOS if none is set).
        prefill_s: seconds spent in prefills; ``decode_s``: in decode steps.
    """

    tokens: list[list[int]]
    finish: list[str]
    logprobs: list[list[float]] | None = None
    steps: list[StepRecord] = field(default_factory=list)
    pad_token_id: int | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0

    def padded(self) -> torch.Tensor:
        """The new tokens as one ``[B, longest]`` int64 tensor, right-padded with :attr:`pad_token_id` (as
        ``generate`` pads sequences that ended early).

        Raises:
            ValueError: requests of different lengths and no pad token.
        """
        longest = max(map(len, self.tokens), default=0)
        if self.pad_token_id is None and any(len(t) != longest for t in self.tokens):
            raise ValueError("requests ended at different lengths and there is no pad token: set pad_token_id")
        pad = self.pad_token_id if self.pad_token_id is not None else 0
        return torch.tensor([t + [pad] * (longest - len(t)) for t in self.tokens], dtype=torch.int64)

    @property
    def num_tokens(self) -> int:
        """New tokens over all prompts."""
        return sum(map(len, self.tokens))

    def steps_of(self, mode: str) -> list[StepRecord]:
        """The steps of one mode (``"decode"``, ``"verify"``, a tier's ``"verify_<k>"``), in order."""
        return [s for s in self.steps if s.mode == mode]

    @property
    def steps_by_mode(self) -> dict[str, int]:
        """Steps per mode (per tier), e.g. ``{"decode": 20, "verify_2": 9, "verify": 11}``; modes in the order
        of their first step."""
        counts: dict[str, int] = {}
        for s in self.steps:
            counts[s.mode] = counts.get(s.mode, 0) + 1
        return counts

    @property
    def accept_by_mode(self) -> dict[str, float]:
        """Mean tokens a verify step of each verify mode (tier) committed per sequence (as
        :attr:`accept_per_verify`), for the modes that ran."""
        return {mode: _accept(self.steps_of(mode)) for mode in self.steps_by_mode if mode != DECODE}

    @property
    def switches(self) -> int:
        """Steps whose mode differs from the step before (tier changes, speculation on or off)."""
        return sum(a.mode != b.mode for a, b in zip(self.steps, self.steps[1:]))

    @property
    def accept_per_verify(self) -> float | None:
        """Mean tokens a verify step committed per sequence (1 + its accepted drafts, before cutting at EOS or
        max tokens), over every verify mode; ``None`` without verify steps. Speculation pays when this beats the
        verify step's cost relative to a plain step's."""
        return _accept([s for s in self.steps if s.mode != DECODE])

    @property
    def misses(self) -> int:
        """Steps that ran eagerly (larger than every graph of their mode)."""
        return sum(s.graph_bs is None for s in self.steps)

    def summary(self) -> str:
        """One line: tokens, steps by mode, acceptance (per verify mode, with tiers), misses, time."""
        accept = self.accept_by_mode
        counts = ", ".join(f"{count} {mode}" for mode, count in self.steps_by_mode.items()) or "no steps"
        if len(accept) == 1:
            counts += f", {next(iter(accept.values())):.2f} tokens per sequence per verify step"
        elif accept:
            counts += ("; tokens per sequence per verify step: " + ", ".join(f"{m} {a:.2f}" for m, a in accept.items())
                       + f"; {self.switches} mode switches")
        return (f"{self.num_tokens} tokens in {len(self.steps)} steps ({counts}; {self.misses} eager misses); "
                f"prefill {self.prefill_s * 1e3:.1f} ms, decode {self.decode_s * 1e3:.1f} ms")


def _accept(verify: list[StepRecord]) -> float | None:
    rows = sum(s.batch_size for s in verify)
    return (rows + sum(s.accepted for s in verify)) / rows if rows else None

"""Tensor parallelism: every rank must replay the same graph each step, and capture the same graphs.

Under tensor parallelism each rank replays its own graphs, and the graphs hold collectives. Two ranks that
replay different graphs (one a decode step, the other a verify step; or two batch sizes) issue collectives
of different sizes and wait on each other forever. :class:`StepAgreement` turns that hang into an error
(a debug check): before each step it all-gathers four integers (step counter, mode, padded batch size, real
batch size) over a gloo group, which costs no device synchronisation, and raises :class:`RankDisagreementError`
on every rank when they differ. The check itself cannot deadlock: it is the same small collective on every
rank, whatever step each rank was about to run.

:func:`agree_on_outcome` does the same for a capture: a capture that failed on one rank fails on every rank,
with that rank's reason, instead of leaving the ranks with different graphs.

Used by the reference engine (``bench/engine``) and by the SGLang integration (SGLang's TP group).
"""
from __future__ import annotations

import zlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .errors import CaptureError, GraphPoolError

#: Step names every rank knows how to print; other names print as their code.
KNOWN_STEPS = ("decode", "verify", "prefill", "eager_decode", "eager_verify", "eager_prefill", "draft_catch_up")


class RankDisagreementError(GraphPoolError, RuntimeError):
    """Tensor-parallel ranks were about to run different steps (their graphs' collectives would deadlock).

    Attributes:
        ranks: the ranks whose step differs from rank 0's.
        entries: per rank, ``(step counter, step name, padded batch size, real batch size)``.
    """

    def __init__(self, message: str, ranks: list[int], entries: list[tuple[int, str, int, int]]):
        super().__init__(message)
        self.ranks, self.entries = ranks, entries

    def __reduce__(self):  # survives pickling (a spawned rank hands its error to the launching process)
        return type(self), (str(self), self.ranks, self.entries)


def _code(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


class StepAgreement:
    """Compares (step counter, step name, padded bs, real bs) across the ranks of ``group`` before each step.

    Args:
        group: the tensor-parallel process group (any backend; the check runs over a gloo group of its ranks).
        timeout_s: how long :meth:`check` waits for a rank that never arrives (a crashed or stuck rank).
        gloo_group: a gloo group of the same ranks to use (e.g. SGLang's ``get_tp_group().cpu_group``); without
            one, the constructor creates it, so every rank must build its ``StepAgreement`` at the same point.
    """

    def __init__(self, group: Any, timeout_s: float = 60.0, gloo_group: Any = None):
        if gloo_group is None:
            ranks = dist.get_process_group_ranks(group)
            gloo_group = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.group = gloo_group
        self.rank, self.size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.steps = 0
        self._names = {_code(n): n for n in KNOWN_STEPS}
        self._mine = torch.zeros(4, dtype=torch.int64)
        self._all = torch.zeros(4 * self.size, dtype=torch.int64)
        self._parts = list(self._all.chunk(self.size))  # views: the list-form all-gather writes into _all

    def check(self, name: str, bs: int, real_bs: int) -> None:
        """Count a step and raise :class:`RankDisagreementError` unless every rank runs the same one.

        Args:
            name: the step (a mode name, or an eager entry point such as ``"draft_catch_up"``).
            bs: the padded batch size of the graph about to replay (the real one for an eager step).
            real_bs: the real batch size.
        """
        self.steps += 1
        code = _code(name)
        self._names.setdefault(code, name)
        self._mine.copy_(torch.tensor([self.steps, code, bs, real_bs]))
        dist.all_gather(self._parts, self._mine, group=self.group)
        rows = self._all.view(self.size, 4).tolist()
        if all(row == rows[0] for row in rows):
            return
        entries = [(s, self._names.get(c, f"step#{c}"), b, r) for s, c, b, r in rows]
        differ = [i for i, row in enumerate(rows) if row != rows[0]]
        table = "; ".join(f"rank {i}: step {s} {n!r} bs {b} (real {r})" for i, (s, n, b, r) in enumerate(entries))
        raise RankDisagreementError(
            f"tensor-parallel ranks disagree on the step about to run: {table}. Ranks {differ} differ from rank 0 "
            f"(this is rank {self.rank}). Replaying different graphs would deadlock in their collectives: every "
            f"rank must choose the same mode and batch size each step, from inputs identical on every rank "
            f"(same requests, same policy, values read back from all-gathered outputs) or broadcast from rank 0",
            differ, entries)


def agree_on_outcome(gloo_group: Any, error: BaseException | None, what: str) -> None:
    """After a collective-holding operation each rank ran (a capture): raise on every rank if it failed on any.

    Every rank calls this, with the exception its own attempt raised (``None`` when it succeeded). The ranks
    exchange their outcomes over ``gloo_group`` (no device synchronisation); if any failed, each rank raises
    :class:`CaptureError` naming the failed ranks and their reasons (a rank whose own attempt failed chains its
    own exception), so no rank goes on with graphs the others do not have.
    """
    mine = None if error is None else f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    outcomes: list[Any] = [None] * dist.get_world_size(gloo_group)
    dist.all_gather_object(outcomes, mine, group=gloo_group)
    failed = {rank: reason for rank, reason in enumerate(outcomes) if reason is not None}
    if not failed:
        return
    listed = "; ".join(f"rank {rank}: {reason}" for rank, reason in failed.items())
    message = (f"{what} failed on tensor-parallel rank(s) {sorted(failed)} ({listed}); it is abandoned on every rank "
               f"(this is rank {dist.get_rank(gloo_group)}), so no rank replays graphs the others lack")
    raise CaptureError(message) from error

"""The decode loop: requests arrive so that ``concurrency`` stay in flight, and every step runs one mode.

How steps run (the four variants of the benchmark):

* ``plain``: every step a plain decode graph.
* ``spec``: every step a speculative (draft + verify + accept) graph.
* ``dynamic``: :class:`graphpool.SpeculationPolicy` picks the mode per step; both are graphs.
* ``dynamic_eager_plain``: the same choice, but plain steps run eagerly, as on a server whose runner
  only holds verify graphs.

The host knows every sequence's length without asking the GPU, except after a verify step, where it
reads the accept lengths (the one sync per speculative step).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from graphpool import GraphPool, SpeculationPolicy, StepBatch

from .engine import Engine
from .transfer import HostToDevice

log = logging.getLogger(__name__)

VARIANTS = ("plain", "spec", "dynamic", "dynamic_eager_plain")


@dataclass(frozen=True)
class Request:
    """A request: fixed-length random prompt, and how many tokens to generate."""

    rid: int
    prompt: np.ndarray
    max_new: int


def make_requests(n: int, prompt_len: int, vocab: int, min_new: int, max_new: int, seed: int = 0) -> list[Request]:
    """``n`` reproducible requests (request ``i`` is the same for any ``n``)."""
    out = []
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        out.append(Request(i, rng.integers(0, vocab, prompt_len, dtype=np.int64), int(rng.integers(min_new, max_new + 1))))
    return out


@dataclass
class RunStats:
    """What one run measured (the timed window only, except ``outputs`` of finished requests and
    ``partial`` outputs of the requests still running when the run stopped)."""

    variant: str
    concurrency: int
    tokens: int = 0
    seconds: float = 0.0
    steps: dict = field(default_factory=lambda: {"decode": 0, "verify": 0, "eager_decode": 0})
    draft_tokens_accepted: int = 0
    accept_rows: int = 0
    graph_misses: int = 0
    catch_ups: int = 0
    outputs: dict[int, list[int]] = field(default_factory=dict)
    partial: dict[int, list[int]] = field(default_factory=dict)  # unfinished requests: tokens so far

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def mean_accept(self) -> float:
        """Committed tokens per sequence per verify step (1 = nothing accepted; steps + 1 at most)."""
        return 1.0 + self.draft_tokens_accepted / self.accept_rows if self.accept_rows else 0.0


class DecodeLoop:
    """Runs requests through an engine and its captured pool.

    Args:
        engine: the engine (its pool captured with ``engine.step``).
        pool: the captured pool.
        variant: one of :data:`VARIANTS`.
        policy: the mode choice for the dynamic variants.
    """

    def __init__(self, engine: Engine, pool: GraphPool, variant: str, policy: SpeculationPolicy | None = None):
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; choose one of {VARIANTS}")
        if variant.startswith("dynamic") and policy is None:
            raise ValueError(f"variant {variant!r} needs a SpeculationPolicy")
        self.engine, self.pool, self.variant, self.policy = engine, pool, variant, policy
        self.h2d = HostToDevice(engine.device, max(2 * engine.rows.num_rows, engine.rows.num_rows * (engine.prompt_len + 1)))
        self._prefill_max = max(pool.batch_sizes["prefill"])

    def _mode(self, bs: int) -> str:
        if self.variant == "plain":
            return "decode"
        if self.variant == "spec":
            return "verify"
        return self.policy.choose(bs)

    def run(self, requests: list[Request], concurrency: int, warmup_steps: int = 0, max_steps: int | None = None,
            min_seconds: float = 0.0, keep_outputs: bool = True) -> RunStats:
        """Serve ``requests`` in order, ``concurrency`` at a time, until all finish, or until ``max_steps``
        timed steps (after ``warmup_steps`` untimed ones) have run and at least ``min_seconds`` passed.
        Throughput counts the tokens committed in the timed window (capped at each request's ``max_new``)."""
        eng, stats = self.engine, RunStats(self.variant, concurrency)
        queue = list(reversed(requests))
        rows = np.zeros(0, np.int64)            # request row of each active sequence
        lens = np.zeros(0, np.int64)            # committed tokens n
        draft_len = np.zeros(0, np.int64)       # positions whose draft KV is valid
        done = np.zeros(0, np.int64)            # tokens generated so far
        reqs: list[Request] = []
        limit = np.zeros(0, np.int64)           # max_new of each active sequence
        pending_out: list[tuple[int, torch.Tensor]] = []
        misses0 = sum(self.pool.stats.misses.values())
        step, t0 = 0, None
        while True:
            free = concurrency - len(reqs)
            if free > 0 and queue:
                new = [queue.pop() for _ in range(min(free, len(queue)))]
                new_rows = self._admit(new)
                reqs += new
                rows = np.concatenate([rows, new_rows])
                lens = np.concatenate([lens, np.full(len(new), eng.prompt_len)])
                draft_len = np.concatenate([draft_len, np.full(len(new), eng.prompt_len - 1)])
                done = np.concatenate([done, np.zeros(len(new), np.int64)])
                limit = np.concatenate([limit, [r.max_new for r in new]])
            if not reqs or (max_steps is not None and step >= warmup_steps + max_steps
                            and time.perf_counter() - t0 >= min_seconds):
                break
            if step == warmup_steps:
                self._sync()
                t0 = time.perf_counter()
            bs = len(reqs)
            mode = self._mode(bs)
            if mode == "verify":
                stale = np.flatnonzero(draft_len < lens - eng.spec.window)
                for i in stale:  # after plain steps: bring the draft KV up to the window before speculating
                    eng.draft_catch_up(int(rows[i]), int(draft_len[i]), int(lens[i] - eng.spec.window))
                stats.catch_ups += len(stale)
            dev = self.h2d(np.stack([lens, rows]))
            inputs = {"seq_lens": dev[0], "req_pool_indices": dev[1]}
            if mode == "verify":
                acc = self.pool.run("verify", **inputs).cpu().numpy()  # the one host sync of a step
                draft_len = lens.copy()
            elif self.variant == "dynamic_eager_plain":
                self.engine.step(StepBatch(self.pool.modes["decode"], bs, bs, inputs, captured=False))
                acc = np.ones(bs, np.int64)
                mode = "eager_decode"
            else:
                self.pool.run("decode", **inputs)
                acc = np.ones(bs, np.int64)
            gained = np.minimum(acc, limit - done)
            lens, done = lens + acc, done + gained
            if step >= warmup_steps:
                stats.tokens += int(gained.sum())
                stats.steps[mode] += 1
                if mode == "verify":
                    stats.draft_tokens_accepted += int((acc - 1).sum())
                    stats.accept_rows += bs
            step += 1
            finished = np.flatnonzero(done >= limit)
            if len(finished):
                for i in finished:
                    r = reqs[i]
                    if keep_outputs:
                        start = eng.prompt_len
                        pending_out.append((r.rid, eng.token_table[int(rows[i]), start:start + r.max_new].clone()))
                    eng.rows.free(int(rows[i]))
                keep = np.setdiff1d(np.arange(len(reqs)), finished)
                reqs = [reqs[i] for i in keep]
                rows, lens, draft_len, done, limit = rows[keep], lens[keep], draft_len[keep], done[keep], limit[keep]
        self._sync()
        stats.seconds = time.perf_counter() - t0 if t0 is not None else 0.0
        stats.graph_misses = sum(self.pool.stats.misses.values()) - misses0
        partial = []
        for i, r in enumerate(reqs):  # unfinished requests free their rows too
            if keep_outputs and done[i]:
                partial.append((r.rid, eng.token_table[int(rows[i]), eng.prompt_len:eng.prompt_len + int(done[i])]))
            eng.rows.free(int(rows[i]))
        stats.outputs = {rid: t.cpu().tolist() for rid, t in pending_out}
        stats.partial = {rid: t.cpu().tolist() for rid, t in partial}
        return stats

    def _admit(self, new: list[Request]) -> np.ndarray:
        """Take rows, write the prompts into the token table, prefill them (graphed, in chunks)."""
        eng = self.engine
        rows = np.array([eng.rows.alloc() for _ in new], dtype=np.int64)
        packed = np.concatenate([rows[:, None], np.stack([r.prompt for r in new])], axis=1)
        dev = self.h2d(packed)
        eng.token_table[dev[:, 0, None], torch.arange(eng.prompt_len, device=eng.device)] = dev[:, 1:]
        lens = self.h2d(np.concatenate([np.full(len(new), eng.prompt_len), rows]))
        for s in range(0, len(new), self._prefill_max):
            e = min(s + self._prefill_max, len(new))
            self.pool.run("prefill", seq_lens=lens[s:e], req_pool_indices=lens[len(new) + s:len(new) + e])
        return rows

    def _sync(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)

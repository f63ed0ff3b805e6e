"""The decode loop: requests arrive so that ``concurrency`` stay in flight, and every step runs one mode.

How steps run (the variants of the benchmark):

* ``plain``: every step a plain decode graph.
* ``spec``: every step a speculative (draft + verify + accept) graph.
* ``spec_<n>``: every step a speculative graph of the engine's shorter tier of ``n`` draft tokens (a fixed tier).
* ``dynamic``: :class:`graphpool.SpeculationPolicy` picks the mode per step; both are graphs.
* ``dynamic_eager_plain``: the same choice, but plain steps run eagerly, as on a server whose runner
  only holds verify graphs.
* ``tiers``: a :class:`graphpool.TierSchedule` picks the tier per step (the draft length by batch size, plain
  decode last), and hears each verify step's acceptance (:meth:`graphpool.TierSchedule.record`). The draft is
  caught up only where speculation resumes after plain steps: every tier re-reads the same draft window.

The host knows every sequence's length without asking the GPU, except after a verify step, whose
accept lengths only the GPU knows. The loop does not wait for them (**run-ahead**): the next step's
``seq_lens`` are computed on the device (``seq_lens + accept_len``, one small launch), the accept lengths
travel to pinned host memory asynchronously, and the host reads them one step later, while the GPU runs
the step it has just queued. The host waits only where it must know them: when the mode changes (a
catch-up needs the lengths), to keep at most ``run_ahead`` verify steps unread, and when every sequence of
the batch may have finished (the next step could be all waste). ``run_ahead=0`` reads them after every
verify step (a sync per step).

**Request ends without a wait.** When only some sequences may have finished, the loop queues the next
step for the whole batch anyway. Once the lengths arrive, a finished request is retired and a new one
admitted while a step is still in flight: the next step's ``seq_lens`` are the in-flight step's
(on the device) for the requests that stay, and the host's for the new ones. Each in-flight record names
the requests of its batch, so lengths read late land on the right requests (a retired one's are dropped;
its extra step is capped out of the counts). A sequence is stepped past its end only while its row has
room (``max_context`` holds the scratch of a verify step beyond the last token). Waiting instead, as at
every request end before, costs a host round trip per step once C is large enough that some request is
always near its end (at C >= 16, most steps).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from graphpool import GraphPool, StepBatch, TierSchedule

from .engine import Engine
from .transfer import HostToDevice, advance_kernel_available, advance_lengths

log = logging.getLogger(__name__)

VARIANTS = ("plain", "spec", "dynamic", "dynamic_eager_plain", "tiers")
#: The variants whose mode a policy chooses per step.
CHOSEN = ("dynamic", "dynamic_eager_plain", "tiers")


def fixed_tier_variants(engine: Engine) -> dict[str, str]:
    """``spec_<n>`` -> the mode of the engine's shorter tier of ``n`` draft tokens (``spec`` runs ``verify``)."""
    return {f"spec_{t.num_draft_tokens}": mode for mode, t in engine.tiers.items() if mode != "verify"}


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
    steps: dict = field(default_factory=lambda: {"decode": 0, "verify": 0, "eager_decode": 0})  # per mode run
    draft_tokens_accepted: int = 0
    accept_rows: int = 0
    by_tier: dict = field(default_factory=dict)  # verify mode -> [draft tokens accepted, rows]
    graph_misses: int = 0
    catch_ups: int = 0   # rows whose draft KV was caught up (after plain steps, before speculating again)
    switches: int = 0    # steps whose chosen mode differed from the step before (a policy's variants)
    outputs: dict[int, list[int]] = field(default_factory=dict)
    partial: dict[int, list[int]] = field(default_factory=dict)  # unfinished requests: tokens so far

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def mean_accept(self) -> float:
        """Committed tokens per sequence per verify step (1 = nothing accepted; steps + 1 at most)."""
        return 1.0 + self.draft_tokens_accepted / self.accept_rows if self.accept_rows else 0.0

    @property
    def mean_accept_by_tier(self) -> dict[str, float]:
        """:attr:`mean_accept` of each verify mode that ran."""
        return {mode: 1.0 + tokens / rows for mode, (tokens, rows) in self.by_tier.items()}


@dataclass
class _Active:
    """The sequences in flight, in batch order (host arrays)."""

    reqs: list = field(default_factory=list)
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))       # request row
    lens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))       # committed tokens n
    draft_len: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # positions with valid draft KV
    done: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))       # tokens generated so far
    limit: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))      # max_new
    rids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))       # request ids

    # Requests only join at the end and leave without reordering the rest: the requests of an earlier batch
    # that are still here lead the batch, in their order (what _commit relies on).
    def add(self, new: list[Request], rows: np.ndarray, prompt_len: int) -> None:
        self.reqs += new
        self.rids = np.concatenate([self.rids, [r.rid for r in new]]).astype(np.int64)
        self.rows = np.concatenate([self.rows, rows])
        self.lens = np.concatenate([self.lens, np.full(len(new), prompt_len)])
        self.draft_len = np.concatenate([self.draft_len, np.full(len(new), prompt_len - 1)])
        self.done = np.concatenate([self.done, np.zeros(len(new), np.int64)])
        self.limit = np.concatenate([self.limit, [r.max_new for r in new]])

    def keep(self, idx: np.ndarray) -> None:
        self.reqs = [self.reqs[i] for i in idx]
        for name in ("rids", "rows", "lens", "draft_len", "done", "limit"):
            setattr(self, name, getattr(self, name)[idx])


@dataclass
class _InFlight:
    """A verify step whose accept lengths the host has not read yet."""

    step: int
    mode: str                            # the step's verify mode (tier)
    accepted: np.ndarray                 # host view the accept lengths land in
    event: Optional["torch.cuda.Event"]  # recorded after the copy (None on CPU: copied already)
    rids: np.ndarray                     # the step's requests, in batch order


class _AcceptRing:
    """Accept lengths to the host without a sync, and the next step's ``seq_lens`` on the device.

    Each verify step gets a ring slot: a pinned host buffer and a device buffer for ``seq_lens +
    accept_len``, both written by one launch (:func:`bench.engine.transfer.advance_lengths`), then an
    event. Slots outnumber the steps the loop keeps unread, so a slot is free again by the time the ring
    comes back to it.
    """

    def __init__(self, device: torch.device, max_rows: int, slots: int):
        self.cuda = device.type == "cuda"
        self.kernel = advance_kernel_available(device)  # one launch for the add and the host copy
        self.host = [torch.zeros(max_rows, dtype=torch.int64, pin_memory=self.cuda) for _ in range(slots)]
        self.lens = [torch.zeros(max_rows, dtype=torch.int64, device=device) for _ in range(slots)]
        self.i = 0

    def push(self, seq_lens: torch.Tensor, accepted: torch.Tensor, step: int, mode: str,
             rids: np.ndarray) -> tuple[_InFlight, torch.Tensor]:
        """Queue the copies of one verify step of ``mode`` (of requests ``rids``); returns its record and the next
        step's ``seq_lens``."""
        self.i = (self.i + 1) % len(self.host)
        bs = accepted.shape[0]
        nxt, host = self.lens[self.i][:bs], self.host[self.i][:bs]
        advance_lengths(seq_lens, accepted, nxt, host, self.kernel)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        return _InFlight(step, mode, host.numpy(), event, rids), nxt


class DecodeLoop:
    """Runs requests through an engine and its captured pool.

    Args:
        engine: the engine (its pool captured with ``engine.step``).
        pool: the captured pool.
        variant: one of :data:`VARIANTS`, or a fixed tier's ``spec_<n>`` (:func:`fixed_tier_variants`).
        policy: the mode choice of the :data:`CHOSEN` variants: ``choose(bs)`` returns a mode, e.g. a
            :class:`graphpool.SpeculationPolicy` or :class:`graphpool.TierSchedule` (whose ``record`` then hears
            each verify step's mean committed tokens per sequence).
        run_ahead: verify steps whose accept lengths may stay unread when the next step is queued
            (0: read them after every verify step, a host sync per step; see the module docstring).
        wait_at_request_end: read the lengths whenever any request may have finished, so that batches
            change only with no step in flight (the loop's behaviour before it ran ahead through request
            ends; the step-by-step reference of the run-ahead tests).
    """

    def __init__(self, engine: Engine, pool: GraphPool, variant: str, policy: TierSchedule | None = None,
                 run_ahead: int = 1, wait_at_request_end: bool = False):
        self._fixed = {"plain": "decode", "spec": "verify", **fixed_tier_variants(engine)}
        if variant not in VARIANTS and variant not in self._fixed:
            raise ValueError(f"unknown variant {variant!r}; choose one of {VARIANTS + tuple(self._fixed)[2:]}")
        if variant in CHOSEN and policy is None:
            raise ValueError(f"variant {variant!r} needs a policy (a SpeculationPolicy or TierSchedule)")
        if run_ahead < 0:
            raise ValueError(f"run_ahead must be >= 0, got {run_ahead}")
        self.engine, self.pool, self.variant, self.policy = engine, pool, variant, policy
        self._record = getattr(policy, "record", None) if variant in CHOSEN else None
        tiers = engine.tiers.values()
        self._gain = max(t.steps for t in tiers) + 1  # the most tokens a verify step commits per sequence
        # Columns a verify step writes past a row's length: its tree, or its draft's scratch.
        self._scratch = max(max(t.num_draft_tokens, (t.steps - 1) * t.topk + 1) for t in tiers)
        self.run_ahead, self.wait_at_request_end = run_ahead, wait_at_request_end
        rows = engine.rows.num_rows
        self.h2d = HostToDevice(engine.device, max(2 * rows, rows * (engine.prompt_len + 1)))
        self.accept_ring = _AcceptRing(engine.device, rows, run_ahead + 2)
        self._prefill_max = max(pool.batch_sizes["prefill"])
        if engine.device.type == "cuda":
            self._warm_batch_change()

    def _warm_batch_change(self) -> None:
        """Run the ops of a batch change in flight (:meth:`_next_inputs`) once: a kernel's first launch in a
        process loads its module (CUDA's lazy loading), tens of milliseconds that would otherwise land in
        the first step whose batch changes in flight (run AP: spec at C = 4 lost 35 % to it)."""
        lens = torch.zeros(2, dtype=torch.int64, device=self.engine.device)
        torch.cat([lens.index_select(0, self.h2d(np.zeros(1, np.int64))), lens])
        torch.cuda.synchronize(self.engine.device)

    def _mode(self, bs: int) -> str:
        fixed = self._fixed.get(self.variant)
        return fixed if fixed is not None else self.policy.choose(bs)

    def run(self, requests: list[Request], concurrency: int, warmup_steps: int = 0, max_steps: int | None = None,
            min_seconds: float = 0.0, keep_outputs: bool = True) -> RunStats:
        """Serve ``requests`` in order, ``concurrency`` at a time, until all finish, or until ``max_steps``
        timed steps (after ``warmup_steps`` untimed ones) have run and at least ``min_seconds`` passed.
        Throughput counts the tokens committed in the timed window (capped at each request's ``max_new``)."""
        eng, stats = self.engine, RunStats(self.variant, concurrency)
        stats.steps = {m: 0 for m in ("decode", *eng.tiers, "eager_decode")}
        self._stats, self._warmup = stats, warmup_steps
        queue = list(reversed(requests))
        act = _Active()
        inflight: list[_InFlight] = []
        lens_dev = rows_dev = None  # the device inputs that follow the unread steps
        outputs: list[tuple[int, torch.Tensor]] = []
        misses0 = sum(self.pool.stats.misses.values())
        step, t0, last_mode = 0, None, None
        while True:
            while len(inflight) > self.run_ahead:
                self._resolve(inflight.pop(0), act)
            if inflight and self._must_wait(act, len(inflight)):
                self._resolve_all(inflight, act)
            kept = self._retire(act, outputs, keep_outputs)  # positions (in the last step's batch) that stay
            n_kept = len(act.reqs)
            free = concurrency - n_kept
            if free > 0 and queue:
                new = [queue.pop() for _ in range(min(free, len(queue)))]
                act.add(new, self._admit(new), eng.prompt_len)
            if not act.reqs or (max_steps is not None and step >= warmup_steps + max_steps
                                and time.perf_counter() - t0 >= min_seconds):
                break
            if step == warmup_steps:
                self._sync()
                t0 = time.perf_counter()
            bs = len(act.reqs)
            mode = self._mode(bs)
            verify = mode in eng.tiers
            if inflight and mode != last_mode:
                self._resolve_all(inflight, act)  # the next step needs exact host lengths
            if verify and not inflight:
                stale = np.flatnonzero(act.draft_len < act.lens - eng.window)
                for i in stale:  # after plain steps: bring the draft KV up to the window before speculating
                    eng.draft_catch_up(int(act.rows[i]), int(act.draft_len[i]), int(act.lens[i] - eng.window))
                stats.catch_ups += len(stale)
            if inflight:
                seq_lens, rows = self._next_inputs(lens_dev, rows_dev, kept, act, n_kept)
            else:
                dev = self.h2d(np.stack([act.lens, act.rows]))
                seq_lens, rows = dev[0], dev[1]
            if verify:
                accepted = self.pool.run(mode, seq_lens=seq_lens, req_pool_indices=rows)
                if self.run_ahead:
                    record, lens_dev = self.accept_ring.push(seq_lens, accepted, step, mode, act.rids)
                    rows_dev = rows
                    inflight.append(record)
                else:
                    self._commit(step, mode, accepted.cpu().numpy(), act)  # the one host sync of a step
            elif self.variant == "dynamic_eager_plain":
                self.engine.step(StepBatch(self.pool.modes["decode"], bs, bs, {"seq_lens": seq_lens,
                                                                               "req_pool_indices": rows}, captured=False))
                mode = "eager_decode"
                self._commit(step, mode, np.ones(bs, np.int64), act)
            else:
                self.pool.run("decode", seq_lens=seq_lens, req_pool_indices=rows)
                self._commit(step, mode, np.ones(bs, np.int64), act)
            kind = "decode" if mode == "eager_decode" else mode
            if step >= warmup_steps:
                stats.steps[mode] += 1
                stats.switches += last_mode is not None and kind != last_mode
            step += 1
            last_mode = kind
        self._resolve_all(inflight, act)
        self._retire(act, outputs, keep_outputs)
        self._sync()
        stats.seconds = time.perf_counter() - t0 if t0 is not None else 0.0
        stats.graph_misses = sum(self.pool.stats.misses.values()) - misses0
        partial = []
        for i, r in enumerate(act.reqs):  # unfinished requests free their rows too
            if keep_outputs and act.done[i]:
                partial.append((r.rid, eng.token_table[int(act.rows[i]), eng.prompt_len:eng.prompt_len + int(act.done[i])]))
            eng.rows.free(int(act.rows[i]))
        stats.outputs = {rid: t.cpu().tolist() for rid, t in outputs}
        stats.partial = {rid: t.cpu().tolist() for rid, t in partial}
        return stats

    def _must_wait(self, act: _Active, unread: int) -> bool:
        """Whether the host must read the unread steps' lengths before queueing another step: some request
        may have finished and either the loop waits at every request end, or every sequence may have
        finished (the next step could be all waste), or a sequence past its end would outgrow its row."""
        gain = self._gain
        may_end = act.done + gain * unread >= act.limit
        if not may_end.any():
            return False
        if self.wait_at_request_end or may_end.all():
            return True
        # Upper bound of each row's length for the next step, and the columns a verify step writes past it.
        reach = act.lens + gain * unread + max(self._scratch, gain)
        return bool(np.any(reach > self.engine.max_context))

    def _next_inputs(self, lens_dev: torch.Tensor, rows_dev: torch.Tensor, kept: np.ndarray | None, act: _Active,
                     n_kept: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next step's ``seq_lens`` and rows while a step is in flight: its device lengths for the requests
        that stay (``kept``: their positions in its batch; ``None``: the batch did not change), the host's for
        the requests admitted since (their lengths are the prompt's, known exactly)."""
        if kept is None and n_kept == len(act.reqs):
            return lens_dev, rows_dev
        kept = np.arange(n_kept) if kept is None else kept
        n_new = len(act.reqs) - n_kept
        dev = self.h2d(np.concatenate([kept, act.lens[n_kept:], act.rows[n_kept:]]))  # one copy for all three
        idx, new_lens, new_rows = dev[:n_kept], dev[n_kept:n_kept + n_new], dev[n_kept + n_new:]
        return (torch.cat([lens_dev.index_select(0, idx), new_lens]),
                torch.cat([rows_dev.index_select(0, idx), new_rows]))

    def _commit(self, step: int, mode: str, accepted: np.ndarray, act: _Active, rids: np.ndarray | None = None) -> None:
        """Apply one step's committed token counts to the host state (and the stats, in the timed window).
        ``rids``: the step's requests in batch order, where the batch may have changed since (lengths of
        requests retired meanwhile are dropped); ``None``: the current batch."""
        if rids is not None:  # the step's requests still here lead the batch, in order (see _Active)
            here = np.isin(rids, act.rids)
            accepted = accepted[here]
            assert np.array_equal(act.rids[:len(accepted)], rids[here])
        at = slice(0, len(accepted))
        verify = mode in self.engine.tiers
        if verify:
            act.draft_len[at] = act.lens[at]  # the step's first draft pass wrote KV up to its input lengths
            if self._record is not None and len(accepted):
                self._record(mode, float(accepted.mean()))  # the schedule's acceptance feedback
        gained = np.minimum(accepted, act.limit[at] - act.done[at])
        act.lens[at] += accepted
        act.done[at] += gained
        if step >= self._warmup:
            self._stats.tokens += int(gained.sum())
            if verify:
                drafted = int((accepted - 1).sum())
                self._stats.draft_tokens_accepted += drafted
                self._stats.accept_rows += len(accepted)
                tier = self._stats.by_tier.setdefault(mode, [0, 0])
                tier[0], tier[1] = tier[0] + drafted, tier[1] + len(accepted)

    def _resolve(self, record: _InFlight, act: _Active) -> None:
        if record.event is not None:
            record.event.synchronize()
        self._commit(record.step, record.mode, record.accepted.copy(), act, record.rids)

    def _resolve_all(self, inflight: list[_InFlight], act: _Active) -> None:
        while inflight:
            self._resolve(inflight.pop(0), act)

    def _retire(self, act: _Active, outputs: list, keep_outputs: bool) -> np.ndarray | None:
        """Record and release the requests that have generated all their tokens. Returns the positions of
        the requests that stay (``None`` when none finished)."""
        finished = np.flatnonzero(act.done >= act.limit)
        if not len(finished):
            return None
        eng = self.engine
        for i in finished:
            r = act.reqs[i]
            if keep_outputs:
                outputs.append((r.rid, eng.token_table[int(act.rows[i]), eng.prompt_len:eng.prompt_len + r.max_new].clone()))
            eng.rows.free(int(act.rows[i]))
        kept = np.setdiff1d(np.arange(len(act.reqs)), finished)
        act.keep(kept)
        return kept

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

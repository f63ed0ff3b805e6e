"""The dynamic speculation switch, driven through a concurrency sweep 1 -> 64 -> 1 in the harness.

Speculative steps: a draft model proposes a chain, the target verifies it in TARGET_VERIFY mode through
the multi-mode runner, greedy acceptance, then a draft extend over the accepted tokens (EAGLE's
draft-extend-after-decode). Plain steps (batch above the threshold): graphpool's
``plain_decode_batch`` + the target in DECODE mode (routed by SGLang's ``_forward_raw``) and NO draft
work: a ``DraftLag`` records where each request's draft lags, and the first speculative step catches
the draft up with one draft extend over the plainly decoded tokens. Greedy outputs must equal plain
greedy decoding without speculation, every plain step must replay a DECODE graph, no draft forward may
run on a plain step, and the draft KV must be exactly what a fresh draft prefill computes.
"""
from __future__ import annotations

from typing import List

import pytest
import torch

from tests import sglang_harness as H  # noqa: I001  (puts the test stand-ins on sys.path first)

H.require_api("classic")  # the runner API (SGLang 0.5.14+) has its own tests
H.require_eagle_v1()  # the EAGLE v1 switch: SGLang 0.5.13.x has no EAGLE v1 worker

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

from graphpool.integrations.sglang import MultiModeCudaGraphRunner
from graphpool.integrations.sglang.draft_lag import DraftLag
from graphpool.integrations.sglang.spec_switch import SpeculationSwitch, plain_decode_batch

PROMPT = 6


class SpecWorld:
    """Target (multi-mode runner) + draft (eager, sharing the target's req_to_token) + request state."""

    def __init__(self, cfg: H.HarnessConfig, device: torch.device):
        self.cfg, self.dev = cfg, device
        self.target = H.HarnessModelRunner(cfg, device, speculative=True, model_seed=0)
        self.target.graph_runner = MultiModeCudaGraphRunner(self.target)
        self.draft = H.HarnessModelRunner(cfg, device, speculative=False, model_seed=1)
        self.draft.req_to_token_pool = self.target.req_to_token_pool
        self.draft.attn_backend = H.TorchPagedAttention(cfg, self.target.req_to_token_pool, self.draft.token_to_kv_pool)
        self.alloc = H.SlotAllocator(cfg.kv_slots)
        self.reqs = H.make_requests(cfg, cfg.max_reqs, PROMPT, seed=11)
        H.prefill(self.target, self.reqs, self.alloc)
        H.prefill(self.draft, self.reqs, None)
        self.plain_graph_hits = 0
        self.lag = DraftLag(keep_hidden=False)  # the harness draft reads tokens only
        H.count_draft_forwards(self)

    def catch_up(self, rows: List[int]) -> None:
        """One draft extend over every lagging request's plainly decoded positions (a draft prefill of
        that chunk; this world's draft writes position ``p`` from token ``p``)."""
        gaps = self.lag.take(rows)
        if gaps:
            late = sorted(gaps)
            H.extend(self.draft, late, [gaps[r].start for r in late],
                     [self.reqs.tokens[r][gaps[r].start:self.reqs.kv_len(r)] for r in late])

    def _lens(self, rows: List[int]) -> torch.Tensor:
        return torch.tensor([self.reqs.kv_len(r) for r in rows], dtype=torch.int64, device=self.dev)

    def spec_step(self, rows: List[int]) -> None:
        self.catch_up(rows)
        k = self.cfg.draft_tokens - 1
        drafts = self._propose(rows, k)
        out = self.target.forward(H.verify_batch(self.target, self.reqs, rows, drafts, self.alloc))
        assert out.can_run_graph and self.target.attn_backend.replay_log[-1][0] == ForwardMode.TARGET_VERIFY
        greedy = out.logits_output.next_token_logits.argmax(-1).view(len(rows), k + 1).tolist()
        accepted = []
        for d, g in zip(drafts.tolist(), greedy):
            a = 0
            while a < k and d[a] == g[a]:
                a += 1
            accepted.append(d[:a] + [g[a]])
        # Draft extend over the tokens whose KV the verify committed: the last token and the accepted drafts.
        H.extend(self.draft, rows, [self.reqs.kv_len(r) for r in rows],
                 [[self.reqs.tokens[r][-1]] + acc[:-1] for r, acc in zip(rows, accepted)])
        for r, acc in zip(rows, accepted):
            self.reqs.tokens[r].extend(acc)

    def _propose(self, rows: List[int], k: int) -> torch.Tensor:
        """A greedy draft chain on scratch slots (the verify then records its own slots)."""
        idx, lens = torch.tensor(rows, device=self.dev), self._lens(rows)
        tok = torch.tensor([self.reqs.tokens[r][-1] for r in rows], device=self.dev)
        out = []
        for i in range(k):
            slots = self.alloc.alloc(len(rows), self.dev)
            self.draft.req_to_token_pool.write((idx, lens + i), slots.to(torch.int32))
            fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=len(rows), input_ids=tok, req_pool_indices=idx,
                              seq_lens=lens + i + 1, out_cache_loc=slots, seq_lens_sum=0, positions=lens + i,
                              capture_hidden_mode=CaptureHiddenMode.NULL, **H._runner_fields(self.draft))
            self.draft.attn_backend.init_forward_metadata(fb)
            tok = self.draft.model.forward(tok, lens + i, fb).next_token_logits.argmax(-1)
            out.append(tok)
        return torch.stack(out, 1)

    def plain_step(self, rows: List[int]) -> None:
        idx, lens = torch.tensor(rows, device=self.dev), self._lens(rows)
        last = torch.tensor([self.reqs.tokens[r][-1] for r in rows], device=self.dev)
        draft_forwards = self.draft_forwards
        fb = plain_decode_batch(self.target, req_pool_indices=idx, seq_lens=lens, seq_lens_cpu=lens.cpu(),
                                last_tokens=last, out_cache_loc=self.alloc.alloc(len(rows), self.dev))
        out = self.target.forward(fb)
        runner = self.target.graph_runner
        if out.can_run_graph and runner.forward_mode == ForwardMode.DECODE and \
                self.target.attn_backend.replay_log[-1][0] == ForwardMode.DECODE:
            self.plain_graph_hits += 1
        assert out.logits_output.hidden_states is not None, "a plain step must return hidden states for the draft"
        nxt = out.logits_output.next_token_logits.argmax(-1).tolist()
        self.lag.record(rows, lens.tolist())
        assert self.draft_forwards == draft_forwards, "no draft work on a plain step"
        for r, t in zip(rows, nxt):
            self.reqs.tokens[r].append(t)


def _greedy_reference(cfg: H.HarnessConfig, device: torch.device, lengths: List[int]) -> List[List[int]]:
    """Plain greedy decoding, eager, no speculation, until each request has its final length."""
    mr = H.HarnessModelRunner(cfg, device, speculative=False, model_seed=0)
    reqs = H.make_requests(cfg, cfg.max_reqs, PROMPT, seed=11)
    alloc = H.SlotAllocator(cfg.kv_slots)
    H.prefill(mr, reqs, alloc)
    while True:
        rows = [r for r in range(cfg.max_reqs) if len(reqs.tokens[r]) < lengths[r]]
        if not rows:
            return reqs.tokens
        out = mr.forward(H.decode_batch(mr, reqs, rows, alloc))
        for r, t in zip(rows, out.logits_output.next_token_logits.argmax(-1).tolist()):
            reqs.tokens[r].append(t)


def _sweep(device: torch.device, dtype: torch.dtype) -> None:
    cfg = H.HarnessConfig(dtype=dtype)
    world = SpecWorld(cfg, device)
    switch = SpeculationSwitch(off_above=16, on_at_or_below=8)
    H.sweep_switch(world, switch)
    # Greedy outputs identical to decoding without speculation.
    final = [len(t) for t in world.reqs.tokens]
    assert world.reqs.tokens == _greedy_reference(cfg, device, final)
    # The draft KV: requests still lagging catch up, then equal a fresh draft prefill of every position.
    world.catch_up(list(range(cfg.max_reqs)))
    fresh = H.HarnessModelRunner(cfg, device, speculative=False, model_seed=1)
    alloc = H.SlotAllocator(cfg.kv_slots)
    for r in range(cfg.max_reqs):
        n = world.reqs.kv_len(r)
        fresh.req_to_token_pool.req_to_token[r, :n] = alloc.alloc(n, device).to(torch.int32)
    H.extend(fresh, list(range(cfg.max_reqs)), [0] * cfg.max_reqs,
             [world.reqs.tokens[r][:world.reqs.kv_len(r)] for r in range(cfg.max_reqs)])
    for r in range(cfg.max_reqs):
        n = world.reqs.kv_len(r)
        ours = world.draft.token_to_kv_pool.k_buffer[:, world.target.req_to_token_pool.req_to_token[r, :n].long()]
        want = fresh.token_to_kv_pool.k_buffer[:, fresh.req_to_token_pool.req_to_token[r, :n].long()]
        torch.testing.assert_close(ours, want, atol=1e-9 if dtype == torch.float64 else 1e-4, rtol=0)


def test_switch_sweep_1_to_64_and_back_cpu():
    _sweep(torch.device("cpu"), torch.float64)


@pytest.mark.gpu
def test_switch_sweep_1_to_64_and_back_cuda():
    # float64 so greedy ties cannot differ between the verify and decode kernels' summation orders.
    _sweep(torch.device("cuda"), torch.float64)


def test_plain_decode_batch_records_the_slot_and_advances():
    cfg = H.HarnessConfig(batch_sizes=(1, 2, 4))
    mr = H.HarnessModelRunner(cfg, torch.device("cpu"), speculative=True)
    lens = torch.tensor([5, 9])
    fb = plain_decode_batch(mr, req_pool_indices=torch.tensor([3, 7]), seq_lens=lens, seq_lens_cpu=lens,
                            last_tokens=torch.tensor([11, 12], dtype=torch.int32), out_cache_loc=torch.tensor([40, 41]))
    assert fb.forward_mode == ForwardMode.DECODE and fb.spec_info is None
    assert fb.capture_hidden_mode == CaptureHiddenMode.FULL
    assert fb.seq_lens.tolist() == [6, 10] and fb.positions.tolist() == [5, 9] and fb.input_ids.dtype == torch.int64
    assert mr.req_to_token_pool.req_to_token[3, 5] == 40 and mr.req_to_token_pool.req_to_token[7, 9] == 41
    with pytest.raises(ValueError, match="one row per sequence"):
        plain_decode_batch(mr, req_pool_indices=torch.tensor([3, 7]), seq_lens=lens, seq_lens_cpu=lens,
                           last_tokens=torch.tensor([11]), out_cache_loc=torch.tensor([40, 41]))


@pytest.fixture(autouse=True)
def _fresh_graph_memory_pool():
    H.forget_graph_memory_pool()


def test_the_gate_pause_counts_every_decode_step_so_the_catch_up_covers_it():
    """A pause that starts below the size threshold, runs through a burst above it and ends below it lasts
    ``pause_steps`` decode steps in all (not 256 more after the burst), so the draft lag's window, which the
    pause length matches, still covers every plainly decoded position at the probe's catch-up."""
    switch = SpeculationSwitch(16, 12, min_accept=1.5)
    for _ in range(switch.gate.window):
        assert switch.speculate(4)
        switch.verified(4, 0)  # one committed token per sequence: below break-even, the gate pauses
    lag, plain = DraftLag(keep_hidden=False), 0
    for bs in [32] * 100 + [4] * 1000:
        if switch.speculate(bs):
            break
        lag.record(["r"], [plain])
        plain += 1
    chunk = lag.take(["r"])["r"]
    assert plain == switch.gate.pause_steps == lag.max_steps
    assert chunk.skipped == 0 and chunk.end - chunk.start == plain

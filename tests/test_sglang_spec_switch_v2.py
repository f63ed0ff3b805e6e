"""The spec-v2 speculation switch (SGLang runner API) through a concurrency sweep 1 -> 64 -> 1, at topk 1 and 4.

Speculative steps: the draft proposes a tree (topk children of the last token, then a greedy chain under
the best child; topk 1 gives a chain), the target verifies it in TARGET_VERIFY mode through SGLang
0.5.23's ``_forward_raw`` and the multi-mode runner (tree mask), greedy acceptance (``bench.engine.tree``),
then a draft extend over the committed tokens. Plain steps (batch above the threshold): graphpool's
``plain_decode_batch`` on the slot spec v2 reserved, the target in DECODE mode, and NO draft work; the
lagging draft catches up with one draft extend when speculation resumes. Greedy outputs must equal plain
greedy decoding without speculation, every plain step must replay a DECODE graph, no draft forward may
run on a plain step, and the draft KV must be exactly what a fresh draft prefill computes.
"""
from __future__ import annotations

from typing import List

import pytest
import torch

from tests import sglang_runner_api_harness as R  # noqa: I001  (skips this module under the classic API)
from tests import sglang_harness as H

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.speculative.eagle_info import EagleVerifyInput

from bench.engine.tree import Tree, greedy_accept
from graphpool.integrations.sglang.runner_api import MultiModeDecodeRunner
from graphpool.integrations.sglang.spec_switch_v2 import DraftLag, SpeculationSwitch, plain_decode_batch

PROMPT = 6
DRAFT_STEPS = 3  # tree depth


class SpecV2World:
    """Target (multi-mode runner, SGLang's _forward_raw) + eager draft sharing req_to_token + requests."""

    def __init__(self, cfg: H.HarnessConfig, device: torch.device, topk: int):
        self.cfg, self.dev, self.topk = cfg, device, topk
        self.target = R.RunnerApiModelRunner(cfg, device, speculative=True, model_seed=0, topk=topk)
        self.target.decode_cuda_graph_runner = MultiModeDecodeRunner(self.target)
        self.draft = R.RunnerApiModelRunner(cfg, device, speculative=False, model_seed=1,
                                            server_args=self.target.server_args)
        self.draft.req_to_token_pool = self.target.req_to_token_pool
        self.draft.attn_backend = H.TorchPagedAttention(cfg, self.target.req_to_token_pool, self.draft.token_to_kv_pool)
        self.alloc = H.SlotAllocator(cfg.kv_slots)
        self.reqs = H.make_requests(cfg, cfg.max_reqs, PROMPT, seed=11)
        H.prefill(self.target, self.reqs, self.alloc)
        H.prefill(self.draft, self.reqs, None)
        self.lag = DraftLag(keep_hidden=False)  # the harness draft reads tokens only
        self.plain_graph_hits = 0
        H.count_draft_forwards(self)

    def _lens(self, rows: List[int]) -> torch.Tensor:
        return torch.tensor([self.reqs.kv_len(r) for r in rows], dtype=torch.int64, device=self.dev)

    def catch_up(self, rows: List[int]) -> None:
        gaps = self.lag.take(rows)
        if gaps:  # one draft extend over every lagging request's plainly decoded tokens
            late = sorted(gaps)
            H.extend(self.draft, late, [gaps[r][0] for r in late],
                     [self.reqs.tokens[r][gaps[r][0]:self.reqs.kv_len(r)] for r in late])

    def spec_step(self, rows: List[int]) -> None:
        self.catch_up(rows)
        tree = self._propose(rows)
        n, t = len(rows), self.cfg.draft_tokens
        idx, lens = torch.tensor(rows, device=self.dev), self._lens(rows)
        slots = self.alloc.alloc(n * t, self.dev).view(n, t)
        self.target.req_to_token_pool.write((idx[:, None].expand(n, t), lens[:, None] + torch.arange(t, device=self.dev)), slots.int())
        positions = (lens[:, None] + tree.depth).reshape(-1)
        mask = torch.cat([torch.cat([torch.ones((t, int(length)), dtype=torch.bool, device=self.dev), tree.mask[i]], 1).reshape(-1)
                          for i, length in enumerate(lens.tolist())])
        spec = EagleVerifyInput(
            draft_token=tree.tokens.reshape(-1), custom_mask=mask, positions=positions, retrieve_index=None,
            retrieve_next_token=None, retrieve_next_sibling=None, retrieve_cum_len=None, spec_steps=DRAFT_STEPS,
            topk=self.topk, draft_token_num=t, capture_hidden_mode=CaptureHiddenMode.FULL,
            seq_lens_sum=int(lens.sum()), seq_lens_cpu=lens.cpu())
        fb = ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=n, input_ids=tree.tokens.reshape(-1),
                          req_pool_indices=idx, seq_lens=lens, seq_lens_cpu=lens.cpu(), out_cache_loc=slots.reshape(-1),
                          seq_lens_sum=int(lens.sum()), positions=positions, spec_info=spec,
                          capture_hidden_mode=CaptureHiddenMode.FULL, spec_algorithm=self.target.spec_algorithm)
        out = self.target.forward(fb)
        assert out.can_run_graph and self.target.attn_backend.replay_log[-1][0] == ForwardMode.TARGET_VERIFY
        acc = greedy_accept(tree, out.logits_output.next_token_logits.argmax(-1).view(n, t), DRAFT_STEPS)
        for i, r in enumerate(rows):  # SGLang moves the accepted path's KV to consecutive positions
            k = int(acc.accept_len[i])
            self.target.req_to_token_pool.req_to_token[r, lens[i] + torch.arange(k, device=self.dev)] = slots[i, acc.path[i, :k]].int()
            committed = acc.new_tokens[i, :k].tolist()
            H.extend(self.draft, [r], [int(lens[i])], [[self.reqs.tokens[r][-1]] + committed[:-1]])
            self.reqs.tokens[r].extend(committed)

    def _propose(self, rows: List[int]) -> Tree:
        """Root = the last token; its ``topk`` best draft children; a greedy chain under the best child."""
        n, k = len(rows), self.topk
        idx, lens = torch.tensor(rows, device=self.dev), self._lens(rows)
        root = torch.tensor([self.reqs.tokens[r][-1] for r in rows], device=self.dev)
        tok, chain = root, []
        for d in range(DRAFT_STEPS):
            logits = self._draft_decode(idx, lens + d, tok)
            if d == 0:
                children = logits.topk(k, dim=-1).indices
                tok = children[:, 0]
            else:
                tok = logits.argmax(-1)
                chain.append(tok)
        tokens = torch.cat([root[:, None], children, torch.stack(chain, 1)], 1)
        t = tokens.shape[1]
        assert t == self.cfg.draft_tokens
        parents = torch.tensor([0] + [0] * k + [1] + list(range(k + 1, t - 1)), device=self.dev)
        depth = torch.tensor([0] + [1] * k + list(range(2, DRAFT_STEPS + 1)), device=self.dev)
        mask = torch.eye(t, dtype=torch.bool, device=self.dev)
        for i in range(1, t):
            mask[i] |= mask[int(parents[i])]
        return Tree(tokens, parents.expand(n, t), depth.expand(n, t), mask.expand(n, t, t))

    def _draft_decode(self, idx: torch.Tensor, pos: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        slots = self.alloc.alloc(len(idx), self.dev)  # scratch: the verify records its own slots there
        self.draft.req_to_token_pool.write((idx, pos), slots.to(torch.int32))
        fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=len(idx), input_ids=tok, req_pool_indices=idx,
                          seq_lens=pos + 1, out_cache_loc=slots, seq_lens_sum=0, positions=pos,
                          capture_hidden_mode=CaptureHiddenMode.NULL, **H._runner_fields(self.draft))
        self.draft.attn_backend.init_forward_metadata(fb)
        with H.attention_context(self.draft):
            return self.draft.model.forward(tok, pos, fb).next_token_logits

    def plain_step(self, rows: List[int]) -> None:
        idx, lens = torch.tensor(rows, device=self.dev), self._lens(rows)
        # Spec v2 reserved this slot ahead (eagle_prepare_for_decode); the plain step allocates nothing.
        self.target.req_to_token_pool.write((idx, lens), self.alloc.alloc(len(rows), self.dev).int())
        bonus = torch.tensor([self.reqs.tokens[r][-1] for r in rows], device=self.dev)
        draft_forwards = self.draft_forwards
        fb = plain_decode_batch(self.target, req_pool_indices=idx, seq_lens=lens, seq_lens_cpu=lens.cpu(),
                                bonus_tokens=bonus)
        out = self.target.forward(fb)
        runner = self.target.decode_cuda_graph_runner
        if out.can_run_graph and runner.forward_mode == ForwardMode.DECODE and \
                self.target.attn_backend.replay_log[-1] == (ForwardMode.DECODE, runner.bs):
            self.plain_graph_hits += 1
        assert out.logits_output.hidden_states is not None, "a plain step returns hidden states for the catch-up"
        self.lag.record(rows, lens.tolist())
        assert self.draft_forwards == draft_forwards, "no draft work on a plain step"
        for r, tok in zip(rows, out.logits_output.next_token_logits.argmax(-1).tolist()):
            self.reqs.tokens[r].append(tok)


def _greedy_reference(world: SpecV2World, lengths: List[int]) -> List[List[int]]:
    cfg, dev = world.cfg, world.dev
    mr = R.RunnerApiModelRunner(cfg, dev, speculative=False, model_seed=0, server_args=world.target.server_args)
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


def _sweep(device: torch.device, topk: int) -> SpecV2World:
    cfg = H.HarnessConfig(dtype=torch.float64, draft_tokens=topk + DRAFT_STEPS, max_ctx=320)
    world = SpecV2World(cfg, device, topk)
    switch = SpeculationSwitch(off_above=16, on_at_or_below=8)
    H.sweep_switch(world, switch)
    final = [len(t) for t in world.reqs.tokens]
    assert world.reqs.tokens == _greedy_reference(world, final), "greedy output equals decoding without speculation"
    # The draft KV: requests that were still lagging catch up, then equal a fresh draft prefill.
    world.catch_up(list(range(cfg.max_reqs)))
    fresh = R.RunnerApiModelRunner(cfg, device, speculative=False, model_seed=1, server_args=world.target.server_args)
    alloc = H.SlotAllocator(cfg.kv_slots)
    for r in range(cfg.max_reqs):
        fresh.req_to_token_pool.req_to_token[r, :world.reqs.kv_len(r)] = alloc.alloc(world.reqs.kv_len(r), device).int()
    H.extend(fresh, list(range(cfg.max_reqs)), [0] * cfg.max_reqs,
             [world.reqs.tokens[r][:world.reqs.kv_len(r)] for r in range(cfg.max_reqs)])
    for r in range(cfg.max_reqs):
        n = world.reqs.kv_len(r)
        ours = world.draft.token_to_kv_pool.k_buffer[:, world.target.req_to_token_pool.req_to_token[r, :n].long()]
        want = fresh.token_to_kv_pool.k_buffer[:, fresh.req_to_token_pool.req_to_token[r, :n].long()]
        torch.testing.assert_close(ours, want, atol=1e-9, rtol=0, msg=f"draft KV of request {r}")
    return world


@pytest.mark.parametrize("topk", [1, 4])
def test_switch_sweep_1_to_64_and_back_cpu(topk):
    world = _sweep(torch.device("cpu"), topk)
    assert world.target.decode_cuda_graph_runner.topk == topk


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [1, 4])
def test_switch_sweep_1_to_64_and_back_cuda(topk):
    _sweep(torch.device("cuda"), topk)  # float64: greedy ties cannot differ between verify and decode kernels


def test_plain_decode_batch_uses_the_reserved_slot_and_advances():
    cfg = H.HarnessConfig(batch_sizes=(1, 2, 4))
    mr = R.RunnerApiModelRunner(cfg, torch.device("cpu"), speculative=True)
    mr.req_to_token_pool.req_to_token[3, 5] = 40
    mr.req_to_token_pool.req_to_token[7, 9] = 41
    lens = torch.tensor([5, 9])
    fb = plain_decode_batch(mr, req_pool_indices=torch.tensor([3, 7]), seq_lens=lens, seq_lens_cpu=lens,
                            bonus_tokens=torch.tensor([11, 12], dtype=torch.int32))
    assert fb.forward_mode == ForwardMode.DECODE and fb.spec_info is None
    assert fb.capture_hidden_mode == CaptureHiddenMode.FULL and fb.input_ids.dtype == torch.int64
    assert fb.seq_lens.tolist() == [6, 10] and fb.positions.tolist() == [5, 9] and fb.out_cache_loc.tolist() == [40, 41]
    with pytest.raises(ValueError, match="pass one row each"):
        plain_decode_batch(mr, req_pool_indices=torch.tensor([3, 7]), seq_lens=lens, seq_lens_cpu=lens,
                           bonus_tokens=torch.tensor([11]))


def test_draft_lag_records_first_position_and_hidden_states():
    lag = DraftLag()
    lag.record([3, 5], [10, 20], torch.arange(4.).view(2, 2))
    lag.record([3], [11], torch.tensor([[9., 9.]]))
    got = lag.take([3, 4])
    assert list(got) == [3] and got[3][0] == 10 and got[3][1].tolist() == [[0., 1.], [9., 9.]]
    assert len(lag) == 1 and lag.catch_ups == 1 and lag.take([3]) == {}
    with pytest.raises(ValueError, match="needs the plain step's hidden states"):
        lag.record([1], [1])


@pytest.fixture(autouse=True)
def _fresh_graph_memory_pool():
    H.forget_graph_memory_pool()


def test_installed_switch_routes_steps_on_the_real_eagle_worker_v2(monkeypatch):
    """The wrapper on SGLang's real ``EAGLEWorkerV2.forward_batch_generation``: above the threshold and at
    SGLang's adaptive step 0 a decode step is a plain step; below it the lagging draft catches up first,
    then SGLang's own path runs; prefill is SGLang's. ``uninstall`` restores SGLang's method."""
    from types import SimpleNamespace

    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    from graphpool.integrations.sglang import spec_switch_v2 as v2

    calls = []
    monkeypatch.setattr(EAGLEWorkerV2, "forward_batch_generation", lambda self, batch, **kw: calls.append("sglang"))
    monkeypatch.setattr(v2, "eagle_v2_plain_decode", lambda worker, batch, lag, *_: calls.append("plain"))
    monkeypatch.setattr(v2, "eagle_v2_catch_up", lambda worker, batch, lag: calls.append("catch-up"))
    original = EAGLEWorkerV2.forward_batch_generation
    switch = v2.install_speculation_switch(16, 8)
    try:
        worker = object.__new__(EAGLEWorkerV2)
        worker.speculative_num_steps = 3
        worker.activate_step_by_batch = lambda bs: None

        def step(bs, mode=ForwardMode.DECODE):
            batch = SimpleNamespace(forward_mode=mode, is_extend_in_batch=False, seq_lens=torch.zeros(bs),
                                    spec_info=object())
            EAGLEWorkerV2.forward_batch_generation(worker, batch)
            return calls.pop()

        assert [step(4), step(32), step(12), step(8)] == ["sglang", "plain", "plain", "sglang"]
        assert step(64, ForwardMode.EXTEND) == "sglang" and calls == ["catch-up", "catch-up"]
        worker.speculative_num_steps = 0  # SGLang's adaptive speculation stepped down to 0 drafts
        assert step(2) == "plain" and switch.switches == 2
    finally:
        v2.uninstall_speculation_switch()
    assert EAGLEWorkerV2.forward_batch_generation is original


def test_the_switch_reads_each_request_row_where_this_release_keeps_it():
    """SGLang 0.5.23 moved ``Req.req_pool_idx`` to ``Req.kv.req_pool_idx``; the switch read the old field and a live
    0.5.23 server's scheduler died on the first plain step. Requests bound to their rows by SGLang's own
    ``ReqToTokenPool.alloc`` must read back through graphpool's one reader of moved fields."""
    from graphpool.integrations.sglang import fields
    from graphpool.integrations.sglang import spec_switch_v2 as v2

    rows = [3, 1, 4]
    reqs = R.bound_requests(rows, [[5], [6], [7]])
    assert fields.req_pool_rows(reqs) == rows
    mr = R.RunnerApiModelRunner(H.HarnessConfig(batch_sizes=(1, 2, 4)), torch.device("cpu"), speculative=True)
    lens = torch.tensor([2, 2, 2])
    batch = R.spec_v2_batch(mr, torch.tensor(rows), lens, torch.tensor([5, 6, 7], dtype=torch.int32))
    assert v2.batch_rows(batch) == rows
    view = v2.catch_up_view(batch, [0, 2], [0, 0], [1, 1])
    assert view.req_pool_indices.tolist() == [3, 4]


def test_the_adaptive_routing_alone_says_so_without_a_threshold(caplog):
    """The launcher installs the switch with no threshold when only SGLang's --speculative-adaptive is on; its log line
    said "plain decode above None requests, back on at <= 4611686018427387904" (seen on a live 0.5.23 server)."""
    import logging

    from graphpool.integrations.sglang import spec_switch_v2 as v2

    with caplog.at_level(logging.INFO, logger=v2.__name__):
        v2.install_speculation_switch(None)
    v2.uninstall_speculation_switch()
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "adaptive step 0 as plain steps" in said and "None" not in said and "4611686018427387904" not in said

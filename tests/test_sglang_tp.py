"""Tensor parallelism through graphpool's SGLang integration, on the CPU: two ranks over gloo.

Given the same batches, the two ranks' real speculation switches (and the acceptance gate) make the same
decision every step, and debug mode's cross-rank check passes. A forced disagreement (a batch size, or a gate
fed rank-local acceptance) raises :class:`graphpool.RankDisagreementError` on both ranks, naming each rank's
choice, instead of hanging in the graphs' collectives. A capture that fails on one rank fails on both. And each
runner checks (mode, padded bs, real bs) before every replay.
"""
from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests import sglang_harness as H  # noqa: I001  (puts the test stand-ins on sys.path first)

import graphpool as gp

# Batch sizes of a run of decode steps: crosses off_above 16 upwards and on_at_or_below 8 downwards.
SIZES = [1, 3, 9, 17, 20, 24, 16, 12, 9, 8, 5, 2, 18, 4]


def _rank(rank: int, world: int, init_file: str, results: dict) -> None:
    os.environ["GRAPHPOOL_DEBUG"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from graphpool.integrations.sglang import tp
    from graphpool.integrations.sglang.spec_switch import SpeculationSwitch

    tp.tp_cpu_group = lambda: dist.group.WORLD  # SGLang's TP group's gloo group, as a server's would be
    out: dict = {}
    try:
        # 1. Same batches and the same accepted drafts on both ranks: the same decisions, and the check passes.
        switch = SpeculationSwitch(16, 8, min_accept=1.5, pause_steps=3)
        decisions = []
        for i, bs in enumerate(SIZES):
            spec = switch.speculate(bs)
            decisions.append(spec)
            if spec:
                switch.verified(bs, correct_drafts=bs // 4 if i < 4 else 0)  # acceptance falls: the gate pauses
        gathered: list = [None] * world
        dist.all_gather_object(gathered, decisions)
        out["same"] = gathered
        out["pauses"] = switch.gate.pauses

        # 2. One rank sees another batch size at step 5: both ranks raise, naming both choices.
        switch = SpeculationSwitch(16, 8)
        try:
            for i, bs in enumerate(SIZES):
                switch.speculate(bs + (10 if rank == 1 and i == 4 else 0))
            out["size"] = "no error"
        except gp.RankDisagreementError as exc:
            out["size"] = str(exc)

        # 3. The gate fed rank-local acceptance (what the integration must never do): raised, not hung.
        switch = SpeculationSwitch(16, 8, min_accept=1.5, pause_steps=3)
        try:
            for _ in range(12):
                if switch.speculate(4):
                    switch.verified(4, correct_drafts=8 if rank == 0 else 0)
            out["gate"] = "no error"
        except gp.RankDisagreementError as exc:
            out["gate"] = str(exc)

        # 4. A capture that fails on rank 1 fails on both, with rank 1's reason.
        def capture() -> None:
            if rank == 1:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory capturing verify bs 32")
        try:
            tp.capture_on_every_rank(capture)
            out["capture"] = "no error"
        except gp.CaptureError as exc:
            out["capture"] = str(exc)
    except Exception:  # reported to the test, not lost in a child's stderr
        out["error"] = traceback.format_exc()
    finally:
        results[rank] = out
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_two_ranks_decide_alike_and_a_disagreement_raises_on_both(tmp_path):
    manager = mp.Manager()
    results = manager.dict()
    mp.start_processes(_rank, args=(2, str(tmp_path / "init"), results), nprocs=2, join=True, start_method="spawn")
    r0, r1 = results[0], results[1]
    assert "error" not in r0 and "error" not in r1, r0.get("error") or r1.get("error")
    assert r0["same"][0] == r0["same"][1] and r0["pauses"] == r1["pauses"] >= 1, (r0, r1)
    assert r0["same"][0][3:6] == [False, False, False], "above 16 requests the switch decodes plainly"
    for r in (r0, r1):  # the same error on both ranks, naming each rank's step
        assert "rank 0: step 5 'decode' bs 20" in r["size"] and "rank 1: step 5 'decode' bs 30" in r["size"], r["size"]
        assert "Ranks [1] differ from rank 0" in r["size"]
        assert "tensor-parallel ranks disagree" in r["gate"] and "'target_verify'" in r["gate"] and "'decode'" in r["gate"]
        assert "failed on tensor-parallel rank(s) [1]" in r["capture"] and "OutOfMemoryError" in r["capture"]


def test_each_runner_checks_mode_and_sizes_before_every_replay():
    """The runner's own check, in front of each replay (single process: the agreement stands in)."""
    H.require_api("classic")
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from graphpool.integrations.sglang import MultiModeCudaGraphRunner

    cfg = H.HarnessConfig()
    mr = H.HarnessModelRunner(cfg, torch.device("cpu"), speculative=True)
    mr.graph_runner = MultiModeCudaGraphRunner(mr)
    seen = []

    class Recorder:
        def check(self, what: str, bs: int, real_bs: int) -> None:
            seen.append((what, bs, real_bs))
    mr.graph_runner.tp_check = Recorder()
    reqs = H.make_requests(cfg, cfg.max_reqs, prompt_len=6, seed=0)
    alloc = H.SlotAllocator(cfg.kv_slots)
    H.prefill(mr, reqs, alloc)
    rows = [0, 1, 2]
    mr.forward(H.decode_batch(mr, reqs, rows, alloc))
    drafts = torch.zeros(len(rows), cfg.draft_tokens - 1, dtype=torch.int64)
    mr.forward(H.verify_batch(mr, reqs, rows, drafts, alloc))
    padded = mr.graph_runner.pool.route("decode", 3)
    assert seen == [("decode", padded, 3), ("target_verify", mr.graph_runner.pool.route("target_verify", 3), 3)], seen
    assert ForwardMode.DECODE in mr.graph_runner.tokens_per_mode

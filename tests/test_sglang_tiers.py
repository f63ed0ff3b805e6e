"""Speculation tiers over one pool per target model, against SGLang's real classes (runner API, 0.5.14 to 0.5.23).

Oracles: SGLang's own ``EAGLEWorkerV2.init_cuda_graphs``, ``build_adaptive_runtime_state`` and ``apply_runtime_state``
on a worker whose draft side is a stand-in (the draft model never runs here), SGLang's ``ModelRunner._forward_raw``
routing each step to the active tier's runner, SGLang's ``AdaptiveSpeculativeParams`` and per-decode KV reservation,
``ServerArgs`` with its CLI parser and resolution; eager execution of the same steps. Each test fails without its part:
the one pool (4a), the tier states with the table's draft tokens, the reservation of the largest tier, the launcher's
refusals (4b).
"""
from __future__ import annotations

import contextlib
import json
import logging
import re
from types import SimpleNamespace

import pytest
import torch

from tests import sglang_runner_api_harness as R  # noqa: I001  (skips this module under the classic API)
from tests import sglang_harness as H

from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

from graphpool.integrations import sglang as gp_sglang
from graphpool.integrations.sglang import spec_switch_v2, spec_tiers
from graphpool.integrations.sglang.launch import GraphpoolOptions, check_server_args, split_args
from graphpool.integrations.sglang.patch_runner_api import DecodeRunnerFactory, target_graphs
from graphpool.integrations.sglang.runner_api import MultiModeDecodeRunner
from graphpool.integrations.sglang.tier_table import TierTable

#: (device, tolerance): the eager twin in float64 (CI), and real CUDA graphs in float32 (the GPU machine).
DEVICES = [("cpu", 1e-9), pytest.param(("cuda", 2e-4), marks=pytest.mark.gpu)]
TABLE = TierTable.parse("4x3:8@1,4x2:6@2,4x1:4@4/3")


@pytest.fixture(autouse=True)
def _clean():
    H.forget_graph_memory_pool()
    yield
    spec_tiers.uninstall_speculation_tiers()
    spec_switch_v2.uninstall_speculation_switch()
    gp_sglang.uninstall()


def _captures(caplog) -> dict:
    """How many times each mode's graphs were captured (graphpool's capture log lines)."""
    counts: dict = {}
    for record in caplog.records:
        found = re.match(r"graphpool captured \d+ graphs for \[([^\]]*)\]", record.getMessage())
        for mode in re.findall(r"'([^']+)'", found.group(1)) if found else ():
            counts[mode] = counts.get(mode, 0) + 1
    return counts


def _config(device: str, **fields) -> H.HarnessConfig:
    return H.HarnessConfig(dtype=torch.float64 if device == "cpu" else torch.float32, **fields)


def _target(cfg: H.HarnessConfig, device: str = "cpu", **publish) -> R.RunnerApiModelRunner:
    args = R.publish(cfg, speculative=True, **publish)
    return R.RunnerApiModelRunner(cfg, torch.device(device), speculative=True, topk=args.speculative_eagle_topk,
                                  server_args=args)


def _worker(target: R.RunnerApiModelRunner) -> EAGLEWorkerV2:
    """SGLang's ``EAGLEWorkerV2`` (its own methods) over the harness target; the draft side is attributes only."""
    def nothing(*args, **kwargs):
        return None

    runner = SimpleNamespace(draft_attn_backend=None, attn_backend=None, tp_group=None)
    draft = SimpleNamespace(
        speculative_num_steps=target.server_args.speculative_num_steps, draft_attn_backend=None,
        speculative_num_draft_tokens=target.server_args.speculative_num_draft_tokens, draft_extend_attn_backend=None,
        draft_runner=runner, cuda_graph_runner=None, cuda_graph_runner_for_draft_extend=None, init_cuda_graphs=nothing,
        init_attention_backend=nothing, _capture_cuda_graphs=nothing, _rebuild_topk1_chain_buffers=nothing)
    # The draft's tensor-parallel scope, as each release keeps it (one TP rank: no group to switch to).
    if _import("sglang.srt.speculative.draft_parallel") is not None:  # 0.5.23: a resolved parallel layout
        draft.parallel_layout = SimpleNamespace(tp_group=None, disable_cp=False)
    else:  # 0.5.14 to 0.5.17: the draft worker's own context, by its TP group
        draft.draft_tp_context = lambda group: contextlib.nullcontext()
    worker = EAGLEWorkerV2.__new__(EAGLEWorkerV2)
    worker.__dict__.update(
        topk=target.server_args.speculative_eagle_topk, speculative_num_steps=draft.speculative_num_steps,
        speculative_num_draft_tokens=draft.speculative_num_draft_tokens, _draft_worker=draft,
        _target_worker=SimpleNamespace(model_runner=target), device=target.device.type, gpu_id=0,
        server_args=target.server_args,
        adaptive_controller=None, _additional_graph_memory_usage={}, _additional_graph_time_usage={})
    if not isinstance(getattr(EAGLEWorkerV2, "draft_worker", None), property):  # a property over _draft_worker in 0.5.2x
        worker.draft_worker = draft
    return worker


def _steps(mr: R.RunnerApiModelRunner, reqs: H.Requests, alloc: H.SlotAllocator, plan, seed: int):
    """Run ``plan`` (width, rows) per step: width 1 a DECODE step, else a TARGET_VERIFY step of that many tokens;
    returns each step's (graph ran, logits). ``before(width)`` runs first: the tier choice of the tiered world."""
    gen, out = torch.Generator().manual_seed(seed), []
    for width, rows, before in plan:
        before()
        if width == 1:
            fb = H.decode_batch(mr, reqs, rows, alloc)
        else:
            fb = H.verify_batch(mr, reqs, rows, torch.randint(0, mr.cfg.vocab, (len(rows), width - 1), generator=gen),
                                alloc)
        result = mr.forward(fb)
        out.append((result.can_run_graph, result.logits_output.next_token_logits.clone()))
        for r in rows:
            reqs.tokens[r].append(int(torch.randint(0, mr.cfg.vocab, (1,), generator=gen)))
    return out


def _against_eager(cfg: H.HarnessConfig, tiered: R.RunnerApiModelRunner, plan, atol: float, **publish) -> None:
    """The tiered world's steps equal the same steps run eagerly (a target without graphs), each on a graph."""
    eager = _target(cfg, tiered.device.type, **publish)
    worlds = []
    for mr, choose in ((tiered, True), (eager, False)):
        reqs = H.make_requests(cfg, 8, prompt_len=6, seed=3)
        alloc = H.SlotAllocator(cfg.kv_slots)
        H.prefill(mr, reqs, alloc)
        worlds.append(_steps(mr, reqs, alloc, [(w, rows, b if choose else (lambda: None)) for w, rows, b in plan], 5))
    for i, ((graph, logits), (ran_eager, want)) in enumerate(zip(*worlds)):
        assert graph and not ran_eager, f"step {i} ({plan[i][0]} tokens, bs {len(plan[i][1])}) ran eagerly"
        torch.testing.assert_close(logits, want, atol=atol, rtol=0, msg=f"step {i}")


# ----------------------------------------------------------------------------------------- 4b: graphpool's tiers
@pytest.mark.parametrize("setup", DEVICES)
def test_tier_states_are_sglangs_own_with_the_tables_draft_tokens_over_one_pool(caplog, setup):
    """graphpool builds each tier's state with SGLang's own build_adaptive_runtime_state, with the table's draft tokens
    at topk 4 (SGLang's adaptive mode passes steps + 1, and refuses topk > 1); every tier's target runner is a view of
    one pool, whose DECODE graphs were captured once; the schedule's choice swaps the states in with SGLang's
    apply_runtime_state, and every tier's verify steps and the plain steps equal eager execution."""
    device, atol = setup
    cfg = _config(device, batch_sizes=(1, 2, 4, 8), draft_tokens=8)
    target = _target(cfg, device, topk=4)
    gp_sglang.install()
    choice = spec_tiers.install_speculation_tiers(TABLE, every=1)
    with caplog.at_level(logging.INFO, logger="graphpool"):
        target.decode_cuda_graph_runner = DecodeRunnerFactory(type(None))(target)  # what SGLang builds at start-up
        worker = _worker(target)
        worker.init_cuda_graphs()  # SGLang's own, wrapped: the tier states are built after it
    states = choice.states
    assert [(s.speculative_num_steps, s.speculative_num_draft_tokens) for s in states] == [(3, 8), (2, 6), (1, 4)]
    runners = [s.target_graph_runner for s in states]
    assert all(isinstance(r, MultiModeDecodeRunner) and r.shared is target_graphs(target) for r in runners)
    assert [r.speculative_num_draft_tokens for r in runners] == [8, 6, 4]
    assert _captures(caplog) == {"DECODE": 1, "TARGET_VERIFY_4x3:8": 1, "TARGET_VERIFY_4x2:6": 1,
                                 "TARGET_VERIFY_4x1:4": 1}
    pool = runners[0].pool
    # Each tier's verify graphs at the batch sizes it serves: the buffers hold the largest of those keys alone.
    assert pool.batch_sizes == {"decode": (1, 2, 4, 8), "target_verify_4x3:8": (1,), "target_verify_4x2:6": (1, 2),
                                "target_verify_4x1:4": (1, 2, 4)}
    assert pool.static_inputs["input_ids"].shape[0] == max(8 * 1, 1 * 8, 2 * 6, 4 * 4)
    if device == "cuda":  # every tier's graphs and the DECODE graphs in SGLang's one graph memory pool
        from sglang.srt.model_executor.runner_utils import pool as sglang_pool

        assert pool.memory_pool is sglang_pool.get_global_graph_memory_pool() is not None
        print({mode: pool.stats.mode_bytes(mode) / 2**20 for mode in pool.modes}, "MiB of graphs by mode")

    def tier(bs):  # the schedule's choice, as the worker's forward asks it
        return lambda: choice.speculate(worker, bs)

    plan = [(8, [0], tier(1)), (6, [0, 1], tier(2)), (4, [0, 1, 2], tier(3)), (1, [0, 1, 2, 3, 4], tier(5)),
            (1, [0, 1, 2, 3], tier(4)), (4, [0, 1, 2], tier(3)), (8, [0], tier(1)), (4, [1, 2, 3, 5], tier(4)),
            (6, [2, 3], tier(2)), (1, [0, 1, 2, 3, 4, 5, 6], tier(7))]
    _against_eager(cfg, target, plan, atol, topk=4)
    assert choice.schedule.switches == 8 and choice.plain_steps == 3


def test_the_kv_reservation_is_the_largest_tiers_at_every_tier():
    """SGLang's scheduler reserves each decode step's KV slots before the worker picks the step's tier, by the running
    state (max(steps * topk, draft tokens)): after a change to a shorter tier its reservation shrinks, and a change
    back would draft 12 slots into 8 reserved. Under the tiers it is the first (largest) tier's at every tier."""
    from sglang.srt.speculative.adaptive_runtime_state import SpecRuntimeState

    module = next(m for m in map(_import, spec_tiers._ALLOCATION_MODULES) if hasattr(m, "get_alloc_reserve_per_decode"))
    cfg = _config("cpu", batch_sizes=(1, 2, 4), draft_tokens=8)
    target = _target(cfg, topk=4)
    worker = _worker(target)

    def shortest_tier():
        EAGLEWorkerV2.apply_runtime_state(worker, SpecRuntimeState(1, 4, None, None, target.attn_backend, None, None,
                                                                   None))

    largest = module.get_alloc_reserve_per_decode()
    assert largest == 2 * max(3 * 4, 8)
    shortest_tier()
    if module.get_alloc_reserve_per_decode() == largest:  # 0.5.17 reads its start-up record, whatever state runs
        pytest.skip("this SGLang reserves by its start-up settings at every state: the largest tier's already")
    # SGLang's own: by the running state (0.5.18 also lowers its draft-token bound to the state's: 2 * max(1 * 4, 4))
    assert module.get_alloc_reserve_per_decode() in (2 * max(1 * 4, 8), 2 * max(1 * 4, 4)), "by the running state"
    # Installed at the first tier (as the tiers' set-up does), the reservation stays the largest tier's.
    EAGLEWorkerV2.apply_runtime_state(worker, SpecRuntimeState(3, 8, None, None, target.attn_backend, None, None, None))
    spec_tiers._wrap_the_reservation()
    spec_tiers._reserve_for_the_largest_tier()
    shortest_tier()
    assert module.get_alloc_reserve_per_decode() == largest


def _import(name):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def test_each_verify_steps_acceptance_is_counted_for_its_tier(caplog):
    """The scheduler's processed result of a verify step (per-request accepted drafts on the host) counts for the tier
    the step ran, even when processed after the next step chose another (SGLang's overlap scheduler); the first step
    after each change is logged with the tier's most; the schedule hears each step's mean."""
    choice = spec_tiers.TierChoice(TABLE, every=1)
    worker = SimpleNamespace(apply_runtime_state=lambda state: None)
    choice.states = [None] * 3
    results = []
    with caplog.at_level(logging.INFO, logger="graphpool"):
        for bs, drafts in ((1, [3]), (3, [1, 1, 0]), (2, [2, 2])):
            assert choice.speculate(worker, bs)
            result = SimpleNamespace()
            choice.ran(worker, result)
            result.num_correct_drafts_per_req_cpu = drafts
            results.append(result)
        assert not choice.speculate(worker, 5)  # plain decode above 4
        for result in results:  # processed late: each counts for its own tier
            choice.processed(None, result)
    said = [r.getMessage() for r in caplog.records]
    assert choice.stats["4x3:8"].at_most == 1 and choice.stats["4x1:4"].steps == 1 and \
        choice.stats["4x1:4"].at_most == 0 and choice.stats["4x2:6"].at_most == 1
    assert "graphpool tiers: first verify step at 4x1:4 after a change: 1.67 tokens per request (at most 2)" in said
    assert said[-1] == ("graphpool tiers: verify steps (at their tier's most/all) 4x3:8=1/1 4x2:6=1/1 4x1:4=0/1; "
                        "plain steps 1; tier changes 3")
    assert "graphpool tiers: 4x2:6 -> decode at 5 running requests" in said


# ----------------------------------------------------------------------------------------- 4a: SGLang's adaptive
@pytest.mark.parametrize("setup", DEVICES)
def test_sglangs_adaptive_states_share_one_pool_and_step0_has_no_verify_graph(tmp_path, caplog, setup):
    """SGLang's --speculative-adaptive builds a target runner per step count (its init_states, through the name
    graphpool's install() replaced): each is a view of the target's one pool, which the first runner sized from SGLang's
    own candidate steps; the DECODE graphs are captured once, each speculating state's verify graphs once, at the batch
    sizes SGLang prunes them to; step 0 (graphpool's plain steps) gets no verify graph. Verify steps of both widths
    and plain steps equal eager execution."""
    config = tmp_path / "adaptive.json"
    config.write_text(json.dumps({"1": {"candidate_steps": [3]}, "2": {"candidate_steps": [1]},
                                  "4": {"candidate_steps": [0]}}))
    device, atol = setup
    cfg = _config(device, batch_sizes=(1, 2, 4, 8), draft_tokens=4)
    target = _target(cfg, device, adaptive=True, adaptive_config=str(config))
    gp_sglang.install()
    spec_switch_v2.install_speculation_switch(None)  # the launcher's adaptive step-0 routing
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

    params = AdaptiveSpeculativeParams(3, str(config))
    params.set_cuda_graph_bs(list(cfg.batch_sizes))
    with caplog.at_level(logging.INFO, logger="graphpool"):
        first = target.decode_cuda_graph_runner = DecodeRunnerFactory(type(None))(target)  # SGLang's start-up runner
        worker = _worker(target)
        # What SGLang's AdaptiveController.init_states does for each other candidate step count.
        tiers = {steps: worker.build_adaptive_runtime_state(steps, steps + 1, params.cuda_graph_bs_for_step(steps))
                 .target_graph_runner for steps in (1, 0)}
    runners = [first, tiers[1], tiers[0]]
    assert all(r.shared is first.shared for r in runners)
    assert _captures(caplog) == {"DECODE": 1, "TARGET_VERIFY_1x3:4": 1, "TARGET_VERIFY_1x1:2": 1}
    assert first.pool.batch_sizes == {"decode": (1, 2, 4, 8), "target_verify_1x3:4": (1,), "target_verify_1x1:2": (2,)}
    assert ForwardMode.TARGET_VERIFY not in tiers[0].tokens_per_mode  # step 0: plain steps, no verify graph

    def active(runner):
        return lambda: setattr(target, "decode_cuda_graph_runner", runner)

    plan = [(4, [0], active(first)), (2, [0, 1], active(tiers[1])), (1, [0, 1, 2, 3], active(tiers[0])),
            (1, [0, 1], active(tiers[1])), (4, [2], active(first)), (1, [0, 1, 2, 3, 4, 5], active(tiers[0]))]
    _against_eager(cfg, target, plan, atol, adaptive=True, adaptive_config=str(config))


# ----------------------------------------------------------------------------------------- the launcher
def _cli(*flags):
    return R.server_args_from_cli("--model-path", "dummy", "--device", "cpu", *flags)


SHAPE = ("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "dummy",
         "--speculative-eagle-topk", "4", "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "8")


def test_the_launcher_refuses_what_tiers_cannot_serve_naming_the_fix():
    """Refused in the launcher process, before SGLang loads anything: tables that cannot hold, other switches beside
    the tiers, SGLang's own adaptive mode (a second chooser), a server shape other than the first tier's (named with
    the flags to pass), setups the worker or graphpool's runner does not serve."""
    options, rest = split_args(["--graphpool-tiers", str(TABLE), "--model-path", "m"])
    assert options == GraphpoolOptions(tiers=TABLE) and rest == ["--model-path", "m"]
    for table, why in (("4x3:8@2,4x2:6@1", "bounds must rise"), ("4x3:8@2/3", "hysteresis cannot hold"),
                       ("4x3:8@1,2x2:4@2", "every tier drafts the server's --speculative-eagle-topk"),
                       ("4x3:8@1,4x3:6@2", "steps must fall"), ("4x1:8@1", r"1 \+ topk \+ \(steps - 1\) \* topk\^2 = 5"),
                       ("1x3:3@1", "write 1x3:4"), ("4x3:8", "cannot read tier"), ("4x2:8@1,4x1:9@2", "= 5")):
        with pytest.raises(SystemExit, match=why):
            split_args(["--graphpool-tiers", table])
    with pytest.raises(SystemExit, match="takes no --graphpool-spec-off-above"):
        split_args(["--graphpool-tiers", str(TABLE), "--graphpool-spec-off-above", "4"])
    good = _cli(*SHAPE)
    check_server_args(GraphpoolOptions(tiers=TABLE), good)
    for flags, why in (((*SHAPE, "--speculative-adaptive"), "drop --speculative-adaptive"),
                       ((*SHAPE[:-1], "6"), "pass --speculative-eagle-topk 4 --speculative-num-steps 3 "
                                            "--speculative-num-draft-tokens 8"),
                       ((*SHAPE, "--pp-size", "2"), "pipeline parallelism")):
        args = _cli(*flags)
        if args is None:  # a flag this SGLang does not have
            continue
        getattr(args, "resolve_once", lambda: None)()
        with pytest.raises(SystemExit, match=why):
            check_server_args(GraphpoolOptions(tiers=TABLE), args)
    with pytest.raises(SystemExit, match="first tier .* must be the server's own speculation shape"):
        check_server_args(GraphpoolOptions(tiers=TierTable.parse("4x2:8@1,4x1:4@2")), good)

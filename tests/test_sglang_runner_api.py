"""MultiModeDecodeRunner (SGLang 0.5.14+ runner API) against eager execution, through SGLang's own routing.

A random sequence of DECODE and TARGET_VERIFY steps at random batch sizes is routed by SGLang 0.5.14+'s
``ModelRunner._forward_raw`` (``decode_cuda_graph_runner.can_run_graph`` then ``execute``) twice: once
into the multi-mode runner, once eagerly (no graph runner). Every output and the final KV caches agree.
Skipped, with the reason, when the installed SGLang has the classic API.
"""
from __future__ import annotations

import inspect
import random

import pytest
import torch

from tests import sglang_runner_api_harness as R  # noqa: I001  (skips this module under the classic API)
from tests import sglang_harness as H

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.model_executor.runner import decode_cuda_graph_runner as sglang_decode

from graphpool.integrations import sglang as gp_sglang
from graphpool.integrations.sglang import versions
from graphpool.integrations.sglang.patch_runner_api import DecodeRunnerFactory
from graphpool.integrations.sglang.runner_api import MultiModeDecodeRunner


def _random_steps(cfg: H.HarnessConfig, n_steps: int, seed: int):
    """(forward mode, rows) per step: random mode, random batch of distinct requests."""
    rng = random.Random(seed)
    return [(rng.choice([ForwardMode.DECODE, ForwardMode.TARGET_VERIFY]),
             sorted(rng.sample(range(cfg.max_reqs), rng.randint(1, max(cfg.batch_sizes))))) for _ in range(n_steps)]


def _run_step(mr, reqs, alloc, mode, rows, gen):
    """Build the step (the same tokens in every world, from ``gen``), run it, commit one token per row."""
    if mode == ForwardMode.DECODE:
        fb = H.decode_batch(mr, reqs, rows, alloc)
    else:
        drafts = torch.randint(0, mr.cfg.vocab, (len(rows), mr.cfg.draft_tokens - 1), generator=gen)
        fb = H.verify_batch(mr, reqs, rows, drafts, alloc)
    out = mr.forward(fb)
    for r in rows:
        reqs.tokens[r].append(int(torch.randint(0, mr.cfg.vocab, (1,), generator=gen)))
    return out


def _world(cfg: H.HarnessConfig, device: torch.device, graphs: bool, topk: int = 1) -> R.RunnerApiModelRunner:
    mr = R.RunnerApiModelRunner(cfg, device, speculative=True, topk=topk)
    if graphs:
        mr.decode_cuda_graph_runner = MultiModeDecodeRunner(mr)
    return mr


def _drive(mr, steps, seed):
    cfg = mr.cfg
    reqs = H.make_requests(cfg, cfg.max_reqs, prompt_len=6, seed=seed)
    alloc = H.SlotAllocator(cfg.kv_slots)
    H.prefill(mr, reqs, alloc)
    gen = torch.Generator().manual_seed(seed)
    return [(out.can_run_graph, out.logits_output.next_token_logits.clone(), out.logits_output.hidden_states.clone())
            for out in (_run_step(mr, reqs, alloc, mode, rows, gen) for mode, rows in steps)]


def _check_against_eager(device: torch.device, atol: float, n_steps: int = 40) -> R.RunnerApiModelRunner:
    cfg = H.HarnessConfig(dtype=torch.float64 if device.type == "cpu" else torch.float32)
    steps = _random_steps(cfg, n_steps, seed=1)
    graph, eager = _world(cfg, device, graphs=True), _world(cfg, device, graphs=False)
    got, want = _drive(graph, steps, seed=2), _drive(eager, steps, seed=2)
    runner = graph.decode_cuda_graph_runner
    for i, ((ran_graph, logits, hidden), (ran_eager, e_logits, e_hidden)) in enumerate(zip(got, want)):
        mode, rows = steps[i]
        assert ran_graph and not ran_eager, f"step {i} ({mode.name}, bs={len(rows)}): graph {ran_graph}, eager {ran_eager}"
        assert logits.shape == e_logits.shape == (len(rows) * runner.tokens_per_mode[mode], cfg.vocab)
        torch.testing.assert_close(logits, e_logits, atol=atol, rtol=0, msg=f"step {i} {mode.name} logits")
        torch.testing.assert_close(hidden, e_hidden, atol=atol, rtol=0, msg=f"step {i} {mode.name} hidden")
    torch.testing.assert_close(graph.token_to_kv_pool.k_buffer[:, 1:], eager.token_to_kv_pool.k_buffer[:, 1:],
                               atol=atol, rtol=0)  # every slot but the dummy slot 0 that padded rows write
    assert [m for m, _ in graph.attn_backend.replay_log] == [m for m, _ in steps], "each step planned in its own mode"
    assert [bs for _, bs in graph.attn_backend.replay_log] == [runner.pool.route(
        "decode" if m == ForwardMode.DECODE else "target_verify", len(r)) for m, r in steps]
    return graph


def test_random_decode_and_verify_steps_through_forward_raw_equal_eager_cpu():
    graph = _check_against_eager(torch.device("cpu"), atol=1e-10)
    runner = graph.decode_cuda_graph_runner
    assert runner.pool.backend.name == "eager"
    assert graph.attn_backend.graph_state_inits == [(64, 64 * 4)], "graph state: once, sized for the largest mode"
    assert runner.capture_bs == list(graph.cfg.batch_sizes), "SGLang's own get_batch_sizes_to_capture"


@pytest.mark.gpu
def test_random_decode_and_verify_steps_through_forward_raw_equal_eager_cuda():
    from sglang.srt.model_executor.runner_utils import pool as sglang_pool

    graph = _check_against_eager(torch.device("cuda"), atol=2e-4, n_steps=60)
    runner = graph.decode_cuda_graph_runner
    assert runner.pool.backend.name == "cuda"
    assert sglang_pool.get_global_graph_memory_pool() is runner.pool.memory_pool
    assert len(runner.graphs) == 2 * len(runner.capture_bs)


def test_signatures_match_sglang_decode_cuda_graph_runner():
    ours, theirs = MultiModeDecodeRunner, sglang_decode.DecodeCudaGraphRunner
    for name in ("__init__", "can_run_graph", "load_batch", "execute", "capture", "get_spec_info"):
        got, want = inspect.signature(getattr(ours, name)), inspect.signature(getattr(theirs, name))
        got_params = [(p.name, p.kind, p.default) for p in got.parameters.values()]
        want_params = [(p.name, p.kind, p.default) for p in want.parameters.values()]
        # Equal to this SGLang's; an older release (0.5.14 has no record_nolora_graph) may lack trailing
        # keyword-only parameters with defaults that a newer one passes.
        extra = got_params[len(want_params):]
        assert got_params[:len(want_params)] == want_params, f"{name}: {got} != {want}"
        assert all(kind == inspect.Parameter.KEYWORD_ONLY and default is not inspect.Parameter.empty
                   for _, kind, default in extra), f"{name}: {got} adds {extra}"
    new = inspect.signature(theirs.__init__).parameters
    assert "record_nolora_graph" in new or versions.sglang_version().startswith("0.5.1"), "0.5.2x passes it"
    assert ours.decode_graph_gather_requirements(None) == (False, False)


def test_spec_v2_split_load_batch_then_execute():
    """Spec v2 calls can_run_graph and load_batch on the plan stream, marks the batch planned, then
    _forward_raw calls execute, which only re-stages the inputs."""
    cfg = H.HarnessConfig(batch_sizes=(1, 2, 4, 8))
    mr, eager = _world(cfg, torch.device("cpu"), graphs=True), _world(cfg, torch.device("cpu"), graphs=False)
    runner = mr.decode_cuda_graph_runner
    reqs = H.make_requests(cfg, cfg.max_reqs, prompt_len=6, seed=5)
    for world in (mr, eager):
        H.prefill(world, reqs, H.SlotAllocator(cfg.kv_slots))
    drafts = torch.randint(0, cfg.vocab, (3, cfg.draft_tokens - 1), generator=torch.Generator().manual_seed(0))
    fb = H.verify_batch(mr, reqs, [0, 1, 2], drafts, H.SlotAllocator(cfg.kv_slots))
    assert runner.can_run_graph(fb)
    runner.load_batch(fb)
    fb.mark_forward_metadata_ready()
    assert (runner.bs, runner.raw_bs, runner.raw_num_token) == (4, 3, 12)
    planned = len(mr.attn_backend.replay_log)
    out = mr.forward(fb)
    assert out.can_run_graph and len(mr.attn_backend.replay_log) == planned, "execute did not plan again"
    want = eager.forward(H.verify_batch(eager, reqs, [0, 1, 2], drafts, H.SlotAllocator(cfg.kv_slots)))
    torch.testing.assert_close(out.logits_output.next_token_logits, want.logits_output.next_token_logits,
                               atol=1e-10, rtol=0)


def test_can_run_graph_rejects_what_no_graph_serves():
    cfg = H.HarnessConfig(batch_sizes=(1, 2, 4))
    mr = _world(cfg, torch.device("cpu"), graphs=True)
    runner = mr.decode_cuda_graph_runner
    reqs = H.make_requests(cfg, cfg.max_reqs, prompt_len=6, seed=6)
    alloc = H.SlotAllocator(cfg.kv_slots)
    H.prefill(mr, reqs, alloc)
    assert runner.can_run_graph(H.decode_batch(mr, reqs, [0, 1, 2], alloc))
    assert not runner.can_run_graph(H.decode_batch(mr, reqs, list(range(5)), alloc)), "bs above the largest graph"
    fb = H.decode_batch(mr, reqs, [0, 1], alloc, input_ids=torch.zeros(8, dtype=torch.int64))
    assert not runner.can_run_graph(fb), "a DECODE step carries one token per sequence"
    fb = H.decode_batch(mr, reqs, [0, 1], alloc)
    fb.capture_hidden_mode = CaptureHiddenMode.LAST
    assert not runner.can_run_graph(fb), "hidden states the DECODE graphs were not captured with"


@pytest.mark.parametrize("backend", ["breakable", "tc_piecewise"])
def test_unserved_decode_graph_backends_are_refused_with_the_reason(backend):
    cfg = H.HarnessConfig(batch_sizes=(1, 2))
    mr = _world(cfg, torch.device("cpu"), graphs=False)
    mr.server_args = R.publish(cfg, speculative=True, decode_backend=backend)
    with pytest.raises(ValueError, match=f"decode graph backend '{backend}' of --cuda-graph-config \\(it "):
        MultiModeDecodeRunner(mr)


def test_install_swaps_the_runner_sglang_builds_and_hands_refused_setups_back(monkeypatch):
    from sglang.srt.speculative import eagle_worker_v2

    original = sglang_decode.DecodeCudaGraphRunner
    gp_sglang.install()
    try:
        gp_sglang.install()  # idempotent
        assert gp_sglang.installed()
        for module in (sglang_decode, eagle_worker_v2):
            assert isinstance(module.DecodeCudaGraphRunner, DecodeRunnerFactory)
        factory = sglang_decode.DecodeCudaGraphRunner
        if hasattr(original, "decode_graph_gather_requirements"):  # 0.5.2x asks the class; 0.5.14 does not
            assert factory.decode_graph_gather_requirements == original.decode_graph_gather_requirements
        cfg = H.HarnessConfig(batch_sizes=(1, 2))
        mr = _world(cfg, torch.device("cpu"), graphs=False)
        assert isinstance(factory(mr, speculative_num_draft_tokens=cfg.draft_tokens), MultiModeDecodeRunner)
        built = []
        monkeypatch.setattr(factory, "sglang_class", lambda m, **kw: built.append(kw) or "sglang")
        mr.server_args.enable_two_batch_overlap = True
        assert factory(mr, attn_backend=None) == "sglang" and built == [{"attn_backend": None}]
    finally:
        gp_sglang.uninstall()
    assert not gp_sglang.installed() and sglang_decode.DecodeCudaGraphRunner is original


def test_classic_runner_says_which_api_is_installed():
    with pytest.raises(ImportError, match="needs the classic graph-runner API .* has the runner API"):
        gp_sglang.MultiModeCudaGraphRunner


@pytest.fixture(autouse=True)
def _fresh_graph_memory_pool():
    H.forget_graph_memory_pool()



def test_launcher_installs_the_runner_api_patch_and_spec_v2_switch():
    """What the launcher's scheduler entry point runs in each scheduler process, under the runner API;
    and the surfaces of SGLang 0.5.23 it relies on (read from the installed source: importing the HTTP
    server needs uvloop, which CI does not install)."""
    import ast
    import importlib.util

    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    from graphpool.integrations.sglang import spec_switch_v2
    from graphpool.integrations.sglang.launch import GraphpoolOptions, check_server_args

    original = EAGLEWorkerV2.forward_batch_generation
    try:
        GraphpoolOptions(16, 8).apply()
        assert isinstance(sglang_decode.DecodeCudaGraphRunner, DecodeRunnerFactory)
        assert EAGLEWorkerV2.forward_batch_generation.graphpool_switch.policy.off_above == 16
    finally:
        spec_switch_v2.uninstall_speculation_switch()
        gp_sglang.uninstall()
    assert EAGLEWorkerV2.forward_batch_generation is original
    args = type("Args", (), {"speculative_algorithm": "EAGLE3", "disable_overlap_schedule": False})()
    check_server_args(GraphpoolOptions(16), args)  # spec v2 runs with the overlap scheduler
    source = open(importlib.util.find_spec("sglang.srt.entrypoints.http_server").origin).read()
    launch = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "launch_server")
    assert "run_scheduler_process_func" in [a.arg for a in launch.args.args]

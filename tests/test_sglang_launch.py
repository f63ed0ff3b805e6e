"""install()/uninstall() on the real SGLang modules, and the launcher's spawn-safe scheduler entry."""
from __future__ import annotations

import ast
import importlib.util
import multiprocessing as mp
import pickle

import pytest
import torch

from tests import sglang_harness as H  # noqa: I001  (puts the test stand-ins on sys.path first)

H.require_api("classic")  # the runner API (SGLang 0.5.14+) has its own tests

from sglang.srt.model_executor import cuda_graph_runner, model_runner

from graphpool.integrations import sglang as gp_sglang
from graphpool.integrations.sglang.launch import GraphpoolOptions, SchedulerEntry, check_server_args, split_args
from graphpool.integrations.sglang.patch import build_graph_runner
from graphpool.integrations.sglang.spec_switch import switch_support_problem

# The classic switch follows the EAGLE v1 worker of each classic release (0.5.9 to 0.5.12.x); it refuses others
# (0.5.13.x, classic runner API without an EAGLE v1 worker, among them).
needs_switch = pytest.mark.skipif(switch_support_problem() is not None,
                                  reason="the speculation switch refuses this SGLang (tested below)")


def test_install_swaps_the_runner_model_runner_builds_and_uninstall_restores():
    original = model_runner.CudaGraphRunner
    assert original is cuda_graph_runner.CudaGraphRunner
    gp_sglang.install()
    try:
        gp_sglang.install()  # idempotent
        assert gp_sglang.installed() and model_runner.CudaGraphRunner is build_graph_runner
        # The draft runners' name is untouched: they call SGLang's CudaGraphRunner.capture unbound.
        assert cuda_graph_runner.CudaGraphRunner is original
        # What init_device_graphs would build for a target model runner:
        mr = H.HarnessModelRunner(H.HarnessConfig(batch_sizes=(1, 2)), torch.device("cpu"), speculative=True)
        assert isinstance(model_runner.CudaGraphRunner(mr), gp_sglang.MultiModeCudaGraphRunner)
    finally:
        gp_sglang.uninstall()
    assert not gp_sglang.installed() and model_runner.CudaGraphRunner is original


def test_unsupported_setups_get_sglangs_runner(monkeypatch):
    built = []
    monkeypatch.setattr(cuda_graph_runner, "CudaGraphRunner", lambda mr, **kw: built.append((mr, kw)) or "sglang")
    mr = H.HarnessModelRunner(H.HarnessConfig(batch_sizes=(1, 2)), torch.device("cpu"), speculative=False)
    mr.server_args.enable_dp_attention = True
    assert build_graph_runner(mr, attn_backend=None) == "sglang" and built == [(mr, {"attn_backend": None})]


@needs_switch
def test_launcher_splits_its_arguments_from_sglangs():
    options, rest = split_args(["--model-path", "m", "--graphpool-spec-off-above", "16",
                                "--graphpool-spec-on-at-or-below", "8", "--speculative-algorithm", "EAGLE"])
    assert options == GraphpoolOptions(16, 8) and rest == ["--model-path", "m", "--speculative-algorithm", "EAGLE"]
    assert split_args(["--model-path", "m"]) == (GraphpoolOptions(), ["--model-path", "m"])
    assert split_args(["--graphpool-spec-off-above", "4", "--graphpool-keep-sglang-runner"])[0] == \
        GraphpoolOptions(4, None, keep_sglang_runner=True)
    with pytest.raises(SystemExit, match="only makes sense with the switch"):
        split_args(["--graphpool-keep-sglang-runner"])
    assert split_args(["--graphpool-spec-off-above", "8", "--graphpool-spec-min-accept", "1.4"])[0] == \
        GraphpoolOptions(8, None, spec_min_accept=1.4)
    for bad in (["--graphpool-spec-min-accept", "1.4"], ["--graphpool-spec-off-above", "8", "--graphpool-spec-min-accept", "1"]):
        with pytest.raises(SystemExit, match="--graphpool-spec-min-accept needs"):
            split_args(bad)
    with pytest.raises(SystemExit, match="on-at-or-below <= --graphpool-spec-off-above"):
        split_args(["--graphpool-spec-off-above", "4", "--graphpool-spec-on-at-or-below", "8"])
    args = type("Args", (), {"speculative_algorithm": "EAGLE", "disable_overlap_schedule": False})()
    with pytest.raises(SystemExit, match="--disable-overlap-schedule"):
        check_server_args(GraphpoolOptions(16), args)
    args.speculative_algorithm = None
    with pytest.raises(SystemExit, match="--speculative-algorithm EAGLE"):
        check_server_args(GraphpoolOptions(16), args)
    args.speculative_algorithm, args.disable_overlap_schedule = "STANDALONE", True
    check_server_args(GraphpoolOptions(16), args)  # SGLang's EAGLE v1 worker subclass: switchable


def test_sglang_accepts_a_scheduler_entry_point():
    # Read from the installed source: importing the HTTP server needs uvloop, which CI does not install.
    source = open(importlib.util.find_spec("sglang.srt.entrypoints.http_server").origin).read()
    launch = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "launch_server")
    assert "run_scheduler_process_func" in [a.arg for a in launch.args.args]


def report_patch(queue) -> None:
    """Runs in the spawned process in place of SGLang's scheduler: reports what the patch did there."""
    from sglang.srt.model_executor import model_runner as child_model_runner
    from sglang.srt.speculative.eagle_worker import EAGLEWorker

    switch = getattr(EAGLEWorker.forward_batch_generation, "graphpool_switch", None)
    queue.put((child_model_runner.CudaGraphRunner.__name__, switch and switch.policy.off_above))


@needs_switch
def test_scheduler_entry_installs_graphpool_inside_a_spawned_process():
    entry = SchedulerEntry(GraphpoolOptions(16, 8), target=f"{__name__}:report_patch")
    assert pickle.loads(pickle.dumps(entry)) == entry
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=entry, args=(queue,))
    proc.start()
    try:
        runner_name, off_above = queue.get(timeout=240)
    finally:
        proc.join(timeout=60)
    assert proc.exitcode == 0
    assert runner_name == "build_graph_runner"
    assert off_above == 16, "the EAGLE v1 speculation switch is installed in the scheduler process"


@needs_switch
def test_keep_sglang_runner_installs_the_switch_only():
    """The test-only launcher option: the switch over SGLang's own runner (the crash reproduction)."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.speculative.eagle_worker import EAGLEWorker
    from sglang.srt.speculative.standalone_worker import StandaloneWorker

    from graphpool.integrations.sglang import uninstall_speculation_switch

    original_forward, original_process = EAGLEWorker.forward_batch_generation, Scheduler.process_batch_result_decode
    try:
        GraphpoolOptions(4, 2, keep_sglang_runner=True).apply()
        assert not gp_sglang.installed() and model_runner.CudaGraphRunner is cuda_graph_runner.CudaGraphRunner
        assert EAGLEWorker.forward_batch_generation.graphpool_switch.policy.off_above == 4
        # STANDALONE speculation runs SGLang's EAGLE v1 worker code, so the switch reaches it too.
        assert StandaloneWorker.forward_batch_generation is EAGLEWorker.forward_batch_generation
    finally:
        uninstall_speculation_switch()
    assert EAGLEWorker.forward_batch_generation is original_forward
    assert Scheduler.process_batch_result_decode is original_process


def test_the_switch_refuses_a_classic_sglang_without_eagle_v1(monkeypatch):
    """SGLang 0.5.13.x keeps the classic runner API (graphpool's runner serves it) but has no EAGLE v1 worker:
    the classic switch refuses it by that reason, before the overlap-scheduler advice and before anything is
    patched. Forced here on any classic SGLang; on 0.5.13.x it is the real answer."""
    from graphpool.integrations.sglang import versions
    from graphpool.integrations.sglang.spec_switch import install_speculation_switch

    monkeypatch.setattr(versions, "has_eagle_v1", lambda: False)
    server_args = type("Args", (), {"speculative_algorithm": "EAGLE", "disable_overlap_schedule": False})()
    with pytest.raises(SystemExit, match=r"EAGLE v1 worker, which SGLang .* does not have"):
        check_server_args(GraphpoolOptions(spec_off_above=16), server_args)
    with pytest.raises(RuntimeError, match=r"does not have \(it has eagle_worker_v2 only\)"):
        install_speculation_switch(16)
    assert not gp_sglang.installed()


@needs_switch
def test_the_switch_refuses_a_classic_sglang_it_was_not_written_for(monkeypatch):
    """A classic SGLang whose verify results carry names the plain step does not know (a release after
    those verified, say): the switch says which releases it follows, at the launcher's check and at
    install, before anything is patched. The release is this SGLang with its result's fields renamed."""
    import dataclasses

    from sglang.srt.managers import utils as sglang_utils

    from graphpool.integrations.sglang import eagle_v1_plain
    from graphpool.integrations.sglang.spec_switch import install_speculation_switch

    renamed = dataclasses.make_dataclass("GenerationBatchResult", [("logits_output", object, None),
                                                                   ("accepted_in_some_later_release", int, 0)])
    monkeypatch.setattr(sglang_utils, "GenerationBatchResult", renamed)
    eagle_v1_plain.release.cache_clear()  # read the renamed class
    server_args = type("Args", (), {"speculative_algorithm": "EAGLE3", "disable_overlap_schedule": True})()
    with pytest.raises(SystemExit, match=r"runs on SGLang 0\.5\.12"):
        check_server_args(GraphpoolOptions(spec_off_above=16), server_args)
    with pytest.raises(RuntimeError, match=r"runs on SGLang 0\.5\.12"):
        install_speculation_switch(16)
    from sglang.srt.speculative.eagle_worker import EAGLEWorker
    assert not hasattr(EAGLEWorker.forward_batch_generation, "graphpool_switch")
    monkeypatch.undo()
    eagle_v1_plain.release.cache_clear()  # this SGLang's own release again, for the tests after this one
    assert switch_support_problem() is None


def test_tiers_are_refused_on_the_classic_api_before_anything_is_patched():
    """--graphpool-tiers swaps the states of SGLang's spec-v2 worker (0.5.14+): on a classic SGLang the launcher's
    check and the scheduler entry's apply() both refuse it, naming the releases, with nothing patched."""
    from types import SimpleNamespace

    from graphpool.integrations.sglang.tier_table import TierTable

    options, _ = split_args(["--graphpool-tiers", "4x3:16@2,4x1:4@8"])
    assert options.tiers == TierTable.parse("4x3:16@2,4x1:4@8")
    for refuse in (lambda: check_server_args(options, SimpleNamespace()), options.apply):
        with pytest.raises(SystemExit, match="SGLang 0.5.14 to 0.5.23"):
            refuse()
    assert not gp_sglang.installed()

"""What graphpool's SGLang integration refuses, and where: the launcher (before anything starts or is patched),
install() (SGLang's runner for a setup graphpool's does not serve) and the speculation switch at run time
(no plain step on SGLang's verify-only runner). Found by an independent review; each fix has a test here that
fails without it. SGLang's own code is the oracle where it has one: its CLI parser and ``ServerArgs`` (the flags),
``require_gathered_buffer`` (gathered attention inputs), its runner classes. Runs under both SGLang API
generations (classic 0.5.12, runner 0.5.23); a test of one generation skips under the other.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests import sglang_harness as H  # noqa: I001  (puts the test stand-ins on sys.path first)

from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from graphpool.integrations import sglang as gp  # noqa: E402
from graphpool.integrations.sglang import launch, spec_switch, support, versions  # noqa: E402
from graphpool.integrations.sglang.launch import GraphpoolOptions, check_server_args, split_args  # noqa: E402

CLASSIC = versions.runner_api() == versions.CLASSIC
classic_only = pytest.mark.skipif(not CLASSIC, reason="SGLang's classic graph-runner API (0.5.9 to 0.5.12.post1)")
runner_only = pytest.mark.skipif(CLASSIC, reason="SGLang's runner API (0.5.14+)")


def gathered(reasons: list) -> bool:
    """Whether ``reasons`` refuse gathered attention inputs."""
    return any("require_gathered_buffer" in reason for reason in reasons)


def sglang_server_args(*flags: str) -> ServerArgs:
    """``ServerArgs`` as SGLang's own CLI parser builds them for a switchable EAGLE server plus ``flags``."""
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    base = ["--model-path", "dummy", "--device", "cpu", "--speculative-algorithm", "EAGLE",
            "--disable-overlap-schedule"]
    return ServerArgs.from_cli_args(parser.parse_args(base + list(flags)))


def stand_in(server_args) -> SimpleNamespace:
    """What unsupported_reasons reads of a target ``ModelRunner``, for a plain dense EAGLE target."""
    return SimpleNamespace(server_args=server_args, model_config=SimpleNamespace(),
                           spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE"), hisparse_coordinator=None)


def graphpool_warnings(caplog) -> list:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("graphpool")]


def the_switch_is_accepted_here() -> bool:
    return not CLASSIC or spec_switch.switch_support_problem() is None  # classic: the switch is 0.5.12's


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    from sglang.srt.layers.moe import utils as moe_utils

    H.forget_graph_memory_pool()
    if hasattr(moe_utils, "MOE_A2A_BACKEND"):  # up to 0.5.18 SGLang's predicate sets this global on first read
        monkeypatch.setattr(moe_utils, "MOE_A2A_BACKEND", moe_utils.MOE_A2A_BACKEND)
    yield
    gp.uninstall()


# ------------------------------------------------------------------ 1. launcher: setups install() hands to SGLang
@pytest.mark.parametrize("flags", [["--enable-torch-compile"], ["--enable-lora"], ["--enable-two-batch-overlap"],
                                   ["--enable-pdmux"], ["--enable-profile-cuda-graph"], ["--debug-cuda-graph"],
                                   ["--pp-size", "2"], ["--dllm-algorithm", "LowConfidence"]])
def test_launcher_refuses_the_switch_where_install_builds_sglangs_runner(flags):
    """install() gives these servers SGLang's own runner (unsupported_reasons), whose verify-only graphs crash
    on the switch's first plain step: the launcher refuses the switch and names the flag."""
    try:
        args = sglang_server_args(*flags)
    except SystemExit:  # SGLang's parser has no such flag (--debug-cuda-graph is 0.5.10+)
        pytest.skip(f"SGLang {versions.sglang_version()} has no {flags[0]}")
    assert support.unsupported_reasons(stand_in(args)), "install() gives this server SGLang's runner"
    with pytest.raises(SystemExit, match=" ".join(flags)):
        check_server_args(GraphpoolOptions(16, 12), args)
    check_server_args(GraphpoolOptions(), args)  # without the switch: the runner's refusal is install()'s business
    if the_switch_is_accepted_here():
        check_server_args(GraphpoolOptions(16, 12), sglang_server_args())  # the same server without the flag


# ------------------------------------------------------------------ 1. the switch at run time over SGLang's runner
def _classic_worker(runner):
    return SimpleNamespace(target_worker=SimpleNamespace(model_runner=SimpleNamespace(graph_runner=runner)))


@classic_only
@pytest.mark.skipif(spec_switch.switch_support_problem() is not None, reason="the switch is SGLang 0.5.12's")
def test_switch_keeps_speculating_over_sglangs_runner_and_says_why_once(monkeypatch, caplog):
    """A model-level refusal (hybrid SWA, mrope, ...) that the launcher cannot see gives the target SGLang's
    CudaGraphRunner: the switch must not send it a plain step (it would replay a TARGET_VERIFY graph: "The
    size of tensor a (24) must match the size of tensor b (6)"). Plain steps still run on graphpool's runner,
    eagerly without one, and on SGLang's where install() is not in effect (--graphpool-keep-sglang-runner)."""
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
    from sglang.srt.speculative.eagle_worker import EAGLEWorker

    from graphpool.integrations.sglang.runner import MultiModeCudaGraphRunner

    steps = []
    monkeypatch.setattr(EAGLEWorker, "forward_batch_generation", lambda worker, batch: steps.append("spec"))
    monkeypatch.setattr(spec_switch, "eagle_v1_plain_decode", lambda worker, batch, lag: steps.append("plain"))
    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, is_extend_in_batch=False, reqs=[], batch_size=lambda: 8)
    sglangs, ours = object.__new__(CudaGraphRunner), object.__new__(MultiModeCudaGraphRunner)
    spec_switch.install_speculation_switch(4)  # 8 running requests: plain steps
    try:
        def step(runner):
            steps.clear()
            EAGLEWorker.forward_batch_generation(_classic_worker(runner), batch)
            return steps[0]

        _assert_sglangs_runner_gets_no_plain_step(step, sglangs, caplog)
        assert step(ours) == "plain" and step(None) == "plain"
    finally:
        spec_switch.uninstall_speculation_switch()


@runner_only
def test_spec_v2_switch_keeps_speculating_over_sglangs_runner(monkeypatch, caplog):
    """The same under the runner API: 0.5.23's DecodeCudaGraphRunner checks a batch's width only through its
    spec_info, which a plain step has none of, so it would replay a verify graph for it."""
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    from graphpool.integrations.sglang import spec_switch_v2
    from graphpool.integrations.sglang.runner_api import MultiModeDecodeRunner

    steps = []
    monkeypatch.setattr(EAGLEWorkerV2, "forward_batch_generation", lambda worker, batch, *a, **k: steps.append("spec"))
    monkeypatch.setattr(spec_switch_v2, "eagle_v2_plain_decode", lambda worker, batch, lag, *_: steps.append("plain"))
    monkeypatch.setattr(spec_switch_v2, "eagle_v2_catch_up", lambda worker, batch, lag: None)
    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, is_extend_in_batch=False, spec_info=object(),
                            seq_lens=torch.zeros(8, dtype=torch.int64))
    eager = object()
    sglangs, ours = object.__new__(DecodeCudaGraphRunner), object.__new__(MultiModeDecodeRunner)
    spec_switch_v2.install_speculation_switch(4)
    try:
        def step(runner):
            steps.clear()
            target = SimpleNamespace(decode_cuda_graph_runner=runner, eager_runner=eager)
            worker = SimpleNamespace(target_worker=SimpleNamespace(model_runner=target), speculative_num_steps=3,
                                     activate_step_by_batch=lambda bs: None)
            EAGLEWorkerV2.forward_batch_generation(worker, batch)
            return steps[0]

        _assert_sglangs_runner_gets_no_plain_step(step, sglangs, caplog)
        assert step(ours) == step(eager) == step(None) == "plain"  # graphpool's runner; --disable-cuda-graph
    finally:
        spec_switch_v2.uninstall_speculation_switch()


def _assert_sglangs_runner_gets_no_plain_step(step: Any, sglangs: Any, caplog: Any) -> None:
    """``step(runner)`` runs one decode step of 8 sequences above the threshold and says which path took it:
    SGLang's runner gets plain steps only where install() is not in effect, else speculation, warned once."""
    assert step(sglangs) == "plain", "install() not in effect: SGLang's runner kept on purpose"
    gp.install()
    with caplog.at_level(logging.WARNING, logger="graphpool"):
        assert [step(sglangs), step(sglangs)] == ["spec", "spec"]
    warnings = graphpool_warnings(caplog)
    assert len(warnings) == 1 and f"SGLang's own {type(sglangs).__name__}" in warnings[0] and "crash" in warnings[0]


# ------------------------------------------------------------------ 2. gathered attention inputs without DP attention
@pytest.fixture
def target():
    """(a target model runner, graphpool's runner class, its refusal check) of this SGLang API."""
    if CLASSIC:
        from graphpool.integrations.sglang.runner import MultiModeCudaGraphRunner

        return stand_in(sglang_server_args()), MultiModeCudaGraphRunner, support.unsupported_reasons
    from graphpool.integrations.sglang.runner_api import MultiModeDecodeRunner
    from graphpool.integrations.sglang.runner_api_support import refusal_reasons
    from tests import sglang_runner_api_harness as R

    mr = R.RunnerApiModelRunner(H.HarnessConfig(batch_sizes=(1, 2)), torch.device("cpu"), speculative=True)
    return mr, MultiModeDecodeRunner, refusal_reasons


@contextlib.contextmanager
def sglang_state(monkeypatch, mr, flags):
    """SGLang's state for ``mr``'s server launched with ``flags``, as its scheduler sets it up (its MoE backend
    global and ``server_args`` up to 0.5.14, the published runtime context from 0.5.16 (0.5.16: its MoE flags; the
    record's own ``moe_dense_tp_size``), whose predicate still takes ``server_args`` up to 0.5.18); yields what
    SGLang's own require_gathered_buffer answers in it."""
    from sglang.srt.layers.moe import utils as moe_utils
    from sglang.srt.utils.common import require_gathered_buffer

    launched = sglang_server_args(*flags)
    a2a = moe_utils.MoeA2ABackend(launched.moe_a2a_backend)
    args = (mr.server_args,) if inspect.signature(require_gathered_buffer).parameters else ()
    if hasattr(moe_utils, "MOE_A2A_BACKEND"):
        monkeypatch.setattr(moe_utils, "MOE_A2A_BACKEND", a2a)
        monkeypatch.setattr(mr.server_args, "moe_dense_tp_size", launched.moe_dense_tp_size)
        yield require_gathered_buffer(*args)
        return
    from sglang.srt import runtime_context

    monkeypatch.setattr(runtime_context.get_flags().moe, "a2a_backend", a2a)
    parallel, context = runtime_context.get_parallel(), runtime_context.get_context()
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(parallel.override(moe_dense_tp_size=launched.moe_dense_tp_size))
        except ValueError:  # not a live parallel value: 0.5.17, a published config leaf; 0.5.16, the record's own
            if hasattr(context, "override"):
                stack.callback(context.override, "graphpool-test", moe_dense_tp_size=parallel.moe_dense_tp_size)
                context.override("graphpool-test", moe_dense_tp_size=launched.moe_dense_tp_size)
            else:
                monkeypatch.setattr(mr.server_args, "moe_dense_tp_size", launched.moe_dense_tp_size)
        yield require_gathered_buffer(*args)


@pytest.mark.parametrize("flags", [["--moe-a2a-backend", "deepep"], ["--moe-dense-tp-size", "1"]])
def test_gathered_attention_inputs_are_refused_where_sglang_requires_them(monkeypatch, target, flags):
    """SGLang's runner pads and gathers attention inputs (bs a multiple of attn_tp_size, global_num_tokens,
    can_run_dp_cuda_graph) whenever its require_gathered_buffer holds, DP attention or not; graphpool's runner
    stages none of it, so install() must hand such a server to SGLang, and the launcher refuse the switch."""
    mr, runner_class, refusals = target
    with sglang_state(monkeypatch, mr, []) as gathers:
        assert not gathers and refusals(mr) == [], "a plain TP server: nothing to gather, nothing refused"
    with sglang_state(monkeypatch, mr, flags) as gathers:
        assert gathers, "SGLang's own runner gathers here"
        assert gathered(refusals(mr))
        with pytest.raises(ValueError, match="require_gathered_buffer"):
            runner_class(mr)
    # The launcher, before SGLang's scheduler set any of that up, reads the same flags.
    with pytest.raises(SystemExit, match=" ".join(flags)):
        check_server_args(GraphpoolOptions(16, 12), sglang_server_args(*flags))


# ------------------------------------------------------------------ 3. package-level switch names follow the API
def test_package_switch_names_are_the_installed_apis():
    module = spec_switch if CLASSIC else pytest.importorskip("graphpool.integrations.sglang.spec_switch_v2")
    for name in ("SpeculationSwitch", "install_speculation_switch", "uninstall_speculation_switch",
                 "plain_decode_batch"):
        assert getattr(gp, name) is getattr(module, name), name


@runner_only
def test_package_uninstall_removes_the_spec_v2_switch_the_launcher_installed():
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    from graphpool.integrations.sglang import spec_switch_v2

    original = EAGLEWorkerV2.forward_batch_generation
    try:
        assert gp.install_speculation_switch(16, 12).policy.off_above == 16
        gp.uninstall_speculation_switch()
        assert EAGLEWorkerV2.forward_batch_generation is original
        GraphpoolOptions(16, 12).apply()  # what the launcher runs in each scheduler process
        gp.uninstall_speculation_switch()
        assert EAGLEWorkerV2.forward_batch_generation is original
    finally:
        spec_switch_v2.uninstall_speculation_switch()


# ------------------------------------------------------------------ 4. --graphpool-spec-min-accept
@runner_only
def test_min_accept_on_the_runner_api_is_refused_before_anything_is_patched():
    args = sglang_server_args()
    with pytest.raises(SystemExit, match="min-accept"):
        check_server_args(GraphpoolOptions(16, 12, spec_min_accept=1.5), args)
    with pytest.raises(SystemExit, match="min-accept"):
        GraphpoolOptions(16, 12, spec_min_accept=1.5).apply()
    assert not gp.installed(), "apply() patched SGLang's runner, then refused"


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_min_accept_must_be_finite(value):
    """inf passes `> 1`: the gate would then pause speculation for good after every probe."""
    with pytest.raises(SystemExit, match="min-accept"):
        split_args(["--graphpool-spec-off-above", "4", "--graphpool-spec-min-accept", value])


# ------------------------------------------------------------------ 5. minor
def test_help_names_both_switches_for_off_above():
    entry = launch.HELP.split("--graphpool-spec-on-at-or-below")[0]
    assert "EAGLE v1" in entry and "spec-v2" in entry and "0.5.14" in entry


def test_missing_dependencies_message_names_the_installed_sglang(monkeypatch):
    exc = ModuleNotFoundError("No module named 'torchvision'", name="torchvision")
    monkeypatch.setattr(versions, "sglang_version", lambda: "0.5.23")
    assert "pip install sglang==0.5.23 " in launch.sglang_missing_message(exc)
    monkeypatch.setattr(versions, "sglang_version", lambda: "not installed")
    missing = ModuleNotFoundError("No module named 'sglang'", name="sglang")
    assert "pip install sglang==0.5.12.post1 " in launch.sglang_missing_message(missing)
    too_old = ImportError("SGLang 0.5.5 has neither the classic CudaGraphRunner nor the runner package; graphpool "
                          "supports SGLang 0.5.9 to 0.5.12.post1")
    assert launch.sglang_missing_message(too_old).endswith(str(too_old))


def _classic_world(batch_sizes=(1, 2, 4)):
    from graphpool.integrations.sglang.runner import MultiModeCudaGraphRunner

    cfg = H.HarnessConfig(batch_sizes=batch_sizes)
    mr = H.HarnessModelRunner(cfg, torch.device("cpu"), speculative=True)
    reqs = H.make_requests(cfg, cfg.max_reqs, prompt_len=6, seed=3)
    alloc = H.SlotAllocator(cfg.kv_slots)
    H.prefill(mr, reqs, alloc)
    return mr, MultiModeCudaGraphRunner(mr), reqs, alloc


@classic_only
def test_can_run_without_input_ids_refuses_instead_of_raising():
    """SGLang's can_run never reads input_ids (no ngram): a batch of input_embeds only must not raise."""
    mr, runner, reqs, alloc = _classic_world()
    fb = H.decode_batch(mr, reqs, [0, 1], alloc)
    fb.input_ids = None
    assert runner.can_run(fb) is False and runner.refusals == {"decode without input_ids": 1}


@classic_only
def test_can_run_counts_a_refused_batch_once_when_asked_twice():
    """Spec v2 on the classic API asks can_run in prepare_for_v2_verify and again in _forward_raw."""
    from sglang.srt.speculative import eagle_info_v2

    assert inspect.getsource(eagle_info_v2).count("graph_runner.can_run(") >= 1
    mr, runner, reqs, alloc = _classic_world()
    fb = H.decode_batch(mr, reqs, [0, 1, 2, 3, 4], alloc)  # bs 5 > 4
    assert runner.can_run(fb) is False and runner.can_run(fb) is False
    assert sum(runner.refusals.values()) == 1
    assert runner.can_run(H.decode_batch(mr, reqs, [0, 1, 2, 3, 4], alloc)) is False  # another step
    assert sum(runner.refusals.values()) == 2


@classic_only
def test_replay_prepare_hands_the_batch_to_the_backend_as_sglang_does():
    """SGLang 0.5.12's replay_prepare sets ``attn_backend._replay_forward_batch`` around the backend's replay
    planning (DeepSeek-V4's backend reads the batch from there); graphpool's must too."""
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner

    if "_replay_forward_batch" not in inspect.getsource(CudaGraphRunner.replay_prepare):
        pytest.skip("this SGLang's runner hands backends no batch")
    mr, runner, reqs, alloc = _classic_world()
    backend, seen = mr.attn_backend, []
    plan = backend.init_forward_metadata_replay_cuda_graph

    def recording(*args, **kwargs):
        seen.append(getattr(backend, "_replay_forward_batch", None))
        return plan(*args, **kwargs)

    backend.init_forward_metadata_replay_cuda_graph = recording
    fb = H.verify_batch(mr, reqs, [0, 1], torch.zeros((2, mr.cfg.draft_tokens - 1), dtype=torch.int64), alloc)
    runner.replay_prepare(fb)
    assert seen == [fb] and backend._replay_forward_batch is None

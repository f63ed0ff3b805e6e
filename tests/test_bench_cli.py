"""The replay-latency benchmark (``graphpool.bench``, ``graphpool-bench``, and the checkout's
bench/replay_latency.py front end): a CPU smoke run end to end, its staging methods against the inputs they
stage, and (GPU) the full method set with the GPU floor beside graphpool's GPU time."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import graphpool as gp
from bench import replay_latency
from graphpool.bench import cli, replay
from graphpool.bench import step as default_step
from graphpool.bench.methods import EagerTritonStage, sglang_style


def run(tmp_path: Path, capsys, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "rl"
    assert replay_latency.main(["--batch-sizes", "1,2", "--iters", "2", "--warmup", "1", "--out", str(out), *extra]) == 0
    return json.loads((out / "replay_latency.json").read_text()), capsys.readouterr().out


def test_cpu_smoke_run_writes_outputs_and_explains_every_column(tmp_path, capsys):
    data, text = run(tmp_path, capsys, "--device", "cpu")
    methods = {(r["mode"], r["bs"], r["method"]) for r in data["rows"]}
    assert methods == {(m, b, meth) for m in ("decode", "verify") for b in (1, 2) for meth in ("graphpool", "eager")}
    assert all(r["token_match"] == 1.0 for r in data["rows"]) and data["env"]["misses"] == 0
    assert "not a speed measurement" in data["env"]["runs_on"]
    assert (tmp_path / "rl" / "replay_latency.png").stat().st_size > 1000
    flat = " ".join(text.split())
    assert "CPU smoke run of the code path" in flat and "not a speed measurement" in flat
    for word in ("mode, bs:", "capture ms:", "graph MiB:", "replays:", "padded rows:", "graphpool:", "eager:",
                 "match:"):
        assert word in flat, word
    assert "acceptance" not in flat  # no verdict from eager-twin timings


def test_cpu_defaults_are_smaller_and_said(tmp_path, capsys):
    args = cli.parse_args([])
    assert cli.resolve(args, cuda=False) == ["iters", "warmup", "batch_sizes"]
    assert (args.iters, args.batch_sizes) == (10, "1,2,4,8")
    assert Path(args.out) == Path("out") / "replay_latency"  # the installed command: under the working directory
    checkout = cli.parse_args([], default_out=str(Path(replay_latency.ROOT) / "out" / "replay_latency"))
    assert Path(checkout.out) == Path(replay_latency.ROOT) / "out" / "replay_latency"
    assert "/out/" in (Path(replay_latency.ROOT) / ".gitignore").read_text().split(), "out/ must be ignored by git"
    gpu_args = cli.parse_args(["--iters", "7"])
    assert cli.resolve(gpu_args, cuda=True) == [] and gpu_args.iters == 7


def _pool(device: str) -> tuple[gp.GraphPool, default_step.BenchStep]:
    step = default_step.make(torch.device(device), max_tokens=64, hidden=32, vocab=64, layers=1)
    pool = gp.GraphPool([gp.Mode("decode", 1), gp.Mode("verify", 16)], step.inputs, [1, 2, 4], device=device,
                        staging="torch")
    pool.capture(step.step_fn, progress=False, outputs=step.outputs)
    return pool, step


@pytest.mark.parametrize("grouped", [False, True])
def test_sglang_style_staging_copies_the_real_rows(grouped):
    pool, step = _pool("cpu")
    mode = pool.modes["verify"]
    inputs = step.sample(mode, 3)
    sglang_style(pool, step.inputs, grouped=grouped)(mode, 4, inputs)
    static = pool.static_inputs
    for spec in step.inputs:
        rows = spec.rows(3, 16)
        assert torch.equal(static[spec.name][:rows], inputs[spec.name]), spec.name
    assert torch.all(static["seq_lens"][3:] == 1)  # the padded tail holds the fill


@pytest.mark.parametrize("first_per", ["token", "seq"])
def test_sglang_style_staging_needs_no_seq_lens(first_per):
    """A step of one's own (here the transformers step's kind of inputs) has no ``seq_lens``: the real batch size
    comes from the declarations (GPU run CB died on ``KeyError: 'seq_lens'`` in ``--step transformers``)."""
    specs = [gp.StepInput("ids", torch.int64, "token"), gp.StepInput("slots", torch.int64, "seq", fill=0)]
    if first_per == "seq":
        specs.reverse()
    pool = gp.GraphPool([gp.Mode("decode", 1), gp.Mode("verify", 4)], specs, [1, 4], device="cpu", staging="torch")
    pool.capture(lambda b: {"y": b.inputs["ids"] + 1}, progress=False, outputs="token")
    mode = pool.modes["verify"]
    inputs = {"ids": torch.arange(8) + 100, "slots": torch.tensor([7, 9])}
    for name in ("ids", "slots"):
        pool.static_inputs[name].fill_(-5)
    sglang_style(pool, specs, grouped=True)(mode, 4, inputs)
    assert torch.equal(pool.static_inputs["ids"][:8], inputs["ids"])
    assert torch.equal(pool.static_inputs["slots"][:2], inputs["slots"])
    assert torch.all(pool.static_inputs["ids"][8:] == -5)  # only the real rows are copied


@pytest.mark.gpu
def test_gpu_transformers_step_times_every_method(tmp_path, capsys):
    """``--step transformers`` on CUDA: every staging method on the integration's own inputs (GPU run CB found
    the SGLang-style method reading a ``seq_lens`` this step does not have)."""
    pytest.importorskip("transformers")
    from graphpool.bench.report import GRAPH_METHODS
    data, _ = run(tmp_path, capsys, "--step", "transformers", "--modes", "decode:1,verify:4")
    rows = {(r["mode"], r["bs"], r["method"]): r for r in data["rows"]}
    for mode in ("decode", "verify"):
        for bs in (1, 2):
            assert all((mode, bs, m) in rows for m in GRAPH_METHODS + ["eager"]), (mode, bs)
            assert rows[mode, bs, "graphpool"]["token_match"] > 0.9


@pytest.mark.gpu
def test_eager_triton_stage_fills_the_static_buffers():
    pool, step = _pool("cuda")
    stage = EagerTritonStage(pool, step.inputs)
    for mode_name, bs in (("decode", 4), ("verify", 2), ("decode", 1)):
        mode = pool.modes[mode_name]
        inputs = step.sample(mode, bs)
        stage.stager(mode, bs, inputs)()
        torch.cuda.synchronize()
        for spec in step.inputs:
            rows = spec.rows(bs, mode.tokens_per_seq)
            assert torch.equal(pool.static_inputs[spec.name][:rows], inputs[spec.name]), (mode_name, bs, spec.name)


@pytest.mark.gpu
def test_gpu_run_times_every_method_and_prints_the_gpu_floor(tmp_path, capsys):
    from graphpool.bench.report import GRAPH_METHODS
    data, text = run(tmp_path, capsys)
    rows = {(r["mode"], r["bs"], r["method"]): r for r in data["rows"]}
    for mode in ("decode", "verify"):
        for bs in (1, 2):
            for method in GRAPH_METHODS + ["eager"]:
                assert (mode, bs, method) in rows
            assert rows[mode, bs, "floor"]["gpu_us"] > 0 and rows[mode, bs, "graphpool"]["gpu_us"] > 0
            assert rows[mode, bs, "graphpool"]["token_match"] > 0.9
            assert len(rows[mode, bs, "graphpool-run"]["host_rounds_us"]) >= 1  # the rounds the ratio is paired by
    assert "GPU us per step" in text and "gpool-floor" in text and "CUDA graphs on" in data["env"]["runs_on"]


def test_gpu_summary_puts_the_gpu_floor_beside_graphpool_and_explains_every_column():
    from graphpool.bench.report import GRAPH_METHODS, summary
    modes = [gp.Mode("decode", 1)]
    rows = [{"mode": "decode", "bs": 1, "method": m, "stage_us": 2.0, "replay_us": 5.0 + i, "host_us": 7.0 + i,
             "gpu_us": 100.0 + i, "gpu_b2b_us": 90.0 + 2 * i, "host_b2b_us": 4.0 + i, "token_match": 1.0}
            for i, m in enumerate(GRAPH_METHODS + ["eager"])]
    # Per-round medians, chosen so that the ratio paired by round (median of 0.06, 0.067, 0.1 = 0.067)
    # differs from the ratio of the overall medians ((7 - 3) / (53 - 3) = 0.08).
    rounds = {"floor": [3.0, 10.0, 3.0], "graphpool-run": [6.0, 14.0, 7.0], "sglang": [53.0, 70.0, 43.0]}
    for r in rows:
        r["host_rounds_us"] = rounds.get(r["method"], [r["host_us"]] * 3)
    text = summary(rows, modes, [1], cuda=True, misses=0)
    flat = " ".join(text.split())
    gpu_line = text.splitlines()[text.splitlines().index("GPU us per step (median, CUDA events around staging + replay)") + 2]
    # floor 100.0, graphpool 101.0: the difference 1.0 is printed beside them; back to back 90.0 and 92.0: 2.0
    floor_i, gpool_i = GRAPH_METHODS.index("floor"), GRAPH_METHODS.index("graphpool")
    b2b = [90.0 + 2 * floor_i, 90.0 + 2 * gpool_i]
    sglang_i = GRAPH_METHODS.index("sglang")
    assert gpu_line.split()[:7] == ["decode", "1", "100.0", f"{100.0 + gpool_i:.1f}", f"{gpool_i - floor_i:.1f}",
                                    f"{100.0 + sglang_i:.1f}", "1.00"]
    assert gpu_line.split()[7:] == [f"{b2b[0]:.1f}", f"{b2b[1]:.1f}", f"{b2b[1] - b2b[0]:.1f}"]
    lines = text.splitlines()
    b2b_host = lines[[i for i, line in enumerate(lines) if line.startswith("host us per step (median, steps issued back")][0] + 2]
    run_i = GRAPH_METHODS.index("graphpool-run")
    want = [4.0 + floor_i, 4.0 + run_i, 4.0 + sglang_i]
    assert b2b_host.split() == ["decode", "1", *(f"{v:.1f}" for v in want), f"{want[1] - want[0]:.1f}",
                                f"{want[2] - want[0]:.1f}", f"{(want[1] - want[0]) / (want[2] - want[0]):.3f}"]
    idle_host = lines[lines.index("host us per step (median, GPU idle at the start of each step)") + 2]
    assert idle_host.split()[-3:] == ["4.0", "50.0", f"{(4 / 60):.3f}"]  # gp ovh, sgl ovh, ratio: paired by round
    assert "acceptance (staging's GPU cost, b2b added <= 2 us at every key): PASS (max 2.0 us)" in text  # 2 * (1 - 0)
    for column in ("floor:", "run:", "st+rp:", "gpool:", "gp+prep:", "triton:", "sglang:", "foreach:", "g-pad:", "eager:",
                   "gp stage:", "gp ovh, sgl ovh:", "ratio:", "gpool-floor:", "match:", "b2b floor, b2b gpool:",
                   "b2b added:"):
        assert column in flat, column


# Argument checks, --step loading, exact iteration counts and the all-or-none output set. Each run is the
# smallest one: one mode, one batch size, one timed step per method, no warm-up.
TINY = ["--device", "cpu", "--modes", "decode:1", "--batch-sizes", "1", "--iters", "1", "--warmup", "0"]
OUTPUTS = {"replay_latency.json", "replay_latency.csv", "replay_latency.png"}


def refused(capsys, argv: list[str]) -> str:
    """The one stderr line of a run main refused with status 2 (argparse's status for a usage error)."""
    with pytest.raises(SystemExit) as exc:
        replay_latency.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("graphpool-bench: "), err
    return err


def strict_json(path: Path) -> dict:
    """The file parsed as strict JSON: a bare NaN or Infinity fails."""
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.mark.parametrize("spec", ["nosuchmod:make", "graphpool.bench.step:nosuch", "os:getcwd", "nocolon",
                                  ":make", "graphpool.bench.step:", "graphpool.bench.step:make:x"])
def test_bad_step_is_one_line_saying_what_is_expected(tmp_path, capsys, monkeypatch, spec):
    monkeypatch.setattr(sys, "path", list(sys.path))  # main puts the working directory on it
    err = refused(capsys, [*TINY, "--step", spec, "--out", str(tmp_path / "rl")])
    assert err.startswith(f"graphpool-bench: --step {spec}: ")
    assert err.endswith("expected a built-in step (default, sglang, transformers) or module:factory, factory(device, "
                        "max_tokens) -> BenchStep")
    assert not (tmp_path / "rl").exists()  # refused before the outputs were even checked


def test_bad_step_names_the_missing_module_and_where_it_was_looked_up(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # main puts the working directory on it
    err = refused(capsys, [*TINY, "--step", "nosuchmod:make", "--out", str(tmp_path / "rl")])
    assert "no module named 'nosuchmod'" in err and f"current directory ({tmp_path})" in err


def test_step_that_returns_no_step_is_refused(tmp_path, capsys, monkeypatch):
    (tmp_path / "rl_notastep.py").write_text("def make(device, max_tokens):\n    return 3\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    err = refused(capsys, [*TINY, "--step", "rl_notastep:make", "--out", str(tmp_path / "rl")])
    assert err.startswith("graphpool-bench: --step rl_notastep:make: the step factory returned a value of type int, "
                          "not a BenchStep") and not (tmp_path / "rl" / "replay_latency.json").exists()


def test_step_module_is_found_in_the_working_directory(tmp_path):
    """Run as a script from the folder holding the user's module (Python puts only bench/ on the path)."""
    (tmp_path / "my_step.py").write_text(
        "from graphpool.bench import default_step as _make\n\n\n"
        "def make(device, max_tokens):\n"
        "    return _make(device, max_tokens, hidden=32, vocab=64, layers=1)\n")
    script = Path(replay_latency.__file__).resolve()
    done = subprocess.run([sys.executable, str(script), *TINY, "--step", "my_step:make", "--no-plots",
                           "--out", str(tmp_path / "rl")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert {r["method"] for r in strict_json(tmp_path / "rl" / "replay_latency.json")["rows"]} == {"graphpool", "eager"}
    help_text = " ".join(cli.__doc__.split())
    assert "looked up first in the current working directory" in help_text


@pytest.mark.parametrize("argv, start", [
    (["--modes", "decode"], "--modes decode: 'decode' is not name:tokens_per_seq"),
    (["--modes", "decode:x"], "--modes decode:x: tokens_per_seq of 'decode' must be an integer"),
    (["--modes", "decode:0"], "--modes decode:0: tokens_per_seq of 'decode' must be >= 1"),
    (["--modes", "decode:1,decode:2"], "--modes decode:1,decode:2: mode 'decode' is named twice"),
    (["--batch-sizes", "0"], "--batch-sizes 0: batch size 0 is not positive"),
    (["--batch-sizes=-1,2"], "--batch-sizes -1,2: batch size -1 is not positive"),
    (["--batch-sizes", "1,,2"], "--batch-sizes 1,,2: '' is not an integer"),
    (["--batch-sizes", "2,2"], "--batch-sizes 2,2: batch size 2 is listed twice"),
    (["--device", "tpu"], "--device tpu: not a device name torch knows; expected cpu or cuda[:index]"),
    (["--device", "meta"], "--device meta: graphpool runs on cuda (CUDA graphs) or cpu"),
    (["--iters", "0"], "--iters 0: expected a positive number"),
    (["--iters", "-5"], "--iters -5: expected a positive number"),
    (["--warmup", "-1"], "--warmup -1: expected untimed steps per method >= 0"),
    (["--iters", "x"], "--iters: invalid int value"),
])
def test_bad_options_are_refused_before_anything_runs(tmp_path, capsys, argv, start):
    err = refused(capsys, [*TINY, *argv, "--out", str(tmp_path / "rl")])
    assert err.startswith(f"graphpool-bench: {start}"), err
    assert "expected" in err or "invalid" in err
    assert not (tmp_path / "rl").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch has no CUDA device")
def test_cuda_without_a_cuda_device_is_refused(tmp_path, capsys):
    err = refused(capsys, [*TINY, "--device", "cuda", "--out", str(tmp_path / "rl")])
    assert err.startswith("graphpool-bench: --device cuda: torch ") and "sees no CUDA device" in err


def test_out_that_is_a_file_or_under_one_is_refused(tmp_path, capsys):
    file = tmp_path / "taken"
    file.write_text("not a folder")
    err = refused(capsys, [*TINY, "--out", str(file)])
    assert err.startswith(f"graphpool-bench: --out {file}: an existing file, not a folder")
    err = refused(capsys, [*TINY, "--out", str(file / "rl")])
    assert err.startswith(f"graphpool-bench: --out {file / 'rl'}: cannot write")
    assert file.read_text() == "not a folder"


@pytest.mark.parametrize("iters", [1, 5, 10, 25])
def test_timed_runs_exactly_the_asked_steps(iters):
    calls = {"a": 0, "b": 0}

    def method(name: str) -> replay.Method:
        return (lambda: calls.__setitem__(name, calls[name] + 1), lambda _: None)
    got = replay.timed({"a": method("a"), "b": method("b")}, iters, warmup=3, cuda=False)
    assert calls == {"a": iters + 3, "b": iters + 3}
    assert all(r["steps_timed"] == iters for r in got.values())
    assert all(len(r["host_rounds_us"]) == -(-iters // 10) for r in got.values())  # rounds of 10, last shorter


def test_run_records_the_steps_it_timed_and_writes_strict_json(tmp_path, capsys):
    out = tmp_path / "rl"
    assert replay_latency.main([*TINY, "--iters", "13", "--no-plots", "--out", str(out)]) == 0
    data = strict_json(out / "replay_latency.json")
    assert data["env"]["iters"] == 13 and data["env"]["warmup"] == 0
    assert all(r["steps_timed"] == 13 and len(r["host_rounds_us"]) == 2 for r in data["rows"])
    assert all(r["gpu_us"] is None and r["gpu_b2b_us"] is None for r in data["rows"])  # not measured on a CPU
    assert set(p.name for p in out.iterdir()) == OUTPUTS - {"replay_latency.png"}


def _previous_set(out: Path) -> dict[str, str]:
    out.mkdir(parents=True)
    for name in OUTPUTS:
        (out / name).write_text(f"previous run's {name}")
    return {p.name: p.read_text() for p in out.iterdir()}


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_failed_write_leaves_the_previous_set_and_no_temporaries(tmp_path, capsys, monkeypatch, error):
    out = tmp_path / "rl"
    before = _previous_set(out)

    def broken_plot(rows, modes, sizes, path, what_ran):
        Path(path).write_bytes(b"half a png")  # cut short while the JSON and CSV were already written
        raise error("plot failed")
    monkeypatch.setattr(cli, "plot", broken_plot)
    with pytest.raises(error):
        replay_latency.main([*TINY, "--out", str(out)])
    assert {p.name: p.read_text() for p in out.iterdir()} == before  # hidden temporaries included


def test_no_plots_removes_the_previous_png(tmp_path, capsys):
    out = tmp_path / "rl"
    _previous_set(out)
    assert replay_latency.main([*TINY, "--no-plots", "--out", str(out)]) == 0
    assert set(p.name for p in out.iterdir()) == OUTPUTS - {"replay_latency.png"}
    assert strict_json(out / "replay_latency.json")["rows"]


def test_without_matplotlib_the_plot_is_skipped_with_a_warning(tmp_path, capsys, caplog, monkeypatch):
    out = tmp_path / "rl"
    _previous_set(out)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert replay_latency.main([*TINY, "--out", str(out)]) == 0
    assert "matplotlib is not installed: no plot written" in caplog.text
    assert set(p.name for p in out.iterdir()) == OUTPUTS - {"replay_latency.png"}  # no stale plot beside it


def test_a_sampler_that_returns_the_wrong_inputs_is_named(tmp_path, capsys, monkeypatch):
    (tmp_path / "rl_badsample.py").write_text(
        "from graphpool.bench import default_step\n\n\n"
        "def make(device, max_tokens):\n"
        "    step = default_step(device, max_tokens, hidden=32, vocab=64, layers=1)\n"
        "    step.sample = lambda mode, bs: {'input_ids': None}\n"
        "    return step\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    err = refused(capsys, [*TINY, "--step", "rl_badsample:make", "--out", str(tmp_path / "rl")])
    assert "sample(mode, bs) must return a dict of tensors keyed by the declared inputs" in err
    assert not (tmp_path / "rl" / "replay_latency.json").exists()


def test_the_python_api_times_a_step_of_ones_own():
    """graphpool.bench.benchmark with a BenchStep built by hand: the rows of every key and method."""
    from graphpool.bench import BenchStep, benchmark

    weight = torch.randn(4, 4)
    step = BenchStep(inputs=[gp.StepInput("x", torch.float32, "token", trailing=(4,))],
                     step_fn=lambda b: {"y": b.inputs["x"] @ weight},
                     sample=lambda mode, bs: {"x": torch.randn(bs * mode.tokens_per_seq, 4)},
                     outputs="token", check="y")
    result = benchmark(step, [gp.Mode("decode", 1), gp.Mode("verify", 3)], [1, 2], "cpu", iters=2, warmup=0,
                       progress=False)
    assert {(r["mode"], r["bs"], r["method"]) for r in result.rows} == {
        (m, b, meth) for m in ("decode", "verify") for b in (1, 2) for meth in ("graphpool", "eager")}
    assert all(r["token_match"] == 1.0 for r in result.rows) and result.env["misses"] == 0


@pytest.mark.optional  # SGLang's classes and transformers come with the sglang-classes extra
@pytest.mark.parametrize("name", ["sglang", "transformers"])
def test_the_integrations_steps_run_their_own_declarations(tmp_path, capsys, name):
    """--step sglang and --step transformers: the pools the integrations build, with their declarations."""
    if name == "sglang":
        from optional import require_sglang
        require_sglang()
        import sglang_harness  # noqa: F401 (its stand-ins for torchvision and sgl_kernel, as every SGLang test)
    else:
        pytest.importorskip("transformers")
    data, _ = run(tmp_path, capsys, "--device", "cpu", "--step", name, "--modes", "decode:1,verify:4")
    assert {(r["mode"], r["bs"]) for r in data["rows"]} == {(m, b) for m in ("decode", "verify") for b in (1, 2)}
    assert all(r["token_match"] == 1.0 for r in data["rows"]) and data["env"]["misses"] == 0

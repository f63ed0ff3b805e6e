"""bench/replay_latency.py: a CPU smoke run end to end, its staging methods against the inputs they stage,
and (GPU) the full method set with the GPU floor beside graphpool's GPU time."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import graphpool as gp
from bench import default_step, replay_latency
from bench.staging_methods import EagerTritonStage, sglang_style


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
    args = replay_latency.parse_args([])
    assert replay_latency.resolve(args, cuda=False) == ["iters", "warmup", "batch_sizes"]
    assert (args.iters, args.batch_sizes) == (10, "1,2,4,8")
    assert Path(args.out) == Path(replay_latency.ROOT) / "out" / "replay_latency"
    assert "/out/" in (Path(replay_latency.ROOT) / ".gitignore").read_text().split(), "out/ must be ignored by git"
    gpu_args = replay_latency.parse_args(["--iters", "7"])
    assert replay_latency.resolve(gpu_args, cuda=True) == [] and gpu_args.iters == 7


def _pool(device: str) -> tuple[gp.GraphPool, default_step.BenchStep]:
    step = default_step.make(torch.device(device), max_tokens=64, hidden=32, vocab=64, layers=1)
    pool = gp.GraphPool([gp.Mode("decode", 1), gp.Mode("verify", 16)], step.inputs, [1, 2, 4], device=device,
                        staging="torch")
    pool.capture(step.step_fn, progress=False)
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
    from bench.replay_report import GRAPH_METHODS
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
    from bench.replay_report import GRAPH_METHODS, summary
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
    b2b_host = lines[[i for i, l in enumerate(lines) if l.startswith("host us per step (median, steps issued back")][0] + 2]
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

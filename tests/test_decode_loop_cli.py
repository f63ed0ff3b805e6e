"""bench/decode_loop.py runs end to end on CPU (eager twin) and writes JSON, a plot and the table."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import decode_loop


def test_cli_tiny_cpu_run_writes_json_png_and_table(tmp_path, capsys):
    out = tmp_path / "dl"
    assert decode_loop.main(["--device", "cpu", "--concurrency", "1,4", "--steps", "4", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    runs = {(r["variant"], r["concurrency"]): r for r in data["results"]}
    assert set(runs) == {(v, c) for v in ("plain", "spec", "dynamic", "dynamic_eager_plain") for c in (1, 4)}
    assert all(r["tokens"] > 0 and r["graph_misses"] == 0 for r in runs.values())
    assert runs[("spec", 1)]["mean_accept"] > 1
    assert runs[("dynamic", 4)]["match_vs_plain"]["identical"] in (None, 1.0)
    assert out.with_suffix(".png").stat().st_size > 1000
    assert data["meta"]["threshold"] == 1 and data["meta"]["crossover"] is None  # fixed, not chosen on CPU
    assert runs[("dynamic", 1)]["steps"]["verify"] > 0 and runs[("dynamic", 4)]["steps"]["decode"] > 0
    text = capsys.readouterr().out
    assert "CPU smoke run of the code path" in text and "not a speed measurement" in text
    last = text.rstrip().splitlines()[-1]
    assert last.startswith("CPU smoke run done") and "6 graphs" in last and "identical to plain decode: 6 of 6" in last
    # No speed figure and no conclusion from eager-twin timings: no tok/s, roofline, crossover or target ratio.
    assert "tok/s" not in text and "tokens/s" not in text
    assert "roofline (" not in text and "spec beat plain" not in text and "dyn/best" not in text
    assert " k parameters" in text and "0.00 B" not in text
    # What ran, per C: dynamic speculates at the smallest C only (the fixed CPU threshold), dyn-eager's plain
    # steps are eager; every run's output equals plain decoding's.
    table = text[text.index("steps by mode at each concurrency C"):].splitlines()
    assert table[1].split() == ["C", "plain", "spec", "dynamic", "dyn-eager", "accept", "=", "plain"]
    assert table[2].split()[:9] == ["1", "4", "decode", "4", "verify", "4", "verify", "4", "verify"]
    assert table[3].split()[:10] == ["4", "4", "decode", "4", "verify", "4", "decode", "4", "eager", "decode"]
    assert table[2].split()[-1] == table[3].split()[-1] == "3/3"
    # Every column of the two tables is explained under it, the prefill mode too.
    for word in ("mode:", "prefill (", "bs:", "capture ms:", "graph MiB:", "replays:", "padded rows:",
                 "C:", "plain, spec, dynamic, dyn-eager:", "accept:", "= plain:", "'-':"):
        assert word in " ".join(text.split()), word  # legends are wrapped


def test_default_output_goes_to_the_ignored_out_folder():
    args = decode_loop.parse_args([])
    assert Path(args.out) == decode_loop.ROOT / "out" / "decode_loop"
    assert "/out/" in (decode_loop.ROOT / ".gitignore").read_text().split(), "out/ must be ignored by git"


def test_gpu_table_explains_ratio_columns_and_marks():
    from bench.decode_report import check_targets, table
    results = {(v, c): {"tokens_per_s": t, "mean_accept": 2.5 if v != "plain" else 0.0, "graph_misses": 0}
               for c in (1, 32) for v, t in (("plain", 100.0), ("spec", 150.0), ("dynamic", 120.0),
                                             ("dynamic_eager_plain", 100.0))}
    text = table(results, [1, 32], check_targets(results, [1, 32]), policy_note="crossover: x")
    flat = " ".join(text.split())
    assert "0.80!" in text and "'!': that target missed" in flat and "dyn/eager:" in flat
    assert text.splitlines()[-1].startswith("targets:") and "MISSED at C = [1, 32]" in text


def test_help_exits_cleanly(capsys):
    import pytest
    with pytest.raises(SystemExit) as e:
        decode_loop.parse_args(["--help"])
    assert e.value.code == 0 and "--quick" in capsys.readouterr().out


def _results(plain: dict, spec: dict) -> dict:
    out = {("plain", c): {"tokens_per_s": t} for c, t in plain.items()}
    out.update({("spec", c): {"tokens_per_s": t} for c, t in spec.items()})
    return out


def test_threshold_follows_the_crossover_and_ignores_a_stray_win():
    cs = [1, 2, 4, 8, 10, 16, 32, 64, 128]
    plain = {c: 400.0 * c for c in cs}
    spec = {c: plain[c] * (1.3 if c <= 10 else 0.7) for c in cs}
    spec[64] = plain[64] * 1.01  # one noisy win far above the crossover
    res = _results(plain, spec)
    assert decode_loop.crossover(res, cs) == 64  # the largest win, dragged up by the stray point
    assert decode_loop.choose_threshold(res, cs) == (10, 8)  # off above 10, back on at <= 8
    assert decode_loop.choose_threshold(_results(plain, {c: 2 * plain[c] for c in cs}), cs) == (128, 64)
    assert decode_loop.choose_threshold(_results(plain, {c: plain[c] / 2 for c in cs}), cs) == (0, 0)


def test_match_rate_compares_the_tokens_both_runs_produced():
    a = {1: [5, 6, 7, 8], 2: [1, 2, 3], 3: [9]}
    b = {1: [5, 6], 2: [1, 4, 3, 0], 4: [2]}
    got = decode_loop.match_rate(a, b)
    assert got == {"requests": 2, "identical": 0.5, "tokens": 4 / 5}


def _run(v, c, tps, accept=None, misses=0):
    return {"tokens_per_s": tps, "mean_accept": accept, "graph_misses": misses}


def test_acceptance_checks_pass_and_fail_on_the_targets():
    from bench.decode_report import acceptance, acceptance_lines, check_targets
    cs = [1, 32]
    roof = {1: (0.80, 1.23), 32: (0.83, 2.70)}
    res = {("plain", 1): _run("plain", 1, 1000 / 1.0), ("spec", 1): _run("spec", 1, 1000 / 1.0 * 1.6, 2.67),
           ("dynamic", 1): _run("dynamic", 1, 1590.0, 2.67), ("dynamic_eager_plain", 1): _run("x", 1, 1500.0),
           ("plain", 32): _run("plain", 32, 30000.0), ("spec", 32): _run("spec", 32, 20000.0, 2.6),
           ("dynamic", 32): _run("dynamic", 32, 29000.0), ("dynamic_eager_plain", 32): _run("x", 32, 10000.0)}
    ok = {name: passed for name, passed, _ in acceptance(res, cs, check_targets(res, cs), roof)}
    # plain 1.0 ms vs 0.8 roofline: 1.25x; spec/plain 1.6 vs 0.85 x 2.67 x 0.8 / 1.23 = 1.48
    assert all(ok.values()), ok
    res[("plain", 1)] = _run("plain", 1, 1000 / 1.1)    # 1.1 ms: 1.375x the roofline
    res[("dynamic", 32)] = _run("dynamic", 32, 14000.0)  # < 0.95 x plain and < 1.5 x dyn-eager
    res[("spec", 32)]["graph_misses"] = 2
    identity = {"ok": False, "attention": "torch", "spec_identical": 7, "dynamic_identical": 8, "requests": 8,
                "switched": True, "graph_misses": 0}
    checks = acceptance(res, cs, check_targets(res, cs), roof, identity)
    failed = {name for name, passed, _ in checks if passed is False}
    assert failed == {"plain step at C=1 within 1.3x its roofline", "dynamic >= 0.95 x max(plain, spec) at every C",
                      "dynamic >= 1.5 x dyn-eager at C >= 32", "no graph misses",
                      "float32 greedy output of spec and dynamic identical to plain"}
    lines = acceptance_lines(checks).splitlines()
    assert len(lines) == 6 and lines[0].startswith("FAIL  plain step at C=1") and lines[1].startswith("PASS  spec/plain")
    missing = acceptance({}, cs, [], roof)
    assert [passed for _, passed, _ in missing][:2] == [None, None]
    # A GPU without roofline figures: those two checks are not judged, the others are.
    unjudged = acceptance(res, cs, check_targets(res, cs), {})
    assert [passed for _, passed, _ in unjudged][:2] == [None, None]
    assert all("this GPU's roofline" in detail for _, _, detail in unjudged[:2])
    assert {name for name, passed, _ in unjudged if passed is False} == failed - {"plain step at C=1 within 1.3x its roofline",
                                                                                 "float32 greedy output of spec and dynamic identical to plain"}


@pytest.mark.gpu
def test_a_gpu_run_draws_the_roofline_of_the_gpu_it_runs_on(tmp_path, capsys):
    """The main job's roofline table (and so its two roofline checks) takes the running GPU's figures."""
    import torch

    from bench.engine.config import ModelConfig, SpecConfig
    from bench.engine.costs import device_roof, roofline_table
    out = tmp_path / "dl"
    assert decode_loop.main(["--device", "cuda", "--size", "tiny", "--concurrency", "1", "--steps", "4",
                             "--variants", "plain,spec", "--out", str(out)]) == 0
    meta = json.loads(out.with_suffix(".json").read_text())["meta"]
    name = torch.cuda.get_device_name()
    hw = device_roof(name)
    if hw is None:
        assert meta["roofline"] is None and f"no roofline figures for {name}" in capsys.readouterr().out
        return
    keys = int(meta["roofline"][0].split("key length ")[1].rstrip(":"))
    want = roofline_table(ModelConfig(**meta["model"]), SpecConfig(**meta["spec"]), [1], keys, **hw)
    assert meta["roofline"] == want.splitlines()


def test_attention_kernel_and_run_ahead_flags():
    args = decode_loop.resolve(decode_loop.parse_args(["--device", "cpu", "--attention", "torch", "--kernels", "torch",
                                                       "--run-ahead", "0", "--identity-check"]))
    assert (args.attention, args.kernels, args.run_ahead, args.identity_check) == ("torch", "torch", 0, True)
    import pytest
    with pytest.raises(SystemExit):
        decode_loop.parse_args(["--attention", "triton"])


def test_windows_last_a_second_on_a_gpu_but_not_on_cpu_or_across_ranks():
    """--min-seconds: 1 s by default on a GPU, so every variant's window holds request ends in proportion;
    0 on CPU (a smoke run) and with --tp (ranks must end their windows after the same step count); an
    explicit value is kept. (resolve() only fills defaults: no GPU is touched.)"""
    resolve = lambda *a: decode_loop.resolve(decode_loop.parse_args(list(a)))  # noqa: E731
    assert resolve("--device", "cuda").min_seconds == 1.0
    assert resolve("--device", "cpu").min_seconds == 0.0
    assert resolve("--device", "cuda", "--tp", "2").min_seconds == 0.0
    assert resolve("--device", "cuda", "--min-seconds", "0").min_seconds == 0.0
    assert resolve("--device", "cpu", "--min-seconds", "2.5").min_seconds == 2.5
    with pytest.raises(SystemExit, match="--min-seconds cannot be used with --tp"):
        decode_loop.main(["--device", "cpu", "--tp", "2", "--min-seconds", "1"])


def test_a_window_of_some_seconds_has_the_requests_to_fill_it(monkeypatch):
    """The request count grows with --min-seconds, so a long window does not run out of arrivals and end
    early: at C = 1, 2000 tokens/s of budget per second over outputs of 8 tokens."""
    from types import SimpleNamespace

    from bench.engine.config import ModelConfig, SpecConfig
    args = decode_loop.resolve(decode_loop.parse_args(["--device", "cpu", "--min-new", "8", "--max-new", "8",
                                                       "--steps", "2", "--min-seconds", "0.5"]))
    made = []

    class Served(Exception):
        pass

    def serve(*a, **k):
        raise Served  # the requests are made; nothing needs to run

    monkeypatch.setattr(decode_loop, "make_requests", lambda n, *a, **k: made.append(n))
    monkeypatch.setattr(decode_loop, "DecodeLoop", serve)
    engine = SimpleNamespace(spec=SpecConfig(), cfg=ModelConfig.tiny())
    with pytest.raises(Served):
        decode_loop.run_variant(engine, None, "plain", 1, args, None)
    assert made and made[0] >= 0.5 * 2000 / 8


@pytest.mark.interpreter  # CPU tensors through Triton: the interpreter must be on before Triton is imported
def test_draft_select_flag_reaches_the_engine(tmp_path, capsys):
    """``--draft-select fused`` runs the fused selection (here in Triton's interpreter) and says so. (Setting
    TRITON_INTERPRET inside the test is too late where Triton was imported with CUDA present: it failed so on
    the H200; the kernels' CUDA path has its own GPU tests.)"""
    pytest.importorskip("triton")
    out = tmp_path / "dl"
    assert decode_loop.main(["--device", "cpu", "--concurrency", "1", "--steps", "3", "--draft-select", "fused",
                             "--variants", "spec", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["meta"]["spec"]["draft_select"] == "fused" and "fused draft selection" in capsys.readouterr().out
    assert data["meta"]["draft_select"] == "fused"  # the path that ran, also where the option was "auto"


def test_draft_select_flag_refuses_what_the_machine_cannot_run(tmp_path, monkeypatch):
    """Where Triton cannot run the fused selection (a CPU device without the interpreter) the run stops with
    one line naming the option, not a traceback; ``auto`` is the default."""
    assert decode_loop.parse_args([]).draft_select == "auto"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(SystemExit, match="draft_select='fused' needs Triton and a CUDA device"):
        decode_loop.main(["--device", "cpu", "--concurrency", "1", "--steps", "3", "--draft-select", "fused",
                          "--out", str(tmp_path / "dl")])


@pytest.mark.parametrize("argv, says", [
    (["--concurrency", "1,x"], "--concurrency: takes a comma list of positive integers"),
    (["--concurrency", "0"], "--concurrency: takes positive integers"),
    (["--threshold", "abc"], "--threshold: takes auto or a batch size >= 0"),
    (["--variants", "foo"], "--variants: takes a comma list of plain, spec, dynamic, dynamic_eager_plain"),
    (["--warmup-steps", "-1"], "--warmup-steps: must be >= 0"),
    (["--steps", "0"], "--steps: must be >= 1"),
    (["--max-new", "1"], "--min-new: 8 is above --max-new 1"),
    (["--draft-steps", "0"], "--draft-steps: must be >= 1"),
    (["--draft-noise", "-1"], "--draft-noise: must be >= 0"),
    (["--device", "tpu"], "--device: takes auto, cpu, cuda or cuda:N"),
    (["--tp", "3"], "--tp: tensor parallelism over 3 ranks splits heads"),
    (["--tp", "0"], "--tp: must be >= 1"),
    (["--out", "/proc/no-such-dir/x"], "--out: cannot write /proc/no-such-dir/x.json"),
    (["--tiers", "4x2"], "--tiers: takes a comma list of TOPKxSTEPS:TOKENS"),
    (["--tiers", "4x2:16"], "--tiers: tier topk=4 steps=2 carries 16 draft tokens, not fewer"),
    (["--tiers", "1x1:8"], "--tiers: num_draft_tokens must be in [2, 2] for topk=1, steps=1"),
    (["--tiers", "4x2:8", "--variants", "spec_4"], "--variants: takes a comma list of plain, spec, dynamic, "
                                                   "dynamic_eager_plain, spec_8, tiers; got ['spec_4']"),
    (["--tiers", "4x2:8", "--tier-bounds", "4"], "--tier-bounds: names 1 bounds for 2 speculative tiers"),
    (["--tiers", "4x2:8", "--tier-bounds", "8,4"], "--tier-bounds: tier 1 ('tier 1') off_above=4 is not above"),
    (["--tiers", "4x2:8", "--tier-bounds", "4/6,8"], "--tier-bounds: tier 0 ('tier 0'): on_at_or_below=6 is above"),
    (["--device", "cuda", "--tiers", "4x2:8", "--variants", "plain,spec,tiers"],
     "--tier-bounds: auto chooses the bounds from this run's plain, spec, spec_8: run them too"),
])
def test_a_bad_option_stops_before_any_work_with_one_line_naming_it(argv, says, monkeypatch):
    """Every option is checked before the engine is built: one line naming the option and what it takes,
    not a traceback after the sweep."""
    monkeypatch.setattr(decode_loop, "build", lambda *a, **k: pytest.fail("built an engine for a bad option"))
    with pytest.raises(SystemExit, match="decode_loop: " + __import__("re").escape(says)):
        decode_loop.main(["--device", "cpu", *argv] if "--device" not in argv else argv)


def test_the_json_and_plot_are_written_together_or_not_at_all(tmp_path, monkeypatch):
    """A failure while writing (here: the plot) leaves the previous pair as it was and no temporary file; a
    prefix with a dot keeps it (``run_c1.5`` -> ``run_c1.5.json``, not ``run_c1.json``)."""
    out = tmp_path / "run_c1.5"
    argv = ["--device", "cpu", "--concurrency", "1", "--steps", "2", "--variants", "plain", "--out", str(out)]
    assert decode_loop.main(argv) == 0
    pair = [tmp_path / "run_c1.5.json", tmp_path / "run_c1.5.png"]
    before = [p.read_bytes() for p in pair]

    def failing_plot(results, cs, path, **kw):
        Path(path).write_bytes(b"\x89PNG half")
        raise KeyboardInterrupt

    monkeypatch.setattr(decode_loop, "plot", failing_plot)
    with pytest.raises(KeyboardInterrupt):
        decode_loop.main(argv)
    assert [p.read_bytes() for p in pair] == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run_c1.5.json", "run_c1.5.png"]
    monkeypatch.setattr(decode_loop, "plot", lambda *a, **k: None)  # no matplotlib: the old plot must go
    assert decode_loop.main(argv) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run_c1.5.json"]
    assert json.loads(pair[0].read_text())["meta"]["size"] == "tiny"


def test_a_tiered_cpu_run_takes_every_tier_and_reports_each(tmp_path, capsys):
    out = tmp_path / "tiers"
    assert decode_loop.main(["--device", "cpu", "--concurrency", "1,2,4,8", "--steps", "3", "--tiers", "4x2:8,1x3:4",
                             "--variants", "plain,spec_8,tiers", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    runs = {(r["variant"], r["concurrency"]): r for r in data["results"]}
    assert set(runs) == {(v, c) for v in ("plain", "spec_8", "tiers") for c in (1, 2, 4, 8)}
    # CPU bounds: the smallest C per tier, so the sweep's batch sizes take one tier each, plain decode above.
    assert data["meta"]["tier_bounds"] == [["verify", 1, 1], ["verify_8", 2, 2], ["verify_4", 4, 4]]
    ran = {c: {m for m, n in runs[("tiers", c)]["steps"].items() if n} for c in (1, 2, 4, 8)}
    assert ran == {1: {"verify"}, 2: {"verify_8"}, 4: {"verify_4"}, 8: {"decode"}}
    assert runs[("spec_8", 4)]["accept_by_tier"].keys() == {"verify_8"} and runs[("spec_8", 4)]["mean_accept"] > 1
    assert all(r["graph_misses"] == 0 for r in runs.values())
    assert set(data["meta"]["graph_stats"]["graph_mib_by_mode"]) == {"decode", "verify", "verify_8", "verify_4",
                                                                     "prefill"}
    text = capsys.readouterr().out
    assert "tiers: verify <= 1 | verify_8 <= 2 | verify_4 <= 4 | decode (fixed at the smallest C" in text
    table = text[text.index("steps by mode at each concurrency C"):].splitlines()
    assert table[1].split()[:8] == ["C", "plain", "spec", "dynamic", "dyn-eager", "spec", "8", "tiers"]
    assert table[3].split() == ["2", "3", "decode", "-", "-", "-", "3", "verify_8", "3", "verify_8", "-", "2/2"]
    assert "plain, spec, dynamic, dyn-eager, spec <n>, tiers:" in " ".join(text.split())


def test_tier_bounds_follow_the_fixed_tiers_and_leave_out_a_tier_that_never_wins():
    from bench.decode_tiers import choose_bounds
    cs = [1, 2, 4, 8, 16, 32, 64]
    gain = {"spec": {1: 1.5, 2: 1.4, 4: 1.1, 8: 0.9, 16: 0.6, 32: 0.4, 64: 0.3},
            "spec_8": {1: 1.3, 2: 1.3, 4: 1.25, 8: 1.2, 16: 1.0, 32: 0.7, 64: 1.01},  # a stray win at 64
            "spec_4": {1: 1.1, 2: 1.1, 4: 1.1, 8: 1.1, 16: 1.1, 32: 0.9, 64: 0.8},
            "spec_2": {c: 0.5 for c in cs}}                                          # never the best
    res = {("plain", c): {"tokens_per_s": 100.0 * c} for c in cs}
    res.update({(v, c): {"tokens_per_s": 100.0 * c * g[c]} for v, g in gain.items() for c in cs})
    assert choose_bounds(res, cs, ["spec", "spec_8", "spec_4", "spec_2"]) == [
        ("spec", 2, 1), ("spec_8", 8, 4), ("spec_4", 16, 8)]
    with pytest.raises(ValueError, match="need the runs of spec, spec_8, plain"):
        choose_bounds({}, cs, ["spec", "spec_8"])


def _threshold_before(results, cs):
    """decode_loop.choose_threshold as it was before the tiers (commit 3e1dedd): the oracle of the two-tier case."""
    def tps(v, c):
        return results[(v, c)]["tokens_per_s"]
    measured = [c for c in cs if ("spec", c) in results and ("plain", c) in results]

    def score(t):
        return sum(tps("spec" if c <= t else "plain", c) / max(tps("spec", c), tps("plain", c)) for c in measured)
    off = max([0] + measured, key=lambda t: (score(t), -t))
    return off, max([c for c in measured if c < off], default=off)


def test_the_on_off_threshold_is_the_two_tier_case_of_the_tier_bounds():
    import random
    rng = random.Random(0)
    cs = [1, 2, 4, 8, 16, 32, 64, 128]
    for _ in range(300):
        res = {(v, c): {"tokens_per_s": rng.choice([1.0, 2.0, 3.0, rng.uniform(0.5, 3)])}
               for v in ("plain", "spec") for c in cs}
        assert decode_loop.choose_threshold(res, cs) == _threshold_before(res, cs)


def test_gpu_table_and_acceptance_judge_the_tiers():
    from bench.decode_report import acceptance, check_targets, table
    figures = {4: {"plain": 100.0, "spec": 120.0, "spec_8": 150.0, "dynamic": 119.0, "dynamic_eager_plain": 90.0,
                   "tiers": 110.0},   # a shorter tier beats both extremes, tiers lose to it and to dynamic
               32: {"plain": 300.0, "spec": 150.0, "spec_8": 250.0, "dynamic": 299.0, "dynamic_eager_plain": 150.0,
                    "tiers": 298.0}}  # plain is the best fixed tier: tiers within 0.98, no tier/dyn judgement
    results = {(v, c): {"tokens_per_s": t, "mean_accept": 2.0, "graph_misses": 0}
               for c, row in figures.items() for v, t in row.items()}
    checks = check_targets(results, [4, 32])
    assert checks[0]["tiers_over_fixed"] == pytest.approx(110 / 150) and not checks[0]["tiers_ok"]
    assert checks[0]["tiers_over_dyn"] == pytest.approx(110 / 119) and not checks[0]["tiers_dyn_ok"]
    assert checks[1]["tiers_ok"] and "tiers_over_dyn" not in checks[1]
    text = table(results, [4, 32], checks)
    assert "spec 8" in text and "tier/fixed" in text and "0.73!" in text and "0.92!" in text
    assert "MISSED at C = [4]" in text.splitlines()[-1]
    judged = {name: ok for name, ok, _ in acceptance(results, [4, 32], checks, {})}
    assert judged["tiers >= 0.98 x the best fixed tier at every C"] is False
    assert judged["tiers > dynamic where a shorter tier beats plain and spec"] is False


def test_a_gpu_run_maps_the_chosen_bounds_to_the_engines_tiers():
    """What the tiers variant gets on a GPU: the bounds chosen from the fixed tiers, as the engine's modes; plain
    decode everywhere when no tier wins (a schedule that never speculates)."""
    from types import SimpleNamespace

    from bench.decode_tiers import schedule
    from bench.engine.config import SpecConfig, tier_modes
    main = SpecConfig()
    engine = SimpleNamespace(tiers=tier_modes(main, [SpecConfig(topk=4, steps=2, num_draft_tokens=8)]))
    args = decode_loop.resolve(decode_loop.parse_args(["--device", "cpu", "--concurrency", "1,8,64",
                                                       "--tiers", "4x2:8"]))
    figures = {"plain": {1: 1.0, 8: 1.0, 64: 1.0}, "spec": {1: 2.0, 8: 1.1, 64: 0.5},
               "spec_8": {1: 1.5, 8: 1.3, 64: 0.6}}
    res = {(v, c): {"tokens_per_s": t} for v, row in figures.items() for c, t in row.items()}
    bounds, how = decode_loop.tier_bounds(args, res, True, None, engine)
    assert bounds == [("verify", 1, 1), ("verify_8", 8, 8)] and "from this run" in how
    plain = {(v, c): {"tokens_per_s": 1.0 if v == "plain" else 0.1} for v in figures for c in (1, 8, 64)}
    bounds, _ = decode_loop.tier_bounds(args, plain, True, None, engine)
    assert bounds == [("verify", 0, 0)]
    assert [schedule(bounds).choose(bs) for bs in (1, 64)] == ["decode", "decode"]

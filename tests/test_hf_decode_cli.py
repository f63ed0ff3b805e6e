"""bench/hf_decode.py --smoke runs the whole benchmark path on CPU (tiny model, eager twin) in seconds and writes
its JSON, CSV and plot; the goals are reported but not judged on a smoke run. With --tiers, (f) runs a tier
schedule from the same pool and reports its steps per tier; bad tiers stop it before any work."""
from __future__ import annotations

import csv
import json

import pytest

from bench import hf_decode
from bench.hf_report import Run, check_goals, table
from tests.hf_models import needs_transformers
from tests.hf_models import one_thread  # noqa: F401 (a fixture)


@needs_transformers
def test_smoke_run_writes_json_csv_png_and_the_table_last(tmp_path, capsys):
    out = tmp_path / "hf"
    assert hf_decode.main(["--smoke", "--batch-sizes", "1,2", "--tiers", "3:1,1:2", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    points = {(r["variant"], r["bs"]): r for r in data["results"]}
    assert set(points) == {(v, b) for v in ("hf-eager", "hf-static", "hf-lookup", "gp-plain", "gp-lookup",
                                            "gp-tiers") for b in (1, 2)}
    for key in [("hf-eager", 1), ("hf-eager", 2), ("hf-static", 2), ("hf-lookup", 1), ("gp-plain", 2),
                ("gp-lookup", 2)]:
        assert points[key]["tokens_per_s"] > 0 and points[key]["error"] is None, key
    assert "refused by transformers" in points[("hf-lookup", 2)]["error"]  # (c) cannot batch; (e) does
    assert points[("gp-plain", 2)]["match_vs_eager"] == 1.0 and points[("gp-lookup", 2)]["match_vs_eager"] == 1.0
    assert max(points[("gp-lookup", b)]["accept"] or 0 for b in (1, 2)) > 1 and points[("gp-plain", 1)]["misses"] == 0
    assert set(data["step_gpu_ms"]) == {"decode", "verify", "verify_1"} and data["meta"]["smoke"] is True
    # (f): 3 drafts at bs 1, 1 draft at bs 2 (3 again once one row ends first); tokens equal (a)'s
    assert all(points[("gp-tiers", b)]["match_vs_eager"] == 1.0 for b in (1, 2))
    assert set(data["meta"]["tier_steps"]["1"]) <= {"verify", "decode"} and "verify" in data["meta"]["tier_steps"]["1"]
    assert "verify_1" in data["meta"]["tier_steps"]["2"]
    assert len(data["goals"]) == 5 and all(g["status"].startswith("not judged") for g in data["goals"])
    rows = list(csv.DictReader(out.with_suffix(".csv").open()))
    assert len(rows) == 12 and out.with_suffix(".png").stat().st_size > 5000
    text = capsys.readouterr().out
    assert text.rstrip().splitlines()[-1].startswith("hf_decode: smoke run done")
    assert "SMOKE RUN" in text and "d/b" in text and "goal not judged" in text and "(f) gp-tiers tokens/s" in text


@needs_transformers
def test_sampled_smoke_run_samples_every_variant_and_compares_no_tokens(tmp_path, capsys):
    """--sample: every variant samples (the smoke model's tokens then differ from a greedy run's), and no row is
    compared with (a)'s."""
    out = tmp_path / "hf"
    assert hf_decode.main(["--smoke", "--sample", "--batch-sizes", "1", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["meta"]["sampled"] is True and data["meta"]["choice"]["do_sample"] is True
    runs = [r for r in data["results"] if r["tokens_per_s"]]
    assert {r["variant"] for r in runs} >= {"hf-eager", "gp-plain", "gp-lookup"}
    assert all(r["match_vs_eager"] is None for r in runs)
    assert "every variant sampled" in capsys.readouterr().out


@needs_transformers
@pytest.mark.parametrize("tiers, message", [("2:x", "is not DRAFTS:OFF_ABOVE"), ("4:1", "raise --draft-tokens"),
                                            ("1:1,2:2", "longest draft first")])
def test_bad_tiers_stop_before_any_work(tiers: str, message: str, capsys):
    with pytest.raises(SystemExit):
        hf_decode.parse_args(["--smoke", "--tiers", tiers])
    assert message in capsys.readouterr().err


def _runs(d: float, b: float, accept: float) -> list[Run]:
    runs = [Run("hf-eager", 1, tokens_per_s=100.0), Run("hf-static", 1, tokens_per_s=b),
            Run("gp-plain", 1, tokens_per_s=d), Run("gp-lookup", 1, tokens_per_s=d * 1.5, accept=accept),
            Run("hf-lookup", 1, tokens_per_s=90.0), Run("hf-eager", 2, tokens_per_s=150.0),
            Run("hf-static", 2, error="skipped: the compile budget"), Run("gp-plain", 2, tokens_per_s=300.0),
            Run("gp-lookup", 2, tokens_per_s=250.0, accept=1.2),
            Run("hf-lookup", 2, error="refused by transformers: assisted generate is only supported for "
                                      "batch_size = 1")]
    return runs


def test_goals_pass_fail_and_not_applicable():
    goals = {g["goal"]: g for g in check_goals(_runs(250.0, 200.0, 3.0), {"decode": 1.0, "verify": 1.2}, judged=True)}
    status = [g["status"] for g in goals.values()]
    assert status == ["PASS", "PASS", "PASS", "PASS", "PASS"], goals
    assert "no (b) figure at bs [2]" in goals["(d) >= 1.0x (b) at every bs measured"]["value"]
    bad = [g["status"] for g in check_goals(_runs(150.0, 200.0, 1.2), {"decode": 1.0, "verify": 1.4}, judged=True)]
    assert bad == ["FAIL", "FAIL", "FAIL", "n.a.", "PASS"]


def test_table_names_why_b_was_skipped():
    """Run BT skipped (b) at its deadline, and the table said "compile budget": the flag to raise differs."""
    meta = {"model": "m", "dtype": "bfloat16", "device_name": "gpu", "new_tokens": 8, "capture_s": 1.0,
            "graphpool_step": "eager", "smoke": False}
    late = [Run("hf-static", 1, error="skipped: a compile (~90 s) would exceed the run's deadline (320 s, "
                                      "--deadline-s; 101 s left)"), Run("gp-plain", 1, tokens_per_s=9.0)]
    assert "(b) skipped at bs [1] (the run's deadline, --deadline-s)" in table(late, {}, [], meta)
    late[0].error = "skipped: a compile (~90 s) would exceed the compile budget (240 s, --compile-budget-s)"
    assert "(b) skipped at bs [1] (the compile budget, --compile-budget-s)" in table(late, {}, [], meta)


def test_b_is_compiled_when_the_time_left_fits_a_measured_first_compile(monkeypatch):
    """Run BT had 101 s left for (b) and skipped it at every size on a 90 s guess; its first compiles take 14-16 s
    (runs BI, BV). With that time left, (b) now runs at both ends and then at the sizes between."""
    import argparse
    import time

    def fake_hf_runs(model, batches, args, variant, **kw):  # a compile of 15 s, then 0.5 s per timed call
        (bs,) = batches
        clock[0] += 15.5
        return [Run(variant, bs, tokens_per_s=100.0, seconds=0.5, first_call_s=15.5)]

    clock = [0.0]
    monkeypatch.setattr(hf_decode, "hf_runs", fake_hf_runs)
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    args = argparse.Namespace(deadline_s=320.0, started=-219.0, compile_budget_s=240.0, device="cuda")
    runs = hf_decode.static_runs(None, {bs: None for bs in (1, 2, 4, 8, 16, 32)}, args)
    done = [r.bs for r in runs if r.error is None]
    assert 1 in done and 32 in done, [(r.bs, r.error) for r in runs]
    assert all("deadline" in r.error for r in runs if r.error), [(r.bs, r.error) for r in runs]

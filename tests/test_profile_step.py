"""bench/profile_step.py's timeline analysis on a synthetic GPU timeline (the profile itself needs a GPU)."""
from __future__ import annotations

import pytest

from bench import profile_step


def test_analyse_splits_steps_at_the_staging_kernel_and_measures_busy_idle_and_host():
    events = [("_stage_kernel", 0, 1), ("prefill_gemm", 1, 50)]  # the prefill step: skipped
    launches = []
    for k in range(4):  # steps every 100 us: staging, a GEMM, an overlapping copy, a torch kernel, then idle
        t = 100 + 100 * k
        events += [("_stage_kernel", t, t + 2), ("nvjet_hsh_128x64", t + 2, t + 60),
                   ("Memcpy DtoH (Device -> Pinned)", t + 50, t + 65), ("void at::native::index_kernel", t + 65, t + 70),
                   ("BatchPrefillWithPagedKVCacheKernel", t + 70, t + 80)]
        launches.append(t - 30.0 + k)  # the host launches each graph ~30 us ahead, 101 us apart
    got = profile_step.analyse(events, launches, skip=1)
    assert got["steps"] == 3  # four marks close three steps
    assert got["kernels"] == 4 and got["period_ms"] == pytest.approx(0.1)
    assert got["busy_ms"] == pytest.approx(0.080) and got["idle_ms"] == pytest.approx(0.020)
    assert got["gemm_ms"] == pytest.approx(0.058) and got["copy_ms"] == pytest.approx(0.015)
    assert got["attention_ms"] == pytest.approx(0.010) and got["other_ms"] == pytest.approx(0.005)
    assert got["host_ms"] == pytest.approx(0.101)
    top = {k["name"]: (k["per_step"], k["us_per_step"]) for k in got["top_kernels"]}
    assert top["nvjet_hsh_128x64"] == (1, pytest.approx(58)) and list(top)[0] == "nvjet_hsh_128x64"  # by time
    assert "prefill_gemm" not in top and "nvjet_hsh_128x64" in profile_step.kernel_table(
        {"config": "c", "step": "spec", **got})
    assert profile_step.analyse(events[:3], [], skip=1) == {"steps": 0}
    # Where the GPU waited: 20 us after the attention kernel until the next step's staging kernel.
    waits = got["top_waits"]
    assert waits == [{"after": "BatchPrefillWithPagedKVCacheKernel", "before": profile_step.NEXT_STEP,
                      "per_step": 1, "us_per_step": pytest.approx(20)}]
    assert "BatchPrefillWithPagedKVCacheKernel -> (next step)" in profile_step.kernel_table(
        {"config": "c", "step": "spec", **got})


def test_step_waits_names_the_kernels_around_each_gap():
    # a copy overlapping the first kernel does not end the busy span early; gaps under MIN_WAIT_US are launch gaps
    inside = [("a", 0, 10), ("copy", 5, 8), ("b", 10.5, 20), ("c", 30, 40), ("d", 41, 45)]
    assert profile_step.step_waits(inside, end=45) == [("b", "c", pytest.approx(10))]
    assert profile_step.step_waits(inside, end=60) == [("b", "c", pytest.approx(10)),
                                                       ("d", profile_step.NEXT_STEP, pytest.approx(15))]
    assert profile_step.step_waits([], end=10) == []


def test_categories_and_union():
    assert [profile_step.category(n) for n in ("_rope_qk_kernel", "_stage_kernel", "sm90_xmma_gemm_bf16",
                                                "fmha_cutlassF_bf16_aligned", "void at::native::reduce_kernel",
                                                "_gemv_kernel")] == \
        ["triton", "staging", "gemm", "attention", "other", "gemm"]  # the engine's GEMV counts as a GEMM
    assert profile_step.union_us([(0, 10), (5, 12), (20, 21)]) == 13


def test_table_renders_rows_and_missing_steps():
    row = {"config": "flashinfer/fused", "step": "plain", "steps": 3, "kernels": 90, "ms_per_step": 1.0,
           "roofline_ms": 0.8, "busy_ms": 0.95, "idle_ms": 0.05, "host_ms": 0.2, "gemm_ms": 0.8,
           "tokens_per_step": 1.0}
    text = profile_step.table([row, {"config": "torch/torch", "step": "spec"}])
    assert "1.25" in text and "no GPU steps" in text


def test_cpu_run_says_it_needs_a_gpu(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    assert profile_step.main([]) == 0 and "needs a CUDA GPU" in capsys.readouterr().out


def test_gemv_probe_cpu_run_says_it_needs_a_gpu(capsys):
    import torch

    from bench import gemv_probe
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    assert gemv_probe.main([]) == 1 and "needs a CUDA GPU" in capsys.readouterr().out
    shapes = gemv_probe.model_shapes(gemv_probe.ModelConfig.medium(), 2)
    assert ("gate_up+silu", 14336, 4096, True) in shapes and ("down", 4096, 7168, False) in shapes

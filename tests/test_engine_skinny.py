"""The skinny tensor-core GEMM for 2-16 rows (bench/engine/skinny.py) against torch's F.linear.

On CPU the kernel runs in Triton's interpreter (float32 copies of the operands: the interpreter has no
16-bit matrix product); on the GPU the same tests run compiled, plus the medium model's shapes inside a
CUDA graph against eager calls."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.engine import gemv, skinny
from bench.engine.config import ModelConfig
from bench.engine.fused import silu_mul

pytestmark = pytest.mark.skipif(skinny.triton is None, reason="needs Triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (BLOCK_N, BLOCK_K, num_warps, stages, split_k): the probe's kinds, split-K among them
CONFIGS = [(16, 64, 4, 2, 1), (32, 64, 4, 3, 2), (64, 32, 4, 2, 4), (128, 64, 8, 2, 1)]


def _close(got: torch.Tensor, want: torch.Tensor, ulps: int = 1) -> None:
    """Equal to ``want`` up to ``ulps`` bf16 ulps of the output's scale (sums in another order)."""
    scale = want.abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=ulps * 2 ** -7 * scale)


def _operands(m: int, n: int, k: int, seed: int, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(DEVICE, dtype)
    return x, w


@pytest.mark.parametrize("m", [2, 5, 16])
@pytest.mark.parametrize("config", CONFIGS)
def test_skinny_matches_linear(m, config):
    """Rows padded to 16 and masked, 80 outputs (not a multiple of 64 or 128: masked columns), K 256
    split into 1, 2 or 4 slices."""
    x, w = _operands(m, 80, 256, seed=m)
    got = skinny.skinny(x, w, config=config)
    assert got.shape == (m, 80) and got.dtype == torch.bfloat16
    _close(got, F.linear(x.float(), w.float()))


@pytest.mark.parametrize("config", CONFIGS)
def test_skinny_silu_mul_matches_torch(config):
    x, w = _operands(6, 2 * 48, 256, seed=3)
    got = skinny.skinny(x, w, silu=True, config=config)
    want = silu_mul(F.linear(x, w), fused=False)  # the model's torch path: cuBLAS, then silu(gate) * up
    assert got.shape == (6, 48)
    _close(got, want, ulps=3)


def test_skinny_masks_a_k_not_a_multiple_of_the_block():
    x, w = _operands(3, 40, 200, seed=4)
    _close(skinny.skinny(x, w, config=(16, 64, 4, 2, 2)), F.linear(x.float(), w.float()))


def test_linear_routes_2_to_16_rows_to_the_skinny_gemm_only_when_on(monkeypatch):
    monkeypatch.setattr(gemv, "SKINNY", gemv.SKINNY)  # restored after the test
    calls = []
    real = gemv.skinny
    monkeypatch.setattr(gemv, "skinny", lambda x, w, silu=False: calls.append((x.shape[0], silu)) or real(x, w, silu))
    x, w = _operands(16, 32, 64, seed=5)
    gemv.use_skinny(False)
    assert torch.equal(gemv.linear(x[:4], w, fused=True), F.linear(x[:4], w)) and calls == []
    gemv.use_skinny(True)
    for rows in (1, 2, 16):
        gemv.linear(x[:rows], w, fused=True)
    gemv.linear_silu_mul(x[:4], w, fused=True)
    assert calls == [(2, False), (16, False), (4, True)]  # one row: the GEMV
    x17 = torch.cat([x, x[:1]])
    assert torch.equal(gemv.linear(x17, w, fused=True), F.linear(x17, w))  # 17 rows: cuBLAS
    assert torch.equal(gemv.linear(x[:4].float(), w.float(), fused=True), F.linear(x[:4].float(), w.float()))
    assert len(calls) == 3  # float32 keeps cuBLAS; fused=False too
    assert torch.equal(gemv.linear(x[:4], w, fused=False), F.linear(x[:4], w))
    assert len(calls) == 3


def test_skinny_rejects_bad_operands():
    x, w = _operands(4, 32, 64, seed=6)
    with pytest.raises(ValueError, match="last dimensions must agree"):
        skinny.skinny(x, w[:, :32])
    with pytest.raises(ValueError, match="even number of rows"):
        skinny.skinny(x, w[:31], silu=True)
    with pytest.raises(ValueError, match=r"takes 1 to 16 rows"):
        skinny.skinny(torch.cat([x] * 5), w)
    with pytest.raises(ValueError, match="split_k 3 must divide"):
        skinny.skinny(x, w, config=(16, 16, 4, 2, 3))
    assert not skinny.skinny_applies(x, w.t().contiguous().t())
    assert not skinny.skinny_applies(x[:1], w)  # one row is the GEMV's


@pytest.mark.gpu
def test_skinny_in_cuda_graph_equals_eager_at_model_shapes(monkeypatch):
    """The medium model's projections at 4 and 16 rows (a draft level, a verify step at C = 1), with the
    committed configurations: replayed from a CUDA graph, the eager call's bytes; against F.linear in
    float32 within an ulp (SwiGLU: against the torch path within 3)."""
    cfg = ModelConfig.medium()
    q, kv, h, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    monkeypatch.setattr(gemv, "SKINNY", True)
    calls = []
    real = skinny.skinny
    monkeypatch.setattr(gemv, "skinny", lambda x, w, silu=False: calls.append(1) or real(x, w, silu))
    for n, k, swiglu in [(q + 2 * kv, h, False), (h, q, False), (2 * inter, h, True), (h, inter, False)]:
        for m in (4, 16):
            x, w = _operands(m, n, k, seed=n + k + m)
            fn = gemv.linear_silu_mul if swiglu else gemv.linear
            calls.clear()
            eager = fn(x, w, True)
            assert calls, "the skinny GEMM did not run"
            want = silu_mul(F.linear(x, w), False) if swiglu else F.linear(x.float(), w.float())
            _close(eager, want, ulps=3 if swiglu else 1)
            static_x = x.clone()
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                out = fn(static_x, w, True)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager), (n, k, m)

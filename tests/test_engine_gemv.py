"""The few-token Triton kernels of the model's projections (bench/engine/gemv.py: the GEMV at one row, the
skinny GEMM at 2-16) against torch's F.linear.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET); on the GPU the
same tests run compiled, plus the model's shapes inside a CUDA graph against eager calls."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.engine import gemv
from bench.engine.config import ModelConfig
from bench.engine.fused import silu_mul
from bench.engine.model import build_target

pytestmark = pytest.mark.skipif(gemv.triton is None, reason="needs Triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF = [torch.bfloat16, torch.float16]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, ulps: int = 1) -> None:
    """Equal to ``want`` up to ``ulps`` ulps of the dtype, relative to the output's scale (sums in another
    order; the interpreter truncates where the GPU rounds)."""
    ulp = 2 ** -7 if dtype is torch.bfloat16 else 2 ** -10
    scale = want.abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=ulps * ulp * scale)


def _operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(DEVICE, dtype)
    return x, w


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("k", [200, 256])  # a masked last k block, and k a multiple of the block (no k mask)
def test_gemv_matches_linear(dtype, k):
    x, w = _operands(1, 37, k, dtype, seed=k)  # 37 outputs: masked columns
    got = gemv.linear(x, w, fused=True)
    assert got.dtype == dtype and got.shape == (1, 37)
    _close(got, F.linear(x.float(), w.float()), dtype)
    assert not torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("k", [130, 128])
def test_gemv_silu_mul_matches_torch(dtype, k):
    x, w = _operands(1, 2 * 45, k, dtype, seed=10 + k)
    got = gemv.linear_silu_mul(x, w, fused=True)
    want = silu_mul(F.linear(x, w), fused=False)  # the model's torch path: cuBLAS, then silu(gate) * up
    assert got.shape == (1, 45) and got.dtype == dtype
    # gate and up are each rounded to the dtype before the activation, as on the torch path; each factor
    # may be an ulp off (summation order), and the activation and the product round again
    _close(got, want, dtype, ulps=3)


def test_gemv_reads_a_row_of_a_wider_tensor():
    """The draft's LM head reads the last token of a sequence: a row view into the hidden states."""
    dtype = torch.bfloat16
    x, w = _operands(3, 29, 64, dtype, seed=3)
    row = x[-1:]
    assert row.data_ptr() != x.data_ptr()
    _close(gemv.linear(row, w, fused=True), F.linear(row.float(), w.float()), dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("m", [2, 5, 16])
@pytest.mark.parametrize("k", [200, 256])
def test_skinny_matches_linear(dtype, m, k):
    x, w = _operands(m, 45, k, dtype, seed=m * k)  # 45 outputs: a masked column tile
    got = gemv.linear(x, w, fused=True)
    assert gemv.small_m_kernel(x, w) == "skinny" and got.shape == (m, 45) and got.dtype == dtype
    _close(got, F.linear(x.float(), w.float()), dtype)
    swiglu = gemv.linear_silu_mul(x, torch.cat([w, w.flip(0)]), fused=True)
    _close(swiglu, silu_mul(F.linear(x, torch.cat([w, w.flip(0)])), fused=False), dtype, ulps=3)


def test_gemv_configs_agree():
    """Every (BLOCK_N, BLOCK_K, warps, stages) computes the same product (the probe may pick any of them)."""
    x, w = _operands(1, 50, 300, torch.bfloat16, seed=4)
    want = F.linear(x.float(), w.float())
    for config in [(1, 32, 1, 1), (4, 128, 4, 3), (16, 64, 4, 1), (8, 512, 8, 3)]:
        _close(gemv.gemv(x, w, config=config), want, torch.bfloat16)
    x4 = torch.cat([x, -x, 2 * x, x])
    want4 = F.linear(x4.float(), w.float())
    for config in [(16, 64, 4, 3), (32, 128, 4, 4), (64, 32, 4, 1)]:
        _close(gemv.skinny(x4, w, config=config), want4, torch.bfloat16)


def test_linear_picks_the_kernel_by_rows_and_dtype(monkeypatch):
    x, w = _operands(17, 16, 32, torch.bfloat16, seed=5)
    assert gemv.small_m_kernel(x[:1], w) == "gemv"
    assert [gemv.small_m_kernel(x[:m], w) for m in (2, 16)] == ["skinny", "skinny"]
    assert gemv.small_m_kernel(x, w) is None  # 17 rows: cuBLAS, bit for bit
    assert torch.equal(gemv.linear(x, w, fused=True), F.linear(x, w))
    x32, w32 = x[:1].float(), w.float()  # float32 keeps cuBLAS (see the module docstring)
    assert gemv.small_m_kernel(x32, w32) is None
    assert torch.equal(gemv.linear(x32, w32, fused=True), F.linear(x32, w32))
    assert torch.equal(gemv.linear(x[:4], w, fused=False), F.linear(x[:4], w))  # not fused: the torch path
    assert torch.equal(gemv.linear_silu_mul(x[:4], w, fused=False), silu_mul(F.linear(x[:4], w), False))
    monkeypatch.setattr(gemv, "GEMV_MAX_ROWS", gemv.GEMV_MAX_ROWS)  # restored after the test
    monkeypatch.setattr(gemv, "SKINNY_MAX_ROWS", gemv.SKINNY_MAX_ROWS)
    gemv.set_small_m_kernels(False)
    assert [gemv.small_m_kernel(x[:m], w) for m in (1, 2, 16)] == [None, None, None]
    assert torch.equal(gemv.linear(x[:1], w, fused=True), F.linear(x[:1], w))
    gemv.set_small_m_kernels(True)
    assert [gemv.small_m_kernel(x[:m], w) for m in (1, 2, 16)] == ["gemv", "skinny", "skinny"]


def test_gemv_rejects_bad_shapes():
    x, w = _operands(1, 16, 32, torch.bfloat16, seed=6)
    with pytest.raises(ValueError, match="last dimensions must agree"):
        gemv.gemv(x, w[:, :16])
    with pytest.raises(ValueError, match="even number of rows"):
        gemv.gemv(x, w[:15], silu=True)
    with pytest.raises(ValueError, match="contiguous in their last dimension"):
        gemv.gemv(x, w.t().contiguous().t())
    with pytest.raises(ValueError, match=r"the GEMV takes 1 to 1 rows: x must be \[M <= 1, K\]"):
        gemv.gemv(torch.cat([x, x]), w)
    with pytest.raises(ValueError, match=r"the skinny GEMM takes 1 to 16 rows"):
        gemv.skinny(x.expand(17, -1).contiguous(), w)
    with pytest.raises(ValueError, match=r"weight must be \[8, 4\]"):
        gemv.Projection(4, 8, torch.zeros(4, 8))


@pytest.mark.parametrize("tokens", [1, 3])
def test_model_flag_reaches_every_projection_and_forward_matches_torch(monkeypatch, tokens):
    """bf16 tiny model, one token (the GEMV) and three (the skinny GEMM): the fused forward (interpreted on
    CPU) against plain torch."""
    cfg = ModelConfig.tiny()
    model = build_target(cfg, seed=7, device=DEVICE, dtype=torch.bfloat16, kernels="torch")
    projections = [m for m in model.modules() if isinstance(m, gemv.Projection)]
    assert len(projections) == 4 * cfg.num_layers + 1 and not any(p.fused for p in projections)
    ids = torch.tensor([99, 5, 7][:tokens], device=DEVICE)
    pos = torch.arange(tokens, device=DEVICE)

    def dense(layer_id, q, k, v):
        from bench.engine.attention import reference_attention
        t = q.shape[0]
        return reference_attention(q, k, v, torch.ones(t, t, dtype=torch.bool, device=q.device).tril())

    want = model.logits(model(ids, pos, dense))
    model.fused = True
    assert all(p.fused for p in projections)
    calls = []
    kernel = "gemv" if tokens == 1 else "skinny"
    real = gemv.SMALL_M_KERNELS[kernel]
    monkeypatch.setitem(gemv.SMALL_M_KERNELS, kernel,
                        lambda x, w, silu=False, config=None: calls.append(silu) or real(x, w, silu, config))
    got = model.logits(model(ids, pos, dense))
    # every projection ran the kernel: per layer qkv, o, gate/up (with SwiGLU), down; then the LM head
    assert calls == [False, False, True, False] * cfg.num_layers + [False]
    # bf16 through two layers: logits agree to a few bf16 ulps of their scale (argmax may flip on near-ties)
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_kernels_in_cuda_graph_equal_eager_at_model_shapes(tp, m):
    """The medium model's projections at 1 token (plain step, the GEMV), 4 (a draft level) and 16 (verify;
    the skinny GEMM), per rank at TP 2: replayed from a CUDA graph, each gives the eager call's bytes, and
    matches F.linear in float32 within an ulp."""
    cfg = ModelConfig.medium()
    q, kv, h, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    for n, k, swiglu in [((q + 2 * kv) // tp, h, False), (h, q // tp, False), (2 * inter // tp, h, True),
                         (h, inter // tp, False), (cfg.vocab_size // tp, h, False)]:
        x, w = _operands(m, n, k, torch.bfloat16, seed=n + k)
        assert gemv.small_m_kernel(x, w) == ("gemv" if m == 1 else "skinny")
        fn = gemv.linear_silu_mul if swiglu else gemv.linear
        eager = fn(x, w, True)
        want = silu_mul(F.linear(x, w), False) if swiglu else F.linear(x.float(), w.float())
        _close(eager, want, torch.bfloat16, ulps=3 if swiglu else 1)
        static_x = x.clone()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = fn(static_x, w, True)
        static_x.copy_(-x)  # new inputs after capture: the replay reads them
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fn(-x, w, True))

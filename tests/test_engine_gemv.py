"""The one-token Triton GEMV of the model's projections (bench/engine/gemv.py) against torch's F.linear.

On CPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET); on the GPU the
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


@pytest.mark.parametrize("silu", [False, True])
def test_gemv_configs_agree(silu):
    """Every (BLOCK_N, BLOCK_K, warps, stages) computes the same product, the SwiGLU one too (its up rows are
    ``N / 2`` below the gate rows, with masked columns where ``BLOCK_N`` does not divide 45): the probe may
    pick any of them."""
    x, w = _operands(1, 90, 300, torch.bfloat16, seed=4)
    want = silu_mul(F.linear(x, w), fused=False) if silu else F.linear(x.float(), w.float())
    for config in [(1, 32, 1, 1), (4, 128, 4, 3), (16, 64, 4, 1), (8, 512, 8, 3)]:
        _close(gemv.gemv(x, w, silu=silu, config=config), want, torch.bfloat16, ulps=3 if silu else 1)


def test_linear_falls_back_to_torch_where_the_gemv_does_not_apply(monkeypatch):
    monkeypatch.setattr(gemv, "SKINNY", False)  # 2-16 rows: cuBLAS here (tests/test_engine_skinny.py: the skinny GEMM)
    x, w = _operands(1, 16, 32, torch.bfloat16, seed=5)
    assert gemv.gemv_applies(x, w)
    two = torch.cat([x, x])  # more rows than GEMV_MAX_ROWS: cuBLAS
    assert not gemv.gemv_applies(two, w)
    assert torch.equal(gemv.linear(two, w, fused=True), F.linear(two, w))
    x32, w32 = x.float(), w.float()  # float32 keeps cuBLAS (see the module docstring)
    assert not gemv.gemv_applies(x32, w32)
    assert torch.equal(gemv.linear(x32, w32, fused=True), F.linear(x32, w32))
    assert torch.equal(gemv.linear(x, w, fused=False), F.linear(x, w))
    assert torch.equal(gemv.linear_silu_mul(x, w, fused=False), silu_mul(F.linear(x, w), False))


def test_gemv_rejects_bad_shapes():
    x, w = _operands(1, 16, 32, torch.bfloat16, seed=6)
    with pytest.raises(ValueError, match="last dimensions must agree"):
        gemv.gemv(x, w[:, :16])
    with pytest.raises(ValueError, match="even number of rows"):
        gemv.gemv(x, w[:15], silu=True)
    with pytest.raises(ValueError, match="contiguous in their last dimension"):
        gemv.gemv(x, w.t().contiguous().t())
    # linear() does not take the GEMV for such operands: F.linear accepts any strides
    wide = torch.cat([x, x], dim=1)[:, ::2]
    assert not gemv.gemv_applies(wide, w) and not gemv.gemv_applies(x, w.t().contiguous().t())
    assert torch.equal(gemv.linear(wide, w, fused=True), F.linear(wide, w))
    with pytest.raises(ValueError, match=r"x must be \[1, K\]"):
        gemv.gemv(torch.cat([x, x]), w)
    with pytest.raises(ValueError, match=r"weight must be \[8, 4\]"):
        gemv.Projection(4, 8, torch.zeros(4, 8))


def test_model_flag_reaches_every_projection_and_forward_matches_torch(monkeypatch):
    """bf16 tiny model, one token: the fused forward (the GEMV, interpreted on CPU) against plain torch."""
    cfg = ModelConfig.tiny()
    model = build_target(cfg, seed=7, device=DEVICE, dtype=torch.bfloat16, kernels="torch")
    projections = [m for m in model.modules() if isinstance(m, gemv.Projection)]
    assert len(projections) == 4 * cfg.num_layers + 1 and not any(p.fused for p in projections)
    ids = torch.tensor([99], device=DEVICE)
    pos = torch.tensor([0], device=DEVICE)

    def dense(layer_id, q, k, v):
        from bench.engine.attention import reference_attention
        t = q.shape[0]
        return reference_attention(q, k, v, torch.ones(t, t, dtype=torch.bool, device=q.device).tril())

    want = model.logits(model(ids, pos, dense))
    model.fused = True
    assert all(p.fused for p in projections)
    calls = []
    real = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda x, w, silu=False, config=None: calls.append(silu) or real(x, w, silu, config))
    got = model.logits(model(ids, pos, dense))
    # every projection ran the GEMV: per layer qkv, o, gate/up (with SwiGLU), down; then the LM head
    assert calls == [False, False, True, False] * cfg.num_layers + [False]
    # bf16 through two layers: logits agree to a few bf16 ulps of their scale (argmax may flip on near-ties)
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * want.abs().max().item())


# One layer: every kind of projection shards the same way in every layer (the TP engine tests run two-layer
# models end to end), and each interpreted GEMV forward costs seconds per layer.
SHARD_CFG = ModelConfig.tiny().with_layers(1)


def rank_shards_a_fused_model(tp) -> tuple[list[str], float]:
    """On each rank: a fused bf16 tiny model and its draft, sharded; every projection's type and flag, and
    the sharded one-token forward (GEMV + collectives) against the unsharded model's plain-torch forward
    (relative max difference; the GEMV's own agreement with torch is tested above, and each interpreted
    GEMV forward costs seconds)."""
    from bench.engine.attention import reference_attention
    from bench.engine.model import build_draft

    def dense(layer_id, q, k, v):
        return reference_attention(q, k, v, torch.ones(1, 1, dtype=torch.bool))

    cfg = SHARD_CFG
    full = build_target(cfg, seed=11, dtype=torch.bfloat16, kernels="torch")
    ids, pos = torch.tensor([42]), torch.tensor([0])
    want = full.logits(full(ids, pos, dense))
    model = build_target(cfg, seed=11, dtype=torch.bfloat16, kernels="torch")
    model.fused = True  # as the engine does: the fused target, its draft from the full target, then both sharded
    draft = tp.shard(build_draft(model))
    tp.shard(model)
    seen = [f"{type(p).__name__}:{p.fused}" for m in (model, draft) for p in m.modules()
            if isinstance(p, gemv.Projection)]
    got = model.logits(model(ids, pos, dense))
    return seen, ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.interpreter  # CPU ranks run the GEMV on CPU tensors (it failed on the H200 without the marker)
@pytest.mark.timeout(240)
def test_tp_shard_keeps_the_models_kernel_choice_cpu():
    """tp.shard swaps every projection for a TP layer: each takes the model's ``fused`` flag (so a sharded
    model still runs the GEMV), the draft built from it too, and the sharded forward equals the unsharded."""
    from bench.engine.tp_launch import spawn
    for seen, rel in spawn(rank_shards_a_fused_model, 2, backend="gloo", timeout_s=200):
        layers = SHARD_CFG.num_layers
        tp_layers = ["ColumnParallelLinear:True", "RowParallelLinear:True"] * 2 * layers + ["VocabParallelHead:True"]
        assert seen[:len(tp_layers)] == tp_layers
        draft = ["ColumnParallelLinear:True", "RowParallelLinear:True"] * 2 + ["VocabParallelHead:True"]
        assert seen[len(tp_layers):] == draft  # the draft: one layer and its head
        assert rel < 0.05  # bf16 partial sums all-reduced in another order


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2])
def test_gemv_in_cuda_graph_equals_eager_at_model_shapes(tp):
    """The medium model's projections (the plain step at C = 1; per rank at TP 2): replayed from a CUDA graph,
    the GEMV gives the eager call's bytes, and matches F.linear in float32 within an ulp."""
    cfg = ModelConfig.medium()
    q, kv, h, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    for n, k, swiglu in [((q + 2 * kv) // tp, h, False), (h, q // tp, False), (2 * inter // tp, h, True),
                         (h, inter // tp, False), (cfg.vocab_size // tp, h, False)]:
        x, w = _operands(1, n, k, torch.bfloat16, seed=n + k)
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

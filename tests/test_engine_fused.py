"""The fused Triton kernels of the decoder layer (bench/engine/fused.py) against the torch code they
replace. On CPU they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET); the same
tests run compiled on the GPU, and the model test checks a whole forward, fused against plain torch."""
from __future__ import annotations

import pytest
import torch

from bench.engine import fused
from bench.engine.config import ModelConfig
from bench.engine.model import build_target, resolve_kernels

pytestmark = pytest.mark.skipif(fused.triton is None, reason="needs Triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype):
    # The kernels round where torch rounds; sums run in another order, so results may differ by an ulp
    # (bf16: 2^-8 relative). Triton's interpreter (CPU) truncates to bf16 where the GPU rounds to nearest.
    return dict(rtol=1e-5, atol=1e-5) if dtype is torch.float32 else dict(rtol=1.6e-2, atol=1e-2)


def _exact(dtype):
    """Tolerance of a result that must round exactly as torch's (one bf16 ulp in the interpreter)."""
    return dict(rtol=0, atol=0) if DEVICE == "cuda" or dtype is torch.float32 else dict(rtol=8e-3, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm_matches_torch(dtype, with_residual):
    torch.manual_seed(0)
    x = torch.randn(5, 96, device=DEVICE).to(dtype)
    res = torch.randn(5, 96, device=DEVICE).to(dtype) if with_residual else None
    w = (1 + 0.1 * torch.randn(96, device=DEVICE)).to(dtype)
    got_out, got_h = fused.add_rmsnorm(x, res, w, 1e-6, fused=True)
    want_out, want_h = fused.add_rmsnorm_reference(x, res, w, 1e-6)
    torch.testing.assert_close(got_h, want_h, **_exact(dtype))  # the add rounds exactly as torch's
    torch.testing.assert_close(got_out, want_out, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qk_matches_torch(dtype):
    torch.manual_seed(1)
    heads, kvh, dim, n = 4, 2, 16, 6
    qkv = torch.randn(n, (heads + 2 * kvh) * dim, device=DEVICE).to(dtype)
    cfg = ModelConfig.tiny()
    model = build_target(cfg, device=DEVICE, dtype=dtype, kernels="torch")
    pos = torch.tensor([0, 3, 7, 100, 4000, 1], device=DEVICE)
    q, k = fused.rope_qk(qkv, pos, model.rope_cos, model.rope_sin, heads, kvh, dim, fused=True)
    q0, k0 = fused.rope_qk(qkv, pos, model.rope_cos, model.rope_sin, heads, kvh, dim, fused=False)
    assert q.shape == (n, heads, dim) and k.shape == (n, kvh, dim) and q.is_contiguous()
    torch.testing.assert_close(q, q0, **_tol(dtype))
    torch.testing.assert_close(k, k0, **_tol(dtype))
    # A draft level's nodes share a position: positions may be a broadcast (stride 0) view.
    shared = torch.tensor([37], device=DEVICE).expand(2, 3).reshape(-1)
    assert shared.stride(0) == 0
    q, k = fused.rope_qk(qkv, shared, model.rope_cos, model.rope_sin, heads, kvh, dim, fused=True)
    q0, k0 = fused.rope_qk(qkv, shared.contiguous(), model.rope_cos, model.rope_sin, heads, kvh, dim, fused=False)
    torch.testing.assert_close(q, q0, **_tol(dtype))
    torch.testing.assert_close(k, k0, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    torch.manual_seed(2)
    gu = (3 * torch.randn(3, 2 * 1500, device=DEVICE)).to(dtype)  # 1500 > one 1024-wide block
    torch.testing.assert_close(fused.silu_mul(gu, fused=True), fused.silu_mul(gu, fused=False), **_tol(dtype))


def test_store_kv_writes_the_slots_from_strided_rows():
    torch.manual_seed(3)
    kvh, dim, n = 2, 16, 4
    qkv = torch.randn(n, 5 * kvh * dim, device=DEVICE)
    k = qkv[:, :kvh * dim].reshape(n, kvh, dim).contiguous()
    v = qkv[:, 3 * kvh * dim:4 * kvh * dim].view(n, kvh, dim)  # a strided view, as the model passes it
    slots = torch.tensor([7, 2, 9, 0], device=DEVICE)
    caches = [torch.zeros(12, kvh, dim, device=DEVICE) for _ in range(4)]
    fused.store_kv(k, v, slots, caches[0], caches[1], fused=True)
    fused.store_kv(k, v, slots, caches[2], caches[3], fused=False)
    torch.testing.assert_close(caches[0], caches[2], rtol=0, atol=0)
    torch.testing.assert_close(caches[1], caches[3], rtol=0, atol=0)


def test_resolve_kernels():
    assert resolve_kernels("torch", "cpu", torch.float32) is False
    assert resolve_kernels("auto", "cpu", torch.float32) is False
    with pytest.raises(ValueError, match="fused kernels need CUDA"):
        resolve_kernels("fused", "cpu", torch.float32)
    with pytest.raises(ValueError, match="kernels must be one of"):
        resolve_kernels("triton", "cpu", torch.float32)


def test_model_forward_fused_matches_torch():
    """A whole forward of the tiny model with every fused kernel (interpreted on CPU) against plain torch."""
    cfg = ModelConfig.tiny()
    model = build_target(cfg, seed=4, device=DEVICE)
    ids = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    pos = torch.arange(9, device=DEVICE)

    def dense(layer_id, q, k, v):
        from bench.engine.attention import reference_attention
        t = q.shape[0]
        return reference_attention(q, k, v, torch.ones(t, t, dtype=torch.bool, device=q.device).tril())

    model.fused = False
    want = model(ids, pos, dense)
    model.fused = True
    got = model(ids, pos, dense)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

"""The fused Triton kernels of the model (bench/engine/fused.py) against the torch code they
replace. On CPU they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET); the same
tests run compiled on the GPU, and the model test checks a whole forward, fused against plain torch."""
from __future__ import annotations

import pytest
import torch

from bench.engine import fused
from bench.engine.attention import TorchLayouts
from bench.engine.config import ModelConfig
from bench.engine.fi_attention import FlashInferLayouts
from bench.engine.kv_cache import KVCache, ReqToTokenPool, SlotAllocator
from bench.engine.model import build_target, resolve_kernels

pytestmark = pytest.mark.skipif(fused.triton is None, reason="needs Triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
ALL_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _tol(dtype):
    # The kernels round where torch rounds; sums run in another order, so results may differ by an ulp
    # (bf16: 2^-8 relative, fp16: 2^-11). Triton's interpreter (CPU) truncates to bf16 where the GPU rounds
    # to nearest.
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


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_embed_rmsnorm_matches_torch(dtype):
    torch.manual_seed(5)
    vocab, hidden = 50, 96  # hidden not a power of two: the block has masked columns
    table = torch.randn(vocab, hidden, device=DEVICE).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    ids = torch.tensor([3, 0, 49, 3, 17, 8, 8], device=DEVICE)
    got_out, got_h = fused.embed_rmsnorm(ids, table, w, 1e-6, fused=True)
    want_out, want_h = fused.embed_rmsnorm(ids, table, w, 1e-6, fused=False)
    # The torch code is the model's old path: the embedding, then add_rmsnorm without a residual.
    ref_out, ref_h = fused.add_rmsnorm_reference(torch.nn.functional.embedding(ids, table), None, w, 1e-6)
    assert torch.equal(want_h, ref_h) and torch.equal(want_out, ref_out)
    assert got_h.dtype == got_out.dtype == dtype and got_h.shape == got_out.shape == (7, hidden)
    torch.testing.assert_close(got_h, want_h, rtol=0, atol=0)  # the rows, copied
    torch.testing.assert_close(got_out, want_out, **_tol(dtype))
    # ... and the norm rounds as add_rmsnorm's kernel does on the same rows.
    torch.testing.assert_close(got_out, fused.add_rmsnorm(want_h, None, w, 1e-6, fused=True)[0], rtol=0, atol=0)
    # ids may be a strided view (a column of a [N, 2] tensor)
    pairs = torch.stack([ids, ids.flip(0)], dim=1)
    got_out, got_h = fused.embed_rmsnorm(pairs[:, 1], table, w, 1e-6, fused=True)
    torch.testing.assert_close(got_h, table[ids.flip(0)], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("vocab", [512, 4096 + 37, 32000])
def test_argmax_rows_matches_torch(dtype, vocab):
    """Small integers make many ties (torch picks the first maximum); vocabs above ARGMAX_BLOCK loop over
    blocks. Rows are strided (a slice of wider rows)."""
    gen = torch.Generator().manual_seed(6)
    wide = torch.randint(-40, 40, (6, vocab + 8), generator=gen).to(dtype).to(DEVICE)
    x = wide[:, :vocab]
    x[1] = float("-inf")  # every value equal: column 0
    x[2, 1:] = float("-inf")
    x[3] = torch.randn(vocab, generator=gen).to(dtype).to(DEVICE)  # few or no ties
    got = fused.argmax_rows(x, fused=True)
    assert got.dtype == torch.int64 and got.shape == (6,)
    assert torch.equal(got, x.argmax(-1)), (got, x.argmax(-1))
    assert torch.equal(fused.argmax_rows(x, fused=False), x.argmax(-1))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_argmax_rows_ties_across_blocks(dtype):
    """A tie between blocks and between lanes of different blocks goes to the lowest column."""
    block = fused.ARGMAX_BLOCK
    vocab = 3 * block - 5  # three blocks, the last one partly masked
    x = torch.zeros(4, vocab, device=DEVICE, dtype=dtype)
    ties = [[block + 1, 10, 2 * block + 3],         # a later block's lower lane: column 10 wins
            [block + 7, 7, 2 * block + 7],           # one lane in every block: the first block's
            [2 * block + 2, block + 9],              # no maximum in the first block
            [vocab - 1]]                             # the last (masked) block's last column
    for row, cols in enumerate(ties):
        x[row, cols] = 2.5
    want = torch.tensor([min(c) for c in ties], device=DEVICE)
    assert torch.equal(x.argmax(-1), want)
    assert torch.equal(fused.argmax_rows(x, fused=True), want)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_argmax_rows_commits_each_token_to_its_table_cell(use_kernel):
    """``commit``: each row's token lands in ``table[rows[i], cols[i]]`` (a decode step's commit), every other
    cell untouched; the returned tokens are the argmax either way; bad commit arguments are refused."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(3, 300, generator=gen).to(DEVICE)
    table = torch.full((5, 7), -1, dtype=torch.int64, device=DEVICE)
    rows, cols = torch.tensor([4, 0, 2], device=DEVICE), torch.tensor([6, 1, 3], device=DEVICE)
    got = fused.argmax_rows(x, fused=use_kernel, commit=(table, rows, cols))
    want = x.argmax(-1)
    assert torch.equal(got, want)
    expected = torch.full_like(table, -1)
    expected[rows, cols] = want
    assert torch.equal(table, expected)
    with pytest.raises(ValueError, match="commit must be"):
        fused.argmax_rows(x, fused=use_kernel, commit=(table, rows[:2], cols[:2]))


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


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_rope_q_store_kv_matches_rope_qk_then_store_kv(dtype):
    """The fused launch writes what rope_qk then store_kv write: q, and the cache rows at the slots (any
    order, slot 0 included, the other rows untouched). qkv is a row-strided view (a slice of wider rows), so
    the torch path's v is a strided view of it; positions a broadcast view; slots a strided view."""
    torch.manual_seed(7)
    heads, kvh, dim, n, num_slots = 4, 2, 16, 6, 16
    width = (heads + 2 * kvh) * dim
    qkv = torch.randn(n, width + 24, device=DEVICE).to(dtype)[:, :width]
    assert qkv.stride(0) == width + 24
    model = build_target(ModelConfig.tiny(), device=DEVICE, kernels="torch")
    cos, sin = model.rope_cos, model.rope_sin
    k_cache = torch.randn(num_slots, kvh, dim, device=DEVICE).to(dtype)
    v_cache = torch.randn(num_slots, kvh, dim, device=DEVICE).to(dtype)
    v = qkv[:, (heads + kvh) * dim:].view(n, kvh, dim)
    for pos, slots in ((torch.tensor([0, 3, 7, 100, 4000, 1], device=DEVICE),
                        torch.tensor([9, 2, 14, 0, 5, 11], device=DEVICE)),
                       (torch.tensor([37], device=DEVICE).expand(n),
                        torch.tensor([3, 15, 1, 8, 6, 12, 4, 10, 13, 7, 2, 0], device=DEVICE)[::2])):
        caches = [c.clone() for c in (k_cache, v_cache) for _ in range(3)]  # k: 0, 1, 2; v: 3, 4, 5
        q = fused.rope_q_store_kv(qkv, pos, cos, sin, slots, caches[0], caches[3], heads, kvh, dim, fused=True)
        assert q.shape == (n, heads, dim) and q.dtype == dtype and q.is_contiguous()
        # The two fused launches it replaces: bit for bit (the same rotary code, the same stores).
        q1, k1 = fused.rope_qk(qkv, pos, cos, sin, heads, kvh, dim, fused=True)
        fused.store_kv(k1, v, slots.contiguous(), caches[1], caches[4], fused=True)
        assert torch.equal(q, q1) and torch.equal(caches[0], caches[1]) and torch.equal(caches[3], caches[4])
        # The torch code (rope_q_store_kv's own torch path is rope_qk then store_kv, fused=False).
        q2 = fused.rope_q_store_kv(qkv, pos.contiguous(), cos, sin, slots, caches[2], caches[5], heads, kvh, dim,
                                   fused=False)
        q0, k0 = fused.rope_qk(qkv, pos.contiguous(), cos, sin, heads, kvh, dim, fused=False)
        assert torch.equal(q2, q0)
        torch.testing.assert_close(q, q0, **_tol(dtype))
        torch.testing.assert_close(caches[0], caches[2], **_tol(dtype))
        torch.testing.assert_close(caches[3], caches[5], rtol=0, atol=0)  # the values, copied
        torch.testing.assert_close(caches[0][slots], k0, **_tol(dtype))
        assert torch.equal(caches[3][slots], v)
        untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
        untouched[slots] = False
        assert torch.equal(caches[0][untouched], k_cache[untouched])
        assert torch.equal(caches[3][untouched], v_cache[untouched])


def test_rope_q_store_kv_checks_its_arguments():
    heads, kvh, dim, n = 4, 2, 16, 3
    model = build_target(ModelConfig.tiny(), device=DEVICE, kernels="torch")
    qkv = torch.randn(n, (heads + 2 * kvh) * dim, device=DEVICE)
    pos, slots = torch.arange(n, device=DEVICE), torch.tensor([4, 1, 2], device=DEVICE)
    cache = torch.zeros(8, kvh, dim, device=DEVICE)
    args = (model.rope_cos, model.rope_sin)
    with pytest.raises(ValueError, match="slots must be"):
        fused.rope_q_store_kv(qkv, pos, *args, slots[:2], cache, cache.clone(), heads, kvh, dim, fused=True)
    with pytest.raises(ValueError, match="v_cache must be a contiguous"):
        fused.rope_q_store_kv(qkv, pos, *args, slots, cache, cache.half(), heads, kvh, dim, fused=True)
    with pytest.raises(ValueError, match="k_cache must be a contiguous"):
        fused.rope_q_store_kv(qkv, pos, *args, slots, cache.transpose(1, 2), cache, heads, kvh, dim, fused=True)
    with pytest.raises(ValueError, match="qkv must be"):
        fused.rope_q_store_kv(qkv[:, :-dim], pos, *args, slots, cache, cache.clone(), heads, kvh, dim, fused=True)


def _slot_table(rows, ctx, seed):
    """A ``req_to_token`` table of ``rows`` real rows whose slots are shuffled (as after verify steps)."""
    alloc = SlotAllocator(1 + rows * ctx)
    table = ReqToTokenPool(rows, ctx, alloc, "cpu").req_to_token
    gen = torch.Generator().manual_seed(seed)
    for r in range(1, rows + 1):
        table[r] = table[r][torch.randperm(ctx, generator=gen)]
    return table.to(DEVICE), alloc.num_slots


class _Recorder:
    """Forwards to an attention callable and records whether each call got k; exposes the callable's
    ``kv_sink`` only where ``sink`` (without it, the model must take the store-in-callable path)."""

    def __init__(self, inner, sink):
        self.inner, self.got_k = inner, []
        if sink:
            self.kv_sink = inner.kv_sink

    def __call__(self, layer_id, q, k, v):
        self.got_k.append(k is not None)
        return self.inner(layer_id, q, k, v)


@pytest.mark.parametrize("attention", ["flashinfer-reference", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_model_forward_kv_sink_matches_store_in_callable(attention, dtype, monkeypatch):
    """A fused model over an attention with kv_sink (one launch ropes q and k and writes k and v into the
    cache; the callable gets k = v = None) against the same model and attention without the sink (rope_qk,
    then the callable stores k and v): prefill, decode and a tree step over the cache those wrote, equal
    outputs and caches, bit for bit."""
    # The projections on cuBLAS: the last check compares with the torch path through two layers, and the
    # skinny GEMM's rounding in Triton's interpreter (truncation) drifts past an ulp there; it has its own
    # tests (tests/test_engine_skinny.py).
    from bench.engine import gemv
    monkeypatch.setattr(gemv, "SKINNY", False)
    cfg = ModelConfig.tiny()
    model = build_target(cfg, seed=7, device=DEVICE, dtype=dtype)
    model.fused = True
    bs, prompt, tree = 2, 6, 3
    table, num_slots = _slot_table(bs + 1, 24, seed=8)
    rows = torch.tensor([3, 1], device=DEVICE)
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, cfg.vocab_size, (bs * (prompt + 1 + tree),), generator=gen).to(DEVICE).split(
        [bs * prompt, bs, bs * tree])
    tree_mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool, device=DEVICE).expand(bs, 3, 3)
    depth = torch.tensor([0, 1, 1], device=DEVICE)
    results = []
    for sink in (True, False):
        if attention == "torch":
            layouts = TorchLayouts(table, cfg.num_heads // cfg.num_kv_heads)
        else:
            layouts = FlashInferLayouts(table, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype, kernel="reference",
                                        triton=True)
        cache = KVCache(cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim, dtype, DEVICE)
        attn = _Recorder(layouts.attention(cache), sink)
        outs = []
        attn.inner.meta = layouts.causal(rows, torch.zeros_like(rows), prompt)
        outs.append(model(ids[0], torch.arange(prompt, device=DEVICE).repeat(bs), attn))
        attn.inner.meta = layouts.causal(rows, torch.full_like(rows, prompt), 1)
        outs.append(model(ids[1], torch.full((bs,), prompt, device=DEVICE), attn))
        attn.inner.meta = layouts.tree(rows, torch.full_like(rows, prompt + 1), tree_mask)
        outs.append(model(ids[2], (prompt + 1 + depth).repeat(bs), attn))
        assert attn.got_k == [not sink] * (3 * cfg.num_layers)
        results.append((outs, cache))
    (got, got_cache), (want, want_cache) = results
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    for layer in range(cfg.num_layers):
        torch.testing.assert_close(got_cache.k[layer], want_cache.k[layer], rtol=0, atol=0)
        torch.testing.assert_close(got_cache.v[layer], want_cache.v[layer], rtol=0, atol=0)
    assert got_cache.k[0].abs().sum() > 0  # the forwards did write the cache
    # The torch model path ignores kv_sink: the callable gets tensors.
    model.fused = False
    attn = _Recorder(layouts.attention(KVCache(cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim, dtype,
                                               DEVICE)), sink=True)
    attn.inner.meta = layouts.causal(rows, torch.zeros_like(rows), prompt)
    torch.testing.assert_close(model(ids[0], torch.arange(prompt, device=DEVICE).repeat(bs), attn), got[0],
                               **_tol(dtype))
    assert attn.got_k == [True] * cfg.num_layers


@pytest.mark.parametrize("attention", ["flashinfer-reference", "torch"])
def test_kv_sink_errors(attention):
    cfg = ModelConfig.tiny()
    table, num_slots = _slot_table(2, 8, seed=1)
    if attention == "torch":
        layouts = TorchLayouts(table, cfg.num_heads // cfg.num_kv_heads)
    else:
        layouts = FlashInferLayouts(table, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                                    kernel="reference", triton=True)
    cache = KVCache(1, num_slots, cfg.num_kv_heads, cfg.head_dim, torch.float32, DEVICE)
    attn = layouts.attention(cache)
    with pytest.raises(RuntimeError, match="meta is unset"):
        attn.kv_sink(0)
    rows = torch.tensor([1, 2], device=DEVICE)
    attn.meta = layouts.causal(rows, torch.tensor([3, 5], device=DEVICE), 1)
    slots, k_cache, v_cache = attn.kv_sink(0)
    assert torch.equal(slots, table[rows, torch.tensor([3, 5], device=DEVICE)])
    assert k_cache is cache.k[0] and v_cache is cache.v[0]
    q = torch.randn(2, cfg.num_heads, cfg.head_dim, device=DEVICE)
    kv = torch.randn(2, cfg.num_kv_heads, cfg.head_dim, device=DEVICE)
    with pytest.raises(ValueError, match="both None"):
        attn(0, q, kv, None)
    with pytest.raises(ValueError, match="both None"):
        attn(0, q, None, kv)
    assert attn(0, q, None, None).shape == (2, cfg.num_heads * cfg.head_dim)


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


def test_model_torch_path_unchanged_and_greedy_fused():
    """The torch path still computes the embedding then the first layer's add_rmsnorm (bit for bit what the
    model did before the embedding kernel), and greedy fused picks torch's argmax."""
    cfg = ModelConfig.tiny()
    model = build_target(cfg, seed=5, device=DEVICE, kernels="torch")
    ids = torch.randint(0, cfg.vocab_size, (7,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    pos = torch.arange(7, device=DEVICE)

    def dense(layer_id, q, k, v):
        from bench.engine.attention import reference_attention
        t = q.shape[0]
        return reference_attention(q, k, v, torch.ones(t, t, dtype=torch.bool, device=q.device).tril())

    h, delta = model.embed(ids), None
    for layer in model.layers:
        h, delta = layer(h, delta, pos, (model.rope_cos, model.rope_sin), dense, False)
    want = fused.add_rmsnorm(delta, h, model.norm.weight, model.norm.eps, False)[0]
    hidden = model(ids, pos, dense)
    torch.testing.assert_close(hidden, want, rtol=0, atol=0)
    want_tokens = model.logits(hidden).argmax(-1)
    assert torch.equal(model.greedy(hidden), want_tokens)
    model.fused = True
    assert torch.equal(model.greedy(hidden), want_tokens)

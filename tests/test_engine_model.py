"""Reference engine: model, paged KV cache and paged attention against longhand oracles (CPU, float32)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.engine.attention import AttnMeta, PagedAttention, reference_attention
from bench.engine.config import ModelConfig
from bench.engine.kv_cache import DUMMY_SLOT, KVCache, ReqToTokenPool, SlotAllocator
from bench.engine.model import build_draft, build_target

CFG = ModelConfig.tiny()


class DenseCausal:
    """Oracle attention for ONE sequence with no cache: every token attends to itself and earlier ones."""

    def __call__(self, layer_id, q, k, v):
        t = q.shape[0]
        return reference_attention(q, k, v, torch.ones(t, t, dtype=torch.bool).tril())


def test_allocator_never_hands_out_dummy_and_recycles():
    alloc = SlotAllocator(10)
    got = alloc.alloc(9)
    assert DUMMY_SLOT not in got and sorted(got) == list(range(1, 10))
    with pytest.raises(MemoryError, match="exhausted"):
        alloc.alloc(1)
    alloc.free(got[:3])
    assert sorted(alloc.alloc(3)) == sorted(got[:3])
    with pytest.raises(ValueError):
        alloc.free(np.array([0]))


def test_req_to_token_rows_reserve_disjoint_slots():
    alloc = SlotAllocator(1 + 3 * 8)
    pool = ReqToTokenPool(3, 8, alloc, "cpu")
    table = pool.req_to_token
    assert table[0].eq(DUMMY_SLOT).all()
    real = table[1:].flatten().tolist()
    assert len(set(real)) == len(real) and DUMMY_SLOT not in real
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [1, 2, 3]
    with pytest.raises(MemoryError):
        pool.alloc()
    pool.free(rows[0])
    assert pool.alloc() == rows[0]


@pytest.mark.parametrize("t", [1, 5])
def test_paged_attention_matches_reference(t):
    torch.manual_seed(0)
    heads, kvh, dim, ctx, bs = 4, 2, 8, 12, 3
    cache = KVCache(1, 1 + bs * (ctx + t), kvh, dim, torch.float32, "cpu")
    cache.k[0].normal_()
    cache.v[0].normal_()
    alloc = SlotAllocator(cache.num_slots)
    r2t = torch.from_numpy(np.concatenate([np.zeros((1, ctx + t), np.int64),
                                           np.stack([alloc.alloc(ctx + t) for _ in range(bs)])]))
    rows = torch.tensor([2, 1, 3])
    prefix = torch.tensor([0, 4, 9])
    write = torch.stack([r2t[r, p:p + t] for r, p in zip(rows.tolist(), prefix.tolist())])
    tree = torch.rand(bs, t, t) < 0.5
    tree |= torch.eye(t, dtype=torch.bool)
    meta = AttnMeta.build(r2t, rows, prefix, write, write, tree, ctx, group=heads // kvh)
    q, k, v = torch.randn(bs * t, heads, dim), torch.randn(bs * t, kvh, dim), torch.randn(bs * t, kvh, dim)
    out = PagedAttention(cache, meta)(0, q, k, v)
    for i, (r, p) in enumerate(zip(rows.tolist(), prefix.tolist())):
        keys = torch.cat([cache.k[0][r2t[r, :p]], k[i * t:(i + 1) * t]])
        vals = torch.cat([cache.v[0][r2t[r, :p]], v[i * t:(i + 1) * t]])
        mask = torch.cat([torch.ones(t, p, dtype=torch.bool), tree[i]], dim=1)
        want = reference_attention(q[i * t:(i + 1) * t], keys, vals, mask)
        torch.testing.assert_close(out[i * t:(i + 1) * t], want, rtol=1e-5, atol=1e-5)


def test_model_paged_prefill_then_decode_matches_dense_forward():
    model = build_target(CFG, seed=3)
    seq = torch.randint(0, CFG.vocab_size, (14,), generator=torch.Generator().manual_seed(1))
    dense = model.logits(model(seq, torch.arange(14), DenseCausal()))

    ctx, group = 32, CFG.num_heads // CFG.num_kv_heads
    cache = KVCache(CFG.num_layers, 1 + 2 * ctx, CFG.num_kv_heads, CFG.head_dim, torch.float32, "cpu")
    pool = ReqToTokenPool(2, ctx, SlotAllocator(cache.num_slots), "cpu")
    r2t, row = pool.req_to_token, torch.tensor([pool.alloc()])
    attn = PagedAttention(cache)
    attn.meta = AttnMeta.causal(r2t, row, torch.tensor([0]), r2t[row, :8], ctx, group)
    got = [model.logits(model(seq[:8], torch.arange(8), attn))]
    for pos in range(8, 14):
        attn.meta = AttnMeta.causal(r2t, row, torch.tensor([pos]), r2t[row, pos:pos + 1], ctx, group)
        got.append(model.logits(model(seq[pos:pos + 1], torch.tensor([pos]), attn)))
    torch.testing.assert_close(torch.cat(got), dense, rtol=1e-4, atol=1e-4)


def test_draft_is_a_noisy_one_layer_copy():
    target = build_target(CFG, seed=0)
    exact = build_draft(target, num_layers=1, noise=0.0)
    assert len(exact.layers) == 1
    torch.testing.assert_close(exact.layers[0].qkv_proj.weight, target.layers[0].qkv_proj.weight)
    noisy = build_draft(target, num_layers=1, noise=0.1)
    diff = (noisy.lm_head.weight - target.lm_head.weight).std() / target.lm_head.weight.std()
    assert 0.05 < diff.item() < 0.2

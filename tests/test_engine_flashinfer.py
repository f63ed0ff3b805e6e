"""FlashInfer attention for the reference engine (bench/engine/fi_attention.py, fi_meta.py).

CPU: the in-graph metadata builders (Triton kernels in the interpreter, and their torch code) against
plain-Python oracles; attention computed from that metadata against the engine's torch attention, in every
step shape the engine runs (decode, the draft's causal first pass and tree levels, verify, prefill); and
the decode loop end to end on the FlashInfer metadata path. GPU (``-m gpu``): FlashInfer's own kernels
replayed from CUDA graphs planned once, at every captured batch size, against eager FlashInfer planned
per call with the exact lengths (bit-exact) and the torch attention (bf16 tolerance).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.engine import fi_meta
from bench.engine.attention import TorchLayouts
from bench.engine.fi_attention import FlashInferLayouts, flashinfer_available
from bench.engine.kv_cache import KVCache, ReqToTokenPool, SlotAllocator

HAVE_TRITON = fi_meta.triton is not None


# ----------------------------------------------------------------------------------------- fixtures
class Setup:
    """A slot table whose rows hold shuffled slots (as after verify steps), a KV cache with random
    contents, and sequence lengths for ``bs`` sequences."""

    def __init__(self, bs, ctx=48, heads=4, kvh=2, dim=16, dtype=torch.float32, device="cpu", seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        self.alloc = SlotAllocator(1 + (bs + 2) * ctx)
        self.pool = ReqToTokenPool(bs + 2, ctx, self.alloc, "cpu")
        table = self.pool.req_to_token
        for r in range(1, bs + 3):
            table[r] = table[r][torch.randperm(ctx, generator=gen)]
        self.table = table.to(device)
        self.cache = KVCache(1, self.alloc.num_slots, kvh, dim, dtype, device)
        self.cache.k[0].copy_(torch.randn(self.cache.k[0].shape, generator=gen))
        self.cache.v[0].copy_(torch.randn(self.cache.v[0].shape, generator=gen))
        self.rows = torch.from_numpy(self.rng.permutation(np.arange(1, bs + 3))[:bs].copy()).to(device)
        self.bs, self.ctx, self.heads, self.kvh, self.dim, self.dtype, self.device = bs, ctx, heads, kvh, dim, dtype, device
        self.gen = gen

    def lens(self, low, high):
        return torch.from_numpy(self.rng.integers(low, high + 1, self.bs)).to(self.device)

    def qkv(self, tokens):
        n = self.bs * tokens
        mk = lambda h: torch.randn(n, h, self.dim, generator=self.gen).to(self.device, self.dtype)  # noqa: E731
        return mk(self.heads), mk(self.kvh), mk(self.kvh)

    def tree_mask(self, tokens):
        """[bs, T, T]: a random tree (node i's parent before it), ancestor-or-self."""
        mask = torch.zeros(self.bs, tokens, tokens, dtype=torch.bool)
        for b in range(self.bs):
            for i in range(tokens):
                mask[b, i, i] = True
                if i:
                    mask[b, i] |= mask[b, int(self.rng.integers(0, i))]
        return mask.to(self.device)

    def beam_mask(self, k, levels):
        """[bs, k, levels * k]: each beam node's ancestor at every level (one per k-block), itself last."""
        mask = torch.zeros(self.bs, k, levels * k, dtype=torch.bool)
        for b in range(self.bs):
            for i in range(k):
                for lvl in range(levels):
                    mask[b, i, lvl * k + (i if lvl == levels - 1 else int(self.rng.integers(0, k)))] = True
        return mask.to(self.device)


def kv_lists(table, rows, kv_len):
    """Oracle: each sequence's slots, in column order."""
    return [table[int(r), :int(n)].tolist() for r, n in zip(rows, kv_len)]


# ------------------------------------------------------------------------------- metadata builders
BUILDERS = [False] + ([pytest.param(True, marks=pytest.mark.interpreter)] if HAVE_TRITON else [])


@pytest.mark.parametrize("use_triton", BUILDERS)
@pytest.mark.parametrize("offset,tokens", [(1, 1), (5, 5), (15, 16), (31, 31)])
def test_kv_indices_match_oracle(use_triton, offset, tokens):
    s = Setup(bs=5, ctx=300 if tokens == 31 else 48, seed=offset)
    base = s.lens(tokens - offset, s.ctx - offset)
    indptr = torch.zeros(s.bs + 1, dtype=torch.int32)
    indices = torch.full((s.bs * s.ctx + 1,), -7, dtype=torch.int32)
    write = torch.zeros(s.bs * tokens, dtype=torch.int64)
    fi_meta.build_kv_indices(s.table, s.rows, base, offset, tokens, indptr, indices, write, use_triton=use_triton)
    lists = kv_lists(s.table, s.rows, base + offset)
    assert indptr.tolist() == np.cumsum([0] + [len(x) for x in lists]).tolist()
    assert indices[:int(indptr[-1])].tolist() == sum(lists, [])
    assert write.view(s.bs, tokens).tolist() == [x[-tokens:] for x in lists]


@pytest.mark.parametrize("use_triton", BUILDERS)
@pytest.mark.parametrize("tokens,extra", [(4, 4), (4, 12), (16, 16), (3, 5)])
def test_pack_mask_matches_oracle(use_triton, tokens, extra):
    s = Setup(bs=4, seed=tokens + extra)
    prefix = s.lens(0, 40)
    mask = torch.rand(s.bs, tokens, extra, generator=s.gen) < 0.5
    kv_max = 64
    region = tokens * kv_max
    out = torch.full((s.bs * region,), 0xAB, dtype=torch.uint8)
    fi_meta.pack_mask(prefix, mask, out, region, use_triton=use_triton)
    for r in range(s.bs):
        p, kv_len = int(prefix[r]), int(prefix[r]) + extra
        full = np.zeros((tokens, kv_len), dtype=bool)
        full[:, :p] = True
        full[:, p:] = mask[r].numpy()
        want = np.packbits(full.reshape(-1), bitorder="little")
        got = out[r * region:(r + 1) * region].numpy()
        assert (got[:len(want)] == want).all(), r
        assert (got[len(want):] == 0).all()  # the rest of the region is cleared


def test_pack_mask_accepts_a_sliced_mask_and_checks_its_buffer():
    s = Setup(bs=3)
    beam = s.beam_mask(4, 3)
    out = torch.zeros(3 * 4 * 64, dtype=torch.uint8)
    fi_meta.pack_mask(s.lens(5, 9), beam[:, :, :8], out, 4 * 64)  # a prefix slice of the last dimension
    with pytest.raises(ValueError, match="mask buffer holds"):
        fi_meta.pack_mask(s.lens(5, 9), beam, out[:10], 4 * 64)


# ---------------------------------------------------------------- attention from the metadata
def _both(s, build):
    """Run one step's attention through the torch layouts and the FlashInfer layouts (reference
    kernel), each on its own copy of the cache; return both outputs and caches."""
    outs = []
    for layouts in (TorchLayouts(s.table, s.heads // s.kvh),
                    FlashInferLayouts(s.table, s.heads, s.kvh, s.dim, s.dtype, kernel="reference")):
        cache = KVCache(1, s.cache.num_slots, s.kvh, s.dim, s.dtype, s.device)
        cache.k[0].copy_(s.cache.k[0]), cache.v[0].copy_(s.cache.v[0])
        attn = layouts.attention(cache)
        meta, (q, k, v) = build(layouts)
        attn.meta = meta
        outs.append((attn(0, q, k, v), cache))
    return outs


@pytest.mark.parametrize("kind", ["decode", "window", "prefill", "draft_level", "verify"])
def test_flashinfer_metadata_attends_like_the_torch_attention(kind):
    """Every step shape of the engine: attention computed from FlashInfer's metadata (the reference
    kernel) equals the engine's torch attention, and both write the same KV slots."""
    s = Setup(bs=6, ctx=64, seed=11)
    k, w = 4, 5

    def build(layouts):
        s.rng, s.gen = np.random.default_rng(3), torch.Generator().manual_seed(5)  # the same step for both
        if kind == "decode":
            n = s.lens(1, 40)
            return layouts.causal(s.rows, n - 1, 1), s.qkv(1)
        if kind == "window":
            n = s.lens(w, 40)
            return layouts.causal(s.rows, n - w, w), s.qkv(w)
        if kind == "prefill":
            return layouts.causal(s.rows, torch.zeros_like(s.rows), 11), s.qkv(11)
        if kind == "draft_level":
            n, beam = s.lens(1, 40), s.beam_mask(k, 3)
            return layouts.tree(s.rows, n, beam[:, :, :2 * k]), s.qkv(k)
        n, tree = s.lens(1, 40), s.tree_mask(16)
        return layouts.tree(s.rows, n - 1, tree), s.qkv(16)

    (want, want_cache), (got, got_cache) = _both(s, build)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_cache.k[0], want_cache.k[0], rtol=0, atol=0)
    torch.testing.assert_close(got_cache.v[0], want_cache.v[0], rtol=0, atol=0)


def test_plans_are_made_once_per_shape_and_reused_for_any_length():
    s = Setup(bs=3)
    layouts = FlashInferLayouts(s.table, s.heads, s.kvh, s.dim, s.dtype, kernel="reference")
    a = layouts.causal(s.rows, s.lens(1, 30), 1)
    b = layouts.causal(s.rows, s.lens(1, 30), 1)
    c = layouts.tree(s.rows, s.lens(1, 30), s.tree_mask(16))
    d = layouts.tree(s.rows[:2], s.lens(1, 30)[:2], s.tree_mask(16)[:2])
    assert a is b and c is not a and d is not c
    assert sorted(layouts.plans) == [(2, 16, "tree"), (3, 1, "decode"), (3, 16, "tree")]
    assert a.kv_indices.data_ptr() == b.kv_indices.data_ptr()  # the buffers a captured graph reads stay put


def test_flashinfer_kernel_refuses_cpu_and_float32():
    s = Setup(bs=2)
    with pytest.raises(ValueError, match="CUDA"):
        FlashInferLayouts(s.table, s.heads, s.kvh, s.dim, torch.bfloat16, kernel="flashinfer")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="bf16 or fp16"):
            FlashInferLayouts(s.table.cuda(), s.heads, s.kvh, 128, torch.float32, kernel="flashinfer")
        with pytest.raises(ValueError, match="head_dim in"):
            FlashInferLayouts(s.table.cuda(), s.heads, s.kvh, 16, torch.bfloat16, kernel="flashinfer")
    with pytest.raises(ValueError, match="kernel must be one of"):
        FlashInferLayouts(s.table, s.heads, s.kvh, s.dim, s.dtype, kernel="cuda")


# --------------------------------------------------------------------------------------- GPU tests
GPU_SIZES = [1, 2, 4, 8, 10, 16, 32, 64, 128]  # bench/decode_loop.py's captured batch sizes
KINDS = ["decode", "window", "draft_level", "verify", "prefill"]


def _step(s, kind, layouts, k=4, w=5, prompt=31):
    """Static inputs and a closure running one attention step (metadata + store + kernel) of ``kind``."""
    heads_q, kvh_k, kvh_v = s.qkv({"decode": 1, "window": w, "draft_level": k, "verify": 16, "prefill": prompt}[kind])
    st = {"q": heads_q, "k": kvh_k, "v": kvh_v, "n": s.lens(w + 1, s.ctx - 32)}
    if kind == "draft_level":
        st["mask"] = s.beam_mask(k, 3)
    if kind == "verify":
        st["mask"] = s.tree_mask(16)
    attn = layouts.attention(s.cache)

    def run():
        if kind == "decode":
            attn.meta = layouts.causal(s.rows, st["n"] - 1, 1)
        elif kind == "window":
            attn.meta = layouts.causal(s.rows, st["n"] - w, w)
        elif kind == "prefill":
            attn.meta = layouts.causal(s.rows, torch.zeros_like(s.rows), prompt)
        elif kind == "draft_level":
            attn.meta = layouts.tree(s.rows, st["n"], st["mask"][:, :, :2 * k])
        else:
            attn.meta = layouts.tree(s.rows, st["n"] - 1, st["mask"])
        return attn(0, st["q"], st["k"], st["v"])
    return st, run


def _oracle_flashinfer(s, kind, st, w=5, prompt=31):
    """Eager FlashInfer planned for this call's exact lengths, metadata built on the host (numpy)."""
    import flashinfer
    tokens = st["q"].shape[0] // s.bs
    n = st["n"].cpu()
    kv_len = {"decode": n, "window": n, "prefill": torch.full_like(n, prompt), "draft_level": n + 8,
              "verify": n + 15}[kind]
    lists = kv_lists(s.table.cpu(), s.rows.cpu(), kv_len)
    dev, i32 = s.device, torch.int32
    indptr = torch.tensor(np.cumsum([0] + [len(x) for x in lists]), dtype=i32, device=dev)
    indices = torch.tensor(sum(lists, []), dtype=i32, device=dev)
    last = torch.ones(s.bs, dtype=i32, device=dev)
    ws = torch.zeros(64 << 20, dtype=torch.uint8, device=dev)
    paged = (s.cache.k[0][:, None], s.cache.v[0][:, None])
    shape = dict(num_kv_heads=s.kvh, page_size=1, q_data_type=s.dtype, kv_data_type=s.dtype, disable_split_kv=True)
    if kind == "decode":
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True, backend="fa2")
        wrapper.plan(indptr, indices, last, num_qo_heads=s.heads, head_dim=s.dim, **shape)
        return wrapper.run(st["q"], paged, enable_pdl=False).view(st["q"].shape[0], -1)
    qo = torch.arange(s.bs + 1, dtype=i32, device=dev) * tokens
    packed = None
    if kind in ("draft_level", "verify"):
        prefix = n if kind == "draft_level" else n - 1
        extra = st["mask"][:, :, :8].cpu() if kind == "draft_level" else st["mask"].cpu()
        # FlashInfer offsets a packed mask by mask_indptr = prefix sums of qo_len x kv_len, in bytes.
        buf = np.zeros(int(sum(tokens * len(x) for x in lists)) + 64, dtype=np.uint8)
        at = 0
        for r, lst in enumerate(lists):
            full = np.zeros((tokens, len(lst)), dtype=bool)
            full[:, :int(prefix[r])] = True
            full[:, int(prefix[r]):] = extra[r].numpy()
            bits = np.packbits(full.reshape(-1), bitorder="little")
            buf[at:at + len(bits)] = bits
            at += tokens * len(lst)
        packed = torch.from_numpy(buf).to(dev)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    wrapper.plan(qo, indptr, indices, last, num_qo_heads=s.heads, head_dim_qk=s.dim, causal=kind in ("window", "prefill"),
                 packed_custom_mask=packed, **shape)
    return wrapper.run(st["q"], paged, enable_pdl=False).view(st["q"].shape[0], -1)


@pytest.mark.gpu
@pytest.mark.skipif(not flashinfer_available(), reason="needs flashinfer")
@pytest.mark.parametrize("kind", KINDS)
def test_flashinfer_graph_replay_equals_eager_flashinfer_and_torch_gpu(kind):
    """At every captured batch size: a CUDA graph captured once (plan made once, before capture) and
    replayed with new lengths, masks and inputs equals eager FlashInfer planned for those exact lengths
    bit for bit, and the engine's torch attention within bf16 tolerance."""
    for bs in GPU_SIZES:
        s = Setup(bs=bs, ctx=192, heads=32, kvh=4, dim=128, dtype=torch.bfloat16, device="cuda", seed=bs)
        layouts = FlashInferLayouts(s.table, s.heads, s.kvh, s.dim, s.dtype, kernel="flashinfer")
        st, run = _step(s, kind, layouts)
        run()  # eager: makes the plan (the pool's warm-up does this before capture)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        for trial in range(3):
            fresh, _ = _step(s, kind, layouts)  # new lengths, masks and q/k/v, copied into the static inputs
            for name, t in st.items():
                t.copy_(fresh[name])
            graph.replay()
            got = out.clone()  # the plan's output buffer: the eager runs below overwrite it
            eager_fi = _oracle_flashinfer(s, kind, st)
            torch.testing.assert_close(got, eager_fi, rtol=0, atol=0,
                                       msg=lambda m: f"{kind} bs={bs} trial {trial}: graph != eager FlashInfer: {m}")
            want = _with_inputs(st, s, kind, TorchLayouts(s.table, s.heads // s.kvh))
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2,
                                       msg=lambda m: f"{kind} bs={bs} trial {trial}: FlashInfer vs torch: {m}")
            torch.testing.assert_close(run(), got, rtol=0, atol=0)  # the same in-graph path, eagerly


def _with_inputs(st, s, kind, layouts):
    """Run ``kind``'s step through ``layouts`` on the static inputs ``st`` (the same KV, lengths, masks)."""
    attn = layouts.attention(s.cache)
    w, k, prompt = 5, 4, 31
    n = st["n"]
    if kind == "decode":
        attn.meta = layouts.causal(s.rows, n - 1, 1)
    elif kind == "window":
        attn.meta = layouts.causal(s.rows, n - w, w)
    elif kind == "prefill":
        attn.meta = layouts.causal(s.rows, torch.zeros_like(s.rows), prompt)
    elif kind == "draft_level":
        attn.meta = layouts.tree(s.rows, n, st["mask"][:, :, :2 * k])
    else:
        attn.meta = layouts.tree(s.rows, n - 1, st["mask"])
    return attn(0, st["q"], st["k"], st["v"])


@pytest.mark.skipif(not HAVE_TRITON or torch.cuda.is_available(), reason="CPU emulation of the GPU path")
def test_gpu_code_path_emulated_on_cpu_matches_plain_torch():
    """Every Triton kernel the GPU path launches (fused norms, rotary, SwiGLU, KV store, FlashInfer metadata
    and mask bits), run in Triton's interpreter inside the engine's real steps, with the reference kernel
    standing in for FlashInfer's: speculation and dynamic speculation commit exactly what plain decoding
    does, and plain decoding matches the plain-torch engine."""
    from bench.engine.config import ModelConfig, SpecConfig
    from bench.engine.harness import build
    from bench.engine.loop import DecodeLoop, make_requests

    class Flip:  # switch modes every other step, so both directions (and the draft catch-up) run
        def __init__(self):
            self.calls = 0

        def choose(self, bs):
            self.calls += 1
            return "verify" if (self.calls // 2) % 2 else "decode"

    cfg, spec = ModelConfig.tiny(), SpecConfig(topk=2, steps=3, num_draft_tokens=6, draft_noise=0.1)
    reqs = make_requests(3, 12, cfg.vocab_size, 10, 14, seed=3)
    ref_engine, ref_pool = build(cfg, spec, [1, 2, 4], 12, 16, attention="torch", kernels="torch")
    want = DecodeLoop(ref_engine, ref_pool, "plain").run(reqs, 3).outputs
    engine, pool = build(cfg, spec, [1, 2, 4], 12, 16, attention="flashinfer-reference", kernels="torch")
    engine.layouts.triton = True
    engine.target.fused = engine.draft.fused = True  # the Triton kernels, interpreted (kernels="fused" needs CUDA)
    got = {v: DecodeLoop(engine, pool, v, Flip() if v == "dynamic" else None).run(reqs, 3)
           for v in ("plain", "spec", "dynamic")}
    assert got["plain"].outputs == want
    assert got["spec"].outputs == want and got["dynamic"].outputs == want
    assert got["spec"].mean_accept > 1.5 and got["dynamic"].steps["verify"] and got["dynamic"].steps["decode"]

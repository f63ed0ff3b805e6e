"""FlashInfer attention for the reference engine (bench/engine/fi_attention.py, fi_meta.py).

CPU: the in-graph metadata builders (Triton kernels in the interpreter, and their torch code) against
plain-Python oracles; attention computed from that metadata against the engine's torch attention, in every
step shape the engine runs (decode, the draft's causal first pass and tree levels, verify, prefill; tree
steps both with the packed mask and as decode, a page list per query token); and the decode loop end to
end on the FlashInfer metadata path. GPU (``-m gpu``): FlashInfer's own kernels replayed from CUDA graphs
planned once, at every captured batch size and in both tree forms, against eager FlashInfer planned per
call with the exact lengths (bit-exact) and the torch attention (bf16 tolerance).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.engine import fi_meta
from bench.engine.attention import TorchLayouts
from bench.engine.fi_attention import TREE_DECODE_MAX_TOKENS, FlashInferLayouts, flashinfer_available
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


def _tree_masks(s, tokens, form):
    """A tree step's ``[bs, T, E]`` extra mask, laid out as the engine hands them over."""
    if form == "tree":  # verify: E = T, each node's ancestors and itself
        return s.tree_mask(tokens)
    if form == "beam":  # a draft level: a slice of the beam's ancestor table (strided), E = 2 T
        return s.beam_mask(tokens, 3)[:, :, :2 * tokens]
    if form == "broadcast":  # the first beam level's table, one for all sequences (stride 0)
        return s.beam_mask(tokens, 2)[:1].expand(s.bs, -1, -1)
    return torch.rand(s.bs, tokens, tokens + 5, generator=s.gen).to(s.device) < 0.4  # any bits, empty rows too


@pytest.mark.parametrize("use_triton", BUILDERS)
@pytest.mark.parametrize("form", ["tree", "beam", "broadcast", "random"])
@pytest.mark.parametrize("tokens", [4, 16])
@pytest.mark.parametrize("bs", [1, 2, 3])
def test_tree_decode_indices_match_oracle(use_triton, form, tokens, bs):
    """A page list per query token: its sequence's prefix, then the extra columns its mask row keeps,
    in column order; the new tokens' slots as build_kv_indices writes them for the same step."""
    s = Setup(bs=bs, ctx=80, seed=10 * bs + tokens)
    mask = _tree_masks(s, tokens, form)
    extra = mask.shape[2]
    prefix = s.lens(0, s.ctx - extra)
    prefix[0] = 0 if bs > 1 else prefix[0]  # an empty prefix beside longer ones
    n = bs * tokens
    indptr = torch.full((n + 1,), -3, dtype=torch.int32)
    indices = torch.full((n * s.ctx + 1,), -7, dtype=torch.int32)
    write = torch.full((n,), -5, dtype=torch.int64)
    fi_meta.build_tree_decode_indices(s.table, s.rows, prefix, mask, indptr, indices, write, use_triton=use_triton)
    lists = []
    for r in range(bs):
        row, p = s.table[int(s.rows[r])].tolist(), int(prefix[r])
        for q in range(tokens):
            lists.append(row[:p] + [row[p + e] for e in range(extra) if mask[r, q, e]])
    assert indptr.tolist() == np.cumsum([0] + [len(x) for x in lists]).tolist()
    assert indices[:int(indptr[-1])].tolist() == sum(lists, [])
    want_write = torch.zeros(n, dtype=torch.int64)
    fi_meta.build_kv_indices(s.table, s.rows, prefix, extra, tokens, torch.zeros(bs + 1, dtype=torch.int32),
                             torch.zeros(bs * s.ctx + 1, dtype=torch.int32), want_write, use_triton=False)
    assert write.tolist() == want_write.tolist()


@pytest.mark.parametrize("use_triton", BUILDERS)
def test_tree_decode_indices_many_tokens_and_wide_masks(use_triton):
    """More query tokens than one block of the prefix-sum loop, more extra columns than one block."""
    s = Setup(bs=9, ctx=300, seed=4)
    tokens, extra = 16, 150
    mask = torch.rand(s.bs, tokens, extra, generator=s.gen) < 0.3
    prefix = s.lens(0, s.ctx - extra)
    n = s.bs * tokens
    want = [torch.zeros(n + 1, dtype=torch.int32), torch.zeros(n * s.ctx + 1, dtype=torch.int32),
            torch.zeros(n, dtype=torch.int64)]
    fi_meta.build_tree_decode_indices_reference(s.table, s.rows, prefix, mask, *want)
    got = [torch.full_like(t, -1) for t in want]
    fi_meta.build_tree_decode_indices(s.table, s.rows, prefix, mask, *got, use_triton=use_triton)
    end = int(want[0][-1])
    assert got[0].tolist() == want[0].tolist() and got[2].tolist() == want[2].tolist()
    assert got[1][:end].tolist() == want[1][:end].tolist()
    lens = (prefix[:, None] + mask.sum(-1)).reshape(-1)
    assert want[0][1:].tolist() == torch.cumsum(lens, 0).tolist()


def test_tree_decode_indices_check_their_buffers():
    s = Setup(bs=2)
    mask, prefix = s.tree_mask(4), s.lens(1, 20)
    ok = dict(indptr=torch.zeros(9, dtype=torch.int32), indices=torch.zeros(8 * s.ctx + 1, dtype=torch.int32),
              write_slots=torch.zeros(8, dtype=torch.int64))

    def build(mask=mask, **kw):
        fi_meta.build_tree_decode_indices(s.table, s.rows, prefix, mask, **{**ok, **kw})

    build()
    with pytest.raises(ValueError, match=r"indptr must be a torch.int32 \[9\]"):
        build(indptr=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"write_slots must be a torch.int64 \[8\]"):
        build(write_slots=torch.zeros(8, dtype=torch.int32))
    with pytest.raises(ValueError, match=f"at least {8 * s.ctx + 1} entries"):
        build(indices=torch.zeros(8 * s.ctx, dtype=torch.int32))
    with pytest.raises(ValueError, match="T <= E"):
        build(mask=mask[:, :, :3])
    with pytest.raises(ValueError, match="bool tensor"):
        build(mask=mask.to(torch.uint8))
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        build(mask=mask.transpose(1, 2))
    with pytest.raises(ValueError, match="prefix must be a contiguous int64"):
        fi_meta.build_tree_decode_indices(s.table, s.rows, prefix[:1], mask, **ok)


# ---------------------------------------------------------------- attention from the metadata
def _both(s, build, **fi_options):
    """Run one step's attention through the torch layouts and the FlashInfer layouts (reference
    kernel, with ``fi_options``), each on its own copy of the cache; return both outputs, caches and metas."""
    outs = []
    for layouts in (TorchLayouts(s.table, s.heads // s.kvh),
                    FlashInferLayouts(s.table, s.heads, s.kvh, s.dim, s.dtype, kernel="reference", **fi_options)):
        cache = KVCache(1, s.cache.num_slots, s.kvh, s.dim, s.dtype, s.device)
        cache.k[0].copy_(s.cache.k[0]), cache.v[0].copy_(s.cache.v[0])
        attn = layouts.attention(cache)
        meta, (q, k, v) = build(layouts)
        attn.meta = meta
        outs.append((attn(0, q, k, v), cache, meta))
    return outs


def _with_builders(*values):
    """``(*values, use_triton)`` for each metadata builder of BUILDERS, keeping the Triton one's mark."""
    return [pytest.param(*values, *b.values, marks=b.marks) if hasattr(b, "values") else (*values, b)
            for b in BUILDERS]


TREE_FORMS = {"tree": 0, "tree-decode": 10 ** 6}  # tree_decode_max_tokens forcing each form of tree step
ATTEND_CASES = ([(kind, None, False) for kind in ("decode", "window", "prefill")]
                + [case for kind in ("draft_level", "verify") for form in TREE_FORMS
                   for case in _with_builders(kind, form)])


@pytest.mark.parametrize("kind,tree_form,use_triton", ATTEND_CASES)
def test_flashinfer_metadata_attends_like_the_torch_attention(kind, tree_form, use_triton):
    """Every step shape of the engine: attention computed from FlashInfer's metadata (the reference
    kernel) equals the engine's torch attention, and both write the same KV slots; tree steps in both
    forms (a masked list per sequence, and as decode: a list per query token), with the metadata built
    by the torch code and by the Triton kernels."""
    s = Setup(bs=6, ctx=64, seed=11)
    k, w = 4, 5
    options = {"triton": use_triton} if tree_form is None else {
        "triton": use_triton, "tree_decode_max_tokens": TREE_FORMS[tree_form]}

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

    (want, want_cache, _), (got, got_cache, plan) = _both(s, build, **options)
    if tree_form is not None:
        assert plan.kind == tree_form
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_cache.k[0], want_cache.k[0], rtol=0, atol=0)
    torch.testing.assert_close(got_cache.v[0], want_cache.v[0], rtol=0, atol=0)


def test_plans_are_made_once_per_shape_and_reused_for_any_length():
    s = Setup(bs=3)
    layouts = FlashInferLayouts(s.table, s.heads, s.kvh, s.dim, s.dtype, kernel="reference",
                                tree_decode_max_tokens=32)
    a = layouts.causal(s.rows, s.lens(1, 30), 1)
    b = layouts.causal(s.rows, s.lens(1, 30), 1)
    c = layouts.tree(s.rows, s.lens(1, 30), s.tree_mask(16))
    d = layouts.tree(s.rows[:2], s.lens(1, 30)[:2], s.tree_mask(16)[:2])
    e = layouts.tree(s.rows[:2], s.lens(1, 30)[:2], s.tree_mask(16)[:2])
    assert a is b and c is not a and d is not c and d is e
    assert sorted(layouts.plans) == [(2, 16, "tree-decode"), (3, 1, "decode"), (3, 16, "tree")]
    assert a.kv_indices.data_ptr() == b.kv_indices.data_ptr()  # the buffers a captured graph reads stay put


@pytest.mark.parametrize("tokens", [4, 16])
def test_tree_steps_run_as_decode_up_to_the_token_limit(tokens):
    """tree() picks "tree-decode" while bs * T <= tree_decode_max_tokens (default 64: verify's 16 tokens
    at 1-4 sequences, the draft's 4-token levels at up to 16), "tree" above; the plans' buffers fit."""
    limit = 64
    for bs in (1, limit // tokens, limit // tokens + 1):
        s = Setup(bs=bs, ctx=40, seed=bs)
        layouts = FlashInferLayouts(s.table, s.heads, s.kvh, s.dim, s.dtype, kernel="reference")
        assert layouts.tree_decode_max_tokens == limit
        plan = layouts.tree(s.rows, s.lens(1, 20), s.tree_mask(tokens))
        lists = bs * tokens if bs * tokens <= limit else bs
        assert plan.kind == ("tree-decode" if bs * tokens <= limit else "tree")
        assert (plan.lists, plan.list_tokens) == ((lists, 1) if plan.kind == "tree-decode" else (bs, tokens))
        assert plan.kv_indptr.shape == (lists + 1,) and plan.last_page_len.shape == (lists,)
        assert plan.kv_indices.shape == (lists * plan.kv_max + 1,) and plan.write_slots.shape == (bs * tokens,)
        assert plan.out.shape == (bs * tokens, s.heads, s.dim)
        assert (plan.mask is None) == (plan.kind == "tree-decode")
        assert plan.qo_indptr.tolist() == list(range(0, lists * plan.list_tokens + 1, plan.list_tokens))
        never = FlashInferLayouts(s.table, s.heads, s.kvh, s.dim, s.dtype, kernel="reference",
                                  tree_decode_max_tokens=0)
        assert never.tree(s.rows, s.lens(1, 20), s.tree_mask(tokens)).kind == "tree"
    with pytest.raises(ValueError, match="tree_decode_max_tokens must be >= 0"):
        FlashInferLayouts(s.table, s.heads, s.kvh, s.dim, s.dtype, kernel="reference", tree_decode_max_tokens=-1)


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


def _oracle_flashinfer(s, kind, st, form=None, w=5, prompt=31):
    """Eager FlashInfer planned for this call's exact lengths, metadata built on the host (numpy). A tree
    step runs in the ``form`` of the plan under test: "tree" (the prefill wrapper with the packed mask) or
    "tree-decode" (the decode wrapper over a page list per query token)."""
    import flashinfer
    tokens = st["q"].shape[0] // s.bs
    n = st["n"].cpu()
    kv_len = {"decode": n, "window": n, "prefill": torch.full_like(n, prompt), "draft_level": n + 8,
              "verify": n + 15}[kind]
    lists = kv_lists(s.table.cpu(), s.rows.cpu(), kv_len)
    if kind in ("draft_level", "verify"):
        prefix = n if kind == "draft_level" else n - 1
        extra = st["mask"][:, :, :8].cpu() if kind == "draft_level" else st["mask"].cpu()
    if form == "tree-decode":  # query (r, q) attends r's prefix, then the extra columns its mask row keeps
        lists = [lst[:int(prefix[r])] + [lst[int(prefix[r]) + e] for e in range(extra.shape[2]) if extra[r, q, e]]
                 for r, lst in enumerate(lists) for q in range(tokens)]
    dev, i32 = s.device, torch.int32
    indptr = torch.tensor(np.cumsum([0] + [len(x) for x in lists]), dtype=i32, device=dev)
    indices = torch.tensor(sum(lists, []), dtype=i32, device=dev)
    last = torch.ones(len(lists), dtype=i32, device=dev)
    ws = torch.zeros(64 << 20, dtype=torch.uint8, device=dev)
    paged = (s.cache.k[0][:, None], s.cache.v[0][:, None])
    shape = dict(num_kv_heads=s.kvh, page_size=1, q_data_type=s.dtype, kv_data_type=s.dtype, disable_split_kv=True)
    if kind == "decode" or form == "tree-decode":
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True, backend="fa2")
        wrapper.plan(indptr, indices, last, num_qo_heads=s.heads, head_dim=s.dim, **shape)
        return wrapper.run(st["q"], paged, enable_pdl=False).view(st["q"].shape[0], -1)
    qo = torch.arange(s.bs + 1, dtype=i32, device=dev) * tokens
    packed = None
    if kind in ("draft_level", "verify"):
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


GPU_TREE_TOKENS = {"draft_level": 4, "verify": 16}
# Default tree_decode_max_tokens: tree steps run as "tree-decode" up to 64 query tokens, as "tree" above.
# With 0 the small sizes run as "tree" too (what they ran before "tree-decode"): both forms at every size.
GPU_CASES = [(kind, None) for kind in KINDS] + [(kind, 0) for kind in GPU_TREE_TOKENS]


@pytest.mark.gpu
@pytest.mark.skipif(not flashinfer_available(), reason="needs flashinfer")
@pytest.mark.parametrize("kind,tree_decode_max_tokens", GPU_CASES)
def test_flashinfer_graph_replay_equals_eager_flashinfer_and_torch_gpu(kind, tree_decode_max_tokens):
    """At every captured batch size: a CUDA graph captured once (plan made once, before capture) and
    replayed with new lengths, masks and inputs equals eager FlashInfer planned for those exact lengths
    bit for bit (in the plan's form: tree steps as decode over a page list per query token up to the
    token limit, else with the packed mask), and the engine's torch attention within bf16 tolerance."""
    options = {} if tree_decode_max_tokens is None else {"tree_decode_max_tokens": tree_decode_max_tokens}
    sizes = GPU_SIZES
    if tree_decode_max_tokens == 0:  # only where the default limit picks "tree-decode": the rest is run above
        sizes = [bs for bs in GPU_SIZES if bs * GPU_TREE_TOKENS[kind] <= TREE_DECODE_MAX_TOKENS]
    for bs in sizes:
        s = Setup(bs=bs, ctx=192, heads=32, kvh=4, dim=128, dtype=torch.bfloat16, device="cuda", seed=bs)
        layouts = FlashInferLayouts(s.table, s.heads, s.kvh, s.dim, s.dtype, kernel="flashinfer", **options)
        st, run = _step(s, kind, layouts)
        run()  # eager: makes the plan (the pool's warm-up does this before capture)
        [plan] = layouts.plans.values()
        if kind in GPU_TREE_TOKENS:
            small = bs * GPU_TREE_TOKENS[kind] <= layouts.tree_decode_max_tokens
            assert plan.kind == ("tree-decode" if small else "tree"), (kind, bs, plan.kind)
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
            eager_fi = _oracle_flashinfer(s, kind, st, plan.kind)
            torch.testing.assert_close(got, eager_fi, rtol=0, atol=0, msg=lambda m: f"{kind} ({plan.kind}) bs={bs} "
                                       f"trial {trial}: graph != eager FlashInfer: {m}")
            want = _with_inputs(st, s, kind, TorchLayouts(s.table, s.heads // s.kvh))
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2,
                                       msg=lambda m: f"{kind} ({plan.kind}) bs={bs} trial {trial}: FlashInfer vs "
                                       f"torch: {m}")
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


# (requests, new tokens per request, captured sizes): two requests already give batched FlashInfer metadata,
# both switch directions and a draft catch-up; the long version (CI) serves three at up to bs 4.
@pytest.mark.skipif(not HAVE_TRITON or torch.cuda.is_available(), reason="CPU emulation of the GPU path")
@pytest.mark.parametrize("requests, new_tokens, sizes", [
    pytest.param(2, (8, 10), [1, 2], id="short"), pytest.param(3, (10, 14), [1, 2, 4], id="long", marks=pytest.mark.slow)])
def test_gpu_code_path_emulated_on_cpu_matches_plain_torch(requests, new_tokens, sizes):
    """Every Triton kernel the GPU path launches (fused norms, rotary, SwiGLU, KV store, FlashInfer metadata
    and mask bits), run in Triton's interpreter inside the engine's real steps, with the reference kernel
    standing in for FlashInfer's: speculation and dynamic speculation commit exactly what plain decoding
    does (tree steps as decode, and again with the packed mask), and plain decoding matches the
    plain-torch engine."""
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
    reqs = make_requests(requests, 12, cfg.vocab_size, *new_tokens, seed=3)
    ref_engine, ref_pool = build(cfg, spec, sizes, 12, 16, attention="torch", kernels="torch")
    want = DecodeLoop(ref_engine, ref_pool, "plain").run(reqs, 3).outputs
    engine, pool = build(cfg, spec, sizes, 12, 16, attention="flashinfer-reference", kernels="torch")
    engine.layouts.triton = True
    engine.target.fused = engine.draft.fused = True  # the Triton kernels, interpreted (kernels="fused" needs CUDA)
    got = {v: DecodeLoop(engine, pool, v, Flip() if v == "dynamic" else None).run(reqs, 3)
           for v in ("plain", "spec", "dynamic")}
    assert {kind for _, _, kind in engine.layouts.plans} == {"decode", "causal", "tree-decode"}  # bs * T <= 64
    engine.layouts.tree_decode_max_tokens = 0  # the tree steps with the packed mask (the eager twin replans)
    got["spec, masked tree"] = DecodeLoop(engine, pool, "spec").run(reqs, 3)
    assert "tree" in {kind for _, _, kind in engine.layouts.plans}
    assert got["plain"].outputs == want
    assert got["spec"].outputs == want and got["dynamic"].outputs == want
    assert got["spec, masked tree"].outputs == want
    assert got["spec"].mean_accept > 1.5 and got["dynamic"].steps["verify"] and got["dynamic"].steps["decode"]
    assert got["dynamic"].catch_ups, "no plain step was followed by a verify step (the draft's catch-up)"

"""Fused Triton kernels of the model's forward and greedy pick, each beside the plain-torch code it replaces.

A decode step of the medium model at C = 1 reads 3.5 GB of weights (0.8 ms at the H200's bandwidth);
in plain torch each layer also launches ~55 tiny kernels (the norms' casts and reductions, the rotary
embedding's slices and concatenations), ~1-2 us each on the GPU even inside a CUDA graph, which doubled
the step time. These Triton kernels do each of those pieces in one launch:

* :func:`add_rmsnorm`: ``h = x + residual`` (rounded to the model dtype, as torch's add) and
  ``rmsnorm(h) * weight`` with float32 statistics.
* :func:`rope_qk`: the rotary embedding of the query and key heads of a fused qkv projection, positions
  looked up in the float32 cos/sin tables.
* :func:`silu_mul`: ``silu(gate) * up`` of a fused gate/up projection.
* :func:`store_kv`: write the step's keys and values into their KV-cache slots.
* :func:`rope_q_store_kv`: :func:`rope_qk` and :func:`store_kv` in one launch: the rotated query heads
  to ``q``, the rotated key heads and the value heads straight into their cache slots (no key tensor).
  The model runs it where the attention callable exposes ``kv_sink`` (see
  :class:`bench.engine.model.AttentionFn`): one launch per layer fewer, and a decode step is partly
  bound by its kernel count (each of these small kernels costs ~2 us plus a launch gap on an H200).

Two more replace torch kernels that a profile of the speculative step showed slow for what they do
(medium model, bs 1, on an H200, run X, measured before these kernels existed):

* :func:`embed_rmsnorm`: the embedding lookup and the first layer's norm in one launch. Torch's lookup
  (``indexSelectSmallIndex``) took 5.6 us a call (5 calls a speculative step, 1 a plain step), and the
  norm was a launch of its own.
* :func:`argmax_rows`: greedy argmax over the logits, one program per row. Torch's ``reduce_kernel`` took
  16 us for ``[16, 4096]`` bf16 (one output per row, so few blocks).

Each kernel reproduces the torch code's roundings (float32 math, a round to the model dtype wherever
torch rounds), so fused and plain steps agree to within reduction order; the embedding rows and the argmax
(ties included) agree exactly. The torch code (in each function, or below) is the CPU path and the test
oracle; each function's ``fused`` flag picks which runs (the model's ``fused``, from
:func:`fused_available` via :func:`bench.engine.model.resolve_kernels`).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: without it every function takes its torch path
    triton = tl = None

FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fused_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the Triton kernels can serve a model on ``device`` in ``dtype`` (CUDA, Triton, and a
    16- or 32-bit float type: a float64 model keeps torch's float64 math end to end)."""
    return triton is not None and torch.device(device).type == "cuda" and dtype in FUSED_DTYPES


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype norms and rotary embeddings compute in: at least float32 (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


# ------------------------------------------------------------------------------------------- kernels
if triton is not None:
    @triton.jit
    def _rmsnorm_row(x, w_ptr, cols, inside, n_cols, eps):
        """``rmsnorm(x) * weight`` of one row ``x`` (model dtype; masked columns 0), as float32 with the torch
        code's roundings: float32 statistics, the normalised row rounded to the dtype, then times the weight."""
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        return (xf * rstd).to(x.dtype).to(tl.float32) * w

    @triton.jit
    def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, stride_x, stride_res, stride_out, stride_h,
                            n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
        if HAS_RES:
            res = tl.load(res_ptr + row * stride_res + cols, mask=inside, other=0.0)
            x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)  # torch rounds the sum to the dtype
            tl.store(h_ptr + row * stride_h + cols, x, mask=inside)
        y = _rmsnorm_row(x, w_ptr, cols, inside, n_cols, eps)
        tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _embed_rmsnorm_kernel(ids_ptr, table_ptr, w_ptr, out_ptr, h_ptr, stride_ids, stride_table, stride_out,
                              stride_h, n_cols, eps, BLOCK: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)
        row = tl.load(ids_ptr + tok * stride_ids).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(table_ptr + row * stride_table + cols, mask=inside, other=0.0)  # the embedding row
        tl.store(h_ptr + tok * stride_h + cols, x, mask=inside)
        y = _rmsnorm_row(x, w_ptr, cols, inside, n_cols, eps)
        tl.store(out_ptr + tok * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _rope_store_q(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_ptr, tok, stride_qkv, stride_pos, NUM_Q: tl.constexpr,
                      NUM_K: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
        """The rotary embedding of token ``tok``'s query and key heads (the first ``NUM_Q + NUM_K`` heads of
        its qkv row), each half rounded to qkv's dtype as the torch code rounds. Stores the query heads to
        ``q`` (``[tokens, NUM_Q, 2 * HALF]``) and returns what the caller stores of the keys: ``is_k``
        (``[BLOCK_H, 1]``, the rows holding key heads), ``k_off`` (each row's offset within the token's
        ``[NUM_K, 2 * HALF]`` key block) and the rotated halves ``o1``, ``o2`` (``[BLOCK_H, HALF]``)."""
        pos = tl.load(pos_ptr + tok * stride_pos).to(tl.int64)
        j = tl.arange(0, HALF)
        c = tl.load(cos_ptr + pos * HALF + j)[None, :]
        s = tl.load(sin_ptr + pos * HALF + j)[None, :]
        head = tl.arange(0, BLOCK_H)[:, None]  # query heads, then key heads: both lead the qkv row
        valid = head < NUM_Q + NUM_K
        src = qkv_ptr + tok * stride_qkv + head * (2 * HALF) + j[None, :]
        x1 = tl.load(src, mask=valid, other=0.0)
        x2 = tl.load(src + HALF, mask=valid, other=0.0)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        o1 = (a * c - b * s).to(x1.dtype)
        o2 = (b * c + a * s).to(x1.dtype)
        is_q = head < NUM_Q
        q_dst = q_ptr + (tok * NUM_Q + head) * (2 * HALF) + j[None, :]
        tl.store(q_dst, o1, mask=is_q)
        tl.store(q_dst + HALF, o2, mask=is_q)
        is_k = valid & (head >= NUM_Q)
        return is_k, (head - NUM_Q) * (2 * HALF) + j[None, :], o1, o2

    @triton.jit
    def _rope_qk_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, stride_qkv, stride_pos,
                        NUM_Q: tl.constexpr, NUM_K: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)
        is_k, k_off, o1, o2 = _rope_store_q(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_ptr, tok, stride_qkv, stride_pos,
                                            NUM_Q, NUM_K, HALF, BLOCK_H)
        k_dst = k_ptr + tok * (NUM_K * 2 * HALF) + k_off
        tl.store(k_dst, o1, mask=is_k)
        tl.store(k_dst + HALF, o2, mask=is_k)

    @triton.jit
    def _rope_q_store_kv_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                                stride_qkv, stride_pos, stride_slot, NUM_Q: tl.constexpr, NUM_K: tl.constexpr,
                                HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)
        is_k, k_off, o1, o2 = _rope_store_q(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, q_ptr, tok, stride_qkv, stride_pos,
                                            NUM_Q, NUM_K, HALF, BLOCK_H)
        # The rotated keys and the value heads go straight to the token's cache row (caches [slots, NUM_K, D]).
        row = tl.load(slot_ptr + tok * stride_slot).to(tl.int64) * (NUM_K * 2 * HALF)
        tl.store(k_cache_ptr + row + k_off, o1, mask=is_k)
        tl.store(k_cache_ptr + row + k_off + HALF, o2, mask=is_k)
        vh = tl.arange(0, BLOCK_K)[:, None]
        d = tl.arange(0, 2 * HALF)[None, :]
        is_v = vh < NUM_K
        v = tl.load(qkv_ptr + tok * stride_qkv + (NUM_Q + NUM_K + vh) * (2 * HALF) + d, mask=is_v)
        tl.store(v_cache_ptr + row + vh * (2 * HALF) + d, v, mask=is_v)

    @triton.jit
    def swiglu(gate, up):
        """``silu(gate) * up`` in float32 from ``gate`` and ``up`` in the model dtype, rounded as the torch code
        rounds: silu in float32, rounded to the dtype, then the product (the caller rounds that)."""
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # torch's silu rounds to the dtype
        return act * up.to(tl.float32)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < n_cols
        g = tl.load(gu_ptr + row * stride_gu + cols, mask=inside, other=0.0)
        u = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=inside, other=0.0)
        tl.store(out_ptr + row * stride_out + cols, swiglu(g, u).to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _store_kv_kernel(k_ptr, v_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, stride_k, stride_v,
                         WIDTH: tl.constexpr, BLOCK: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < WIDTH
        tl.store(k_cache_ptr + slot * WIDTH + cols, tl.load(k_ptr + tok * stride_k + cols, mask=inside), mask=inside)
        tl.store(v_cache_ptr + slot * WIDTH + cols, tl.load(v_ptr + tok * stride_v + cols, mask=inside), mask=inside)

    @triton.jit
    def _argmax_rows_kernel(x_ptr, out_ptr, stride_x, n_cols, table_ptr, rows_ptr, cols_ptr, stride_table,
                            BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr, COMMIT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        lanes = tl.arange(0, BLOCK)
        # Each lane keeps the largest value it has seen and its column; a strict ">" keeps the earlier
        # (lower) column on ties, and a NaN never wins (NaN > v is false).
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_col = tl.zeros([BLOCK], dtype=tl.int32)
        for blk in range(NUM_BLOCKS):  # a constexpr bound: Triton's interpreter (numpy 2) fails on a runtime one
            cols = blk * BLOCK + lanes
            x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            take = x > best
            best = tl.where(take, x, best)
            best_col = tl.where(take, cols, best_col)
        top = tl.max(best, axis=0)
        # The lowest column among the lanes holding the maximum (an all -inf row: every lane, column 0).
        first = tl.min(tl.where(best == top, best_col, n_cols), axis=0)
        tl.store(out_ptr + row, first.to(tl.int64))
        if COMMIT:  # also table[rows[row], cols[row]] = the token (a decode step's commit, no extra launch)
            dest = tl.load(rows_ptr + row) * stride_table + tl.load(cols_ptr + row)
            tl.store(table_ptr + dest, first.to(tl.int64))


def _rows_contiguous(t: torch.Tensor, name: str) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


# ------------------------------------------------------------------------------------------ launchers
def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (or ``h = x`` without one) and ``rmsnorm(h) * weight``.

    Args:
        x, residual: ``[N, hidden]`` in the model dtype.
        weight: ``[hidden]`` norm weight.
        eps: the norm's epsilon.
        fused: one Triton launch (CUDA) or the torch code.
    Returns:
        ``(normed, h)``: the norm's output and the new residual stream.
    """
    if not fused:
        return add_rmsnorm_reference(x, residual, weight, eps)
    _rows_contiguous(x, "x")
    n, hidden = x.shape
    out = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else x
    if residual is not None:
        _rows_contiguous(residual, "residual")
    block = triton.next_power_of_2(hidden)
    res = residual if residual is not None else x
    _add_rmsnorm_kernel[(n,)](x, res, weight, out, h, x.stride(0), res.stride(0), out.stride(0), h.stride(0),
                              hidden, eps, HAS_RES=residual is not None, BLOCK=block, num_warps=_warps(block))
    return out, h


def embed_rmsnorm(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float,
                  fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The embedding lookup ``h = table[ids]`` and the first layer's norm ``rmsnorm(h) * weight``.

    The torch code is ``embedding`` then :func:`add_rmsnorm` without a residual; the kernel copies the rows
    exactly and computes the norm with :func:`add_rmsnorm`'s kernel code (the same roundings).

    Args:
        ids: ``[N]`` int64 token ids, each in ``[0, vocab)`` (not checked on the fused path).
        table: ``[vocab, hidden]`` embedding weight in the model dtype.
        weight: ``[hidden]`` norm weight.
        eps: the norm's epsilon.
        fused: one Triton launch (CUDA) or the torch code.
    Returns:
        ``(normed, h)``: the norm's output and the residual stream (the embeddings, in the table's dtype).
    """
    if ids.dim() != 1:
        raise ValueError(f"ids must be one-dimensional [N], got shape {tuple(ids.shape)}")
    if not fused:
        return add_rmsnorm_reference(torch.nn.functional.embedding(ids, table), None, weight, eps)
    _rows_contiguous(table, "table")
    n, hidden = ids.shape[0], table.shape[1]
    out = torch.empty(n, hidden, dtype=table.dtype, device=table.device)
    h = torch.empty_like(out)
    block = triton.next_power_of_2(hidden)
    _embed_rmsnorm_kernel[(n,)](ids, table, weight, out, h, ids.stride(0), table.stride(0), out.stride(0),
                                h.stride(0), hidden, eps, BLOCK=block, num_warps=_warps(block))
    return out, h


def rope_qk(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
            num_kv_heads: int, head_dim: int, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of the query and key parts of ``qkv [N, (H + 2 KVH) * D]``.

    Args:
        positions: ``[N]`` int64 positions; ``cos``, ``sin``: ``[max_positions, D / 2]`` float32 tables.
        fused: one Triton launch (CUDA) or the torch code.
    Returns:
        ``q [N, H, D]`` and ``k [N, KVH, D]`` (contiguous, in qkv's dtype).
    """
    n = qkv.shape[0]
    if positions.dim() != 1 or positions.shape[0] != n:
        raise ValueError(f"positions must be [{n}] (one per qkv row), got {tuple(positions.shape)}")
    if not fused:
        q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
        c, s = cos[positions], sin[positions]
        q = apply_rope(qkv[:, :q_dim].reshape(n, num_heads, head_dim), c, s)
        k = apply_rope(qkv[:, q_dim:q_dim + kv_dim].reshape(n, num_kv_heads, head_dim), c, s)
        return q, k
    _rows_contiguous(qkv, "qkv")
    half = head_dim // 2
    if half & (half - 1):
        raise ValueError(f"the fused rotary kernel needs head_dim / 2 to be a power of two, got head_dim {head_dim}")
    q = torch.empty(n, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(n, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    # positions may be a broadcast view (stride 0: a draft level's k nodes share one position)
    _rope_qk_kernel[(n,)](qkv, positions, cos, sin, q, k, qkv.stride(0), positions.stride(0), NUM_Q=num_heads,
                          NUM_K=num_kv_heads,
                          HALF=half, BLOCK_H=triton.next_power_of_2(num_heads + num_kv_heads), num_warps=4)
    return q, k


def silu_mul(gate_up: torch.Tensor, fused: bool) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [N, 2 M]`` (gate first) -> ``[N, M]``."""
    if not fused:
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    _rows_contiguous(gate_up, "gate_up")
    n, two_m = gate_up.shape
    m = two_m // 2
    out = torch.empty(n, m, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(n, triton.cdiv(m, block))](gate_up, out, gate_up.stride(0), out.stride(0), m, BLOCK=block,
                                                 num_warps=4)
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             fused: bool) -> None:
    """``k_cache[slots] = k`` and ``v_cache[slots] = v`` (``k``, ``v``: ``[N, KVH, D]``, rows may be strided)."""
    if not fused:
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)
        return
    n, kvh, dim = k.shape
    if slots.dim() != 1 or slots.shape[0] != n or (n > 1 and slots.stride(0) != 1):
        raise ValueError(f"slots must be a contiguous [{n}] tensor, got shape {tuple(slots.shape)} strides {slots.stride()}")
    for name, t in (("k", k), ("v", v)):
        if t.stride(2) != 1 or t.stride(1) != dim:
            raise ValueError(f"{name} must have contiguous heads [N, KVH, D] (row stride free), got strides {t.stride()}")
    width = kvh * dim
    _store_kv_kernel[(n,)](k, v, slots, k_cache, v_cache, k.stride(0), v.stride(0), WIDTH=width,
                           BLOCK=triton.next_power_of_2(width), num_warps=4)


def rope_q_store_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                    num_kv_heads: int, head_dim: int, fused: bool) -> torch.Tensor:
    """:func:`rope_qk` of ``qkv [N, (H + 2 KVH) * D]``, then :func:`store_kv` of the rotated keys and of
    qkv's value heads at ``slots``; fused, one launch writes the keys and values straight into the cache
    (no key tensor, no second launch), with the same roundings.

    Args:
        positions: ``[N]`` int64 positions (may be a broadcast view); ``cos``, ``sin``: the float32 tables.
        slots: ``[N]`` cache slots of the N tokens (any order; any stride).
        k_cache, v_cache: ``[num_slots, KVH, D]`` contiguous, in qkv's dtype.
        fused: one Triton launch (CUDA) or the torch code (:func:`rope_qk` then :func:`store_kv`).
    Returns:
        ``q [N, H, D]`` (contiguous, in qkv's dtype).
    """
    n = qkv.shape[0]
    if slots.dim() != 1 or slots.shape[0] != n:
        raise ValueError(f"slots must be [{n}] (one per qkv row), got shape {tuple(slots.shape)}")
    if not fused:
        q, k = rope_qk(qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim, fused=False)
        v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(n, num_kv_heads, head_dim)
        store_kv(k, v, slots, k_cache, v_cache, fused=False)
        return q
    if positions.dim() != 1 or positions.shape[0] != n:
        raise ValueError(f"positions must be [{n}] (one per qkv row), got {tuple(positions.shape)}")
    _rows_contiguous(qkv, "qkv")
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv must be [N, (H + 2 KVH) * D] = [N, {(num_heads + 2 * num_kv_heads) * head_dim}], "
                         f"got {tuple(qkv.shape)}")
    half = head_dim // 2
    if half & (half - 1):
        raise ValueError(f"the fused rotary kernel needs head_dim / 2 to be a power of two, got head_dim {head_dim}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 3 or cache.shape[1:] != (num_kv_heads, head_dim) or not cache.is_contiguous() \
                or cache.dtype != qkv.dtype:
            raise ValueError(f"{name} must be a contiguous [num_slots, {num_kv_heads}, {head_dim}] {qkv.dtype} tensor, "
                             f"got {cache.dtype} shape {tuple(cache.shape)} strides {cache.stride()}")
    q = torch.empty(n, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rope_q_store_kv_kernel[(n,)](qkv, positions, cos, sin, slots, q, k_cache, v_cache, qkv.stride(0),
                                  positions.stride(0), slots.stride(0), NUM_Q=num_heads, NUM_K=num_kv_heads,
                                  HALF=half, BLOCK_H=triton.next_power_of_2(num_heads + num_kv_heads),
                                  BLOCK_K=triton.next_power_of_2(num_kv_heads), num_warps=4)
    return q


ARGMAX_BLOCK = 4096  # columns a program of argmax_rows reads at a time; wider rows loop over blocks


def argmax_rows(x: torch.Tensor, fused: bool,
                commit: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``x.argmax(-1)`` of ``x [rows, n]`` (float32 or a 16-bit float): int64 ``[rows]``, the lowest column
    among equal maxima (torch's rule), values compared in float32 (an exact upcast).

    One program per row. NaNs are skipped on the fused path (torch would pick a NaN's column).
    ``commit = (table, table_rows, table_cols)`` also writes ``table[table_rows[i], table_cols[i]]`` = row
    i's token (int64 table, int64 ``[rows]`` indices), in the same launch on the fused path: a decode step
    commits its tokens without an indexed-write kernel of its own.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be two-dimensional [rows, n], got shape {tuple(x.shape)}")
    if commit is not None:
        table, table_rows, table_cols = commit
        if (table.dim() != 2 or table.dtype != torch.int64 or table.stride(1) != 1
                or any(t.shape != (x.shape[0],) or t.dtype != torch.int64 for t in (table_rows, table_cols))):
            raise ValueError(f"commit must be (int64 [R, C] table with unit column stride, int64 [{x.shape[0]}] rows, "
                             f"int64 [{x.shape[0]}] cols); got {table.dtype} {tuple(table.shape)}, "
                             f"{table_rows.dtype} {tuple(table_rows.shape)}, {table_cols.dtype} {tuple(table_cols.shape)}")
    if not fused:
        out = x.argmax(-1)
        if commit is not None:
            table[table_rows, table_cols] = out
        return out
    _rows_contiguous(x, "x")
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    block = min(triton.next_power_of_2(n), ARGMAX_BLOCK)
    if commit is None:
        dest = (out, out, out, 0)
    else:
        dest = (table, table_rows.contiguous(), table_cols.contiguous(), table.stride(0))
    _argmax_rows_kernel[(rows,)](x, out, x.stride(0), n, *dest, BLOCK=block, NUM_BLOCKS=triton.cdiv(n, block),
                                 COMMIT=commit is not None, num_warps=_warps(block))
    return out


# ---------------------------------------------------------------------------- torch code (CPU, oracle)
def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square norm with statistics in at least float32, then times ``weight`` in x's dtype."""
    xs = x.to(stats_dtype(x.dtype))
    xs = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps)
    return xs.to(x.dtype) * weight


def add_rmsnorm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch code :func:`add_rmsnorm` fuses."""
    h = x if residual is None else x + residual
    return rmsnorm_reference(h, weight, eps), h


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding. ``x``: [N, heads, D]; ``cos``/``sin``: [N, D/2] (already gathered)."""
    half = x.shape[-1] // 2
    dtype = stats_dtype(x.dtype)
    x1, x2 = x[..., :half].to(dtype), x[..., half:].to(dtype)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)

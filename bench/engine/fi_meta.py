"""FlashInfer's per-step attention metadata, built on the device inside the step's graph.

Every attention call of the engine has the same shape: ``R`` sequences, ``T`` new tokens each, and
sequence ``r`` attends the KV of its first ``kv_len[r]`` positions (columns of its ``req_to_token`` row),
the step's new tokens being the last ``T`` of them. FlashInfer reads that as a page-size-1 paged KV
cache: ``kv_indptr`` (``[R + 1]`` int32 prefix sums of ``kv_len``) and ``kv_indices`` (the slots of each
sequence's columns, back to back), plus, for tree attention, a *packed custom mask*: bit ``q * kv_len + c``
of sequence ``r``'s region says whether query ``q`` may attend column ``c``.

:func:`build_kv_indices` writes ``kv_indptr``, ``kv_indices`` and the slots the new tokens' K and V go
to (``write_slots``); :func:`pack_mask` writes the mask bits. On CUDA each is one Triton launch (captured
in the step's graph); the torch code beside each is the CPU path and the test oracle. Nothing here reads
a device value on the host, so no step waits for the GPU.

Tree as decode. With page size 1 a tree step needs no mask at all: each query token ``(r, q)`` becomes a
page list of its own, sequence ``r``'s first ``prefix[r]`` columns followed by the extra columns ``e``
with ``extra_mask[r, q, e]`` (the token's ancestors and itself), in column order, and attends all of it
with one query. :func:`build_tree_decode_indices` writes those ``R * T`` lists (on CUDA two Triton launches,
the lists' prefix sums, then their pages; one for up to 64 query tokens), for FlashInfer's decode kernel.

:func:`reference_attention_paged` computes attention from exactly this metadata in plain torch
(float32-capable, fixed shapes): the CPU stand-in for FlashInfer's kernels and the oracle that checks the
metadata end to end.

Mask layout. FlashInfer offsets sequence ``r``'s mask by ``mask_indptr[r]`` *bytes*, and when a plan gets
an already packed mask it computes ``mask_indptr`` as the prefix sums of ``qo_len x kv_len`` (bits). The
engine plans once with every ``kv_len`` at its maximum ``kv_max``, so sequence ``r``'s region starts at byte
``r * T * kv_max`` and holds ``T * kv_max`` bytes, 8x more than its bits need: :func:`pack_mask` writes
each sequence's bits from the start of its region.
"""
from __future__ import annotations

import torch

from .attention import AttnMeta, attend

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: without it the torch code below builds the metadata
    triton = tl = None

INDEX_BLOCK = 256
MASK_BLOCK = 64  # bytes per program (x 8 bits each)
TREE_TOKEN_BLOCK = 128  # query tokens per iteration of the tree-as-decode prefix sums
TREE_EXTRA_BLOCK = 64   # at most this many extra columns per iteration
# Up to this many query tokens, the tree-as-decode lists come from one launch: every program sums the lengths
# of the lists before its own (<= 64 x E mask bytes, from L2) instead of a prefix-sum launch first. A draft
# level at C <= 16 and a verify step at C <= 4 take it; a step at C = 1 saves 4 launches (~10 us on the H200).
TREE_OWN_START_TOKENS = 64


# ------------------------------------------------------------------------------------------- kernels
if triton is not None:
    # Batch sizes, offsets and token counts vary from call site to call site: one compiled variant for all
    # (Triton would otherwise compile one per value class: 1, a multiple of 16, anything else).
    @triton.jit(do_not_specialize=["table_width", "n_seqs", "offset", "tokens"])
    def _kv_indices_kernel(table_ptr, rows_ptr, base_ptr, indptr_ptr, indices_ptr, write_ptr, table_width,
                           n_seqs, offset, tokens, R_BLOCK: tl.constexpr, T_BLOCK: tl.constexpr,
                           BLOCK: tl.constexpr):
        r = tl.program_id(0)
        blk = tl.program_id(1)
        seq = tl.arange(0, R_BLOCK)
        lens = tl.load(base_ptr + seq, mask=seq < n_seqs, other=0) + offset
        start = tl.sum(tl.where(seq < r, lens, 0), axis=0)  # kv entries of the sequences before r
        kv_len = tl.load(base_ptr + r) + offset
        row = tl.load(rows_ptr + r).to(tl.int64)
        if blk == 0:
            tl.store(indptr_ptr + r + 1, (start + kv_len).to(tl.int32))
            if r == 0:
                tl.store(indptr_ptr, 0)
            j = tl.arange(0, T_BLOCK)
            is_new = j < tokens
            new_slots = tl.load(table_ptr + row * table_width + kv_len - tokens + j, mask=is_new, other=0)
            tl.store(write_ptr + r * tokens + j, new_slots, mask=is_new)
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        inside = cols < kv_len
        slots = tl.load(table_ptr + row * table_width + cols, mask=inside, other=0)
        tl.store(indices_ptr + start + cols, slots.to(tl.int32), mask=inside)

    @triton.jit(do_not_specialize=["stride_mr", "stride_mt", "n_extra", "region", "tokens"])
    def _pack_mask_kernel(prefix_ptr, mask_ptr, out_ptr, stride_mr, stride_mt, n_extra, region, tokens,
                          BLOCK: tl.constexpr):
        r = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        bit = tl.arange(0, 8)[None, :]
        prefix = tl.load(prefix_ptr + r)
        kv_len = prefix + n_extra
        pos = offs[:, None] * 8 + bit
        q = pos // kv_len
        c = pos - q * kv_len
        e = c - prefix
        in_tree = (q < tokens) & (e >= 0)
        tree = tl.load(mask_ptr + r * stride_mr + q * stride_mt + e, mask=in_tree, other=0)
        keep = (q < tokens) & ((c < prefix) | (tree != 0))
        packed = tl.sum(keep.to(tl.int32) << bit, axis=1)
        tl.store(out_ptr + r * region + offs, packed.to(tl.uint8), mask=offs < region)

    @triton.jit
    def _kept_columns(mask_ptr, r, q, live, stride_mr, stride_mt, n_extra, E_BLOCK: tl.constexpr):
        # Per token (r, q) of a block: how many of its n_extra tree-mask columns it sees (nonzero bits).
        row = mask_ptr + r.to(tl.int64) * stride_mr + q.to(tl.int64) * stride_mt
        kept = tl.zeros(r.shape, tl.int32)
        e0 = 0
        while e0 < n_extra:
            e = e0 + tl.arange(0, E_BLOCK)
            bits = tl.load(row[:, None] + e[None, :], mask=live[:, None] & (e[None, :] < n_extra), other=0)
            kept += tl.sum((bits != 0).to(tl.int32), axis=1)
            e0 += E_BLOCK
        return kept

    @triton.jit(do_not_specialize=["stride_mr", "stride_mt", "n_tokens", "tokens", "n_extra"])
    def _tree_decode_indptr_kernel(prefix_ptr, mask_ptr, indptr_ptr, stride_mr, stride_mt, n_tokens, tokens,
                                   n_extra, BLOCK: tl.constexpr, E_BLOCK: tl.constexpr):
        # One program: token i = r * tokens + q has prefix[r] + popcount(mask[r, q, :]) pages; indptr holds
        # their running sums, a block of tokens at a time.
        # (while loops: Triton 3.6's interpreter cannot range() over a runtime bound under NumPy 2.4)
        tl.store(indptr_ptr, 0)
        carry = 0
        t0 = 0
        while t0 < n_tokens:
            i = t0 + tl.arange(0, BLOCK)
            live = i < n_tokens
            r = i // tokens
            q = i - r * tokens
            lens = tl.load(prefix_ptr + r, mask=live, other=0).to(tl.int32)
            lens += _kept_columns(mask_ptr, r, q, live, stride_mr, stride_mt, n_extra, E_BLOCK)
            tl.store(indptr_ptr + 1 + i, carry + tl.cumsum(lens, axis=0), mask=live)
            carry += tl.sum(lens, axis=0)
            t0 += BLOCK

    @triton.jit(do_not_specialize=["table_width", "stride_mr", "stride_mt", "tokens", "n_extra"])
    def _tree_decode_indices_kernel(table_ptr, rows_ptr, prefix_ptr, mask_ptr, indptr_ptr, indices_ptr, write_ptr,
                                    table_width, stride_mr, stride_mt, tokens, n_extra, BLOCK: tl.constexpr,
                                    E_BLOCK: tl.constexpr, OWN_START: tl.constexpr, TB: tl.constexpr):
        i = tl.program_id(0)  # query token r * tokens + q
        blk = tl.program_id(1)
        r = i // tokens
        q = i - r * tokens
        row = table_ptr + tl.load(rows_ptr + r).to(tl.int64) * table_width
        prefix = tl.load(prefix_ptr + r)
        if OWN_START:
            # Few tokens (TB covers them all): each program sums the lengths of the lists before its own
            # instead of reading _tree_decode_indptr_kernel's prefix sums, so the step needs one launch.
            j = tl.arange(0, TB)
            before = j < i
            rj = j // tokens
            lens = tl.load(prefix_ptr + rj, mask=before, other=0).to(tl.int64)
            lens += _kept_columns(mask_ptr, rj, j - rj * tokens, before, stride_mr, stride_mt, n_extra,
                                  E_BLOCK).to(tl.int64)
            start = tl.sum(lens, axis=0)
        else:
            start = tl.load(indptr_ptr + i).to(tl.int64)
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        inside = cols < prefix
        slots = tl.load(row + cols, mask=inside, other=0)
        tl.store(indices_ptr + start + cols, slots.to(tl.int32), mask=inside)
        if blk == 0:
            # The extra columns the token sees follow the prefix in column order: the k-th kept one at
            # start + prefix + k.
            mrow = mask_ptr + r.to(tl.int64) * stride_mr + q.to(tl.int64) * stride_mt
            kept = 0
            e0 = 0
            while e0 < n_extra:
                e = e0 + tl.arange(0, E_BLOCK)
                keep = tl.load(mrow + e, mask=e < n_extra, other=0) != 0
                rank = kept + tl.cumsum(keep.to(tl.int32), axis=0) - 1
                picked = tl.load(row + prefix + e, mask=keep, other=0)
                tl.store(indices_ptr + start + prefix + rank, picked.to(tl.int32), mask=keep)
                kept += tl.sum(keep.to(tl.int32), axis=0)
                e0 += E_BLOCK
            tl.store(write_ptr + i, tl.load(row + prefix + n_extra - tokens + q))
            if OWN_START:
                tl.store(indptr_ptr + 1 + i, (start + prefix + kept).to(tl.int32))
                if i == 0:
                    tl.store(indptr_ptr, 0)


def _check_vector(name: str, t: torch.Tensor, n: int) -> None:
    """The kernels index per-sequence inputs as contiguous int64 vectors."""
    if t.shape != (n,) or (n > 1 and t.stride(0) != 1) or t.dtype != torch.int64:
        raise ValueError(f"{name} must be a contiguous int64 [{n}] tensor, got {t.dtype} shape {tuple(t.shape)} "
                         f"strides {t.stride()}")


def _use_triton(t: torch.Tensor, use_triton: bool | None) -> bool:
    """The Triton kernel on CUDA (or wherever ``use_triton`` says: tests run it in the interpreter)."""
    return triton is not None and t.is_cuda if use_triton is None else use_triton


# ------------------------------------------------------------------------------------------ builders
def build_kv_indices(table: torch.Tensor, rows: torch.Tensor, base: torch.Tensor, offset: int, tokens: int,
                     indptr: torch.Tensor, indices: torch.Tensor, write_slots: torch.Tensor,
                     use_triton: bool | None = None) -> None:
    """Write the paged-KV metadata of a step of ``R = len(rows)`` sequences.

    Sequence ``r`` attends columns ``[0, base[r] + offset)`` of ``table[rows[r]]``; its ``tokens`` new
    tokens are the last ``tokens`` of them.

    Args:
        table: ``[rows, width]`` int64 ``req_to_token``.
        rows, base: ``[R]`` int64.
        offset, tokens: fixed per call site (``kv_len = base + offset``; ``tokens <= kv_len <= width``).
        indptr: ``[R + 1]`` int32 out.
        indices: int32 out, at least ``sum(kv_len) + 1`` entries (the torch path spills into the last).
        write_slots: ``[R * tokens]`` int64 out, the slots of the new tokens.
        use_triton: force the kernel (``True``) or the torch code (``False``); default: the kernel on CUDA.
    """
    n = rows.shape[0]
    _check_vector("rows", rows, n)
    _check_vector("base", base, n)
    if indptr.shape[0] != n + 1 or write_slots.shape[0] != n * tokens:
        raise ValueError(f"metadata buffers sized for another batch: indptr {tuple(indptr.shape)}, write_slots "
                         f"{tuple(write_slots.shape)} for {n} sequences x {tokens} tokens")
    if not _use_triton(table, use_triton):
        build_kv_indices_reference(table, rows, base, offset, tokens, indptr, indices, write_slots)
        return
    width = table.shape[1]
    grid = (n, triton.cdiv(width, INDEX_BLOCK))
    _kv_indices_kernel[grid](table, rows, base, indptr, indices, write_slots, width, n, offset, tokens,
                             R_BLOCK=max(16, triton.next_power_of_2(n)), T_BLOCK=triton.next_power_of_2(tokens),
                             BLOCK=INDEX_BLOCK, num_warps=4)


def build_kv_indices_reference(table: torch.Tensor, rows: torch.Tensor, base: torch.Tensor, offset: int,
                               tokens: int, indptr: torch.Tensor, indices: torch.Tensor,
                               write_slots: torch.Tensor) -> None:
    """The torch code :func:`build_kv_indices` runs as one kernel (fixed shapes, no host sync)."""
    width = table.shape[1]
    kv_len = base + offset
    ends = torch.cumsum(kv_len, 0)
    indptr[0] = 0
    indptr[1:] = ends.to(indptr.dtype)
    cols = torch.arange(width, device=table.device)
    src = table[rows[:, None], cols]
    spill = indices.shape[0] - 1  # columns past a sequence's kv_len land here; FlashInfer never reads it
    dest = torch.where(cols < kv_len[:, None], (ends - kv_len)[:, None] + cols, spill)
    indices.scatter_(0, dest.reshape(-1), src.reshape(-1).to(indices.dtype))
    new_cols = kv_len[:, None] - tokens + torch.arange(tokens, device=table.device)
    write_slots.copy_(table[rows[:, None], new_cols].reshape(-1))


def pack_mask(prefix: torch.Tensor, extra_mask: torch.Tensor, out: torch.Tensor, region: int,
              use_triton: bool | None = None) -> None:
    """Pack a tree step's attention mask in FlashInfer's layout (see the module docstring).

    Sequence ``r`` attends columns ``[0, prefix[r] + E)``: every query sees the first ``prefix[r]``;
    query ``q`` sees extra column ``prefix[r] + e`` where ``extra_mask[r, q, e]``.

    Args:
        prefix: ``[R]`` int64.
        extra_mask: ``[R, T, E]`` bool (its last dimension contiguous).
        out: uint8, ``R * region`` bytes; sequence ``r``'s bits start at byte ``r * region``; the rest of
            its region is zeroed.
        region: bytes per sequence (``8 * region >= T * kv_len`` for every sequence).
        use_triton: as in :func:`build_kv_indices`.
    """
    n, t, e = extra_mask.shape
    _check_vector("prefix", prefix, n)
    if extra_mask.stride(2) != 1:
        raise ValueError(f"extra_mask must be contiguous in its last dimension, got strides {extra_mask.stride()}")
    if out.shape[0] < n * region:
        raise ValueError(f"mask buffer holds {out.shape[0]} bytes, {n} sequences x {region} need {n * region}")
    if not _use_triton(prefix, use_triton):
        pack_mask_reference(prefix, extra_mask, out, region)
        return
    grid = (n, triton.cdiv(region, MASK_BLOCK))
    _pack_mask_kernel[grid](prefix, extra_mask.view(torch.uint8), out, extra_mask.stride(0), extra_mask.stride(1), e,
                            region, t, BLOCK=MASK_BLOCK, num_warps=4)


def build_tree_decode_indices(table: torch.Tensor, rows: torch.Tensor, prefix: torch.Tensor,
                              extra_mask: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
                              write_slots: torch.Tensor, use_triton: bool | None = None) -> None:
    """Write a tree step's metadata as ``R * T`` decode page lists, one per query token (see the module
    docstring): token ``(r, q)``, list ``r * T + q``, holds the slots of sequence ``r``'s columns
    ``[0, prefix[r])`` followed by those of extra columns ``prefix[r] + e`` where ``extra_mask[r, q, e]``,
    in column order. The step's ``T`` new tokens are the last ``T`` extra columns, as in :func:`pack_mask`'s
    steps: ``write_slots`` gets what ``build_kv_indices(table, rows, prefix, E, T, ...)`` writes there.

    Args:
        table: ``[rows, width]`` int64 ``req_to_token``.
        rows, prefix: ``[R]`` int64 (``prefix[r] + E <= width``).
        extra_mask: ``[R, T, E]`` bool, ``T <= E`` (its last dimension contiguous; the others may be
            strided or broadcast).
        indptr: ``[R * T + 1]`` int32 out: prefix sums of the lists' lengths
            ``prefix[r] + popcount(extra_mask[r, q])``.
        indices: int32 out, at least ``R * T * width + 1`` entries (the lists back to back; the torch path
            spills into the last).
        write_slots: ``[R * T]`` int64 out, the slots of the new tokens.
        use_triton: as in :func:`build_kv_indices`.
    """
    if extra_mask.dim() != 3 or extra_mask.dtype != torch.bool:
        raise ValueError(f"extra_mask must be a [R, T, E] bool tensor, got {extra_mask.dtype} shape "
                         f"{tuple(extra_mask.shape)}")
    n, t, e = extra_mask.shape
    _check_vector("rows", rows, n)
    _check_vector("prefix", prefix, n)
    if t > e:
        raise ValueError(f"extra_mask [R, T, E] = {tuple(extra_mask.shape)}: the step's T new tokens are the last "
                         f"T of its E extra columns, so T <= E is expected")
    if e > 1 and extra_mask.stride(2) != 1:
        raise ValueError(f"extra_mask must be contiguous in its last dimension, got strides {extra_mask.stride()}")
    width = table.shape[1]
    want = {"indptr": ((n * t + 1,), torch.int32), "write_slots": ((n * t,), torch.int64)}
    for name, buf in (("indptr", indptr), ("write_slots", write_slots)):
        shape, dtype = want[name]
        if tuple(buf.shape) != shape or buf.dtype != dtype:
            raise ValueError(f"{name} must be a {dtype} {list(shape)} tensor for {n} sequences x {t} tokens, got "
                             f"{buf.dtype} shape {tuple(buf.shape)}")
    if indices.dim() != 1 or indices.dtype != torch.int32 or indices.shape[0] < n * t * width + 1:
        raise ValueError(f"indices must be an int32 vector of at least {n * t * width + 1} entries ({n} x {t} "
                         f"lists of up to {width} pages, plus one), got {indices.dtype} shape {tuple(indices.shape)}")
    if n * t == 0:
        indptr.zero_()
        return
    if not _use_triton(table, use_triton):
        build_tree_decode_indices_reference(table, rows, prefix, extra_mask, indptr, indices, write_slots)
        return
    mask = extra_mask.view(torch.uint8)
    e_block = min(TREE_EXTRA_BLOCK, triton.next_power_of_2(max(e, 1)))
    own_start = n * t <= TREE_OWN_START_TOKENS
    if not own_start:
        _tree_decode_indptr_kernel[(1,)](prefix, mask, indptr, mask.stride(0), mask.stride(1), n * t, t, e,
                                         BLOCK=TREE_TOKEN_BLOCK, E_BLOCK=e_block, num_warps=4)
    grid = (n * t, triton.cdiv(width, INDEX_BLOCK))
    _tree_decode_indices_kernel[grid](table, rows, prefix, mask, indptr, indices, write_slots, width, mask.stride(0),
                                      mask.stride(1), t, e, BLOCK=INDEX_BLOCK, E_BLOCK=e_block, OWN_START=own_start,
                                      TB=triton.next_power_of_2(n * t) if own_start else 1, num_warps=4)


def build_tree_decode_indices_reference(table: torch.Tensor, rows: torch.Tensor, prefix: torch.Tensor,
                                        extra_mask: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
                                        write_slots: torch.Tensor) -> None:
    """The torch code :func:`build_tree_decode_indices` runs as two kernels (fixed shapes, no host sync)."""
    n, t, e = extra_mask.shape
    width, dev = table.shape[1], table.device
    lens = (prefix[:, None] + extra_mask.sum(-1)).reshape(-1)  # [R * T] pages per query token
    ends = torch.cumsum(lens, 0)
    indptr[0] = 0
    indptr[1:] = ends.to(indptr.dtype)
    starts = (ends - lens).view(n, t, 1)
    spill = indices.shape[0] - 1  # entries past a list's end land here; FlashInfer never reads it
    row_slots = table[rows]  # [R, width]
    cols = torch.arange(width, device=dev)
    # Pages 0 .. prefix-1 of every list: the prefix columns.
    dest = torch.where(cols < prefix[:, None, None], starts + cols, spill)  # [R, T, width]
    indices.scatter_(0, dest.reshape(-1), row_slots[:, None, :].expand(n, t, width).reshape(-1).to(indices.dtype))
    # Then the kept extra columns, the k-th at page prefix + k.
    extra_cols = (prefix[:, None] + torch.arange(e, device=dev)).clamp(max=width - 1)  # [R, E]
    rank = torch.cumsum(extra_mask.long(), -1) - 1
    dest = torch.where(extra_mask, starts + prefix[:, None, None] + rank, spill)  # [R, T, E]
    src = row_slots.gather(1, extra_cols)[:, None, :].expand(n, t, e)
    indices.scatter_(0, dest.reshape(-1), src.reshape(-1).to(indices.dtype))
    new_cols = prefix[:, None] + e - t + torch.arange(t, device=dev)
    write_slots.copy_(table[rows[:, None], new_cols].reshape(-1))


def unpacked_mask(prefix: torch.Tensor, extra_mask: torch.Tensor, width: int) -> torch.Tensor:
    """``[R, T, width]`` bool: query ``q`` of sequence ``r`` may attend column ``c`` (``c < prefix + E``)."""
    n, t, e = extra_mask.shape
    cols = torch.arange(width, device=prefix.device)
    rel = cols[None, :] - prefix[:, None]  # [R, width]: column minus prefix
    tree = extra_mask.gather(2, rel.clamp(0, e - 1)[:, None, :].expand(n, t, width))
    return (rel < 0)[:, None, :] | (tree & (rel < e)[:, None, :])


def pack_mask_reference(prefix: torch.Tensor, extra_mask: torch.Tensor, out: torch.Tensor, region: int) -> None:
    """The torch code :func:`pack_mask` runs as one kernel (fixed shapes, no host sync)."""
    n, t, e = extra_mask.shape
    kv_len = prefix + e
    width = 8 * region // t  # no sequence has more columns (see pack_mask)
    pos = torch.arange(8 * region, device=prefix.device)
    q = pos[None, :] // kv_len[:, None]  # [R, bits]: query and column of every bit
    c = pos[None, :] - q * kv_len[:, None]
    flat = unpacked_mask(prefix, extra_mask, width).reshape(n, t * width)
    keep = (q < t) & flat.gather(1, q.clamp(max=t - 1) * width + c.clamp(max=width - 1))
    weights = 1 << torch.arange(8, device=prefix.device)
    out[:n * region].view(n, region).copy_((keep.view(n, region, 8).long() * weights).sum(-1).to(torch.uint8))


# -------------------------------------------------------------------------------- reference attention
def reference_attention_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tokens: int,
                              kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_max: int, causal: bool,
                              packed_mask: torch.Tensor | None = None, region: int = 0) -> torch.Tensor:
    """Attention of ``q [R * T, H, D]`` over a page-size-1 paged KV cache described by FlashInfer's metadata,
    in plain torch (fixed shapes: graph-safe). ``causal``: query ``q`` sees columns ``<= kv_len - T + q``
    (FlashInfer's bottom-right-aligned causal mask); ``packed_mask``: the bits of :func:`pack_mask`.
    Returns ``[R * T, H * D]``."""
    n = kv_indptr.shape[0] - 1
    group = q.shape[1] // k_cache.shape[1]
    start = kv_indptr[:-1].long()
    kv_len = kv_indptr[1:].long() - start
    cols = torch.arange(kv_max, device=q.device)
    valid = cols[None, :] < kv_len[:, None]  # [R, kv_max]
    idx = torch.where(valid, kv_indices[(start[:, None] + cols).clamp(max=kv_indices.shape[0] - 1)].long(), 0)
    mask = valid[:, None, :].expand(n, tokens, kv_max)
    qpos = torch.arange(tokens, device=q.device)
    if causal:
        mask = mask & (cols[None, None, :] <= (kv_len - tokens)[:, None, None] + qpos[None, :, None])
    if packed_mask is not None:
        bitpos = qpos[None, :, None] * kv_len[:, None, None] + cols[None, None, :]  # [R, T, kv_max]
        byte = torch.arange(n, device=q.device)[:, None, None] * region + bitpos // 8
        bits = (packed_mask[byte.clamp(max=packed_mask.shape[0] - 1)].long() >> (bitpos % 8)) & 1
        mask = mask & (bits == 1)
    grouped = mask[:, None, None].expand(n, 1, group, tokens, kv_max).reshape(n, 1, group * tokens, kv_max)
    meta = AttnMeta(n, tokens, idx.new_zeros(0), idx, grouped)
    return attend(q, k_cache[idx], v_cache[idx], meta)

"""A weight-streaming tensor-core GEMM for the speculative step's few-token products (2 to 16 rows).

At C = 1 a speculative step multiplies 4-5 tokens (each draft level) and 16 tokens (verify) by every
weight matrix: like a plain step it is bound by reading the weights, but cuBLAS serves these shapes with
tiles sized for larger products (``nvjet ... 128x16``, split-K with a reduce launch for the narrow ones),
at 3.1-4.1 TB/s where the one-token GEMV of :mod:`bench.engine.gemv` streams 4.1-4.4 TB/s (run AR in
bench/RESULTS_HISTORY.md: the step's GEMMs 1.446 ms against a whole-step roofline of 1.234 ms).

The kernel here is written the other way round from a GEMM tile (``swap-AB``): each program owns
``BLOCK_N`` weight rows and computes their dot products with all ``M <= 16`` input rows on tensor cores,
``acc[BLOCK_N, 16] += w[BLOCK_N, BLOCK_K] @ x[16, BLOCK_K]^T``, the input rows (a few tens of kilobytes)
served from L2 to every program. Blocks of 64-128 weight rows stream fastest on the H200 (16-row blocks,
which give more programs and a shorter last wave, ran at half the speed: run AT); ``SPLIT_K`` lets
programs share a row block, each summing one slice of ``K`` into a float32 workspace that a second launch
reduces (no model shape needs it at the sizes above: run AU). The SwiGLU of the gate/up product is applied
before the store (in the reduce launch when split), so the MLP's activation needs no launch of its own, as
with the GEMV. In the speculative step at C = 1 it took the GEMMs from 1.446 to 1.40 ms and the step from
188 to 122 kernels together with the selection kernels (run AW).

Only 16-bit models take it (float32 keeps cuBLAS, as for the GEMV). Results equal ``F.linear`` up to
the order of the float32 sums, rounded to the model dtype once.
"""
from __future__ import annotations

import torch

from .fused import triton

if triton is not None:
    import triton.language as tl

    from .fused import swiglu

BLOCK_M = 16           # input rows per call, padded: the tensor cores' smallest tile side
SKINNY_DTYPES = (torch.bfloat16, torch.float16)

Config = tuple[int, int, int, int, int]   # (BLOCK_N, BLOCK_K, num_warps, stages, split_k)


def skinny_config(n: int, k: int, silu: bool = False) -> Config:
    """``(BLOCK_N, BLOCK_K, num_warps, stages, split_k)`` for ``x [M <= 16, k] @ weight[n, k]^T`` (``n``
    outputs; with ``silu`` each output reads a gate and an up row): :data:`CONFIGS` where the shape is
    listed, else the rule its entries follow: row blocks of 64, k blocks of 256 (128 with SwiGLU's two
    tiles, in 3 stages, to fit the shared memory), and ``K`` split until the programs cover the SMs once."""
    key = (n, k, silu)
    if key in CONFIGS:
        return CONFIGS[key]
    block_n, block_k, stages = 64, 128 if silu else 256, 3 if silu else 4
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    split = 1
    while split < 8 and -(-n // block_n) * split < 132 and k % (2 * split) == 0 and k // (2 * split) >= block_k:
        split *= 2
    return block_n, block_k, 4, stages, split


# The medium model's shapes ``(n outputs, K, silu)``: the best of 60 configurations at 4 and 16 rows on the
# H200 (run AU in bench/RESULTS_HISTORY.md, by a probe since removed; scored as a speculative step at C = 1
# calls them, four draft levels and one verify). None of them splits K: with 64- and 128-row blocks the
# unsplit kernel was as fast as the split one and saves the reduce launch.
CONFIGS: dict[tuple[int, int, bool], Config] = {
    (5120, 4096, False): (64, 256, 4, 4, 1),    # qkv: 13.2 / 13.3 us at 4 / 16 rows (cuBLAS 13.2 / 13.5)
    (4096, 4096, False): (64, 256, 4, 4, 1),    # o, and the LM head: 11.7 / 11.6 (13.3 / 13.3)
    (14336, 4096, True): (128, 128, 8, 3, 1),   # gate/up + SwiGLU: 55.7 / 56.3 (57.7 / 58.3, with its SwiGLU launch)
    (4096, 14336, False): (64, 256, 4, 5, 1),   # down: 30.6 / 31.3 (31.6 / 32.3)
}


if triton is not None:
    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, out_ptr, M, N, stride_x, stride_w, stride_out, up_rows, split_stride,
                       K: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, STAGES: tl.constexpr,
                       UPCAST: tl.constexpr):
        """``out[m, n] = sum_k x[m, k] w[n, k]`` over this program's slice of ``K`` for its ``BLOCK_N``
        outputs ``n`` and every row ``m < M``. Unsplit, ``out`` is the result (SwiGLU applied with
        ``SILU_MUL``); split, ``out`` is the float32 workspace ``[SPLIT_K, M, N (x2 with SILU_MUL)]`` and
        this program writes its partial sums (gate sums, then up sums ``N`` columns on). ``UPCAST``
        multiplies float32 copies (exact): Triton's interpreter has no 16-bit matrix product."""
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_M)
        col_in, row_in = cols < N, rows < M
        K_PART: tl.constexpr = K // SPLIT_K
        k_first = pid_k * K_PART
        w_row = w_ptr + cols.to(tl.int64)[:, None] * stride_w + k_first
        u_row = w_row + up_rows.to(tl.int64) * stride_w
        x_col = x_ptr + rows[None, :] * stride_x + k_first   # x read as [BLOCK_K, BLOCK_M]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in tl.range(0, K_PART, BLOCK_K, num_stages=STAGES):
            k = k0 + tl.arange(0, BLOCK_K)
            if K_PART % BLOCK_K == 0:
                w_in, x_in = col_in[:, None], row_in[None, :]
            else:
                w_in, x_in = col_in[:, None] & (k < K_PART)[None, :], row_in[None, :] & (k < K_PART)[:, None]
            w = tl.load(w_row + k[None, :], mask=w_in, other=0.0)
            x = tl.load(x_col + k[:, None], mask=x_in, other=0.0)
            if UPCAST:
                w, x = w.to(tl.float32), x.to(tl.float32)
            acc = tl.dot(w, x, acc)
            if SILU_MUL:
                u = tl.load(u_row + k[None, :], mask=w_in, other=0.0)
                acc_up = tl.dot(u.to(tl.float32) if UPCAST else u, x, acc_up)
        inside = col_in[:, None] & row_in[None, :]
        if SPLIT_K == 1:
            dtype = out_ptr.dtype.element_ty
            y = acc
            if SILU_MUL:  # gate and up rounded to the dtype first, as cuBLAS rounds them on the torch path
                y = swiglu(acc.to(dtype), acc_up.to(dtype))
            tl.store(out_ptr + rows[None, :] * stride_out + cols[:, None], y.to(dtype), mask=inside)
        else:
            part = out_ptr + pid_k * split_stride + rows[None, :] * stride_out + cols[:, None]
            tl.store(part, acc, mask=inside)
            if SILU_MUL:
                tl.store(part + N, acc_up, mask=inside)

    @triton.jit
    def _split_reduce_kernel(part_ptr, out_ptr, N, stride_part, split_stride, stride_out,
                             SPLIT_K: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK: tl.constexpr):
        """``out[m, n]`` = the sum of the ``SPLIT_K`` partial sums (gate and up each summed, then SwiGLU)."""
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < N
        src = part_ptr + row * stride_part + cols
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(src + s * split_stride, mask=inside, other=0.0)
            if SILU_MUL:
                acc_up += tl.load(src + s * split_stride + N, mask=inside, other=0.0)
        dtype = out_ptr.dtype.element_ty
        y = acc
        if SILU_MUL:
            y = swiglu(acc.to(dtype), acc_up.to(dtype))
        tl.store(out_ptr + row * stride_out + cols, y.to(dtype), mask=inside)


def skinny_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`skinny` can take ``x [M, K] @ weight^T``: 2 to 16 rows of a 16-bit ``x``, a weight of
    the same dtype, both contiguous in their last dimension, Triton present."""
    return (triton is not None and x.dim() == 2 and 1 < x.shape[0] <= BLOCK_M and x.dtype in SKINNY_DTYPES
            and weight.dtype == x.dtype and x.stride(-1) == 1 and weight.stride(-1) == 1)


def check_operands(x: torch.Tensor, weight: torch.Tensor, silu: bool, max_rows: int, what: str) -> int:
    """Validate ``x [M, K] @ weight[N, K]^T`` for a Triton projection of 1 to ``max_rows`` rows (this GEMM's
    and :func:`bench.engine.gemv.gemv`'s); returns the number of outputs (``N``, or ``N / 2`` with ``silu``:
    a gate/up weight, gate rows first)."""
    if x.dim() != 2 or not 0 < x.shape[0] <= max_rows:
        rows, shape = ("one row", "[1, K]") if max_rows == 1 else (f"1 to {max_rows} rows", f"[M <= {max_rows}, K]")
        raise ValueError(f"the {what} takes {rows}: x must be {shape}, got {tuple(x.shape)}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"the {what} needs x and weight contiguous in their last dimension, got strides "
                         f"{x.stride()} and {weight.stride()}")
    n, k = weight.shape
    if k != x.shape[1]:
        raise ValueError(f"x {list(x.shape)} does not match weight [{n}, {k}]: the last dimensions must agree")
    if silu and n % 2:
        raise ValueError(f"a gate/up weight has an even number of rows (gate, then up), got {n}")
    return n // 2 if silu else n


def skinny(x: torch.Tensor, weight: torch.Tensor, silu: bool = False, config: Config | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` for ``x [M <= 16, K]`` (or with ``silu`` the SwiGLU of the gate/up product,
    gate rows first: ``[M, N / 2]``) in one launch, two when :func:`skinny_config` splits ``K``. ``config``
    overrides the ``(BLOCK_N, BLOCK_K, num_warps, stages, split_k)`` choice. CUDA, or CPU tensors in Triton's interpreter."""
    if triton is None:
        raise RuntimeError("the skinny GEMM needs Triton")
    n = check_operands(x, weight, silu, BLOCK_M, "skinny GEMM")
    m, k = x.shape
    block_n, block_k, warps, stages, split = config or skinny_config(n, k, silu)
    if k % split:
        raise ValueError(f"split_k {split} must divide K = {k}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    upcast = x.device.type != "cuda"
    grid = (triton.cdiv(n, block_n), split)
    if split == 1:
        _skinny_kernel[grid](x, weight, out, m, n, x.stride(0), weight.stride(0), out.stride(0), n, 0, K=k,
                             SILU_MUL=silu, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=1,
                             STAGES=stages, UPCAST=upcast, num_warps=warps)
        return out
    width = 2 * n if silu else n
    part = torch.empty(split, m, width, dtype=torch.float32, device=x.device)
    _skinny_kernel[grid](x, weight, part, m, n, x.stride(0), weight.stride(0), width, n, m * width, K=k,
                         SILU_MUL=silu, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
                         STAGES=stages, UPCAST=upcast, num_warps=warps)
    block = 1024
    _split_reduce_kernel[(m, triton.cdiv(n, block))](part, out, n, width, m * width, out.stride(0), SPLIT_K=split,
                                                     SILU_MUL=silu, BLOCK=block, num_warps=4)
    return out

"""The model's projections, and Triton kernels for the few-token products of decode at low concurrency.

A plain decode step at C = 1 multiplies one token by every weight matrix: it is bound by reading 3.5 GB of
weights (the medium model), so its floor is the HBM bandwidth. cuBLAS serves such products with split-K GEMM
kernels plus a reduce launch per call: on the H200 the plain step's GEMMs took 0.944 ms for 3.46 GB, 3.66
TB/s, with 17 reduce launches (run AA in bench/RESULTS.md). :func:`linear` runs a one-row product as one
GEMV launch instead: each program owns ``BLOCK_N`` output columns, streams their weight rows (contiguous in
``nn.Linear``'s ``[N, K]`` layout) once, multiplies them with the input row, and writes its columns; no
partial sums leave the program, so there is nothing to reduce afterwards. :func:`linear_silu_mul` does
the same for the fused gate/up projection and applies SwiGLU before it stores, so the MLP's activation
needs no launch of its own either.

From 2 to ``SKINNY_MAX_ROWS`` (16) rows (a draft level's or a verify step's tokens at C = 1) the skinny GEMM
does the same on tensor cores: one 16-row tile of outputs per program, the whole K loop in the program
(pipelined loads, no split-K, so no reduce launch), SwiGLU in the epilogue where asked.

Both serve 16-bit models only: float32 keeps cuBLAS, so a float32 greedy run
computes every step's projections with the same library as before and the float32 token-identity checks
between plain decode and speculation do not hinge on two summation orders. Results equal ``F.linear`` up to
the order of the float32 sums (the output is rounded to the model dtype once, as cuBLAS rounds it).

:class:`Projection` is the model's linear layer (a bias-free ``nn.Linear`` whose ``fused`` flag, set by
the model, picks these kernels where they apply); the tensor-parallel layers of :mod:`bench.engine.parallel`
extend it with their collectives.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fused import silu_mul, triton

if triton is not None:
    import triton.language as tl

GEMV_MAX_ROWS = 1          # input rows (tokens) up to which the GEMV replaces cuBLAS (0: never)
SKINNY_MAX_ROWS = 16       # rows up to which the skinny GEMM serves what the GEMV does not (0: never)
SKINNY_BLOCK_M = 16        # the skinny GEMM's row tile: the smallest tensor-core tile
GEMV_DTYPES = (torch.bfloat16, torch.float16)


def set_small_m_kernels(enabled: bool) -> None:
    """Turn the Triton kernels for few-token products on (the default) or off for this process: off, every
    projection runs ``F.linear`` (the library's GEMMs, then the SwiGLU kernel), as the engine did before them.
    Read at each call, so set it before a pool captures (``bench/profile_step.py --small-m blas``)."""
    global GEMV_MAX_ROWS, SKINNY_MAX_ROWS
    GEMV_MAX_ROWS, SKINNY_MAX_ROWS = (1, 16) if enabled else (0, 0)


def small_m_kernel(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Which Triton kernel :func:`linear` runs for ``x [M, K]`` (with ``fused``): ``"gemv"`` at ``M <=
    GEMV_MAX_ROWS``, ``"skinny"`` at ``M <= SKINNY_MAX_ROWS``, ``None`` (cuBLAS) otherwise or for anything but
    a 16-bit ``x`` and a weight of its dtype (or without Triton)."""
    if triton is None or x.dim() != 2 or x.dtype not in GEMV_DTYPES or weight.dtype != x.dtype:
        return None
    m = x.shape[0]
    if 0 < m <= GEMV_MAX_ROWS:
        return "gemv"
    if 0 < m <= min(SKINNY_MAX_ROWS, SKINNY_BLOCK_M):
        return "skinny"
    return None


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` runs a Triton kernel for ``x`` (:func:`small_m_kernel`)."""
    return small_m_kernel(x, weight) is not None


def gemv_config(n: int, k: int, silu: bool = False) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, stages)`` for ``weight [n, k] @ x [k]`` (``n`` outputs; with ``silu``
    each output reads a gate and an up row).

    One output per program (``n`` programs: thousands, so every SM holds many and has loads in flight),
    8 warps, the row in blocks of 2048 (1024 for rows longer than 4096). Picked from
    ``bench/gemv_probe.py --sweep`` on the H200 (run AD in bench/RESULTS.md): within 0.2 us of the best of
    72 configurations at every shape of the medium model, and 8-28 % faster than cuBLAS at each.
    """
    return 1, min(2048 if k <= 4096 else 1024, triton.next_power_of_2(k)), 8, 1


def skinny_config(n: int, k: int, silu: bool = False) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, stages)`` of the skinny GEMM for ``weight [n, k]`` (``n`` outputs; with
    ``silu`` two weight tiles a step, so half the k block and fewer stages fit the shared memory). From
    ``bench/gemv_probe.py --sweep skinny`` on the H200 (run AF in bench/RESULTS.md): at 4 and 16 rows, within
    1.7 us of the best of 27 configurations at every shape of the medium model, and as fast as cuBLAS (its
    split-K GEMM and reduce, then the SwiGLU launch) or up to 5.6 us faster, except the qkv projection (160
    programs on 132 SMs: 0.9-1.5 us slower)."""
    if silu:
        return 32, min(128, triton.next_power_of_2(k)), 4, 3
    return 32, min(256, triton.next_power_of_2(k)), 4, 4


if triton is not None:
    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, out_ptr, M, N, stride_x, stride_w, stride_out, up_rows, K: tl.constexpr,
                       SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       STAGES: tl.constexpr, UPCAST: tl.constexpr):
        """``out[m, n] = sum_k x[m, k] w[n, k]`` for all ``M <= BLOCK_M`` rows and this program's ``BLOCK_N``
        columns, on tensor cores (rows past ``M`` are zeros); ``SILU_MUL`` as in :func:`_gemv_kernel`.
        ``UPCAST`` multiplies float32 copies of the operands (exact): Triton's interpreter has no bfloat16
        matrix product."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_M)
        col_in, row_in = cols < N, rows < M
        x_row = x_ptr + rows[:, None] * stride_x
        w_col = w_ptr + cols.to(tl.int64)[None, :] * stride_w  # the weight tile read as [BLOCK_K, BLOCK_N]
        u_col = w_col + up_rows * stride_w
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            k = k0 + tl.arange(0, BLOCK_K)
            if K % BLOCK_K == 0:
                x_in, w_in = row_in[:, None], col_in[None, :]
            else:
                x_in, w_in = row_in[:, None] & (k < K)[None, :], col_in[None, :] & (k < K)[:, None]
            x = tl.load(x_row + k[None, :], mask=x_in, other=0.0)
            w = tl.load(w_col + k[:, None], mask=w_in, other=0.0)
            if UPCAST:
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(x, w, acc)
            if SILU_MUL:
                u = tl.load(u_col + k[:, None], mask=w_in, other=0.0)
                acc_up = tl.dot(x, u.to(tl.float32) if UPCAST else u, acc_up)
        dtype = out_ptr.dtype.element_ty
        y = acc
        if SILU_MUL:
            g = acc.to(dtype).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # torch's silu rounds to the dtype
            y = act * acc_up.to(dtype).to(tl.float32)
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y.to(dtype),
                 mask=row_in[:, None] & col_in[None, :])

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, stride_w, up_rows, K: tl.constexpr, SILU_MUL: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
        """``out[n] = sum_k w[n, k] x[k]`` for this program's ``BLOCK_N`` outputs. With ``SILU_MUL``, ``w`` is a
        gate/up weight: output ``n`` is ``silu(gate_n) * up_n``, the up row ``up_rows`` rows below the gate
        row, each rounded to the dtype first as the torch code rounds."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_in = cols < N
        w_row = w_ptr + cols.to(tl.int64)[:, None] * stride_w
        u_row = w_row + up_rows * stride_w
        # Products accumulate elementwise and are summed over k once at the end: no reduction in the loop.
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        # K is a constexpr: Triton's interpreter (numpy 2) fails on a runtime loop bound, and without a k mask
        # (K a multiple of BLOCK_K, as every model shape is) the loads vectorise.
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            k = k0 + tl.arange(0, BLOCK_K)
            if K % BLOCK_K == 0:
                inside = col_in[:, None]
                x = tl.load(x_ptr + k).to(tl.float32)[None, :]
            else:
                inside = col_in[:, None] & (k < K)[None, :]
                x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
            acc += tl.load(w_row + k[None, :], mask=inside, other=0.0).to(tl.float32) * x
            if SILU_MUL:
                acc_up += tl.load(u_row + k[None, :], mask=inside, other=0.0).to(tl.float32) * x
        dtype = out_ptr.dtype.element_ty
        y = tl.sum(acc, axis=1)
        if SILU_MUL:
            g = y.to(dtype).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # torch's silu rounds to the dtype
            y = act * tl.sum(acc_up, axis=1).to(dtype).to(tl.float32)
        tl.store(out_ptr + cols, y.to(dtype), mask=col_in)


def _check(x: torch.Tensor, weight: torch.Tensor, silu: bool, max_rows: int, what: str) -> int:
    """Validate the operands; return the number of outputs."""
    if x.dim() != 2 or not 0 < x.shape[0] <= max_rows:
        raise ValueError(f"the {what} takes 1 to {max_rows} rows: x must be [M <= {max_rows}, K], got {tuple(x.shape)}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"the {what} needs x and weight contiguous in their last dimension, got strides "
                         f"{x.stride()} and {weight.stride()}")
    rows, k_w = weight.shape
    if k_w != x.shape[1]:
        raise ValueError(f"x {list(x.shape)} does not match weight [{rows}, {k_w}]: the last dimensions must agree")
    if silu and rows % 2:
        raise ValueError(f"a gate/up weight has an even number of rows (gate, then up), got {rows}")
    return rows // 2 if silu else rows


def gemv(x: torch.Tensor, weight: torch.Tensor, silu: bool = False,
         config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """The Triton GEMV of one row ``x [1, K]``: ``F.linear(x, weight)``, or with ``silu`` the SwiGLU of the
    gate/up product (:func:`linear_silu_mul`). ``config`` overrides :func:`gemv_config`'s ``(BLOCK_N,
    BLOCK_K, num_warps, stages)`` (``bench/gemv_probe.py`` sweeps it). CUDA, or CPU tensors in Triton's
    interpreter."""
    n = _check(x, weight, silu, 1, "GEMV")
    k = x.shape[1]
    block_n, block_k, warps, stages = config or gemv_config(n, k, silu)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, weight, out, n, weight.stride(0), n, K=k, SILU_MUL=silu,
                                             BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, num_warps=warps)
    return out


def skinny(x: torch.Tensor, weight: torch.Tensor, silu: bool = False,
           config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """The skinny GEMM of ``x [M, K]``, ``M <= 16`` (a draft level's or a verify step's few tokens):
    ``F.linear(x, weight)``, or with ``silu`` the SwiGLU of the gate/up product, in one launch (no split-K
    reduce, no activation launch). ``config``: as :func:`gemv`'s, over :func:`skinny_config`."""
    n = _check(x, weight, silu, SKINNY_BLOCK_M, "skinny GEMM")
    m, k = x.shape
    block_n, block_k, warps, stages = config or skinny_config(n, k, silu)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _skinny_kernel[(triton.cdiv(n, block_n),)](x, weight, out, m, n, x.stride(0), weight.stride(0), out.stride(0), n,
                                               K=k, SILU_MUL=silu, BLOCK_M=SKINNY_BLOCK_M, BLOCK_N=block_n,
                                               BLOCK_K=block_k, STAGES=stages, UPCAST=x.device.type != "cuda",
                                               num_warps=warps)
    return out


SMALL_M_KERNELS = {"gemv": gemv, "skinny": skinny}


def linear(x: torch.Tensor, weight: torch.Tensor, fused: bool) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) for ``x [M, K]``, ``weight [N, K]``: one Triton launch where ``fused``
    and :func:`small_m_kernel` names one, cuBLAS otherwise."""
    kernel = small_m_kernel(x, weight) if fused else None
    if kernel is not None:
        return SMALL_M_KERNELS[kernel](x, weight)
    return F.linear(x, weight)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, fused: bool) -> torch.Tensor:
    """``silu(gate) * up`` of ``F.linear(x, weight)`` split in halves (gate rows first): ``[M, N / 2]``.
    One Triton launch where ``fused`` and :func:`small_m_kernel` names one; else cuBLAS then
    :func:`bench.engine.fused.silu_mul` (a Triton kernel where ``fused``, torch ops otherwise)."""
    kernel = small_m_kernel(x, weight) if fused else None
    if kernel is not None:
        return SMALL_M_KERNELS[kernel](x, weight, silu=True)
    return silu_mul(F.linear(x, weight), fused)


class Projection(nn.Module):
    """A bias-free linear layer, ``x @ weight.T``, with ``weight [out_features, in_features]`` as in
    ``nn.Linear``. ``fused`` (kept in step with the model's, see :class:`bench.engine.model.LlamaModel`)
    lets few-row calls run :func:`linear`'s Triton kernels."""

    def __init__(self, in_features: int, out_features: int, weight: torch.Tensor | None = None):
        super().__init__()
        if weight is None:
            weight = torch.empty(out_features, in_features)
        if tuple(weight.shape) != (out_features, in_features):
            raise ValueError(f"weight must be [{out_features}, {in_features}], got {tuple(weight.shape)}")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.fused = False

    @classmethod
    def of(cls, weight: torch.Tensor, *args, **kwargs) -> "Projection":
        """A projection (or subclass) holding a contiguous copy of ``weight``."""
        w = weight.detach().contiguous().clone()
        return cls(w.shape[1], w.shape[0], w, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.fused)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU of this gate/up projection's output (:func:`linear_silu_mul`)."""
        return linear_silu_mul(x, self.weight, self.fused)

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, fused={self.fused}"

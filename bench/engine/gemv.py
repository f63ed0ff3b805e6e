"""The model's projections, and a weight-streaming Triton GEMV for the one-token steps of decode.

A plain decode step at C = 1 multiplies one token by every weight matrix: it is bound by reading 3.5 GB of
weights (the medium model), so its floor is the HBM bandwidth. cuBLAS serves ``M = 1`` with split-K GEMM
kernels plus a reduce launch per call: on the H200 the step's GEMMs took 0.944 ms for 3.46 GB, 3.66 TB/s,
with 17 reduce launches (run AA in bench/RESULTS_HISTORY.md). :func:`linear` runs a one-row product as one GEMV
launch instead: each program owns ``BLOCK_N`` output columns, streams their weight rows (contiguous in
``nn.Linear``'s ``[N, K]`` layout) once, multiplies them with the input row, and writes its columns; no
partial sums leave the program, so there is nothing to reduce afterwards. :func:`linear_silu_mul` does
the same for the fused gate/up projection and applies SwiGLU before it stores, so the MLP's activation
needs no launch of its own either.

A GEMV over several rows was slower than cuBLAS at every shape (run AB in bench/RESULTS_HISTORY.md); 2-16 rows go to
the skinny tensor-core GEMM of :mod:`bench.engine.skinny` (:func:`use_skinny`; a first one, with 32-row
blocks, was no faster than cuBLAS in the speculative step, runs AF and AG; the second, with 64-128-row
blocks, is, runs AT-AW), and more rows to cuBLAS. The GEMV serves 16-bit models only: float32 keeps cuBLAS, so a
float32 greedy run computes every step's projections with the same library as before and the float32
token-identity checks between plain decode and speculation do not hinge on two summation orders. Results equal ``F.linear`` up to
the order of the float32 sums (the output is rounded to the model dtype once, as cuBLAS rounds it).

:class:`Projection` is the model's linear layer (a bias-free ``nn.Linear`` whose ``fused`` flag, set by
the model, picks this kernel where it applies); the tensor-parallel layers of :mod:`bench.engine.parallel`
extend it with their collectives.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fused import silu_mul, triton
from .skinny import check_operands, skinny, skinny_applies

if triton is not None:
    import triton.language as tl

    from .fused import swiglu

GEMV_MAX_ROWS = 1          # input rows (tokens) up to which the GEMV replaces cuBLAS
SKINNY = True              # 2-16 rows through bench.engine.skinny instead of cuBLAS (use_skinny)
GEMV_DTYPES = (torch.bfloat16, torch.float16)


def use_skinny(enabled: bool) -> None:
    """Send 16-bit products of 2-16 rows through the skinny tensor-core GEMM of :mod:`bench.engine.skinny`
    (on, the default) or the BLAS library (off) for this process; read at each call, so set it before a pool
    captures."""
    global SKINNY
    SKINNY = bool(enabled)


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` takes the GEMV for ``x [M, K]`` (with ``fused``): a 16-bit ``x`` of at most
    ``GEMV_MAX_ROWS`` rows (one: a matrix-vector product), a weight of the same dtype, both contiguous in
    their last dimension (anything else goes to ``F.linear``, which takes any strides), Triton present."""
    return (triton is not None and x.dim() == 2 and 0 < x.shape[0] <= GEMV_MAX_ROWS and x.dtype in GEMV_DTYPES
            and weight.dtype == x.dtype and x.stride(-1) == 1 and weight.stride(-1) == 1)


def gemv_config(n: int, k: int, silu: bool = False) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, stages)`` for ``weight [n, k] @ x [k]`` (``n`` outputs; with ``silu``
    each output reads a gate and an up row).

    One output per program (``n`` programs: thousands, so every SM holds many and has loads in flight),
    8 warps, the row in blocks of 2048 (1024 for rows longer than 4096). Picked from a sweep on the H200
    (run AD in bench/RESULTS_HISTORY.md, by a probe since removed): within 0.2 us of the best of 72
    configurations at every shape of the medium model, and 8-28 % faster than cuBLAS at each.
    """
    return 1, min(2048 if k <= 4096 else 1024, triton.next_power_of_2(k)), 8, 1


if triton is not None:
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
        if SILU_MUL:  # gate and up rounded to the dtype first, as cuBLAS rounds them on the torch path
            y = swiglu(y.to(dtype), tl.sum(acc_up, axis=1).to(dtype))
        tl.store(out_ptr + cols, y.to(dtype), mask=col_in)


def gemv(x: torch.Tensor, weight: torch.Tensor, silu: bool = False,
         config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """The Triton GEMV of one row ``x [1, K]``: ``F.linear(x, weight)``, or with ``silu`` the SwiGLU of the
    gate/up product (:func:`linear_silu_mul`). ``config`` overrides :func:`gemv_config`'s ``(BLOCK_N,
    BLOCK_K, num_warps, stages)``. CUDA, or CPU tensors in Triton's
    interpreter."""
    n = check_operands(x, weight, silu, 1, "GEMV")
    k = x.shape[1]
    block_n, block_k, warps, stages = config or gemv_config(n, k, silu)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, weight, out, n, weight.stride(0), n, K=k, SILU_MUL=silu,
                                             BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, num_warps=warps)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, fused: bool) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) for ``x [M, K]``, ``weight [N, K]``; one GEMV launch where ``fused``
    and :func:`gemv_applies`, cuBLAS otherwise."""
    if fused and gemv_applies(x, weight):
        return gemv(x, weight, silu=False)
    if fused and SKINNY and skinny_applies(x, weight):
        return skinny(x, weight, silu=False)
    return F.linear(x, weight)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, fused: bool) -> torch.Tensor:
    """``silu(gate) * up`` of ``F.linear(x, weight)`` split in halves (gate rows first): ``[M, N / 2]``.
    One GEMV launch where ``fused`` and :func:`gemv_applies`; else cuBLAS then
    :func:`bench.engine.fused.silu_mul` (a Triton kernel where ``fused``, torch ops otherwise)."""
    if fused and gemv_applies(x, weight):
        return gemv(x, weight, silu=True)
    if fused and SKINNY and skinny_applies(x, weight):
        return skinny(x, weight, silu=True)
    return silu_mul(F.linear(x, weight), fused)


class Projection(nn.Module):
    """A bias-free linear layer, ``x @ weight.T``, with ``weight [out_features, in_features]`` as in
    ``nn.Linear``. ``fused`` (kept in step with the model's, see :class:`bench.engine.model.LlamaModel`)
    lets one-row calls run :func:`linear`'s GEMV."""

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

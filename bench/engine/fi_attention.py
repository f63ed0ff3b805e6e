"""FlashInfer attention for the reference engine: plain decode, the draft's steps, tree verify, prefill.

Which FlashInfer call serves which step (``R`` sequences, ``T`` new tokens each):

* plain decode (``T = 1``): ``BatchDecodeWithPagedKVCacheWrapper`` (tensor-core kernels: the model's 8
  query heads per KV head fill a tensor-core tile);
* causal steps (prefill, the draft's first pass over the last committed tokens): the prefill/append
  wrapper ``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True``;
* small tree steps, ``R * T <= tree_decode_max_tokens`` (default 64: the target's verify, 16 tokens a
  sequence, at 1 to 4 sequences; the draft's beam levels, 4 tokens, at up to 16 sequences): the decode
  wrapper too, as "tree-decode" plans. With page size 1 a tree needs no mask: each query token becomes a
  decode sequence of its own whose page list is its sequence's committed prefix followed by its
  ancestors and itself, in column order (:func:`bench.engine.fi_meta.build_tree_decode_indices`), so
  ``R * T`` sequences and as many times more CTAs. Why: the masked prefill kernel packs a sequence's 16
  verify tokens x 8 query heads per KV head into one 128-row tile, so a verify call at one sequence ran
  4 CTAs, each walking the KV alone: 17 us a call (8 a step) and 9.5 us for the draft's levels, against
  ~6 us for a plain decode call (run Z in `bench/RESULTS_HISTORY.md`, H200, medium model, C = 1, measured
  before this form existed);
* larger tree steps: the prefill wrapper with a packed custom mask (each query sees the committed prefix
  and its own ancestors in the tree). It reads each sequence's KV once for all its tokens, the decode
  form once per token: at large batches there are CTAs enough and the reads count.

**Planned once, replayed with any lengths.** A FlashInfer ``plan()`` splits the work into CTAs from the
host's copy of the sequence lengths, and a CUDA graph bakes the plan's grid into its kernels, so the usual
recipe is a plan per step before each replay: host lengths (a device-to-host sync after every verify
step), ~50 us of Python per plan, and a pinned buffer that the next plan overwrites while the GPU may
still be copying it. This engine plans each (batch size, tokens, kind) once, with split-KV disabled
(``disable_split_kv=True``): then the plan's work list is one CTA per (sequence, query tile), independent
of the KV lengths, and every length-dependent input the kernel reads (``kv_indptr``, ``kv_indices``, the
mask bits) lives in device buffers the wrapper keeps references to, written inside the step's graph by
:mod:`bench.engine.fi_meta` from the device's own ``seq_lens``. The host never plans, syncs or copies per
step. (Split-KV only pays for long contexts with few sequences; the benchmark's contexts are < 200 tokens.)
The wrappers are made without ``use_cuda_graph``: that mode pads the grid and sizes buffers for re-planning,
which a plan made once does not need; run() then reads exactly the buffers passed to plan().

``kernel="reference"`` keeps every buffer and in-graph builder but computes the attention in plain torch
from the same metadata (:func:`bench.engine.fi_meta.reference_attention_paged`): the CPU path, and a
float32 path for checking the metadata end to end (FlashInfer's kernels take bf16 and fp16 only).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .fi_meta import build_kv_indices, build_tree_decode_indices, pack_mask, reference_attention_paged
from .fused import store_kv
from .kv_cache import KVCache

log = logging.getLogger(__name__)

FLOAT_WORKSPACE_BYTES = 16 << 20  # split-KV is off, so FlashInfer keeps no partial results here
INT_WORKSPACE_BYTES = 1 << 20     # the plan's work list: a few int32 per CTA
KERNELS = ("flashinfer", "reference")
HEAD_DIMS = (64, 128, 256)  # the head sizes FlashInfer's fa2 kernels are built for
TREE_DECODE_MAX_TOKENS = 64  # default: tree steps of at most this many query tokens run as decode
DECODE_KINDS = ("decode", "tree-decode")  # planned on BatchDecodeWithPagedKVCacheWrapper: one query per page list


def flashinfer_available() -> bool:
    """Whether ``import flashinfer`` works here (its wrappers additionally need a CUDA device)."""
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class Plan:
    """One planned FlashInfer call shape: ``bs`` sequences x ``tokens`` new tokens, of one ``kind``
    (``"decode"``, ``"causal"``, ``"tree"`` or ``"tree-decode"``), with the fixed buffers its wrapper
    reads. Every step of that shape (all layers, and the target and draft alike) reuses it; the in-graph
    builders overwrite the metadata buffers before each call.

    The KV is described as :attr:`lists` page lists of :attr:`list_tokens` query tokens each: one list per
    sequence, except for ``"tree-decode"``, which gives each of the ``bs * tokens`` query tokens a list of
    its own (its prefix, ancestors and itself; see the module docstring)."""

    bs: int
    tokens: int
    kind: str
    kv_max: int
    qo_indptr: torch.Tensor      # [lists + 1] int32, fixed: query tokens per list
    kv_indptr: torch.Tensor      # [lists + 1] int32, written per step
    kv_indices: torch.Tensor     # [lists * kv_max + 1] int32, written per step (last entry: spill)
    last_page_len: torch.Tensor  # [lists] int32, all 1 (page size 1)
    write_slots: torch.Tensor    # [bs * tokens] int64, written per step
    mask: torch.Tensor | None    # [bs * tokens * kv_max] uint8 packed mask bits ("tree" only)
    out: torch.Tensor            # [bs * tokens, heads, head_dim] attention output
    wrapper: object = None       # the planned FlashInfer wrapper (None for the reference kernel)

    @property
    def lists(self) -> int:
        """Page lists (FlashInfer's batch size): ``bs * tokens`` for ``"tree-decode"``, else ``bs``."""
        return self.bs * self.tokens if self.kind == "tree-decode" else self.bs

    @property
    def list_tokens(self) -> int:
        """Query tokens per page list: 1 for ``"tree-decode"``, else ``tokens``."""
        return 1 if self.kind == "tree-decode" else self.tokens

    @property
    def region(self) -> int:
        """Bytes of the mask buffer per sequence (see :mod:`bench.engine.fi_meta`)."""
        return self.tokens * self.kv_max


class FlashInferLayouts:
    """Builds each forward's attention metadata for FlashInfer (see the module docstring).

    Args:
        req_to_token: the engine's ``[rows, max_context]`` slot table (int64).
        num_heads, num_kv_heads, head_dim: the attention shape.
        dtype: q and KV dtype (bf16 or fp16 for ``kernel="flashinfer"``).
        kernel: ``"flashinfer"`` or ``"reference"`` (torch math on the same metadata).
        triton: build the metadata and store the KV with the Triton kernels (default: on CUDA); tests
            force them on CPU, where they run in Triton's interpreter.
        tree_decode_max_tokens: :meth:`tree` runs steps of at most this many query tokens (``bs * T``)
            as "tree-decode" plans, larger ones as "tree" plans (0: never as decode; see the module
            docstring).

    The engine calls :meth:`causal` or :meth:`tree` once per model forward (inside the graph: they only
    launch the metadata builders) and hands the returned :class:`Plan` to the attention callables of
    :meth:`attention`. Plans are made on first use, which must be outside graph capture (the pool's
    warm-up run before each capture does it).
    """

    def __init__(self, req_to_token: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, kernel: str = "flashinfer", triton: bool | None = None,
                 tree_decode_max_tokens: int = TREE_DECODE_MAX_TOKENS):
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        if tree_decode_max_tokens < 0:
            raise ValueError(f"tree_decode_max_tokens must be >= 0 (0: tree steps never run as decode), got "
                             f"{tree_decode_max_tokens}")
        if kernel == "flashinfer":
            if req_to_token.device.type != "cuda":
                raise ValueError("FlashInfer attention needs a CUDA device; use attention='torch' or the "
                                 "'flashinfer-reference' kernel on CPU")
            if head_dim not in HEAD_DIMS:
                raise ValueError(f"FlashInfer's kernels take head_dim in {HEAD_DIMS}, the model has {head_dim}: use "
                                 f"attention='torch' (or 'flashinfer-reference')")
            if dtype not in (torch.bfloat16, torch.float16):
                raise ValueError(f"FlashInfer's kernels take bf16 or fp16, the engine runs {dtype}: use "
                                 f"attention='torch' (or 'flashinfer-reference') for {dtype}")
            if not flashinfer_available():
                raise RuntimeError("attention='flashinfer' needs the flashinfer-python package (0.6.11.post1 was "
                                   "tested; it needs apache-tvm-ffi): install it, or use attention='torch'")
            self._workspace = torch.zeros(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=req_to_token.device)
        self.table = req_to_token
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype, self.kernel = dtype, kernel
        self.kv_max = -(-req_to_token.shape[1] // 8) * 8  # every kv_len fits; the mask region packs whole bytes
        self.device = req_to_token.device
        self.triton = _have_triton() and self.device.type == "cuda" if triton is None else triton
        self.tree_decode_max_tokens = tree_decode_max_tokens
        self.plans: dict[tuple[int, int, str], Plan] = {}

    # ------------------------------------------------------------------------------ step metadata
    def causal(self, rows: torch.Tensor, start: torch.Tensor, tokens: int) -> Plan:
        """``tokens`` new tokens per sequence at columns ``start .. start + tokens - 1``, each attending
        every column up to its own (prefill, the draft's first pass, plain decode with ``tokens == 1``)."""
        plan = self._plan(rows.shape[0], tokens, "decode" if tokens == 1 else "causal")
        build_kv_indices(self.table, rows, start, tokens, tokens, plan.kv_indptr, plan.kv_indices, plan.write_slots,
                         self.triton)
        return plan

    def tree(self, rows: torch.Tensor, prefix_len: torch.Tensor, extra_mask: torch.Tensor) -> Plan:
        """A tree step: sequence ``r`` attends columns ``[0, prefix_len[r] + E)``; query ``q`` sees all of
        the first ``prefix_len[r]`` and extra column ``prefix_len[r] + e`` where ``extra_mask[r, q, e]``.
        The step's ``T`` new tokens are the last ``T`` extra columns (``extra_mask``: ``[bs, T, E]``).
        Steps of at most ``tree_decode_max_tokens`` query tokens get a "tree-decode" plan (a page list per
        query token, no mask), larger ones a "tree" plan (a list per sequence and the packed mask)."""
        bs, tokens, extra = extra_mask.shape
        if bs * tokens <= self.tree_decode_max_tokens:
            plan = self._plan(bs, tokens, "tree-decode")
            build_tree_decode_indices(self.table, rows, prefix_len, extra_mask, plan.kv_indptr, plan.kv_indices,
                                      plan.write_slots, self.triton)
            return plan
        plan = self._plan(bs, tokens, "tree")
        build_kv_indices(self.table, rows, prefix_len, extra, tokens, plan.kv_indptr, plan.kv_indices,
                         plan.write_slots, self.triton)
        pack_mask(prefix_len, extra_mask, plan.mask, plan.region, self.triton)
        return plan

    def attention(self, cache: KVCache) -> "FlashInferAttention":
        """The attention callable of one model over ``cache`` (set its ``meta`` to a :class:`Plan`)."""
        return FlashInferAttention(cache, self)

    # ---------------------------------------------------------------------------------- plans
    def _plan(self, bs: int, tokens: int, kind: str) -> Plan:
        plan = self.plans.get((bs, tokens, kind))
        if plan is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"no FlashInfer plan for {bs} sequences x {tokens} tokens ({kind}) was made before "
                                   f"graph capture; run the step once eagerly first (GraphPool.capture's warm-up does)")
            plan = self.plans[(bs, tokens, kind)] = self._make_plan(bs, tokens, kind)
        return plan

    def _make_plan(self, bs: int, tokens: int, kind: str) -> Plan:
        dev, i32 = self.device, torch.int32
        kv_max = self.kv_max
        lists, per_list = (bs * tokens, 1) if kind == "tree-decode" else (bs, tokens)  # Plan.lists, .list_tokens
        plan = Plan(
            bs, tokens, kind, kv_max,
            qo_indptr=torch.arange(lists + 1, dtype=i32, device=dev) * per_list,
            kv_indptr=torch.arange(lists + 1, dtype=i32, device=dev) * kv_max,  # plan-time layout: every list at max
            kv_indices=torch.zeros(lists * kv_max + 1, dtype=i32, device=dev),
            last_page_len=torch.ones(lists, dtype=i32, device=dev),
            write_slots=torch.zeros(bs * tokens, dtype=torch.int64, device=dev),
            mask=torch.zeros(bs * tokens * kv_max, dtype=torch.uint8, device=dev) if kind == "tree" else None,
            out=torch.empty(bs * tokens, self.num_heads, self.head_dim, dtype=self.dtype, device=dev))
        if self.kernel == "flashinfer":
            plan.wrapper = self._plan_wrapper(plan)
        log.info("FlashInfer %s plan: %d sequences x %d tokens (%s kernel)", kind, bs, tokens, self.kernel)
        return plan

    def _plan_wrapper(self, plan: Plan):
        import flashinfer
        int_workspace = torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        shape = dict(num_kv_heads=self.num_kv_heads, page_size=1, q_data_type=self.dtype, kv_data_type=self.dtype,
                     disable_split_kv=True)
        if plan.kind in DECODE_KINDS:  # plan.lists sequences of one query each
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD", use_tensor_cores=True,
                                                                   backend="fa2")
            wrapper.reset_workspace_buffer(self._workspace, int_workspace)
            wrapper.plan(plan.kv_indptr, plan.kv_indices, plan.last_page_len, num_qo_heads=self.num_heads,
                         head_dim=self.head_dim, **shape)
        else:
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend="fa2")
            wrapper.reset_workspace_buffer(self._workspace, int_workspace)
            wrapper.plan(plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.last_page_len,
                         num_qo_heads=self.num_heads, head_dim_qk=self.head_dim, causal=plan.kind == "causal",
                         packed_custom_mask=plan.mask, **shape)
        return wrapper

    # ------------------------------------------------------------------------------------ kernel
    def run(self, plan: Plan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Attention of ``q [bs * tokens, H, D]`` over the cache under ``plan``'s current metadata
        -> ``[bs * tokens, H * D]``."""
        if plan.wrapper is None:  # q's rows are the lists' queries in order, list_tokens per list
            return reference_attention_paged(q, k_cache, v_cache, plan.list_tokens, plan.kv_indptr, plan.kv_indices,
                                             plan.kv_max, plan.kind == "causal", plan.mask, plan.region)
        slots, kvh, dim = k_cache.shape
        paged = (k_cache.view(slots, 1, kvh, dim), v_cache.view(slots, 1, kvh, dim))  # page size 1, NHD
        out = plan.wrapper.run(q, paged, out=plan.out, enable_pdl=False)
        return out.view(q.shape[0], -1)


class FlashInferAttention:
    """The attention callable for :class:`~bench.engine.model.LlamaModel` over one :class:`KVCache`:
    writes the step's K and V into their slots (one fused launch on CUDA), then runs the current plan.
    Set :attr:`meta` to the :class:`Plan` of :meth:`FlashInferLayouts.causal` / :meth:`~FlashInferLayouts.tree`
    before each forward.

    It has the model's optional :meth:`kv_sink`: a model running fused kernels then writes K and V into
    the slots itself, in its rotary kernel, and calls with ``k = v = None`` (one launch per layer fewer)."""

    def __init__(self, cache: KVCache, layouts: FlashInferLayouts):
        self.cache, self.layouts = cache, layouts
        self.meta: Plan | None = None

    def _plan(self) -> Plan:
        if self.meta is None:
            raise RuntimeError("FlashInferAttention.meta is unset: build the step's Plan before the forward")
        return self.meta

    def kv_sink(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(write_slots, k_cache, v_cache)``: the current plan's slots of this forward's new tokens (a
        buffer the in-graph metadata builder writes) and layer ``layer_id``'s cache tensors (see
        :class:`bench.engine.model.AttentionFn`)."""
        return self._plan().write_slots, self.cache.k[layer_id], self.cache.v[layer_id]

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        plan = self._plan()
        k_cache, v_cache = self.cache.k[layer_id], self.cache.v[layer_id]
        if k is not None and v is not None:
            store_kv(k, v, plan.write_slots, k_cache, v_cache, self.layouts.triton)
        elif k is not None or v is not None:
            raise ValueError("FlashInferAttention takes k and v both as tensors, or both None (already written "
                             "into the cache through kv_sink), not one of each")
        return self.layouts.run(plan, q, k_cache, v_cache)


def _have_triton() -> bool:
    from . import fused
    return fused.triton is not None

"""The one small reference engine shared by the benchmarks, the demo and the SGLang test harness.

Stable pieces (import them on their own):

* :mod:`bench.engine.config`: :class:`ModelConfig` (``medium()`` for the GPU benchmark, ``small()``, ``tiny()`` for CPU) and
  :class:`SpecConfig`.
* :mod:`bench.engine.model`: :class:`LlamaModel` (``forward(input_ids, positions, attn)``),
  :func:`build_target`, :func:`build_draft`.
* :mod:`bench.engine.kv_cache`: :class:`KVCache`, :class:`SlotAllocator`, :class:`ReqToTokenPool`
  (plain tensors; slot 0 and row 0 are the dummies padded rows use).
* :mod:`bench.engine.attention`: :class:`AttnMeta`, :class:`PagedAttention` (graph-safe), :class:`TorchLayouts`
  (each step's metadata), and the longhand :func:`reference_attention` oracle.
* :mod:`bench.engine.fi_attention`: FlashInfer attention (CUDA, bf16/fp16), planned once per shape, its
  metadata built in the graph by :mod:`bench.engine.fi_meta` (Triton kernels with torch references).
* :mod:`bench.engine.fused`: fused Triton kernels for the embedding lookup with the first norm, the norms, rotary
  embedding, SwiGLU, KV store and the greedy argmax.
* :mod:`bench.engine.gemv`: the model's projections (:class:`~bench.engine.gemv.Projection`) and the Triton GEMV that
  runs their one-token products (plain decode at C = 1) in 16-bit models; :mod:`bench.engine.skinny` runs their
  2-16-token products (the speculative step's draft levels and verify at C = 1) on tensor cores.
* :mod:`bench.engine.draft_select`, :mod:`bench.engine.tree_kernels`, :mod:`bench.engine.draft_inputs`: the
  speculative step's selection work (each draft level's top-k, next beam and ancestors, the tree's selection, the
  greedy acceptance with its commit) and its index arithmetic as one Triton kernel each, beside the torch code of
  :mod:`bench.engine.tree` and ``Engine`` they replace (``SpecConfig.draft_select``).
* :mod:`bench.engine.costs`: FLOPs, bytes and roofline time of a plain and a speculative step.
* :mod:`bench.engine.parallel`: :class:`TensorParallel` (sharded layers, collectives; how every rank takes the
  same decision per step), :mod:`graphpool.agreement` (the per-step cross-rank check and
  :class:`RankDisagreementError`), :mod:`bench.engine.tp_launch` (spawn or torchrun, teardown order).
"""
from .attention import AttnMeta, PagedAttention, TorchLayouts, attend, reference_attention
from .config import ModelConfig, SpecConfig, dtype_from_name
from .kv_cache import DUMMY_ROW, DUMMY_SLOT, KVCache, ReqToTokenPool, SlotAllocator
from .model import AttentionFn, LlamaModel, build_draft, build_target

__all__ = [
    "AttnMeta", "PagedAttention", "TorchLayouts", "attend", "reference_attention", "ModelConfig", "SpecConfig",
    "dtype_from_name", "DUMMY_ROW", "DUMMY_SLOT", "KVCache", "ReqToTokenPool", "SlotAllocator",
    "AttentionFn", "LlamaModel", "build_draft", "build_target",
]

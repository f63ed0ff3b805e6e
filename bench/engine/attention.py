"""Graph-safe paged attention in plain torch, for plain decode, tree verify, prefill and drafting.

One formulation covers every step shape. A step carries ``T`` new tokens per sequence (1 for decode,
``num_draft_tokens`` for verify, the prompt for prefill). Each new token attends to

* the sequence's **prefix**: cache positions ``< prefix_len``, gathered through ``req_to_token`` up to a
  fixed ``prefix_cols`` columns and masked by length (fixed shapes: no host sync, no data-dependent
  shape), and
* **extra** slots ``[bs, E]`` (usually the new tokens themselves) under an explicit ``[bs, T, E]`` mask:
  causal for prefill, ancestor-or-self for a draft tree, ``[[True]]`` for decode.

Each layer first writes the new tokens' K and V into their ``write_slots`` (or the model has, through
:meth:`PagedAttention.kv_sink`), then gathers prefix and extra slots in one index and runs
``scaled_dot_product_attention`` with the boolean mask. Everything the layers need is computed once per
step in :class:`AttnMeta`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv_cache import DUMMY_SLOT, KVCache

_ALIGN = 16  # pad the key length so the fused SDPA kernels take the aligned-mask path


def key_len(prefix_cols: int, extras: int) -> int:
    """Keys per query in a step: the gathered prefix columns and extra slots, padded to ``_ALIGN``."""
    return -(-(prefix_cols + extras) // _ALIGN) * _ALIGN


@dataclass
class AttnMeta:
    """Per-step attention metadata (every field a tensor computed in-graph or before it).

    Attributes:
        bs: sequences in the step (padded batch size inside a graph).
        tokens_per_seq: new tokens per sequence, ``T``.
        write_slots: ``[bs * T]`` slots that receive the new tokens' K and V.
        gather_idx: ``[bs, S]`` slots to attend over (prefix columns, extras, alignment padding).
        mask: ``[bs, 1, group * T, S]`` bool, True where a query may attend (grouped-query layout).
    """

    bs: int
    tokens_per_seq: int
    write_slots: torch.Tensor
    gather_idx: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def build(cls, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
              write_slots: torch.Tensor, extra_slots: torch.Tensor, extra_mask: torch.Tensor,
              prefix_cols: int, group: int) -> "AttnMeta":
        """Metadata for a step.

        Args:
            req_to_token: ``[rows, max_context]`` slot table.
            req_pool_indices: ``[bs]`` request rows.
            prefix_lens: ``[bs]`` cache positions each sequence attends before its extras.
            write_slots: ``[bs, T]`` where the new tokens' K/V go.
            extra_slots: ``[bs, E]`` slots attended under ``extra_mask`` (written this step or earlier).
            extra_mask: ``[bs, T, E]`` bool.
            prefix_cols: fixed number of prefix columns gathered (>= every prefix_len).
            group: query heads per KV head.
        """
        bs, t = write_slots.shape
        prefix_slots = req_to_token[req_pool_indices, :prefix_cols]
        cols = torch.arange(prefix_cols, device=prefix_lens.device)
        prefix_mask = (cols[None, :] < prefix_lens[:, None])[:, None, :].expand(bs, t, prefix_cols)
        idx = torch.cat([prefix_slots, extra_slots], dim=1)
        mask = torch.cat([prefix_mask, extra_mask], dim=2)
        pad = key_len(prefix_cols, idx.shape[1] - prefix_cols) - idx.shape[1]
        if pad:
            idx = F.pad(idx, (0, pad), value=DUMMY_SLOT)
            mask = F.pad(mask, (0, pad), value=False)
        s = idx.shape[1]
        mask = mask[:, None, None].expand(bs, 1, group, t, s).reshape(bs, 1, group * t, s)
        return cls(bs, t, write_slots.reshape(-1), idx, mask)

    @classmethod
    def causal(cls, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, start: torch.Tensor,
               slots: torch.Tensor, prefix_cols: int, group: int) -> "AttnMeta":
        """``T`` consecutive new tokens per sequence at positions ``start .. start+T-1`` whose slots
        are ``slots [bs, T]``, each attending the cache before ``start`` and the new tokens causally
        (prefill, draft catch-up, plain decode with ``T == 1``)."""
        bs, t = slots.shape
        causal = torch.ones(t, t, dtype=torch.bool, device=slots.device).tril()
        return cls.build(req_to_token, req_pool_indices, start, slots, slots, causal.expand(bs, t, t),
                         prefix_cols, group)


class TorchLayouts:
    """Builds each forward's :class:`AttnMeta` (the engine's attention-layout interface; the FlashInfer
    twin is :class:`bench.engine.fi_attention.FlashInferLayouts`).

    Args:
        req_to_token: the engine's ``[rows, max_context]`` slot table.
        group: query heads per KV head.

    Every query gathers all ``max_context`` prefix columns (masked by length): fixed shapes for any
    sequence length, at the cost of reading up to ``max_context`` keys per query.
    """

    def __init__(self, req_to_token: torch.Tensor, group: int):
        self.table, self.group = req_to_token, group
        self.prefix_cols = req_to_token.shape[1]

    def causal(self, rows: torch.Tensor, start: torch.Tensor, tokens: int) -> AttnMeta:
        """``tokens`` new tokens per sequence at columns ``start .. start + tokens - 1``, each attending
        every column up to its own (prefill, the draft's first pass, plain decode with ``tokens == 1``)."""
        cols = start[:, None] + torch.arange(tokens, device=start.device)
        return AttnMeta.causal(self.table, rows, start, self.table[rows[:, None], cols], self.prefix_cols, self.group)

    def tree(self, rows: torch.Tensor, prefix_len: torch.Tensor, extra_mask: torch.Tensor) -> AttnMeta:
        """A tree step: every query attends columns ``[0, prefix_len)``, and query ``q`` extra column
        ``prefix_len + e`` where ``extra_mask[:, q, e]``; the step's ``T`` new tokens are the last ``T``
        extra columns (``extra_mask``: ``[bs, T, E]``)."""
        tokens, extra = extra_mask.shape[1:]
        cols = prefix_len[:, None] + torch.arange(extra, device=prefix_len.device)
        extra_slots = self.table[rows[:, None], cols]
        return AttnMeta.build(self.table, rows, prefix_len, extra_slots[:, extra - tokens:], extra_slots, extra_mask,
                              self.prefix_cols, self.group)

    def attention(self, cache: KVCache) -> "PagedAttention":
        """The attention callable of one model over ``cache`` (set its ``meta`` per forward)."""
        return PagedAttention(cache)


class PagedAttention:
    """The attention callable for :class:`~bench.engine.model.LlamaModel` over a :class:`KVCache`.

    Set :attr:`meta` before each forward. Graph-safe: fixed shapes per (bs, T), no host syncs.

    It has the model's optional :meth:`kv_sink`: a model running fused kernels then writes K and V into
    the slots itself, in its rotary kernel, and calls with ``k = v = None`` (one launch per layer fewer).
    """

    def __init__(self, cache: KVCache, meta: AttnMeta | None = None):
        self.cache = cache
        self.meta = meta

    def _meta(self) -> AttnMeta:
        if self.meta is None:
            raise RuntimeError("PagedAttention.meta is unset: build an AttnMeta for the step before the forward")
        return self.meta

    def kv_sink(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(write_slots, k_cache, v_cache)``: the current meta's slots of this forward's new tokens and
        layer ``layer_id``'s cache tensors (see :class:`bench.engine.model.AttentionFn`)."""
        return self._meta().write_slots, self.cache.k[layer_id], self.cache.v[layer_id]

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        meta = self._meta()
        k_cache, v_cache = self.cache.k[layer_id], self.cache.v[layer_id]
        if k is not None and v is not None:
            k_cache.index_copy_(0, meta.write_slots, k)
            v_cache.index_copy_(0, meta.write_slots, v)
        elif k is not None or v is not None:
            raise ValueError("PagedAttention takes k and v both as tensors, or both None (already written into "
                             "the cache through kv_sink), not one of each")
        return attend(q, k_cache[meta.gather_idx], v_cache[meta.gather_idx], meta)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
    """``q [bs*T, H, D]`` against gathered ``keys``/``values`` ``[bs, S, KVH, D]`` -> ``[bs*T, H*D]``."""
    bs, t = meta.bs, meta.tokens_per_seq
    _, heads, dim = q.shape
    kvh = keys.shape[2]
    group = heads // kvh
    # Fold the query heads of one KV head into the query-length axis: plain SDPA, no KV repeat.
    qg = q.view(bs, t, kvh, group, dim).permute(0, 2, 3, 1, 4).reshape(bs, kvh, group * t, dim)
    out = F.scaled_dot_product_attention(qg, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=meta.mask)
    return out.view(bs, kvh, group, t, dim).permute(0, 3, 1, 2, 4).reshape(bs * t, heads * dim)


def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Test oracle for one sequence, written out longhand in float32.

    Args:
        q: ``[T, H, D]``; keys, values: ``[L, KVH, D]``; mask: ``[T, L]`` bool.
    Returns:
        ``[T, H * D]`` in ``q``'s dtype.
    """
    t, heads, dim = q.shape
    group = heads // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)  # [L, H, D]
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,lhd->htl", q.float(), k) / dim ** 0.5
    scores = scores.masked_fill(~mask[None], float("-inf"))
    out = torch.einsum("htl,lhd->thd", scores.softmax(-1), v)
    return out.reshape(t, heads * dim).to(q.dtype)

"""Grouped-query attention over the slot cache without repeating keys and values.

transformers' ``"sdpa"`` attention repeats each key/value head for its query heads (``repeat_kv``) whenever a
mask is passed, and the slot cache always passes one: at batch 32 over a few hundred positions that copy
moves four times the cache's bytes per layer for Llama-3.2-1B (32 query heads over 8 key/value heads). Here
the ``G`` query heads that share a key/value head ride as ``G * T`` query rows of that one head instead, so
scaled-dot-product attention reads each key once; the mask :meth:`SlotCache.attention_mask` builds for
``groups=G`` has those rows. The maths is HF's ``sdpa`` attention's (same scale, same additive mask);
only the order of heads inside the kernel call differs.

It runs while :class:`~.step.SlotForward` calls the decoder (:func:`grouped_attention` sets the model's
attention implementation for that call and puts it back), so ``model.generate`` and every other use of the
model keep their own attention.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from transformers import AttentionInterface

#: The name this attention is registered under in transformers' attention functions.
GROUPED_SDPA = "graphpool_grouped_sdpa"


def grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` ``[B, H, T, D]``, ``key``/``value``
    ``[B, Hkv, L, D]``, ``attention_mask`` ``[B, 1, (H // Hkv) * T, L]``; returns ``[B, T, H, D]``."""
    rows, heads, tokens, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    # Head h reads key/value head h // groups (transformers' repeat_kv order): its rows sit at g * T + t.
    q = query.reshape(rows, kv_heads, groups * tokens, dim)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling)
    # reshape, not view: CUDA's memory-efficient kernel returns its output in a transposed layout.
    return out.reshape(rows, heads, tokens, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)


@contextmanager
def grouped_attention(config: Any, on: bool) -> Iterator[None]:
    """Run the enclosed forward with :func:`grouped_sdpa` (when ``on``), then restore the config's attention."""
    if not on:
        yield
        return
    before = config._attn_implementation
    config._attn_implementation = GROUPED_SDPA
    try:
        yield
    finally:
        config._attn_implementation = before

"""Grouped-query attention over the slot cache without repeating keys and values.

transformers' ``"sdpa"`` attention repeats each key/value head for its query heads (``repeat_kv``) whenever a
mask is passed, and the slot cache always passes one: at batch 32 over a few hundred positions that copy
moves four times the cache's bytes per layer for Llama-3.2-1B (32 query heads over 8 key/value heads). Here
the ``G`` query heads that share a key/value head ride as ``G * T`` query rows of that one head instead, so
scaled-dot-product attention reads each key once; the mask :meth:`SlotCache.attention_mask` builds for
``groups=G`` has those rows. The maths is HF's ``sdpa`` attention's (same scale, same additive mask);
only the order of heads inside the kernel call differs.

:func:`slot_attention` wraps it (or transformers' own ``sdpa``, or the model's eager function): each layer picks
the mask of its own sliding window. It runs only while :class:`~.step.SlotForward` calls the model
(:func:`~.structure.attention_implementation` sets the model's attention implementation for that call and puts
it back), so ``model.generate`` and every other use of the model keep their own attention.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .structure import ModelLayout, unique_name


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
    return out.reshape(rows, heads, tokens, value.shape[-1]).transpose(1, 2).contiguous(), None


def slot_attention(layout: ModelLayout, grouped: bool) -> Callable:
    """The step's attention function for a model of ``layout``: transformers' attention-function signature.

    The step passes, as ``attention_mask``, one mask per window of the layout stacked on dimension 1
    (``[B, len(layout.windows), rows, kv_len]``, :meth:`SlotCache.attention_mask`); each layer's call picks the
    mask of the window it receives (``sliding_window=``, ``None`` for full attention), then attends with
    :func:`grouped_sdpa` (``grouped``), transformers' ``sdpa``, or the model's own eager function, as the model
    is configured.
    """
    index = {window: i for i, window in enumerate(layout.windows)}
    if grouped:
        attend = grouped_sdpa
    elif layout.implementation == "sdpa":
        attend = sdpa_attention_forward
    else:
        functions = layout.eager_functions

        def attend(module, *args, **kwargs):
            return functions[type(module)](module, *args, **kwargs)

    def slot_attend(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        i = index[kwargs.get("sliding_window")]
        return attend(module, query, key, value, attention_mask[:, i:i + 1], **kwargs)

    return slot_attend


def register(function: Callable) -> str:
    """Register ``function`` as a transformers attention function under a name of its own; returns the name."""
    name = unique_name("graphpool_slots")
    AttentionInterface.register(name, function)
    return name

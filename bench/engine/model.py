"""A Llama-style decoder with random weights, and a cheap draft made from it.

The model knows nothing about KV caches or batching: :meth:`LlamaModel.forward` takes flat
``input_ids`` and ``positions`` (one row per token) and an *attention callable* that owns the cache.
That keeps the model reusable by any harness (the SGLang test harness wraps its own backend)::

    attn(layer_id, q, k, v) -> out
        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        out: [num_tokens, num_heads * head_dim]

:class:`bench.engine.attention.PagedAttention` is the graph-safe paged implementation.
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from .config import ModelConfig


class AttentionFn(Protocol):
    """What :meth:`LlamaModel.forward` calls once per layer (see the module docstring)."""

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype norms, rotary embeddings and logits compute in: float32 for bf16, fp16 and fp32 models
    (stability), float64 for a float64 model (test oracles stay float64 end to end)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """Root-mean-square norm; statistics in at least float32 (see :func:`stats_dtype`)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = x.to(stats_dtype(x.dtype))
        xs = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + self.eps)
        return xs.to(x.dtype) * self.weight


def rope_tables(cfg: ModelConfig, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape ``[max_positions, head_dim // 2]`` in float32."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device=device) / cfg.head_dim))
    angles = torch.outer(torch.arange(cfg.max_positions, dtype=torch.float32, device=device), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding. ``x``: [N, heads, D]; ``cos``/``sin``: [N, D/2] (already gathered)."""
    half = x.shape[-1] // 2
    dtype = stats_dtype(x.dtype)
    x1, x2 = x[..., :half].to(dtype), x[..., half:].to(dtype)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class DecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm SwiGLU block, both residual."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.input_norm = RMSNorm(cfg.hidden_size)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_dim + 2 * kv_dim, bias=False)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=False)
        self.post_norm = RMSNorm(cfg.hidden_size)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        n = h.shape[0]
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(self.input_norm(h)).split([q_dim, kv_dim, kv_dim], dim=-1)
        q = apply_rope(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        h = h + self.o_proj(attn(self.layer_id, q, k, v))
        gate, up = self.gate_up_proj(self.post_norm(h)).chunk(2, dim=-1)
        return h + self.down_proj(nn.functional.silu(gate) * up)


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm, LM head.

    Args:
        cfg: the shape.

    Call :func:`init_random_` (or :func:`build_target`) to get seeded random weights.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` after the final norm.

        Args:
            input_ids: ``[num_tokens]`` int64 token ids.
            positions: ``[num_tokens]`` int64 positions (rotary embedding index).
            attn: the attention callable; it sees every layer's q, k, v and owns the KV cache.
        """
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, attn)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[num_tokens, vocab]`` in at least float32 (so greedy argmax is stable across batch shapes)."""
        return self.lm_head(hidden).to(stats_dtype(hidden.dtype))


@torch.no_grad()
def init_random_(model: LlamaModel, seed: int) -> LlamaModel:
    """Seeded random weights. Output projections are scaled by ``cfg.residual_scale`` so each layer
    nudges the residual stream instead of replacing it (see :class:`ModelConfig`)."""
    cfg = model.cfg
    gen = torch.Generator(device=model.embed.weight.device).manual_seed(seed)
    scales = {"embed": 1.0, "lm_head": cfg.logit_scale * cfg.hidden_size ** -0.5, "qkv_proj": cfg.hidden_size ** -0.5,
              "gate_up_proj": cfg.hidden_size ** -0.5,
              "o_proj": cfg.residual_scale * (cfg.num_heads * cfg.head_dim) ** -0.5,
              "down_proj": cfg.residual_scale * cfg.intermediate_size ** -0.5}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        part = name.split(".")[-2]
        p.normal_(0.0, scales[part], generator=gen)
    return model


def build_target(cfg: ModelConfig, seed: int = 0, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> LlamaModel:
    """A target model with seeded random weights on ``device`` in ``dtype`` (weights are drawn in float32)."""
    with torch.device(device):
        model = LlamaModel(cfg)
    init_random_(model, seed)
    return model.to(dtype).eval().requires_grad_(False)


@torch.no_grad()
def build_draft(target: LlamaModel, num_layers: int = 1, noise: float = 0.05, seed: int = 1) -> LlamaModel:
    """A cheap draft: the target's embedding, first ``num_layers`` layers, final norm and LM head, each
    weight perturbed by Gaussian noise of relative std ``noise``. It misses the target's later layers
    and the noise, so it agrees with the target often but not always; ``noise`` sets how often.
    """
    if not 1 <= num_layers <= target.cfg.num_layers:
        raise ValueError(f"draft num_layers must be in [1, {target.cfg.num_layers}], got {num_layers}")
    device, dtype = target.embed.weight.device, target.embed.weight.dtype
    with torch.device(device):
        draft = LlamaModel(target.cfg.with_layers(num_layers))
    src = dict(target.named_parameters())
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in draft.named_parameters():
        w = src[name].float()
        if noise > 0 and not name.endswith("norm.weight"):
            w = w + noise * w.std() * torch.randn(w.shape, generator=gen, device=device)
        p.copy_(w)
    return draft.to(dtype).eval().requires_grad_(False)

"""A Llama-style decoder with random weights, and a cheap draft made from it.

The model knows nothing about KV caches or batching: :meth:`LlamaModel.forward` takes flat
``input_ids`` and ``positions`` (one row per token) and an *attention callable* that owns the cache.
That keeps the model reusable by any harness (the SGLang test harness wraps its own backend)::

    attn(layer_id, q, k, v) -> out
        q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        out: [num_tokens, num_heads * head_dim]

    attn.kv_sink(layer_id) -> (write_slots, k_cache, v_cache)    # optional
        write_slots: [num_tokens] slots of this forward's new tokens
        k_cache, v_cache: that layer's [num_slots, num_kv_heads, head_dim] cache tensors

A callable that stores the new keys and values into a slot cache may expose ``kv_sink``. Where the model
runs fused kernels and the callable has it, each layer ropes q and k and writes k and v into those slots in
one Triton launch (:func:`bench.engine.fused.rope_q_store_kv`), then calls ``attn(layer_id, q, None, None)``:
k and v are already in the cache. That saves the callable's own store launch, one launch per layer (a
decode step is partly bound by its kernel count). A callable without ``kv_sink`` (or the torch path)
always gets tensors. :class:`bench.engine.attention.PagedAttention` is the graph-safe paged implementation;
it and :class:`bench.engine.fi_attention.FlashInferAttention` have ``kv_sink``. Norms, rotary embeddings,
SwiGLU, the embedding lookup (with the first norm) and the greedy argmax run as fused Triton kernels where
``model.fused`` (CUDA; :mod:`bench.engine.fused`), as plain torch elsewhere; with it, the projections of a
single token run the GEMV of :mod:`bench.engine.gemv` in 16-bit models; ``v`` reaches the attention as
a view into the qkv projection (rows strided).
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from .config import ModelConfig
from .fused import (add_rmsnorm, argmax_rows, embed_rmsnorm, fused_available, rmsnorm_reference, rope_q_store_kv,
                    rope_qk, stats_dtype)
from .gemv import Projection


class AttentionFn(Protocol):
    """What :meth:`LlamaModel.forward` calls once per layer (see the module docstring).

    ``k`` and ``v`` are ``None`` only for a callable that also has the optional method
    ``kv_sink(layer_id) -> (write_slots, k_cache, v_cache)`` (not part of this protocol's required
    surface): then the model has already written the layer's new keys and values into ``k_cache`` and
    ``v_cache`` at ``write_slots`` (fused kernels only; it saves the callable's store launch, one per layer).
    """

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor | None,
                 v: torch.Tensor | None) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    """Root-mean-square norm; statistics in at least float32 (see :func:`bench.engine.fused.stats_dtype`)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm_reference(x, self.weight, self.eps)


def rope_tables(cfg: ModelConfig, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape ``[max_positions, head_dim // 2]`` in float32."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device=device) / cfg.head_dim))
    angles = torch.outer(torch.arange(cfg.max_positions, dtype=torch.float32, device=device), inv)
    return angles.cos(), angles.sin()


class DecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm SwiGLU block, both residual.

    The layer takes the residual stream ``h`` and the previous block's output ``delta`` (``None`` for the
    first layer) and adds them inside its first norm, so one fused kernel does the residual add and the
    norm (see :mod:`bench.engine.fused`). The first layer may instead be given that norm's output as
    ``normed`` (the model computes it with the embedding lookup). It returns the new ``(h, delta)``.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.input_norm = RMSNorm(cfg.hidden_size)
        self.qkv_proj = Projection(cfg.hidden_size, q_dim + 2 * kv_dim)
        self.o_proj = Projection(q_dim, cfg.hidden_size)
        self.post_norm = RMSNorm(cfg.hidden_size)
        self.gate_up_proj = Projection(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Projection(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, h: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor, rope: tuple,
                attn: AttentionFn, fused: bool,
                normed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = h.shape[0]
        kv_start = (self.num_heads + self.num_kv_heads) * self.head_dim
        if normed is None:
            x, h = add_rmsnorm(h, delta, self.input_norm.weight, self.input_norm.eps, fused)
        elif delta is None:
            x = normed  # input_norm(h), computed by the caller
        else:
            raise ValueError("pass delta (added to h, then normed) or normed (the first layer's), not both")
        qkv = self.qkv_proj(x)
        sink = getattr(attn, "kv_sink", None) if fused else None
        if sink is not None:  # k and v go straight into the callable's cache: one launch, no store in attn
            q = rope_q_store_kv(qkv, positions, *rope, *sink(self.layer_id), self.num_heads, self.num_kv_heads,
                                self.head_dim, fused)
            out = attn(self.layer_id, q, None, None)
        else:
            q, k = rope_qk(qkv, positions, *rope, self.num_heads, self.num_kv_heads, self.head_dim, fused)
            v = qkv[:, kv_start:].view(n, self.num_kv_heads, self.head_dim)
            out = attn(self.layer_id, q, k, v)
        x, h = add_rmsnorm(self.o_proj(out), h, self.post_norm.weight, self.post_norm.eps, fused)
        return h, self.down_proj(self.gate_up_proj.silu_mul(x))


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
        self.lm_head = Projection(cfg.hidden_size, cfg.vocab_size)
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.fused = False  # Triton kernels: lookup, norms, rotary, SwiGLU, argmax, one-token GEMV (resolve_kernels)

    @property
    def fused(self) -> bool:
        """Whether the forward runs the Triton kernels (:func:`resolve_kernels`). Setting it sets every
        projection's flag too (their one-token GEMV, :mod:`bench.engine.gemv`)."""
        return self._fused

    @fused.setter
    def fused(self, value: bool) -> None:
        self._fused = bool(value)
        for module in self.modules():
            if isinstance(module, Projection):
                module.fused = self._fused

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` after the final norm.

        Args:
            input_ids: ``[num_tokens]`` int64 token ids.
            positions: ``[num_tokens]`` int64 positions (rotary embedding index).
            attn: the attention callable; it sees every layer's q, k, v and owns the KV cache (with
                fused kernels and ``attn.kv_sink``, the model writes k and v into it; see the module docstring).
        """
        rope, first = (self.rope_cos, self.rope_sin), self.layers[0]
        # The lookup and the first layer's input norm in one kernel (fused) or as embedding then the norm.
        x, h = embed_rmsnorm(input_ids, self.embed.weight, first.input_norm.weight, first.input_norm.eps, self.fused)
        h, delta = first(h, None, positions, rope, attn, self.fused, normed=x)
        for layer in self.layers[1:]:
            h, delta = layer(h, delta, positions, rope, attn, self.fused)
        return add_rmsnorm(delta, h, self.norm.weight, self.norm.eps, self.fused)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[num_tokens, vocab]`` in at least float32 (so greedy argmax is stable across batch shapes)."""
        return self.lm_head(hidden).to(stats_dtype(hidden.dtype))

    def greedy(self, hidden: torch.Tensor, commit: tuple | None = None) -> torch.Tensor:
        """The argmax token of every row, as ``logits(hidden).argmax(-1)`` (the upcast is exact, so the
        argmax is taken on the LM head's output directly: one kernel fewer; a Triton kernel where fused).
        ``commit = (table, rows, cols)`` also writes each row's token to ``table[rows[i], cols[i]]``
        (:func:`bench.engine.fused.argmax_rows`)."""
        return argmax_rows(self.lm_head(hidden), self.fused, commit)


KERNELS = ("auto", "fused", "torch")


def resolve_kernels(kernels: str, device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a model on ``device`` in ``dtype`` uses the fused Triton kernels of :mod:`bench.engine.fused`:
    ``"fused"`` (an error where they cannot run), ``"torch"`` (never), ``"auto"`` (where they can run)."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    can = fused_available(device, dtype)
    if kernels == "fused" and not can:
        raise ValueError(f"fused kernels need CUDA, Triton and bf16/fp16/fp32; got device {device}, dtype {dtype}: "
                         f"use kernels='torch' or 'auto'")
    return can if kernels == "auto" else kernels == "fused"


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
                 dtype: torch.dtype = torch.float32, kernels: str = "auto") -> LlamaModel:
    """A target model with seeded random weights on ``device`` in ``dtype`` (weights are drawn in float32);
    ``kernels`` picks fused Triton or plain torch elementwise kernels (:func:`resolve_kernels`)."""
    with torch.device(device):
        model = LlamaModel(cfg)
    init_random_(model, seed)
    model = model.to(dtype).eval().requires_grad_(False)
    model.fused = resolve_kernels(kernels, device, dtype)
    return model


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
    draft = draft.to(dtype).eval().requires_grad_(False)
    draft.fused = target.fused
    return draft

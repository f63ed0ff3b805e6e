"""Model and engine configuration for the reference engine.

Three presets: :meth:`ModelConfig.medium` (the H200 benchmark's default: ~1.7 B parameters, big enough
that verifying 16 tokens per sequence costs real compute, see :mod:`bench.engine.costs`),
:meth:`ModelConfig.small` (hidden 2048: at this size a step is bound by kernel count, not by the
model, and speculation wins at every batch size), and :meth:`ModelConfig.tiny`, which runs in well under
a second per step on a CPU (CI and the eager-twin demo).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP.

    Args:
        vocab_size: tokens in the vocabulary.
        hidden_size: width of the residual stream.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention; must divide ``num_heads``).
        head_dim: width of one head.
        intermediate_size: width of the SwiGLU MLP.
        rope_theta: rotary embedding base.
        residual_scale: scale of each layer's output projections at init. Random weights with a small
            residual scale keep the logits dominated by the token embedding, so a cheap draft can
            agree with the target often enough to be a useful speculative draft.
        logit_scale: std of the logits at init. Real LMs are confident; a large scale gives random
            weights peaked next-token distributions, so a draft tree grows deep rather than wide.
        max_positions: the largest position the rotary table covers.
    """

    vocab_size: int = 4096
    hidden_size: int = 2048
    num_layers: int = 8
    num_heads: int = 16
    num_kv_heads: int = 4
    head_dim: int = 128
    intermediate_size: int = 5632
    rope_theta: float = 10000.0
    residual_scale: float = 0.08
    logit_scale: float = 8.0
    max_positions: int = 4096

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @classmethod
    def small(cls) -> "ModelConfig":
        """Shaped like a small real model: hidden 2048, 16 heads (4 KV heads), 8 layers, vocab 4096."""
        return cls()

    @classmethod
    def medium(cls) -> "ModelConfig":
        """Llama-3-8B's layer shape (hidden 4096, 32 heads, MLP 14336) with 8 layers and 4 KV heads: 1.75 B
        parameters, 3.5 GB in bf16. Plain decode reads all weights per step (weights-bound up to ~184
        tokens per step on an H200); a verify step of 16 tokens x C sequences turns compute-bound near
        C = 12, which is what makes speculation lose at large batch sizes."""
        return cls(hidden_size=4096, num_heads=32, num_kv_heads=4, intermediate_size=14336)

    @classmethod
    def tiny(cls) -> "ModelConfig":
        """A CPU-sized model for tests and the eager-twin demo."""
        return cls(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   intermediate_size=128)

    def with_layers(self, num_layers: int) -> "ModelConfig":
        """The same shape with another layer count (the draft is a one-layer copy)."""
        return replace(self, num_layers=num_layers)


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: a draft tree of ``topk`` x ``steps`` candidates, verified as
    ``num_draft_tokens`` tokens per sequence (the root, i.e. the last committed token, plus the best
    ``num_draft_tokens - 1`` tree nodes by cumulative draft log-probability, as EAGLE does).

    Args:
        topk: children expanded per beam node, and beam width per level.
        steps: draft forward passes per speculative step (tree depth).
        num_draft_tokens: tokens per sequence in the verify step, root included.
        draft_layers: layers of the draft model (a noisy copy of the target's first layers).
        draft_noise: relative std of the Gaussian noise added to the draft's copied weights; larger
            noise lowers the acceptance rate.
        draft_select: how each draft level picks its candidates and next beam: ``"torch"`` ops, one
            ``"fused"`` Triton kernel per level (:mod:`bench.engine.draft_select`; CUDA, or Triton's
            interpreter; an error elsewhere), or ``"auto"``, the default: the fused kernel on CUDA, the
            torch ops elsewhere. The same switch covers the tree's selection and the greedy acceptance
            (:mod:`bench.engine.tree_kernels`). The fused path was measured faster on the H200 (run X in
            bench/RESULTS_HISTORY.md, C = 1: a speculative step took 2.071 ms with it, 2.289 ms with the torch ops).
    """

    topk: int = 4
    steps: int = 4
    num_draft_tokens: int = 16
    draft_layers: int = 1
    draft_noise: float = 0.05
    draft_select: str = "auto"

    def __post_init__(self) -> None:
        candidates = self.topk + (self.steps - 1) * self.topk * self.topk
        if not 2 <= self.num_draft_tokens <= candidates + 1:
            raise ValueError(f"num_draft_tokens must be in [2, {candidates + 1}] for topk={self.topk}, "
                             f"steps={self.steps}; got {self.num_draft_tokens}")
        if self.topk < 1 or self.steps < 1:
            raise ValueError(f"topk and steps must be >= 1, got topk={self.topk}, steps={self.steps}")

    @property
    def window(self) -> int:
        """Committed tokens the first draft pass re-reads: enough to cover one step's accepted tokens."""
        return self.steps + 1


def dtype_from_name(name: str) -> torch.dtype:
    """``"bf16"``/``"bfloat16"``, ``"fp16"``, ``"fp32"``/``"float32"`` -> the torch dtype."""
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
             "fp32": torch.float32, "float32": torch.float32}
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(table)}") from None


def tier_modes(spec: SpecConfig, shorter: Sequence[SpecConfig] = ()) -> dict[str, SpecConfig]:
    """The engine's speculative tiers by mode name, longest draft first: ``"verify"`` for ``spec``, then
    ``"verify_<num_draft_tokens>"`` for each of the ``shorter`` tiers (e.g. ``verify_8``, ``verify_4``).

    The tiers share one draft model, so they must agree on its layers, noise and selection kernels; each carries
    fewer draft tokens than the one before."""
    tiers = {"verify": spec}
    before = spec
    for tier in shorter:
        if (tier.draft_layers, tier.draft_noise, tier.draft_select) != (spec.draft_layers, spec.draft_noise,
                                                                       spec.draft_select):
            raise ValueError(f"tier {tier} differs from the first tier in draft_layers, draft_noise or draft_select: "
                             f"every tier drafts with the one draft model; give them the first tier's values")
        if tier.num_draft_tokens >= before.num_draft_tokens:
            raise ValueError(f"tier topk={tier.topk} steps={tier.steps} carries {tier.num_draft_tokens} draft tokens, "
                             f"not fewer than the tier before it ({before.num_draft_tokens}): list tiers longest "
                             f"draft first")
        tiers[f"verify_{tier.num_draft_tokens}"] = before = tier
    return tiers

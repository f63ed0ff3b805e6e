"""What a step costs: FLOPs, bytes and the roofline time, from the model shape alone.

The decode-loop benchmark only shows the real regime (speculation wins at small batch sizes and loses at
large ones) if a verify step's extra tokens cost real time. This module says when they do. Every
forward of a step is counted separately, as ``max(flops / peak, bytes / bandwidth)``:

* FLOPs: ``2 x linear parameters x tokens`` (the LM head only on the tokens whose logits the step
  uses), plus attention, ``4 x heads x head_dim x key_len`` per token and layer.
* bytes: every linear weight once per forward (a small-M GEMM streams its weights), plus each
  sequence's keys and values once per layer (an ideal attention kernel; the engine's plain-torch
  gather moves them about three times, see :mod:`bench.engine.attention`).

A plain step is one target forward of 1 token per sequence. A speculative step is the draft's
``steps`` forwards (``window`` tokens per sequence, then ``topk`` per sequence per level) and one
target forward of ``num_draft_tokens`` per sequence. With ``A`` tokens committed per verify step,
speculation wins while ``A x t_plain(C) > t_spec(C)``. On the roofline a GEMM turns compute-bound at
``peak / bandwidth`` (~184 on an H200) tokens, so verify (16 C tokens) does near C = 12, while plain
decode stays weights-bound to C = 128: the crossover sits near ``184 x A / 16`` sequences, lowered
further by the draft and by per-kernel overheads (which the roofline leaves out).
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig, SpecConfig

H200_PEAK_FLOPS = 790e12  # dense bf16 tensor-core peak
H200_BANDWIDTH = 4.3e12   # HBM3e, bytes/s

# ``peak`` and ``bandwidth`` by a substring of the name CUDA gives the GPU. A roofline drawn with another GPU's
# figures judges the wrong machine: an H100 timed against the H200's 4.3 TB/s reads 1.6x its roofline at C = 1 where
# it is within 1.3x of its own (run CH). The H100 SXM (same compute die, so the same peak) streams 3.35 TB/s on its
# datasheet against the H200's 4.8: scaled alike, 3.0 TB/s.
DEVICE_ROOFS = {
    "H200": {"peak": H200_PEAK_FLOPS, "bandwidth": H200_BANDWIDTH},
    "H100 80GB HBM3": {"peak": H200_PEAK_FLOPS, "bandwidth": 3.0e12},  # the SXM card's name (runs CB-CJ)
}


def device_roof(device_name: str) -> dict[str, float] | None:
    """The ``peak`` and ``bandwidth`` keywords of :func:`forward_cost` for the GPU CUDA names ``device_name``
    (``torch.cuda.get_device_name()``); None for a GPU without figures here (draw no roofline for it)."""
    return next((dict(hw) for key, hw in DEVICE_ROOFS.items() if key in device_name), None)


@dataclass(frozen=True)
class Cost:
    """FLOPs, bytes and roofline seconds of one or more forwards (``+`` sums them)."""

    flops: float
    bytes: float
    seconds: float

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.bytes + other.bytes, self.seconds + other.seconds)


def layer_linear_params(cfg: ModelConfig) -> int:
    """Weights of one decoder layer's four projections (qkv, o, gate_up, down)."""
    q, kv, h, m = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return h * (q + 2 * kv) + q * h + h * 2 * m + m * h


def total_params(cfg: ModelConfig) -> int:
    """Every parameter of the model: layers (projections and two norms), embedding, final norm, LM head."""
    layer = layer_linear_params(cfg) + 2 * cfg.hidden_size
    return cfg.num_layers * layer + 2 * cfg.vocab_size * cfg.hidden_size + cfg.hidden_size


def attention_flops(cfg: ModelConfig, tokens: int, key_len: int, num_layers: int) -> int:
    """Scores and weighted values of ``tokens`` queries over ``key_len`` keys, in ``num_layers`` layers."""
    return 4 * cfg.num_heads * cfg.head_dim * key_len * tokens * num_layers


def forward_cost(cfg: ModelConfig, num_layers: int, seqs: int, tokens_per_seq: int, logit_tokens_per_seq: int,
                 key_len: int, dtype_bytes: int = 2, peak: float = H200_PEAK_FLOPS,
                 bandwidth: float = H200_BANDWIDTH) -> Cost:
    """One forward of ``num_layers`` layers over ``seqs x tokens_per_seq`` tokens.

    Args:
        cfg: the model shape (``num_layers`` overrides its depth: the draft has one layer).
        seqs, tokens_per_seq: the step's batch.
        logit_tokens_per_seq: tokens per sequence that go through the LM head.
        key_len: keys each token attends over (the engine computes all of its fixed gather width).
        dtype_bytes: bytes per weight and cache element (2 for bf16).
        peak, bandwidth: the device's FLOP/s and bytes/s.
    """
    tokens = seqs * tokens_per_seq
    head = cfg.hidden_size * cfg.vocab_size
    linear = num_layers * layer_linear_params(cfg)
    flops = (2 * linear * tokens + 2 * head * seqs * logit_tokens_per_seq
             + attention_flops(cfg, tokens, key_len, num_layers))
    kv_bytes = 2 * seqs * key_len * cfg.num_kv_heads * cfg.head_dim * dtype_bytes * num_layers
    nbytes = (linear + head) * dtype_bytes + kv_bytes
    return Cost(flops, nbytes, max(flops / peak, nbytes / bandwidth))


def plain_step(cfg: ModelConfig, seqs: int, key_len: int, **hw) -> Cost:
    """A plain decode step: one target forward of 1 token per sequence."""
    return forward_cost(cfg, cfg.num_layers, seqs, 1, 1, key_len, **hw)


def spec_step(cfg: ModelConfig, spec: SpecConfig, seqs: int, key_len: int, **hw) -> Cost:
    """A speculative step: the draft's tree passes, then the target's verify forward."""
    n = spec.num_draft_tokens
    cost = forward_cost(cfg, spec.draft_layers, seqs, spec.window, 1, key_len, **hw)
    for _ in range(spec.steps - 1):
        cost = cost + forward_cost(cfg, spec.draft_layers, seqs, spec.topk, spec.topk, key_len, **hw)
    return cost + forward_cost(cfg, cfg.num_layers, seqs, n, n, key_len + n, **hw)


def roofline_table(cfg: ModelConfig, spec: SpecConfig, concurrency: list[int], key_len: int, **hw) -> str:
    """Per C: GFLOP and GB of a plain and a speculative step, their roofline times, and the tokens a
    verify step must commit per sequence for speculation to break even (``t_spec / t_plain``)."""
    lines = [f"roofline (no kernel overheads), key length {key_len}:",
             f"{'C':>4} {'plain GFLOP':>11} {'GB':>5} {'ms':>6} {'spec GFLOP':>11} {'GB':>5} {'ms':>6} {'break-even A':>12}"]
    for c in concurrency:
        p, s = plain_step(cfg, c, key_len, **hw), spec_step(cfg, spec, c, key_len, **hw)
        lines.append(f"{c:>4} {p.flops / 1e9:>11.0f} {p.bytes / 1e9:>5.2f} {p.seconds * 1e3:>6.2f} "
                     f"{s.flops / 1e9:>11.0f} {s.bytes / 1e9:>5.2f} {s.seconds * 1e3:>6.2f} {s.seconds / p.seconds:>12.2f}")
    return "\n".join(lines)

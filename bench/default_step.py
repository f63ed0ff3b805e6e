"""The benchmark's embedded default step: a small transformer-style decode step over SGLang's decode inputs.

Six inputs, int64 and int32, as SGLang's runner stages them for a decode or verify step: ``input_ids``,
``positions``, ``out_cache_loc`` (int64, per token), ``out_cache_loc_swa`` (int32, per token; SGLang's
sliding-window cache location), ``seq_lens`` (int32, per sequence) and ``req_pool_indices`` (int64, per
sequence). The step embeds the tokens, writes a KV stand-in at ``out_cache_loc``, attends over a fixed
window of each request's cached rows masked by ``seq_lens``, and returns logits and greedy tokens.

A user's own step plugs in the same way: a factory ``make(device, max_tokens) -> BenchStep``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import graphpool as gp


@dataclass
class BenchStep:
    """What the benchmark needs of a step: its inputs, the step function, a sampler of real inputs, and
    which outputs have rows (``pool.capture(..., outputs=...)``)."""

    inputs: list[gp.StepInput]
    step_fn: Callable[[gp.StepBatch], object]
    sample: Callable[[gp.Mode, int], dict[str, torch.Tensor]]
    outputs: object = None


def make(device: torch.device, max_tokens: int, hidden: int = 512, vocab: int = 8192, window: int = 64,
         layers: int = 2, dtype: torch.dtype | None = None) -> BenchStep:
    """The default step, sized for ``max_tokens`` token rows per step (bf16 on CUDA, else float32)."""
    g = torch.Generator().manual_seed(0)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)

    def param(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / shape[0] ** 0.5).to(device, dtype)

    num_slots = max_tokens * 2 + window + 1   # slot 0 is the dummy slot padded rows write to
    max_reqs = 512
    embed, lm_head = param(vocab, hidden), param(hidden, vocab)
    weights = [(param(hidden, 3 * hidden), param(hidden, hidden)) for _ in range(layers)]
    kv = torch.zeros(layers, num_slots, hidden, dtype=dtype, device=device)
    swa = torch.zeros(num_slots, dtype=dtype, device=device)
    req_to_token = torch.randint(1, num_slots, (max_reqs, window), generator=g).to(device)
    inputs = [
        gp.StepInput("input_ids", torch.int64, "token", fill=0),
        gp.StepInput("positions", torch.int64, "token", fill=0),
        gp.StepInput("out_cache_loc", torch.int64, "token", fill=0),
        gp.StepInput("out_cache_loc_swa", torch.int32, "token", fill=0),
        gp.StepInput("seq_lens", torch.int32, "seq", fill=1),
        gp.StepInput("req_pool_indices", torch.int64, "seq", fill=0),
    ]
    cols = torch.arange(window, device=device)

    def step(batch: gp.StepBatch) -> dict[str, torch.Tensor]:
        x, tps = batch.inputs, batch.mode.tokens_per_seq
        h = embed[x["input_ids"]] * (1.0 + (x["positions"] % 7).to(dtype)[:, None] * 0.01)
        visible = (cols[None, :] < x["seq_lens"][:, None]).repeat_interleave(tps, 0)        # [T, W]
        rows = req_to_token[x["req_pool_indices"]].repeat_interleave(tps, 0)                 # [T, W]
        for layer, (w_qkv, w_o) in enumerate(weights):
            q, k, v = (torch.nn.functional.rms_norm(h, (hidden,)) @ w_qkv).chunk(3, dim=-1)
            kv[layer].index_copy_(0, x["out_cache_loc"], k)
            keys = kv[layer][rows]                                                            # [T, W, H]
            scores = (keys @ q[:, :, None]).squeeze(-1).float().masked_fill(~visible, -1e9)
            h = h + (torch.softmax(scores, -1).to(dtype)[:, :, None] * keys).sum(1) @ w_o + v
        swa.index_copy_(0, x["out_cache_loc_swa"].long(), h[:, 0])
        logits = h @ lm_head
        return {"logits": logits, "next_tokens": logits.argmax(-1)}

    def sample(mode: gp.Mode, bs: int) -> dict[str, torch.Tensor]:
        tokens = bs * mode.tokens_per_seq
        loc = torch.randperm(num_slots - 1, device=device)[:tokens] + 1
        return {
            "input_ids": torch.randint(0, vocab, (tokens,), device=device),
            "positions": torch.randint(0, 4096, (tokens,), device=device),
            "out_cache_loc": loc,
            "out_cache_loc_swa": loc.to(torch.int32),
            "seq_lens": torch.randint(1, window + 1, (bs,), device=device, dtype=torch.int32),
            "req_pool_indices": torch.randint(0, max_reqs, (bs,), device=device),
        }

    return BenchStep(inputs, step, sample, outputs="token")  # logits and next_tokens: one row per token

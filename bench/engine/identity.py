"""The greedy identity check: speculation, dynamic speculation and every speculation tier commit exactly the
tokens plain decoding does.

Greedy speculative decoding is lossless by construction, so in float32 (where batched and unbatched
arithmetic agree far below the gaps between logits) every request's output must be token-identical
across plain decode, speculation always on, dynamic speculation that switches modes mid-request, each
shorter tier always on, and a tier schedule that moves through every tier as the batch drains.
A difference means a bug in the tree, the acceptance, the KV bookkeeping or the attention metadata. In
bf16 near-ties break differently in differently shaped steps, so the check runs in float32: with the
torch attention, or with FlashInfer's metadata and the torch reference kernel (FlashInfer's own kernels
take bf16/fp16 only), which checks every in-graph metadata builder the FlashInfer path uses.
"""
from __future__ import annotations

import logging
import time
from typing import Sequence

import torch

from graphpool import SpeculationPolicy, Tier, TierSchedule

from .config import ModelConfig, SpecConfig
from .harness import build
from .engine import Engine
from .loop import DecodeLoop, fixed_tier_variants, make_requests

log = logging.getLogger(__name__)


def drain_schedule(engine: Engine) -> TierSchedule:
    """A schedule that takes every tier of ``engine`` as a batch drains: the longest draft at 1 sequence, the next
    at 2, ..., plain decode above (for runs that end with the batch thinning out one request at a time)."""
    spec = [Tier(mode, off_above=i + 1) for i, mode in enumerate(engine.tiers)]
    return TierSchedule(spec + [Tier("decode")])


def greedy_identity(cfg: ModelConfig, spec: SpecConfig, attention: str, device: str, kernels: str = "auto",
                    concurrency: int = 4, n_requests: int = 8, prompt_len: int = 32, min_new: int = 24,
                    max_new: int = 40, run_ahead: int = 1, seed: int = 0, tiers: Sequence[SpecConfig] = ()) -> dict:
    """Serve the same requests on a float32 engine to completion, plain, spec, dynamic (switching at half the
    concurrency) and, with shorter ``tiers``, each tier always on and the :func:`drain_schedule` (at a
    concurrency above the tier count, so the batch starts on plain decode); report whether every output matches
    plain decoding.

    Returns:
        ``{"ok", "requests", "spec_identical", "dynamic_identical", "switched", "mean_accept", "graph_misses",
        "seconds", "attention"}``, and with tiers ``"identical"`` (requests identical to plain, per run),
        ``"tier_steps"`` (the schedule's steps per mode) and ``"catch_ups"`` (its rows caught up).
    """
    started = time.perf_counter()
    concurrency = max(concurrency, len(tiers) + 2)
    sizes = sorted({1, 2, concurrency})
    engine, pool = build(cfg, spec, sizes, prompt_len, max_new, device, torch.float32, seed=seed,
                         attention=attention, kernels=kernels, tiers=tiers)
    reqs = make_requests(n_requests, prompt_len, cfg.vocab_size, min_new, max_new, seed + 11)
    threshold = max(1, concurrency // 2)
    runs = {
        "plain": DecodeLoop(engine, pool, "plain", run_ahead=run_ahead).run(reqs, concurrency),
        "spec": DecodeLoop(engine, pool, "spec", run_ahead=run_ahead).run(reqs, concurrency),
        "dynamic": DecodeLoop(engine, pool, "dynamic", SpeculationPolicy(threshold, max(1, threshold - 1)),
                              run_ahead=run_ahead).run(reqs, concurrency),
    }
    for variant in fixed_tier_variants(engine):
        runs[variant] = DecodeLoop(engine, pool, variant, run_ahead=run_ahead).run(reqs, concurrency)
    if tiers:
        runs["tiers"] = DecodeLoop(engine, pool, "tiers", drain_schedule(engine), run_ahead=run_ahead).run(
            reqs, concurrency)
    plain = runs["plain"].outputs
    same = {v: sum(runs[v].outputs.get(r) == out for r, out in plain.items()) for v in runs if v != "plain"}
    dyn = runs["dynamic"].steps
    result = {"attention": engine.attention, "requests": len(plain), "spec_identical": same["spec"],
              "dynamic_identical": same["dynamic"], "switched": bool(dyn["decode"] and dyn["verify"]),
              "mean_accept": runs["spec"].mean_accept,
              "graph_misses": sum(r.graph_misses for r in runs.values()), "seconds": time.perf_counter() - started}
    if tiers:
        result.update(identical=same, tier_steps={m: n for m, n in runs["tiers"].steps.items() if n},
                      catch_ups=runs["tiers"].catch_ups)
    result["ok"] = (len(plain) == n_requests and all(n == n_requests for n in same.values())
                    and result["graph_misses"] == 0)
    del engine, pool
    return result

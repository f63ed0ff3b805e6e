"""The greedy identity check: speculation and dynamic speculation commit exactly the tokens plain decoding does.

Greedy speculative decoding is lossless by construction, so in float32 (where batched and unbatched
arithmetic agree far below the gaps between logits) every request's output must be token-identical
across plain decode, speculation always on, and dynamic speculation that switches modes mid-request.
A difference means a bug in the tree, the acceptance, the KV bookkeeping or the attention metadata. In
bf16 near-ties break differently in differently shaped steps, so the check runs in float32: with the
torch attention, or with FlashInfer's metadata and the torch reference kernel (FlashInfer's own kernels
take bf16/fp16 only), which checks every in-graph metadata builder the FlashInfer path uses.
"""
from __future__ import annotations

import logging
import time

import torch

from graphpool import SpeculationPolicy

from .config import ModelConfig, SpecConfig
from .harness import build
from .loop import DecodeLoop, make_requests

log = logging.getLogger(__name__)


def greedy_identity(cfg: ModelConfig, spec: SpecConfig, attention: str, device: str, kernels: str = "auto",
                    concurrency: int = 4, n_requests: int = 8, prompt_len: int = 32, min_new: int = 24,
                    max_new: int = 40, run_ahead: int = 1, seed: int = 0) -> dict:
    """Serve the same requests three ways on a float32 engine (plain, spec, dynamic switching at half the
    concurrency) to completion; report whether every output matches plain decoding.

    Returns:
        ``{"ok", "requests", "spec_identical", "dynamic_identical", "switched", "mean_accept", "graph_misses",
        "seconds", "attention"}``.
    """
    started = time.perf_counter()
    sizes = sorted({1, 2, concurrency})
    engine, pool = build(cfg, spec, sizes, prompt_len, max_new, device, torch.float32, seed=seed,
                         attention=attention, kernels=kernels)
    reqs = make_requests(n_requests, prompt_len, cfg.vocab_size, min_new, max_new, seed + 11)
    threshold = max(1, concurrency // 2)
    runs = {
        "plain": DecodeLoop(engine, pool, "plain", run_ahead=run_ahead).run(reqs, concurrency),
        "spec": DecodeLoop(engine, pool, "spec", run_ahead=run_ahead).run(reqs, concurrency),
        "dynamic": DecodeLoop(engine, pool, "dynamic", SpeculationPolicy(threshold, max(1, threshold - 1)),
                              run_ahead=run_ahead).run(reqs, concurrency),
    }
    plain = runs["plain"].outputs
    same = {v: sum(runs[v].outputs.get(r) == out for r, out in plain.items()) for v in ("spec", "dynamic")}
    dyn = runs["dynamic"].steps
    result = {"attention": engine.attention, "requests": len(plain), "spec_identical": same["spec"],
              "dynamic_identical": same["dynamic"], "switched": bool(dyn["decode"] and dyn["verify"]),
              "mean_accept": runs["spec"].mean_accept,
              "graph_misses": sum(r.graph_misses for r in runs.values()), "seconds": time.perf_counter() - started}
    result["ok"] = (len(plain) == n_requests and same["spec"] == same["dynamic"] == n_requests
                    and result["graph_misses"] == 0)
    del engine, pool
    return result

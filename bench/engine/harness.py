"""One call that builds an engine and its captured GraphPool (used by the benchmark, demo and tests)."""
from __future__ import annotations

import logging
import time
from typing import Sequence

import torch

from graphpool import GraphPool

from .config import ModelConfig, SpecConfig
from .engine import Engine
from .parallel import TensorParallel

log = logging.getLogger(__name__)

def build(cfg: ModelConfig, spec: SpecConfig, batch_sizes: list[int], prompt_len: int, max_new_tokens: int,
          device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, backend: str = "auto",
          prefill_batch_sizes: list[int] | None = None, seed: int = 0, progress: bool = False,
          tp: TensorParallel | None = None, attention: str = "torch",
          kernels: str = "auto", tiers: Sequence[SpecConfig] = ()) -> tuple[Engine, GraphPool]:
    """An :class:`Engine` with ``max(batch_sizes)`` request rows and a pool holding decode, verify
    and prefill graphs for every size (prefill: sizes up to 8 unless given), captured. With ``tp``, this
    rank's shard of the engine, and graphs holding the collectives (every rank captures the same keys in
    the same order: call it on every rank with the same arguments). ``attention`` and ``kernels``: see
    :class:`Engine`; ``tiers``: shorter speculation tiers, a verify mode each in the same pool."""
    prefill = prefill_batch_sizes or [s for s in batch_sizes if s <= 8] or [min(batch_sizes)]
    engine = Engine(cfg, spec, max(batch_sizes), prompt_len, max_new_tokens, device, dtype, seed, tp=tp,
                    attention=attention, kernels=kernels, tiers=tiers)
    pool = engine.build_pool(sorted(batch_sizes), sorted(prefill), backend)
    started = time.perf_counter()
    prepare = None
    if tp is not None:
        tp.track(pool)
        prepare = tp.guard(prepare)
    pool.capture(engine.step, prepare=prepare, progress=progress, outputs=engine.OUTPUTS)
    log.info("captured %d graphs in %.1f s (%s backend)", len(pool.graph_keys), time.perf_counter() - started,
             pool.stats.backend)
    return engine, pool

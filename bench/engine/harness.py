"""One call that builds an engine and its captured GraphPool (used by the benchmark, demo and tests)."""
from __future__ import annotations

import logging
import time

import torch

from graphpool import GraphPool

from .config import ModelConfig, SpecConfig
from .engine import Engine

log = logging.getLogger(__name__)


def build(cfg: ModelConfig, spec: SpecConfig, batch_sizes: list[int], prompt_len: int, max_new_tokens: int,
          device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, backend: str = "auto",
          prefill_batch_sizes: list[int] | None = None, seed: int = 0, progress: bool = False) -> tuple[Engine, GraphPool]:
    """An :class:`Engine` with ``max(batch_sizes)`` request rows and a pool holding decode, verify
    and prefill graphs for every size (prefill: sizes up to 8 unless given), captured."""
    prefill = prefill_batch_sizes or [s for s in batch_sizes if s <= 8] or [min(batch_sizes)]
    engine = Engine(cfg, spec, max(batch_sizes), prompt_len, max_new_tokens, device, dtype, seed)
    pool = engine.build_pool(sorted(batch_sizes), sorted(prefill), backend)
    started = time.perf_counter()
    pool.capture(engine.step, progress=progress)
    log.info("captured %d graphs in %.1f s (%s backend)", len(pool.graph_keys), time.perf_counter() - started,
             pool.stats.backend)
    return engine, pool

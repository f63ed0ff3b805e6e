"""Timing every way of feeding a graph on every (mode, batch size) of a step: :func:`benchmark`.

Methods (CUDA; on a CPU only ``graphpool`` and ``eager`` run, on the eager twin: a smoke run of the code
path, not a speed measurement):

  floor            the same step's graph without staging (a pool with ``staging="torch"``), replayed with
                   ``pool.graph(mode, bs).replay()`` on buffers staged once beforehand: the least any
                   method can cost, on the host and on the GPU
  graphpool        ``pool.stage`` + ``pool.replay``: validate, route, write the ring row; the graph's
                   first node stages
  graphpool-run    the same in one call, ``pool.run`` (what a decode loop calls; the overhead judged)
  graphpool+prep   ring staging as its own small graph, then a (no-op) prepare hook, then the step graph
  triton-launch    the same staging kernel launched eagerly from Python, then the step graph
  sglang           SGLang's way: tail fills when padded, then a slice ``copy_`` per buffer
  foreach          tail fills, then one ``torch._foreach_copy_`` per dtype group (SGLang 0.5.12's batching)
  graph-pad        the same grouped copies of the real rows plus a device-side count; the graph pads
  eager            the step run eagerly, no graph

Each method is timed exactly ``iters`` steps per key, in rounds of :data:`ROUND` steps that take turns, so
drift in the machine's speed reaches every method alike.
"""
from __future__ import annotations

import importlib
import logging
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

import graphpool as gp

from .methods import EagerTritonStage, padding_in_graph, sglang_style
from .step import BenchStep, check_step, sample_checked

log = logging.getLogger("graphpool.bench")
ROUND = 10  # steps of one method in a row: its code stays in the CPU caches, as in a decode loop
Method = tuple[Callable[[], object], Callable[[object], object]]  # (stage, replay)


@dataclass
class BenchResult:
    """What :func:`benchmark` measured.

    Attributes:
        rows: one dict per (mode, bs, method): host and GPU microseconds (see :mod:`graphpool.bench.report`),
            capture ms and graph MiB of the key, and ``token_match`` (the check output against eager).
        env: what ran (torch, device, Triton, iterations, misses, graph MiB in all).
        modes, sizes: the modes and captured batch sizes.
        stats: the graphpool pool's per-graph table (:meth:`PoolStats.table`).
    """

    rows: list[dict]
    env: dict
    modes: list[gp.Mode]
    sizes: list[int]
    stats: str = ""
    cuda: bool = field(default=False)


def round_sizes(iters: int, block: int = ROUND) -> list[int]:
    """Steps per round for exactly ``iters`` timed steps: full rounds of ``block``, then the rest."""
    return [block] * (iters // block) + ([iters % block] if iters % block else [])


def timed(methods: dict[str, Method], iters: int, warmup: int, cuda: bool) -> dict[str, dict[str, Any]]:
    """Median host us of stage and replay (GPU idle at the start of each step) and median GPU us of the
    step, per method, over exactly ``iters`` steps each. Methods take turns in rounds of :data:`ROUND` steps
    (the last one shorter when ``iters`` is not a multiple), so drift in the machine's speed (clocks,
    neighbours) reaches all of them alike and their medians compare; ``host_rounds_us`` keeps each round's
    median host us, for comparisons paired by round, and ``steps_timed`` the host-timed steps."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        for stage, replay in methods.values():
            replay(stage())
    samples: dict[str, tuple[list, list, list]] = {name: ([], [], []) for name in methods}
    rounds: dict[str, list[float]] = {name: [] for name in methods}  # per round: median host us of its block
    b2b_us: dict[str, list[float]] = {}
    b2b_host: dict[str, list[float]] = {}
    start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (None, None)
    for block in round_sizes(iters):
        for name, (stage, replay) in methods.items():
            stage_us, replay_us, gpu_us = samples[name]
            for _ in range(block):
                sync()
                t0 = time.perf_counter()
                s = stage()
                t1 = time.perf_counter()
                replay(s)
                t2 = time.perf_counter()
                stage_us.append((t1 - t0) * 1e6)
                replay_us.append((t2 - t1) * 1e6)
            rounds[name].append(statistics.median(a + b for a, b in zip(stage_us[-block:], replay_us[-block:])))
            for _ in range(block if cuda else 0):  # the same steps again, timed on the GPU
                sync()
                start.record()
                replay(stage())
                end.record()
                end.synchronize()
                gpu_us.append(start.elapsed_time(end) * 1e3)
            if cuda:  # back to back: the host stays ahead, so the events time the GPU's own work per step
                sync()
                for _ in range(2):  # untimed lead-in: the timed steps start with the queue already busy, as in a loop
                    replay(stage())
                start.record()
                host = b2b_host.setdefault(name, [])
                for _ in range(block):  # the host time of each, as a decode loop sees it (GPU busy, caches warm)
                    t0 = time.perf_counter()
                    replay(stage())
                    host.append((time.perf_counter() - t0) * 1e6)
                end.record()
                end.synchronize()
                b2b_us.setdefault(name, []).append(start.elapsed_time(end) * 1e3 / block)
    med = statistics.median
    return {name: {"stage_us": med(st), "replay_us": med(rp), "host_us": med(st) + med(rp),
                   "gpu_us": med(gp_) if gp_ else float("nan"),
                   "gpu_b2b_us": med(b2b_us[name]) if name in b2b_us else float("nan"),
                   "host_b2b_us": med(b2b_host[name]) if name in b2b_host else float("nan"),
                   "host_rounds_us": rounds[name], "steps_timed": len(st)}
            for name, (st, rp, gp_) in samples.items()}


def build_pools(step: BenchStep, modes: Sequence[gp.Mode], sizes: Sequence[int], device: torch.device,
                progress: bool = True) -> tuple[dict[str, gp.GraphPool], dict]:
    """The captured pools every method replays (CPU: graphpool's alone, on the eager twin), and the
    SGLang-style stagers over the torch-staged pool."""
    cuda = device.type == "cuda"
    pools = {"graphpool": gp.GraphPool(modes, step.inputs, sizes, device=device)}
    if cuda:
        pools["graphpool+prep"] = gp.GraphPool(modes, step.inputs, sizes, device=device, staging="ring")
        pools["plain"] = gp.GraphPool(modes, step.inputs, sizes, device=device, staging="torch")
        pools["graph-pad"] = gp.GraphPool(modes, step.inputs, sizes, device=device, staging="torch")
    pad_count = torch.zeros((), dtype=torch.int64, device=device)  # real sequences, for graph-pad's graphs
    for name, pool in pools.items():
        log.info("capturing the %s pool ...", name)
        fn = padding_in_graph(step.step_fn, step.inputs, pad_count) if name == "graph-pad" else step.step_fn
        pool.capture(fn, prepare=(lambda b, n: None) if name == "graphpool+prep" else None, outputs=step.outputs,
                     progress=progress)
    extras: dict = {}
    if cuda:
        extras = {"sglang": sglang_style(pools["plain"], step.inputs, grouped=False),
                  "foreach": sglang_style(pools["plain"], step.inputs, grouped=True),
                  "pad_copy": sglang_style(pools["graph-pad"], step.inputs, grouped=True, fills=False),
                  "pad_count": pad_count, "triton": EagerTritonStage(pools["plain"], step.inputs)}
    return pools, extras


def bench_key(pools: dict[str, gp.GraphPool], extras: dict, step: BenchStep, mode: gp.Mode, bs: int, iters: int,
              warmup: int, cuda: bool) -> dict[str, dict[str, Any]]:
    """Every method timed on one key (``bs`` real sequences of ``mode``, the graph's own size)."""
    inputs = sample_checked(step, mode, bs)
    name = mode.name
    ring_pool = pools["graphpool"]
    eager_batch = gp.StepBatch(mode, bs, bs * mode.tokens_per_seq, inputs, captured=False)
    methods: dict[str, Method] = {
        "graphpool": (lambda: ring_pool.stage(name, **inputs), ring_pool.replay),
        "eager": (lambda: None, lambda _: step.step_fn(eager_batch)),
    }
    if cuda:
        prep_pool, plain, pad_pool = pools["graphpool+prep"], pools["plain"], pools["graph-pad"]
        graph, pad_graph = plain.graph(name, bs), pad_pool.graph(name, bs)
        plain.run(name, **inputs)  # stage once: the floor replays on buffers that already hold the step
        sglang, foreach = extras["sglang"], extras["foreach"]
        pad_copy, pad_count = extras["pad_copy"], extras["pad_count"]
        triton_stage = extras["triton"].stager(mode, bs, inputs)

        def copy_and_count() -> None:
            pad_copy(mode, bs, inputs)
            pad_count.fill_(bs)
        methods.update({
            "floor": (lambda: None, lambda _: graph.replay()),
            "graphpool-run": (lambda: None, lambda _: ring_pool.run(name, **inputs)),
            "graphpool+prep": (lambda: prep_pool.stage(name, **inputs), prep_pool.replay),
            "triton-launch": (triton_stage, lambda _: graph.replay()),
            "sglang": (lambda: sglang(mode, bs, inputs), lambda _: graph.replay()),
            "foreach": (lambda: foreach(mode, bs, inputs), lambda _: graph.replay()),
            "graph-pad": (copy_and_count, lambda _: pad_graph.replay()),
        })
    return timed(methods, iters, warmup, cuda)


def key_stats(pool: gp.GraphPool, mode: str, bs: int) -> gp.KeyStats:
    """The pool's figures for graph (mode, bs)."""
    return next(s for key, s in pool.stats.keys.items() if (key.mode, key.bs) == (mode, bs))


def check_against_eager(pool: gp.GraphPool, step: BenchStep, mode: gp.Mode, bs: int) -> float:
    """Fraction of the check output's values the graph step agrees with eager on (bf16 can break near-ties);
    NaN without a check output."""
    if step.check is None:
        return float("nan")
    inputs = sample_checked(step, mode, bs)
    got = pool.run(mode.name, copy=True, **inputs)[step.check]
    want = step.step_fn(gp.StepBatch(mode, bs, bs * mode.tokens_per_seq, inputs, captured=False))[step.check]
    return (got == want).float().mean().item()


def benchmark(step: BenchStep, modes: Sequence[gp.Mode], batch_sizes: Sequence[int], device: torch.device | str,
              iters: int, warmup: int, progress: bool = True) -> BenchResult:
    """Capture ``step``'s graphs for every (mode, batch size) and time every method on every key.

    Args:
        step: the step (see :class:`BenchStep`); its sampler gives each key's real inputs.
        modes, batch_sizes: the keys (batch sizes captured for every mode).
        device: ``cuda`` (CUDA graphs: every method) or ``cpu`` (the eager twin: graphpool and eager only).
        iters: timed steps per method and key (exactly); warmup: untimed steps per method first.
        progress: log one line per key being timed, and the pools' capture progress.

    Returns:
        The rows and environment (:class:`BenchResult`); nothing is written.

    Raises:
        StepSpecError: the step or its sampler does not fit the contract. ValueError: bad counts.
    """
    check_step(step)
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    device = torch.device(device)
    cuda = device.type == "cuda"
    modes, sizes = list(modes), sorted(batch_sizes)
    for mode in modes:  # a sampler that does not fit is said before minutes of capturing
        sample_checked(step, mode, sizes[0])
    pools, extras = build_pools(step, modes, sizes, device, progress)
    rows: list[dict] = []
    keys = [(m, b) for m in modes for b in sizes]
    for i, (mode, bs) in enumerate(keys, 1):
        if progress:
            log.info("[%d/%d] timing %s bs=%d", i, len(keys), mode.name, bs)
        stats = key_stats(pools["graphpool"], mode.name, bs)
        match = check_against_eager(pools["graphpool"], step, mode, bs)
        for method, r in bench_key(pools, extras, step, mode, bs, iters, warmup, cuda).items():
            rows.append({"mode": mode.name, "bs": bs, "method": method, **r, "capture_ms": stats.capture_s * 1e3,
                         "graph_mib": stats.graph_bytes / 2**20, "token_match": match})
    for mode in modes:  # every real batch size up to the largest captured one must be a graph hit
        for real_bs in range(1, sizes[-1] + 1):
            pools["graphpool"].run(mode.name, **sample_checked(step, mode, real_bs))
    misses = sum(sum(p.stats.misses.values()) for p in pools.values())
    what_ran = (f"CUDA graphs on {torch.cuda.get_device_name(device)}" if cuda else
                "CPU smoke run on graphpool's eager twin (no CUDA graphs): not a speed measurement")
    timed_steps = {r["steps_timed"] for r in rows}  # what was timed per method and key, not merely what was asked
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
           "triton": _version("triton"), "graphpool": gp.__version__, "python": sys.version.split()[0],
           "misses": misses, "runs_on": what_ran,
           "iters": timed_steps.pop() if len(timed_steps) == 1 else sorted(timed_steps), "warmup": warmup,
           "round_steps": ROUND, "graph_mib_total": pools["graphpool"].stats.graph_bytes / 2**20}
    stats_table = pools["graphpool"].stats.table()
    for pool in pools.values():
        pool.close()
    return BenchResult(rows, env, modes, sizes, stats_table, cuda)


def _version(module: str) -> str:
    try:
        return importlib.import_module(module).__version__
    except ImportError:
        return "absent"


__all__ = ["BenchResult", "benchmark", "timed", "round_sizes", "ROUND", "Method"]

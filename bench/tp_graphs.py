"""Graphs under tensor parallelism, per rank: graph memory and the host cost of a step (issue 12).

Every rank builds its shard of the engine, then

1. captures the verify graphs alone into a fresh pool and records the graph memory, releases them;
2. captures decode + verify graphs into a fresh pool (the graphs hold the NCCL collectives) and records the
   graph memory: the ratio to (1) shows whether the decode graphs fit into the verify graphs' blocks
   (target <= 1.10, as on one GPU);
3. with the pool of (2), times ``pool.run`` on the host (validate, route, stage, replay launch: the host
   overhead each rank pays per step) and the step on the GPU (CUDA events), for both modes at a few sizes.

Rank 0 prints one table with a row per rank and writes JSON. On a CPU it runs the tiny model on the eager
twin over gloo (no graph memory: the figures then only show that it runs).

    python bench/tp_graphs.py --tp 2 --out out/tp_graphs
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from bench.decode_loop import FULL_C, PRESETS  # noqa: E402
from bench.engine.config import SpecConfig, dtype_from_name  # noqa: E402
from bench.engine.engine import STEP_INPUTS, Engine  # noqa: E402
from bench.engine.tp_launch import add_arguments as add_tp_arguments, run_ranks  # noqa: E402
from graphpool import GraphPool  # noqa: E402

MEMORY_TARGET = 1.10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    p.add_argument("--size", default="auto", choices=["auto", *PRESETS], help="medium on GPU, tiny on CPU")
    p.add_argument("--dtype", default="auto", help="bf16 on GPU, fp32 on CPU by default")
    p.add_argument("--batch-sizes", default=None, help=f"captured sizes (default GPU {FULL_C}, CPU 1,2,4)")
    p.add_argument("--timed-sizes", default="1,8,32", help="sizes whose steps are timed (those captured)")
    p.add_argument("--iters", type=int, default=200, help="timed steps per (mode, size)")
    p.add_argument("--out", default="out/tp_graphs", help="JSON path prefix")
    add_tp_arguments(p)
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = args.device.startswith("cuda")
    args.size = args.size if args.size != "auto" else ("medium" if gpu else "tiny")
    args.dtype = args.dtype if args.dtype != "auto" else ("bf16" if gpu else "fp32")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else (FULL_C if gpu else [1, 2, 4])
    args.timed_sizes = [b for b in (int(x) for x in args.timed_sizes.split(",")) if b in args.batch_sizes] or \
        [min(args.batch_sizes)]
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _capture(engine: Engine, modes: list[str], sizes: list[int], tp) -> GraphPool:
    pool = GraphPool([m for m in engine.modes() if m.name in modes], STEP_INPUTS, sizes, device=engine.device)
    if tp is not None:
        tp.track(pool)
    pool.capture(engine.step, prepare=tp.guard(None) if tp is not None else None, progress=False,
                 outputs=engine.OUTPUTS)
    return pool


def _release(device: torch.device) -> None:
    gc.collect()  # the last reference to the pool is gone: its graphs are destroyed here
    _sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _time_steps(pool: GraphPool, engine: Engine, mode: str, bs: int, iters: int) -> dict:
    """Host us per ``pool.run`` (median, p90) and GPU us per step, in blocks of 10 steps behind a sync."""
    dev = engine.device
    lens = torch.full((bs,), engine.prompt_len, dtype=torch.int64, device=dev)
    rows = torch.arange(1, bs + 1, dtype=torch.int64, device=dev)
    host, gpu = [], []
    for block in range(max(1, iters // 10) + 1):
        _sync(dev)
        start = torch.cuda.Event(enable_timing=True) if dev.type == "cuda" else None
        if start is not None:
            start.record()
        for _ in range(10):
            t = time.perf_counter()
            pool.run(mode, seq_lens=lens, req_pool_indices=rows)
            if block:  # block 0 warms up
                host.append((time.perf_counter() - t) * 1e6)
        if start is not None and block:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            gpu.append(start.elapsed_time(end) * 1e3 / 10)
    host.sort()
    return {"host_us": statistics.median(host), "host_p90_us": host[int(0.9 * (len(host) - 1))],
            "gpu_us": statistics.median(gpu) if gpu else None}


def measure(tp, args: argparse.Namespace) -> dict:
    """One rank's figures (``tp=None``: the single-process engine)."""
    device = f"cuda:{torch.cuda.current_device()}" if args.device.startswith("cuda") else "cpu"
    preset = PRESETS[args.size]
    engine = Engine(preset.model(), SpecConfig(draft_noise=preset.draft_noise), max(args.batch_sizes),
                    preset.prompt_len, preset.max_new, device, dtype_from_name(args.dtype), 0, tp)
    dev = engine.device
    verify_alone = _capture(engine, ["verify"], args.batch_sizes, tp)
    verify_bytes = verify_alone.stats.graph_bytes
    del verify_alone
    _release(dev)
    pool = _capture(engine, ["decode", "verify"], args.batch_sizes, tp)
    both_bytes = pool.stats.graph_bytes
    timings = {f"{mode} {bs}": _time_steps(pool, engine, mode, bs, args.iters)
               for mode in ("decode", "verify") for bs in args.timed_sizes}
    misses = sum(pool.stats.misses.values())
    del pool
    _release(dev)
    return {"rank": tp.rank if tp is not None else 0, "device": str(dev), "verify_mib": verify_bytes / 2**20,
            "both_mib": both_bytes / 2**20, "ratio": both_bytes / verify_bytes if verify_bytes else None,
            "timings": timings, "misses": misses}


def run(tp, args: argparse.Namespace) -> int:
    mine = measure(tp, args)
    ranks = [mine]
    if tp is not None:
        ranks = [None] * tp.size
        dist.all_gather_object(ranks, mine, group=tp.group)
        if tp.rank:
            return 0
    rows, ok = [], True
    for r in ranks:
        passed = r["ratio"] is None or r["ratio"] <= MEMORY_TARGET
        ok &= passed and r["misses"] == 0
        rows.append(f"rank {r['rank']} ({r['device']}): graph MiB verify alone {r['verify_mib']:.1f}, decode + verify "
                    f"{r['both_mib']:.1f}, ratio " + (f"{r['ratio']:.3f}" if r["ratio"] else "-")
                    + f" -> {'PASS' if passed else 'FAIL'} (target <= {MEMORY_TARGET})")
    head = f"{'rank':>4} {'mode':<7} {'bs':>4} {'host us/run':>12} {'p90':>7} {'GPU us/step':>12}"
    lines = ["host us per pool.run on each rank (validate + route + stage + replay launch; median of "
             f"{args.iters}), GPU us per step (CUDA events)", head]
    for r in ranks:
        for key, t in r["timings"].items():
            mode, bs = key.split()
            gpu = f"{t['gpu_us']:>12.1f}" if t["gpu_us"] is not None else f"{'-':>12}"
            lines.append(f"{r['rank']:>4} {mode:<7} {int(bs):>4} {t['host_us']:>12.1f} {t['host_p90_us']:>7.1f} {gpu}")
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "ranks": ranks, "torch": torch.__version__}, indent=1, default=str))
    print(f"wrote {out}")
    print("\n".join(rows + lines))
    print(f"tp_graphs: {'PASS' if ok else 'FAIL'} (graph memory per rank <= {MEMORY_TARGET} x verify alone, no misses)")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tp > 1:
        backend = "nccl" if args.device.startswith("cuda") else "gloo"
        return run_ranks(run, args.tp, (args,), backend=backend, check=args.tp_check)[0]
    return run(None, args)


if __name__ == "__main__":
    sys.exit(main())

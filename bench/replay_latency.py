"""Replay-latency microbenchmark: what each way of feeding a graph costs per step, per mode and batch size.

For every (mode, bs) it reports capture time and graph bytes, and for each method the host time of
staging and of replay (median over iterations, GPU idle at the start of each, so the host cost is seen
alone), the host time per step again with steps issued back to back (the GPU busy, as in a decode loop),
and the GPU time of the whole step (CUDA events), idle-start and back to back. Methods:

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

On a CPU only graphpool (on its eager twin) and eager run, with fewer iterations and batch sizes (said on
screen): a smoke run of the code path, not a speed measurement.

Usage: ``python bench/replay_latency.py`` (embedded default step), ``--step my_module:make`` for your own
(``make(device, max_tokens) -> bench.default_step.BenchStep``). Writes JSON, CSV and a PNG plot to --out
(default: out/replay_latency in the checkout, ignored by git; recorded runs name bench/results/ explicitly).
"""
from __future__ import annotations

import argparse
import csv
import importlib
import json
import logging
import os
import statistics
import sys
import time
from typing import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script from anywhere
import graphpool as gp  # noqa: E402
from bench import default_step  # noqa: E402
from bench.replay_report import explain, plot, summary  # noqa: E402
from bench.staging_methods import EagerTritonStage, padding_in_graph, sglang_style  # noqa: E402

log = logging.getLogger("replay_latency")
GPU_DEFAULTS = {"iters": 200, "warmup": 20, "batch_sizes": "1,2,4,8,16,32,64"}
CPU_DEFAULTS = {"iters": 10, "warmup": 2, "batch_sizes": "1,2,4,8"}  # the eager twin: a smoke run, < 1 minute


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--modes", default="decode:1,verify:16", help="name:tokens_per_seq list (default %(default)s)")
    p.add_argument("--batch-sizes", default=None,
                   help=f"captured sizes (default GPU {GPU_DEFAULTS['batch_sizes']}, CPU {CPU_DEFAULTS['batch_sizes']})")
    p.add_argument("--iters", type=int, default=None,
                   help=f"timed iterations per method and key (default GPU {GPU_DEFAULTS['iters']}, CPU {CPU_DEFAULTS['iters']})")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"untimed iterations first (default GPU {GPU_DEFAULTS['warmup']}, CPU {CPU_DEFAULTS['warmup']})")
    p.add_argument("--step", default=None, help="module:factory of your own step (default: embedded step)")
    p.add_argument("--out", default=os.path.join(ROOT, "out", "replay_latency"),
                   help="output folder for JSON, CSV and PNG (default: out/replay_latency in the checkout)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu (eager twin)")
    return p.parse_args(argv)


def resolve(args: argparse.Namespace, cuda: bool) -> list[str]:
    """Fill the device-dependent defaults; returns the names of those a CPU run shrank."""
    defaults, shrunk = (GPU_DEFAULTS if cuda else CPU_DEFAULTS), []
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
            shrunk += [] if cuda else [name]
    return shrunk


def load_step(spec: str | None) -> Callable[..., default_step.BenchStep]:
    if spec is None:
        return default_step.make
    module, _, attr = spec.partition(":")
    if not attr:
        raise SystemExit(f"--step must look like module:factory, got {spec!r}")
    return getattr(importlib.import_module(module), attr)


Method = tuple[Callable[[], object], Callable[[object], object]]  # (stage, replay)


def timed(methods: dict[str, Method], iters: int, warmup: int, cuda: bool) -> dict[str, dict[str, float]]:
    """Median host us of stage and replay (GPU idle at the start of each step) and median GPU us of the
    step, per method. Methods take turns in blocks of ten steps, so drift in the machine's speed
    (clocks, neighbours) reaches all of them alike and their medians compare; ``host_rounds_us`` keeps each
    round's median host us, for comparisons paired by round."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        for stage, replay in methods.values():
            replay(stage())
    samples = {name: ([], [], []) for name in methods}
    rounds: dict[str, list[float]] = {name: [] for name in methods}  # per round: median host us of its block
    b2b_us: dict[str, list[float]] = {}
    b2b_host: dict[str, list[float]] = {}
    start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (None, None)
    block = 10  # consecutive steps of one method: its code stays in the CPU caches, as in a decode loop
    for _ in range(max(1, iters // block)):
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
                   "gpu_us": med(gp) if gp else float("nan"),
                   "gpu_b2b_us": med(b2b_us[name]) if name in b2b_us else float("nan"),
                   "host_b2b_us": med(b2b_host[name]) if name in b2b_host else float("nan"),
                   "host_rounds_us": rounds[name]}
            for name, (st, rp, gp) in samples.items()}


def bench_key(pools: dict[str, gp.GraphPool], extras: dict, step: default_step.BenchStep, mode: gp.Mode, bs: int,
              args: argparse.Namespace, cuda: bool) -> dict[str, dict[str, float]]:
    inputs = step.sample(mode, bs)
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
    return timed(methods, args.iters, args.warmup, cuda)


def key_stats(pool: gp.GraphPool, mode: str, bs: int) -> gp.KeyStats:
    """The pool's figures for graph (mode, bs)."""
    return next(s for key, s in pool.stats.keys.items() if (key.mode, key.bs) == (mode, bs))


def check_against_eager(pool: gp.GraphPool, step: default_step.BenchStep, mode: gp.Mode, bs: int) -> float:
    """Fraction of greedy tokens the graph step agrees with eager on (bf16 can break near-ties)."""
    inputs = step.sample(mode, bs)
    got = pool.run(mode.name, copy=True, **inputs)["next_tokens"]
    want = step.step_fn(gp.StepBatch(mode, bs, bs * mode.tokens_per_seq, inputs, captured=False))["next_tokens"]
    return (got == want).float().mean().item()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    shrunk = resolve(args, cuda)
    if not cuda:
        fewer = ", ".join(f"--{n.replace('_', '-')} {getattr(args, n)} (GPU {GPU_DEFAULTS[n]})" for n in shrunk)
        print("replay_latency: CPU smoke run of the code path: no CUDA device, so graphpool runs on its eager twin "
              "and only the graphpool and eager methods run; the timings are not a speed measurement."
              + (f" Fewer iterations and sizes than on a GPU: {fewer}." if shrunk else ""), flush=True)
    modes = [gp.Mode(n, int(t)) for n, t in (m.split(":") for m in args.modes.split(","))]
    sizes = sorted(int(b) for b in args.batch_sizes.split(","))
    max_tokens = max(m.tokens_per_seq for m in modes) * sizes[-1]
    step = load_step(args.step)(device, max_tokens)

    pools = {"graphpool": gp.GraphPool(modes, step.inputs, sizes, device=device)}
    if cuda:
        pools["graphpool+prep"] = gp.GraphPool(modes, step.inputs, sizes, device=device, staging="ring")
        pools["plain"] = gp.GraphPool(modes, step.inputs, sizes, device=device, staging="torch")
        pools["graph-pad"] = gp.GraphPool(modes, step.inputs, sizes, device=device, staging="torch")
    pad_count = torch.zeros((), dtype=torch.int64, device=device)  # real sequences, for graph-pad's graphs
    for name, pool in pools.items():
        log.info("capturing %s pool ...", name)
        fn = padding_in_graph(step.step_fn, step.inputs, pad_count) if name == "graph-pad" else step.step_fn
        pool.capture(fn, prepare=(lambda b, n: None) if name == "graphpool+prep" else None)
    extras: dict = {}
    if cuda:
        extras = {"sglang": sglang_style(pools["plain"], step.inputs, grouped=False),
                  "foreach": sglang_style(pools["plain"], step.inputs, grouped=True),
                  "pad_copy": sglang_style(pools["graph-pad"], step.inputs, grouped=True, fills=False),
                  "pad_count": pad_count, "triton": EagerTritonStage(pools["plain"], step.inputs)}

    rows: list[dict] = []
    total = len(modes) * len(sizes)
    for i, (mode, bs) in enumerate([(m, b) for m in modes for b in sizes], 1):
        log.info("[%d/%d] timing %s bs=%d", i, total, mode.name, bs)
        stats = key_stats(pools["graphpool"], mode.name, bs)
        match = check_against_eager(pools["graphpool"], step, mode, bs)
        for method, r in bench_key(pools, extras, step, mode, bs, args, cuda).items():
            rows.append({"mode": mode.name, "bs": bs, "method": method, **r, "capture_ms": stats.capture_s * 1e3,
                         "graph_mib": stats.graph_bytes / 2**20, "token_match": match})

    # Every real batch size up to the largest captured one must be a graph hit.
    for mode in modes:
        for real_bs in range(1, sizes[-1] + 1):
            pools["graphpool"].run(mode.name, **step.sample(mode, real_bs))
    misses = sum(sum(p.stats.misses.values()) for p in pools.values())

    os.makedirs(args.out, exist_ok=True)
    what_ran = (f"CUDA graphs on {torch.cuda.get_device_name(device)}" if cuda else
                "CPU smoke run on graphpool's eager twin (no CUDA graphs): not a speed measurement")
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
           "triton": _version("triton"), "argv": sys.argv[1:] if argv is None else argv, "misses": misses,
           "runs_on": what_ran, "iters": args.iters, "warmup": args.warmup,
           "graph_mib_total": pools["graphpool"].stats.graph_bytes / 2**20}
    with open(os.path.join(args.out, "replay_latency.json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "replay_latency.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    if not args.no_plots:
        plot(rows, modes, sizes, os.path.join(args.out, "replay_latency.png"), what_ran)
    print(f"wrote {args.out}/replay_latency.json, .csv" + ("" if args.no_plots else " and .png"))
    print(pools["graphpool"].stats.table())
    print(explain("Per graph of the graphpool pool. mode, bs: the graph's key. capture ms: its capture (warm-up and, "
                  "for the first, one-time compiles included). graph MiB: memory it added to the shared graph pool"
                  + ("" if cuda else " (0 on the eager twin: no graphs)") + ". replays: steps it served (timing "
                  "and checks). padded rows: token rows filled with padding because fewer sequences than bs came."))
    print(summary(rows, modes, sizes, cuda, misses))
    return 0


def _version(module: str) -> str:
    try:
        return importlib.import_module(module).__version__
    except ImportError:
        return "absent"


if __name__ == "__main__":
    sys.exit(main())

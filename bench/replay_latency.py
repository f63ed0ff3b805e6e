"""Replay-latency microbenchmark: what each way of feeding a graph costs per step, per mode and batch size.

For every (mode, bs) it reports capture time and graph bytes, and for each method the host time of
staging and of replay (median over iterations, GPU idle at the start of each, so the host cost is seen
alone) and the GPU time of the whole step (CUDA events). Methods:

  floor            raw ``CUDAGraph.replay()`` on buffers staged beforehand (the least any method can cost)
  graphpool        ``pool.run``: validate, route, write the ring row; the graph's first node stages
  graphpool+prep   ring staging as its own small graph, then a (no-op) prepare hook, then the step graph
  triton-launch    the same staging kernel launched eagerly from Python, then the step graph
  sglang           SGLang's way: tail fills when padded, then a slice ``copy_`` per buffer
  foreach          tail fills, then one ``torch._foreach_copy_`` per dtype group (SGLang 0.5.12's batching)
  graph-pad        the same grouped copies of the real rows plus a device-side count; the graph pads
  eager            the step run eagerly, no graph

Usage: ``python bench/replay_latency.py`` (embedded default step), ``--step my_module:make`` for your own
(``make(device, max_tokens) -> bench.default_step.BenchStep``). Writes JSON, CSV and PNG plots to --out.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import graphpool as gp  # noqa: E402
from bench import default_step  # noqa: E402

log = logging.getLogger("replay_latency")
GRAPH_METHODS = ["floor", "graphpool", "graphpool+prep", "triton-launch", "sglang", "foreach", "graph-pad"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--modes", default="decode:1,verify:16", help="name:tokens_per_seq list (default %(default)s)")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64", help="captured sizes (default %(default)s)")
    p.add_argument("--iters", type=int, default=200, help="timed iterations per method and key")
    p.add_argument("--warmup", type=int, default=20, help="untimed iterations first")
    p.add_argument("--step", default=None, help="module:factory of your own step (default: embedded step)")
    p.add_argument("--out", default="out/replay_latency", help="output folder for JSON, CSV and PNG")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu (eager twin)")
    return p.parse_args(argv)


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
    (clocks, neighbours) reaches all of them alike and their medians compare."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        for stage, replay in methods.values():
            replay(stage())
    samples = {name: ([], [], []) for name in methods}
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
            for _ in range(block if cuda else 0):  # the same steps again, timed on the GPU
                sync()
                start.record()
                replay(stage())
                end.record()
                end.synchronize()
                gpu_us.append(start.elapsed_time(end) * 1e3)
    med = statistics.median
    return {name: {"stage_us": med(st), "replay_us": med(rp), "host_us": med(st) + med(rp),
                   "gpu_us": med(gp) if gp else float("nan")} for name, (st, rp, gp) in samples.items()}


def padding_in_graph(step_fn: Callable, specs: list[gp.StepInput], count: torch.Tensor) -> Callable:
    """``step_fn`` preceded, inside the graph, by padding every input past a device-side count of real
    sequences: the host then only copies the real rows and sets the count."""
    def padded(batch: gp.StepBatch) -> object:
        for spec in specs:
            view = batch.inputs[spec.name]
            rows_per_seq = batch.mode.tokens_per_seq if spec.per == "token" else 1
            pad = torch.arange(view.shape[0], device=view.device) >= count * rows_per_seq
            view.masked_fill_(pad.view(-1, *[1] * (view.dim() - 1)), spec.fill)
        return step_fn(batch)
    return padded


def sglang_style(pool: gp.GraphPool, grouped: bool, fills: bool = True) -> Callable:
    """Staging as SGLang's runner does it: fills of the padded tails, then copies of the real rows."""
    buf = pool.buffers.full
    names = [s.name for s in pool.buffers.specs]

    def stage(mode: gp.Mode, padded: int, inputs: dict[str, torch.Tensor]) -> None:
        raw_bs = inputs["seq_lens"].shape[0]
        if fills and padded != raw_bs:
            buf["seq_lens"].fill_(1)
            buf["out_cache_loc"].zero_()
            buf["out_cache_loc_swa"].zero_()
        dsts = [buf[n][: inputs[n].shape[0]] for n in names]
        srcs = [inputs[n] for n in names]
        if not grouped:
            for d, s in zip(dsts, srcs):
                d.copy_(s)
            return
        groups: dict[torch.dtype, tuple[list, list]] = {}
        for d, s in zip(dsts, srcs):
            groups.setdefault(d.dtype, ([], []))
            groups[d.dtype][0].append(d)
            groups[d.dtype][1].append(s)
        for d, s in groups.values():
            torch._foreach_copy_(d, s)
    return stage


def bench_key(pools: dict[str, gp.GraphPool], pad_count: torch.Tensor | None, step: default_step.BenchStep,
              mode: gp.Mode, bs: int, args: argparse.Namespace, cuda: bool) -> dict[str, dict[str, float]]:
    inputs = step.sample(mode, bs)
    name = mode.name
    ring_pool = pools["graphpool"]
    eager_batch = gp.StepBatch(mode, bs, bs * mode.tokens_per_seq, inputs, captured=False)
    methods: dict[str, Method] = {
        "graphpool": (lambda: ring_pool.stage(name, **inputs), ring_pool.replay),
        "eager": (lambda: None, lambda _: step.step_fn(eager_batch)),
    }
    if cuda:
        prep_pool, plain = pools["graphpool+prep"], pools["plain"]
        ring, key, prep_graph = prep_pool._ring, gp.GraphKey(name, bs), prep_pool.graph(name, bs)
        pointers = [inputs[s.name].data_ptr() for s in prep_pool.buffers.specs]

        def triton_stage() -> None:
            ring.write(ring.next_row(), bs, pointers)
            ring.launch(key)
            ring.issued += 1

        graph = plain.graph(name, bs)
        plain.run(name, **inputs)  # stage once: the floor replays on buffers that already hold the step
        sglang, foreach = sglang_style(plain, grouped=False), sglang_style(plain, grouped=True)
        pad_copy = sglang_style(pools["graph-pad"], grouped=True, fills=False)
        pad_graph = pools["graph-pad"].graph(name, bs)

        def copy_and_count() -> None:
            pad_copy(mode, bs, inputs)
            pad_count.fill_(bs)
        methods.update({
            "floor": (lambda: None, lambda _: graph.replay()),
            "graphpool+prep": (lambda: prep_pool.stage(name, **inputs), prep_pool.replay),
            "triton-launch": (triton_stage, lambda _: prep_graph.replay()),
            "sglang": (lambda: sglang(mode, bs, inputs), lambda _: graph.replay()),
            "foreach": (lambda: foreach(mode, bs, inputs), lambda _: graph.replay()),
            "graph-pad": (copy_and_count, lambda _: pad_graph.replay()),
        })
    return timed(methods, args.iters, args.warmup, cuda)


def check_against_eager(pool: gp.GraphPool, step: default_step.BenchStep, mode: gp.Mode, bs: int) -> float:
    """Fraction of greedy tokens the graph step agrees with eager on (bf16 can break near-ties)."""
    inputs = step.sample(mode, bs)
    got = pool.run(mode.name, copy=True, **inputs)["next_tokens"]
    want = step.step_fn(gp.StepBatch(mode, bs, bs * mode.tokens_per_seq, inputs, captured=False))["next_tokens"]
    return (got == want).float().mean().item()


def plot(rows: list[dict], modes: list[gp.Mode], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for method in sorted({r["method"] for r in rows}):
            pts = sorted((r["bs"], r["host_us"]) for r in rows if r["mode"] == mode.name and r["method"] == method)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="host us per step (median)",
               title=f"{mode.name} ({mode.tokens_per_seq} token/seq)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if not cuda:
        print("No CUDA device: running the eager twin. Graph timings (floor, graphpool replay, SGLang-style "
              "staging) need CUDA; the numbers below only exercise the code path.", file=sys.stderr)
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

    rows: list[dict] = []
    total = len(modes) * len(sizes)
    for i, (mode, bs) in enumerate([(m, b) for m in modes for b in sizes], 1):
        log.info("[%d/%d] timing %s bs=%d", i, total, mode.name, bs)
        key_stats = pools["graphpool"].stats.keys[gp.GraphKey(mode.name, bs)]
        match = check_against_eager(pools["graphpool"], step, mode, bs)
        for method, r in bench_key(pools, pad_count, step, mode, bs, args, cuda).items():
            rows.append({"mode": mode.name, "bs": bs, "method": method, **r, "capture_ms": key_stats.capture_s * 1e3,
                         "graph_mib": key_stats.graph_bytes / 2**20, "token_match": match})

    # Every real batch size up to the largest captured one must be a graph hit.
    for mode in modes:
        for real_bs in range(1, sizes[-1] + 1):
            pools["graphpool"].run(mode.name, **step.sample(mode, real_bs))
    misses = sum(sum(p.stats.misses.values()) for p in pools.values())

    os.makedirs(args.out, exist_ok=True)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
           "triton": _version("triton"), "argv": sys.argv[1:], "misses": misses,
           "graph_mib_total": pools["graphpool"].stats.graph_bytes / 2**20}
    with open(os.path.join(args.out, "replay_latency.json"), "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "replay_latency.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    if not args.no_plots:
        plot(rows, modes, os.path.join(args.out, "replay_latency.png"))
    print(pools["graphpool"].stats.table())
    print(summary(rows, modes, sizes, cuda, misses))
    return 0


def summary(rows: list[dict], modes: list[gp.Mode], sizes: list[int], cuda: bool, misses: int) -> str:
    get = {(r["mode"], r["bs"], r["method"]): r for r in rows}
    if not cuda:
        return "\n".join(f"{m.name:<8} bs={b:<4} graphpool(eager twin) {get[m.name, b, 'graphpool']['host_us']:8.1f} us"
                         for m in modes for b in sizes)
    head = (f"{'mode':<7}{'bs':>5}{'floor':>8}{'gpool':>8}{'gp+prep':>8}{'triton':>8}{'sglang':>8}{'foreach':>8}"
            f"{'g-pad':>8}{'eager':>9}{'gp stage':>9}{'gp ovh':>8}{'sgl ovh':>8}{'ratio':>7}{'GPU us':>8}{'match':>7}")
    lines, ok = ["host us per step (median); ovh = host above floor; ratio = gp ovh / sglang ovh", head], True
    for m in modes:
        for b in sizes:
            h = {meth: get[m.name, b, meth]["host_us"] for meth in GRAPH_METHODS + ["eager"]}
            gp_ovh, sgl_ovh = h["graphpool"] - h["floor"], h["sglang"] - h["floor"]
            stage = get[m.name, b, "graphpool"]["stage_us"]
            ratio = gp_ovh / sgl_ovh if sgl_ovh > 0 else float("inf")
            ok &= ratio <= 0.1 and stage <= 10.0
            lines.append(f"{m.name:<7}{b:>5}{h['floor']:>8.1f}{h['graphpool']:>8.1f}{h['graphpool+prep']:>8.1f}"
                         f"{h['triton-launch']:>8.1f}{h['sglang']:>8.1f}{h['foreach']:>8.1f}{h['graph-pad']:>8.1f}{h['eager']:>9.1f}"
                         f"{stage:>9.1f}{gp_ovh:>8.1f}{sgl_ovh:>8.1f}{ratio:>7.3f}"
                         f"{get[m.name, b, 'graphpool']['gpu_us']:>8.1f}{get[m.name, b, 'graphpool']['token_match']:>7.2f}")
    lines.append(f"graph misses for bs <= {sizes[-1]}: {misses}")
    lines.append(f"acceptance (ratio <= 0.1 and graphpool validate+route+stage <= 10 us at every key): "
                 f"{'PASS' if ok and misses == 0 else 'FAIL'}")
    return "\n".join(lines)


def _version(module: str) -> str:
    try:
        return importlib.import_module(module).__version__
    except ImportError:
        return "absent"


if __name__ == "__main__":
    sys.exit(main())

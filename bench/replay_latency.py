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
(``make(device, max_tokens) -> bench.default_step.BenchStep``; ``my_module`` is looked up first in the current
working directory, then in the checkout and on Python's path, so ``python3 /path/to/bench/replay_latency.py
--step my_step:make`` run from the folder holding my_step.py finds it). Writes JSON, CSV and a PNG plot to --out
(default: out/replay_latency in the checkout, ignored by git; recorded runs name bench/results/ explicitly),
all three or none: a run that fails or is interrupted leaves the previous set as it was. Each method is timed
exactly --iters steps per key, in rounds of 10 (the last round shorter when --iters is not a multiple of 10).
Bad options end the run before anything is measured, with one line ``replay_latency: --opt ...`` and status 2.
"""
from __future__ import annotations

import argparse
import csv
import importlib
import inspect
import json
import logging
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NoReturn

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script from anywhere
import graphpool as gp  # noqa: E402
from bench import default_step  # noqa: E402
from bench.outputs import OutputError, OutputSet  # noqa: E402
from bench.replay_report import explain, plot, summary  # noqa: E402
from bench.staging_methods import EagerTritonStage, padding_in_graph, sglang_style  # noqa: E402

log = logging.getLogger("replay_latency")
GPU_DEFAULTS = {"iters": 200, "warmup": 20, "batch_sizes": "1,2,4,8,16,32,64"}
CPU_DEFAULTS = {"iters": 10, "warmup": 2, "batch_sizes": "1,2,4,8"}  # the eager twin: a smoke run, < 1 minute
ROUND = 10  # steps of one method in a row: its code stays in the CPU caches, as in a decode loop
STEP_CONTRACT = "expected module:factory, factory(device, max_tokens) -> bench.default_step.BenchStep"
OUTPUT_NAMES = ("replay_latency.json", "replay_latency.csv", "replay_latency.png")


def fail(message: str) -> NoReturn:
    """End the run over a bad option: one line ``replay_latency: --opt ...: what is wrong, what is expected``
    on stderr and status 2, argparse's convention for usage errors (a traceback would bury the option)."""
    print(f"replay_latency: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


class Parser(argparse.ArgumentParser):
    """argparse whose own errors (a non-integer --iters, an unknown option) read like this script's others."""

    def error(self, message: str) -> NoReturn:
        fail(message.removeprefix("argument "))  # argparse says "argument --iters: ..."; ours say "--iters: ..."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options as given; the device-dependent defaults stay None until :func:`resolve`, and nothing is
    checked beyond argparse's types until :func:`check_args`."""
    p = Parser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--modes", default="decode:1,verify:16",
                   help="name:tokens_per_seq list: distinct names, positive token counts (default %(default)s)")
    p.add_argument("--batch-sizes", default=None,
                   help=f"captured sizes, distinct positive integers (default GPU {GPU_DEFAULTS['batch_sizes']}, "
                        f"CPU {CPU_DEFAULTS['batch_sizes']})")
    p.add_argument("--iters", type=int, default=None,
                   help=f"timed steps per method and key, >= 1, exactly this many: methods take turns in rounds of "
                        f"{ROUND} steps, the last round shorter when not a multiple of {ROUND} "
                        f"(default GPU {GPU_DEFAULTS['iters']}, CPU {CPU_DEFAULTS['iters']})")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"untimed steps per method first, >= 0 (default GPU {GPU_DEFAULTS['warmup']}, "
                        f"CPU {CPU_DEFAULTS['warmup']})")
    p.add_argument("--step", default=None,
                   help="module:factory of your own step, factory(device, max_tokens) -> "
                        "bench.default_step.BenchStep; the module is looked up in the current working directory "
                        "first, then in the checkout and on Python's path (default: the embedded step)")
    p.add_argument("--out", default=os.path.join(ROOT, "out", "replay_latency"),
                   help="output folder for JSON, CSV and PNG, created if missing; written all or none "
                        "(default: out/replay_latency in the checkout)")
    p.add_argument("--no-plots", action="store_true", help="no PNG (a previous run's PNG in --out is removed)")
    p.add_argument("--device", default=None,
                   help="cpu (eager twin) or cuda[:index] (default: cuda if available, else cpu)")
    return p.parse_args(argv)


def parse_device(text: str | None) -> torch.device:
    """--device as a torch device this machine has: cpu, or cuda[:index] where torch sees that GPU."""
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        fail(f"--device {text}: not a device name torch knows; expected cpu or cuda[:index]")
    if device.type not in ("cpu", "cuda"):
        fail(f"--device {text}: graphpool runs on cuda (CUDA graphs) or cpu (its eager twin); "
             f"expected cpu or cuda[:index]")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            fail(f"--device {text}: torch {torch.__version__} sees no CUDA device here; expected cpu "
                 f"(or leave --device out: cuda where there is one, else cpu)")
        if device.index is not None and device.index >= count:
            fail(f"--device {text}: torch sees {count} CUDA device(s); expected cuda:0 to cuda:{count - 1}")
    return device


def parse_modes(text: str) -> list[gp.Mode]:
    """--modes as Modes: comma-separated name:tokens_per_seq, names distinct, token counts positive."""
    want = "expected name:tokens_per_seq[,name:tokens_per_seq...], distinct names, e.g. decode:1,verify:16"
    modes: list[gp.Mode] = []
    for item in text.split(","):
        name, sep, tokens = item.strip().partition(":")
        if not name or not sep:
            fail(f"--modes {text}: {item.strip()!r} is not name:tokens_per_seq; {want}")
        try:
            count = int(tokens)
        except ValueError:
            fail(f"--modes {text}: tokens_per_seq of {name!r} must be an integer, got {tokens!r}; {want}")
        if count < 1:
            fail(f"--modes {text}: tokens_per_seq of {name!r} must be >= 1, got {count}; {want}")
        if name in (m.name for m in modes):
            fail(f"--modes {text}: mode {name!r} is named twice (steps are routed by name); {want}")
        modes.append(gp.Mode(name, count))
    return modes


def parse_sizes(text: str) -> list[int]:
    """--batch-sizes as a sorted list of distinct positive integers. A size listed twice is refused rather
    than deduplicated: it would time a key twice, and a typo (2,2 for 2,4) should not pass unseen."""
    want = "expected distinct positive integers separated by commas, e.g. 1,2,4,8"
    sizes: list[int] = []
    for item in text.split(","):
        try:
            bs = int(item)
        except ValueError:
            fail(f"--batch-sizes {text}: {item.strip()!r} is not an integer; {want}")
        if bs < 1:
            fail(f"--batch-sizes {text}: batch size {bs} is not positive; {want}")
        if bs in sizes:
            fail(f"--batch-sizes {text}: batch size {bs} is listed twice; {want}")
        sizes.append(bs)
    return sorted(sizes)


def check_counts(args: argparse.Namespace) -> None:
    """--iters and --warmup (their defaults filled): every timed step is one the user asked for."""
    if args.iters < 1:
        fail(f"--iters {args.iters}: expected a positive number of timed steps per method and key "
             f"(any count: rounds of {ROUND}, the last one shorter)")
    if args.warmup < 0:
        fail(f"--warmup {args.warmup}: expected untimed steps per method >= 0")


def resolve(args: argparse.Namespace, cuda: bool) -> list[str]:
    """Fill the device-dependent defaults; returns the names of those a CPU run shrank."""
    defaults, shrunk = (GPU_DEFAULTS if cuda else CPU_DEFAULTS), []
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
            shrunk += [] if cuda else [name]
    return shrunk


def load_step(spec: str | None) -> Callable[..., default_step.BenchStep]:
    """The step factory --step names (the embedded one without --step), checked before anything is built:
    the module imports, has the factory, and the factory takes (device, max_tokens). An exception raised by
    the user's own module while it imports propagates with its traceback (that is a bug to see in full),
    with a note naming --step."""
    if spec is None:
        return default_step.make
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr or ":" in attr:
        fail(f"--step {spec}: not module:factory; {STEP_CONTRACT}")
    cwd = os.getcwd()
    if cwd not in sys.path:  # run as a script, Python put bench/ on the path, not the folder the user is in
        sys.path.insert(0, cwd)
    importlib.invalidate_caches()  # a module written since this process last looked in that folder
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module == exc.name or module.startswith(exc.name + ".")):
            exc.add_note(f"replay_latency: raised while importing --step {spec}")
            raise  # the module exists, something it imports does not: the traceback says where
        hint = " (name the module, not its file: drop the .py)" if module.endswith(".py") else ""
        fail(f"--step {spec}: no module named {exc.name!r} in the current directory ({cwd}), the checkout "
             f"({ROOT}) or on Python's path{hint}; {STEP_CONTRACT}")
    except Exception as exc:
        exc.add_note(f"replay_latency: raised while importing --step {spec}")
        raise
    factory: object = mod
    for part in attr.split("."):  # module:Class.method names a factory inside a class too
        if not hasattr(factory, part):
            fail(f"--step {spec}: module {module} ({getattr(mod, '__file__', '?')}) has no attribute {attr!r}; "
                 f"{STEP_CONTRACT}")
        factory = getattr(factory, part)
    if not callable(factory):
        fail(f"--step {spec}: {module}.{attr} is a {type(factory).__name__}, not callable; {STEP_CONTRACT}")
    try:
        inspect.signature(factory).bind(torch.device("cpu"), 1)
    except TypeError as exc:
        fail(f"--step {spec}: {module}.{attr} cannot be called as factory(device, max_tokens) ({exc}); "
             f"{STEP_CONTRACT}")
    except ValueError:
        pass  # a builtin without a signature: the call itself will tell
    return factory


def build_step(factory: Callable[..., default_step.BenchStep], spec: str | None, device: torch.device,
               max_tokens: int) -> default_step.BenchStep:
    """Call the step factory and check it returned a step (inputs, step_fn, sample). An exception raised
    inside the factory propagates with its traceback, noted as the --step factory's."""
    try:
        step = factory(device, max_tokens)
    except Exception as exc:
        exc.add_note(f"replay_latency: raised by the step factory --step {spec}")
        raise
    if not all(hasattr(step, name) for name in ("inputs", "step_fn", "sample")):
        fail(f"--step {spec}: the factory returned a value of type {type(step).__name__}, not a step with inputs, "
             f"step_fn and sample; {STEP_CONTRACT}")
    return step


def check_args(args: argparse.Namespace) -> tuple[torch.device, list[gp.Mode], list[int], Callable, list[str]]:
    """Every option checked right after parsing, before any capture or timing: the device, then the
    device-dependent defaults filled, the counts, modes, batch sizes and the --step factory. Returns the
    device, modes, sorted sizes, step factory, and the defaults a CPU run shrank."""
    device = parse_device(args.device)
    shrunk = resolve(args, device.type == "cuda")
    check_counts(args)
    modes, sizes = parse_modes(args.modes), parse_sizes(args.batch_sizes)
    return device, modes, sizes, load_step(args.step), shrunk


def open_outputs(out: str) -> OutputSet:
    """The run's output set under --out, checked writable now, before minutes of measuring."""
    if os.path.exists(out) and not os.path.isdir(out):
        fail(f"--out {out}: an existing file, not a folder; expected a folder (created if missing) for "
             f"{', '.join(OUTPUT_NAMES)}")
    try:
        return OutputSet(*(os.path.join(out, name) for name in OUTPUT_NAMES))
    except OutputError as exc:
        fail(f"--out {out}: {exc}")


def finite(value: object) -> object:
    """``value`` with every NaN or infinite float replaced by None, through dicts and lists: JSON has no NaN
    (json.dump would write a bare NaN that strict readers refuse); null reads as "not measured"."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def write_outputs(outputs: OutputSet, rows: list[dict], env: dict, modes: list[gp.Mode], sizes: list[int],
                  plots: bool, what_ran: str) -> list[Path]:
    """JSON, CSV and (with plots and matplotlib) the PNG, each to a temporary name, then all moved into place
    at once; a file this run did not write (the PNG with --no-plots) is removed, so the set is this run's
    alone. On any failure or interrupt the temporaries are removed and the previous set stays. Returns the
    paths written."""
    json_path, csv_path, png_path = outputs.paths
    clean = [finite(r) for r in rows]  # NaN (not measured here, e.g. GPU times on a CPU) written as null
    try:
        with open(outputs.temporary(json_path), "w") as f:
            json.dump({"env": finite(env), "rows": clean}, f, indent=1, allow_nan=False)
        with open(outputs.temporary(csv_path), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(clean[0]))
            writer.writeheader()
            writer.writerows(clean)
        if plots:
            plot(rows, modes, sizes, str(outputs.temporary(png_path)), what_ran)  # False: no matplotlib, warned
    except BaseException:  # KeyboardInterrupt too: no half-written set
        outputs.discard()
        raise
    return outputs.commit()


Method = tuple[Callable[[], object], Callable[[object], object]]  # (stage, replay)


def round_sizes(iters: int, block: int = ROUND) -> list[int]:
    """Steps per round for exactly ``iters`` timed steps: full rounds of ``block``, then the rest."""
    return [block] * (iters // block) + ([iters % block] if iters % block else [])


def timed(methods: dict[str, Method], iters: int, warmup: int, cuda: bool) -> dict[str, dict[str, float]]:
    """Median host us of stage and replay (GPU idle at the start of each step) and median GPU us of the
    step, per method, over exactly ``iters`` steps each. Methods take turns in rounds of ``ROUND`` steps
    (the last one shorter when ``iters`` is not a multiple), so drift in the machine's speed (clocks,
    neighbours) reaches all of them alike and their medians compare; ``host_rounds_us`` keeps each round's
    median host us, for comparisons paired by round, and ``steps_timed`` the host-timed steps."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        for stage, replay in methods.values():
            replay(stage())
    samples = {name: ([], [], []) for name in methods}
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
                   "gpu_us": med(gp) if gp else float("nan"),
                   "gpu_b2b_us": med(b2b_us[name]) if name in b2b_us else float("nan"),
                   "host_b2b_us": med(b2b_host[name]) if name in b2b_host else float("nan"),
                   "host_rounds_us": rounds[name], "steps_timed": len(st)}
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
    device, modes, sizes, factory, shrunk = check_args(args)
    outputs = open_outputs(args.out)  # an unwritable --out said now, not after minutes of measuring
    cuda = device.type == "cuda"
    if not cuda:
        fewer = ", ".join(f"--{n.replace('_', '-')} {getattr(args, n)} (GPU {GPU_DEFAULTS[n]})" for n in shrunk)
        print("replay_latency: CPU smoke run of the code path: no CUDA device, so graphpool runs on its eager twin "
              "and only the graphpool and eager methods run; the timings are not a speed measurement."
              + (f" Fewer iterations and sizes than on a GPU: {fewer}." if shrunk else ""), flush=True)
    max_tokens = max(m.tokens_per_seq for m in modes) * sizes[-1]
    step = build_step(factory, args.step, device, max_tokens)

    pools = {"graphpool": gp.GraphPool(modes, step.inputs, sizes, device=device)}
    if cuda:
        pools["graphpool+prep"] = gp.GraphPool(modes, step.inputs, sizes, device=device, staging="ring")
        pools["plain"] = gp.GraphPool(modes, step.inputs, sizes, device=device, staging="torch")
        pools["graph-pad"] = gp.GraphPool(modes, step.inputs, sizes, device=device, staging="torch")
    pad_count = torch.zeros((), dtype=torch.int64, device=device)  # real sequences, for graph-pad's graphs
    for name, pool in pools.items():
        log.info("capturing %s pool ...", name)
        fn = padding_in_graph(step.step_fn, step.inputs, pad_count) if name == "graph-pad" else step.step_fn
        pool.capture(fn, prepare=(lambda b, n: None) if name == "graphpool+prep" else None,
                     outputs=getattr(step, "outputs", None))
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

    what_ran = (f"CUDA graphs on {torch.cuda.get_device_name(device)}" if cuda else
                "CPU smoke run on graphpool's eager twin (no CUDA graphs): not a speed measurement")
    timed_steps = {r["steps_timed"] for r in rows}  # what was timed per method and key, not merely what was asked
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
           "triton": _version("triton"), "argv": sys.argv[1:] if argv is None else argv, "misses": misses,
           "runs_on": what_ran, "iters": timed_steps.pop() if len(timed_steps) == 1 else sorted(timed_steps),
           "warmup": args.warmup, "round_steps": ROUND,
           "graph_mib_total": pools["graphpool"].stats.graph_bytes / 2**20}
    written = write_outputs(outputs, rows, env, modes, sizes, not args.no_plots, what_ran)
    print("wrote " + ", ".join(str(path) for path in written))
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

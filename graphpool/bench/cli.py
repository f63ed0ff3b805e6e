"""``graphpool-bench`` / ``python -m graphpool.bench``: the replay-latency microbenchmark, for the embedded
default step or your own.

For every (mode, bs) it reports capture time and graph bytes, and for each method (see
:mod:`graphpool.bench.replay`) the host time of staging and of replay (median over iterations, GPU idle at
the start of each, so the host cost is seen alone), the host time per step again with steps issued back to
back (the GPU busy, as in a decode loop), and the GPU time of the whole step (CUDA events), idle-start and
back to back.

On a CPU only graphpool (on its eager twin) and eager run, with fewer iterations and batch sizes (said on
screen): a smoke run of the code path, not a speed measurement.

Steps: ``--step default`` (the embedded step), ``--step sglang`` (graphpool's SGLang runners' input
declarations; needs SGLang), ``--step transformers`` (a small Llama through graphpool's transformers
integration; needs transformers), ``--step module:factory`` for your own (``factory(device, max_tokens) ->
graphpool.bench.BenchStep``; ``module`` is looked up first in the current working directory, then on Python's
path). Writes JSON, CSV and a PNG plot to --out, all three or none: a run that fails or is interrupted leaves
the previous set as it was. Each method is timed exactly --iters steps per key, in rounds of 10 (the last round
shorter when --iters is not a multiple of 10). Bad options end the run before anything is measured, with one
line ``graphpool-bench: --opt ...`` and status 2.
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Callable, NoReturn

import torch

import graphpool as gp

from .outputs import OutputError, OutputSet
from .replay import ROUND, BenchResult, benchmark
from .report import explain, plot, summary
from .step import BenchStep, StepSpecError, build_step, load_factory

log = logging.getLogger("graphpool.bench")
PROG = "graphpool-bench"
GPU_DEFAULTS = {"iters": 200, "warmup": 20, "batch_sizes": "1,2,4,8,16,32,64"}
CPU_DEFAULTS = {"iters": 10, "warmup": 2, "batch_sizes": "1,2,4,8"}  # the eager twin: a smoke run, < 1 minute
OUTPUT_NAMES = ("replay_latency.json", "replay_latency.csv", "replay_latency.png")


def fail(message: str) -> NoReturn:
    """End the run over a bad option: one line ``graphpool-bench: --opt ...: what is wrong, what is expected``
    on stderr and status 2, argparse's convention for usage errors (a traceback would bury the option)."""
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


class Parser(argparse.ArgumentParser):
    """argparse whose own errors (a non-integer --iters, an unknown option) read like this script's others."""

    def error(self, message: str) -> NoReturn:
        fail(message.removeprefix("argument "))  # argparse says "argument --iters: ..."; ours say "--iters: ..."


def parse_args(argv: list[str] | None = None, default_out: str | None = None) -> argparse.Namespace:
    """The options as given; the device-dependent defaults stay None until :func:`resolve`, and nothing is
    checked beyond argparse's types until :func:`check_args`. ``default_out``: --out's default (the
    checkout's front end passes its own ignored folder; else ``out/replay_latency`` in the working directory)."""
    p = Parser(prog=PROG, description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
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
                   help="default (the embedded step), sglang (graphpool's SGLang runners' inputs), transformers (a small "
                        "Llama through graphpool's transformers integration), or module:factory "
                        "of your own step, factory(device, max_tokens) -> graphpool.bench.BenchStep; the module is "
                        "looked up in the current working directory first, then on Python's path (default: default)")
    p.add_argument("--out", default=default_out or os.path.join("out", "replay_latency"),
                   help="output folder for JSON, CSV and PNG, created if missing; written all or none "
                        "(default: %(default)s)")
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


def load_step(spec: str | None) -> Callable[..., BenchStep]:
    """The step factory --step names, checked before anything is built (see :func:`graphpool.bench.step.load_factory`)."""
    try:
        return load_factory(spec)
    except StepSpecError as exc:
        fail(f"--step {exc}")


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


def write_outputs(outputs: OutputSet, result: BenchResult, plots: bool) -> list[Path]:
    """JSON, CSV and (with plots and matplotlib) the PNG, each to a temporary name, then all moved into place
    at once; a file this run did not write (the PNG with --no-plots) is removed, so the set is this run's
    alone. On any failure or interrupt the temporaries are removed and the previous set stays. Returns the
    paths written."""
    rows, env = result.rows, result.env
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
            plot(rows, result.modes, result.sizes, str(outputs.temporary(png_path)), env["runs_on"])  # False: no matplotlib
    except BaseException:  # KeyboardInterrupt too: no half-written set
        outputs.discard()
        raise
    return outputs.commit()


def main(argv: list[str] | None = None, default_out: str | None = None) -> int:
    """The command line: parse and check every option, capture, time, write the outputs, print the tables."""
    args = parse_args(argv, default_out)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device, modes, sizes, factory, shrunk = check_args(args)
    outputs = open_outputs(args.out)  # an unwritable --out said now, not after minutes of measuring
    cuda = device.type == "cuda"
    if not cuda:
        fewer = ", ".join(f"--{n.replace('_', '-')} {getattr(args, n)} (GPU {GPU_DEFAULTS[n]})" for n in shrunk)
        print(f"{PROG}: CPU smoke run of the code path: no CUDA device, so graphpool runs on its eager twin "
              "and only the graphpool and eager methods run; the timings are not a speed measurement."
              + (f" Fewer iterations and sizes than on a GPU: {fewer}." if shrunk else ""), flush=True)
    max_tokens = max(m.tokens_per_seq for m in modes) * sizes[-1]
    try:
        step = build_step(factory, args.step, device, max_tokens)
        result = benchmark(step, modes, sizes, device, args.iters, args.warmup)
    except StepSpecError as exc:
        fail(f"--step {args.step or 'default'}: {exc}")
    result.env["argv"] = sys.argv[1:] if argv is None else argv
    written = write_outputs(outputs, result, not args.no_plots)
    print("wrote " + ", ".join(str(path) for path in written))
    print_tables(result)
    return 0


def print_tables(result: BenchResult) -> None:
    """The per-graph table, then the timing tables, each with its columns explained."""
    print(result.stats)
    print(explain("Per graph of the graphpool pool. mode, bs: the graph's key. capture ms: its capture (warm-up and, "
                  "for the first, one-time compiles included). graph MiB: memory it added to the shared graph pool"
                  + ("" if result.cuda else " (0 on the eager twin: no graphs)") + ". replays: steps it served "
                  "(timing and checks). padded rows: token rows filled with padding because fewer sequences than bs "
                  "came."))
    print(summary(result.rows, result.modes, result.sizes, result.cuda, result.env["misses"]))


if __name__ == "__main__":
    sys.exit(main())

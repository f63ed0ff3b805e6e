"""End-to-end decode-loop benchmark: plain decode vs speculation vs dynamic speculation, all on graphs.

For each concurrency C, requests arrive so that C are always in flight, and output tokens/s is
measured for four ways of running the steps:

  (i)   plain       every step a plain-decode graph
  (ii)  spec        every step a speculative graph (draft tree + verify + greedy acceptance)
  (iii) dynamic     SpeculationPolicy picks per step; both modes replayed from graphs (graphpool)
  (iv)  dyn-eager   the same choice, but plain steps run eagerly (a runner with verify graphs only)

and with ``--tiers`` (speculation tiers, docs/tiers.md), for each shorter tier and for the schedule:

  spec_<n>          every step a speculative graph of the tier with n draft tokens
  (v)   tiers       a TierSchedule picks the draft length per step by batch size, plain decode last

Writes JSON and a PNG plot (to the ignored folder out/ unless --out names another) and prints a table
last. On a CPU it is a smoke run of the code path: a tiny model on the pool's eager twin (no CUDA graphs),
about 20 s on 2 cores; it times nothing worth comparing, so it fixes the speculation threshold instead of
choosing it from the timings and draws no crossover, threshold or roofline conclusion.

    python bench/decode_loop.py            # tiny on CPU (eager twin), or the full sweep on a GPU
    python bench/decode_loop.py --quick    # a shorter GPU sweep
    python bench/decode_loop.py --tp 2     # tensor parallel over 2 ranks (GPUs, or gloo on CPU); rank 0 prints
    python bench/decode_loop.py --attention torch --identity-check   # the torch attention; fp32 check after

Attention: FlashInfer (``--attention flashinfer``, the default where it is installed, on CUDA in bf16/fp16)
or the engine's torch gather + SDPA (``torch``, the CPU path); ``flashinfer-reference`` runs FlashInfer's
in-graph metadata with the attention math in torch (CPU, float32 checks). ``--kernels`` picks the fused
Triton norms/rotary/SwiGLU (default on CUDA) or plain torch; ``--run-ahead`` how many verify steps the host
may queue before reading their accept lengths. The last lines are issue 11's acceptance checks (PASS/FAIL).
    python bench/decode_loop.py --out bench/results/decode_loop   # a run to record (bench/RESULTS_HISTORY.md)
    python bench/decode_loop.py --tiers 4x2:8,4x1:4 --out bench/results/decode_tiers   # issue 40's tiers run (GPU)

Why the GPU default is the ``medium`` model (1.75 B parameters, bf16) with a draft committing ~2.6
tokens per verify step. Per step, from :mod:`bench.engine.costs` (H200: 790 TFLOP/s, 4.3 TB/s; keys 192):

     C   plain: GFLOP    GB  roofline ms   spec (4 draft passes + verify of 16 C tokens): GFLOP    GB     ms
     1              3  3.46         0.80                                                     63  5.31   1.23
    16             56  3.51         0.82                                                   1016  5.38   1.56
    32            111  3.56         0.83                                                   2032  5.46   2.70
   128            446  3.86         0.90                                                   8128  5.94  10.29

Plain decode stays weights-bound through C = 128; verify turns compute-bound near C = 12. The first
H200 runs were far off this roofline: ~55 tiny kernels per layer (norm casts and reductions, rotary
slices, the attention's gather to the padded key length) cost ~1-2 us each even inside a graph, so a
plain step took 1.65 ms (2.1x) and a speculative one 4.2 ms (3.4x), plus a host sync per verify step;
speculation then barely won at C = 1. Issue 11 goes after those causes: fused Triton kernels for the norms,
rotary and SwiGLU (:mod:`bench.engine.fused`), FlashInfer attention planned once with its metadata built
in the graph (:mod:`bench.engine.fi_attention`), fewer ops in the tree acceptance, and a loop that queues
the next verify step before reading the last one's accept lengths (``--run-ahead``); where a step's time
went, kernel by kernel: bench/RESULTS_HISTORY.md (runs T to AW). Eager plain steps (dyn-eager) still launch
every op from Python (~100 ops, each a few to tens of microseconds of host time, FlashInfer's wrappers among
the slowest), which is what graphs exist to remove.

Windows last at least one second on a GPU (``--min-seconds``) as well as ``--steps`` steps. Each request
costs a prefill (~1.3 ms at batch size 1 here) and, with speculation, a wait at its end (the host must
read the last accept lengths before it admits the next request). A window of 40 steps held none of that
for plain decode at C = 1 (outputs of 96-112 tokens outlast it) but one or two request switches for
speculation (~3 tokens a step), which charged the switches to speculation alone; a one-second window holds
about ten requests of either, so both pay their per-request costs per token as a server does.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from bench.engine.attention import key_len  # noqa: E402
from bench.engine.config import ModelConfig, SpecConfig, dtype_from_name, tier_modes  # noqa: E402
from bench.engine.costs import device_roof, plain_step, roofline_table, spec_step, total_params  # noqa: E402
from bench.engine.draft_select import DRAFT_SELECT  # noqa: E402
from bench.engine.engine import ATTENTION  # noqa: E402
from bench.engine.gemv import use_skinny  # noqa: E402
from bench.engine.harness import build  # noqa: E402
from bench.engine.identity import greedy_identity  # noqa: E402
from bench.engine.loop import CHOSEN, DecodeLoop, fixed_tier_variants, make_requests  # noqa: E402
from bench.engine.model import KERNELS  # noqa: E402
from bench.engine.tp_launch import add_arguments as add_tp_arguments, run_ranks  # noqa: E402
from graphpool.bench.outputs import OutputError, OutputSet  # noqa: E402
from bench.decode_report import (LABELS, ROOFLINE_LEGEND, STATS_LEGEND, TIERS_LEGEND, acceptance,  # noqa: E402
                                 acceptance_lines, check_targets, count, explain, identical, label, plot,
                                 steps_table, table)
from bench import decode_tiers  # noqa: E402
from graphpool import SpeculationPolicy, TierSchedule  # noqa: E402

log = logging.getLogger("decode_loop")

FULL_C = [1, 2, 4, 8, 10, 16, 32, 64, 128]
QUICK_C = [1, 4, 16, 32, 128]
CPU_C = [1, 2, 4, 8]


@dataclass(frozen=True)
class Preset:
    """A model size and the benchmark settings that go with it (override any of them on the command line)."""

    model: Callable[[], ModelConfig]
    draft_noise: float   # sets the acceptance rate (the accept column of a spec run measures it)
    prompt_len: int
    min_new: int
    max_new: int


PRESETS = {
    # Noise 0.2: 2.55-2.73 tokens committed per verify step (CPU, float32, 40-96 samples; 0.22: 2.44, 0.3: 1.93,
    # 0.1: 3.65; bench/RESULTS_HISTORY.md, removed probes). bf16 on the H200 ran ~4 % higher for `small`.
    "medium": Preset(ModelConfig.medium, draft_noise=0.2, prompt_len=32, min_new=96, max_new=112),
    "small": Preset(ModelConfig.small, draft_noise=0.05, prompt_len=32, min_new=64, max_new=128),
    "tiny": Preset(ModelConfig.tiny, draft_noise=0.05, prompt_len=12, min_new=8, max_new=24),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    p.add_argument("--size", default="auto", choices=["auto", *PRESETS],
                   help="model size: medium (hidden 4096, 8 layers, 1.75 B) on GPU, tiny on CPU by default")
    p.add_argument("--dtype", default="auto", help="bf16 or fp32 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--concurrency", default=None, help=f"comma list (default GPU {FULL_C}, CPU {CPU_C})")
    p.add_argument("--quick", action="store_true", help=f"C in {QUICK_C} and fewer steps")
    p.add_argument("--variants", default=None,
                   help="comma list of plain, spec, dynamic, dynamic_eager_plain, and with --tiers spec_<n> (each "
                        "shorter tier fixed) and tiers (default: all of them)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 80 GPU, 40 quick, 8 CPU)")
    p.add_argument("--warmup-steps", type=int, default=None, help="untimed steps first (default 3 GPU, 1 CPU)")
    p.add_argument("--min-seconds", type=float, default=None,
                   help="each timed window also lasts at least this long (default: 1 on a GPU, so that every "
                        "variant's window holds many request switches, see above; 0 on CPU and with --tp, where "
                        "windows end after --steps)")
    p.add_argument("--threshold", default="auto",
                   help="speculate at batch sizes <= this; 'auto' picks it on a GPU from this run's plain and "
                        "spec figures (the crossover; see choose_threshold) and resumes at the swept C below it; "
                        "on a CPU 'auto' fixes it at the smallest C (eager-twin timings choose nothing)")
    p.add_argument("--prompt-len", type=int, default=None, help="default: the size's preset")
    p.add_argument("--min-new", type=int, default=None, help="default: the size's preset")
    p.add_argument("--max-new", type=int, default=None, help="default: the size's preset")
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--draft-steps", type=int, default=4)
    p.add_argument("--num-draft-tokens", type=int, default=16)
    p.add_argument("--tiers", default="",
                   help="shorter speculation tiers besides the one above, longest draft first, as TOPKxSTEPS:TOKENS, "
                        "e.g. 4x2:8,4x1:4 (docs/tiers.md): adds the variants spec_<TOKENS> and tiers")
    p.add_argument("--tier-bounds", default="auto",
                   help="the tiers variant's bounds: OFF_ABOVE[/ON_AT_OR_BELOW] per speculative tier (the one above, "
                        "then each of --tiers), e.g. 2/1,8/4,32; 'auto' chooses them on a GPU from this run's fixed "
                        "tiers (see bench/decode_tiers.py choose_bounds) and fixes them at the smallest C on a CPU")
    p.add_argument("--draft-noise", type=float, default=None, help="default: the size's preset")
    p.add_argument("--backend", default="auto", help="graphpool backend: auto, cuda or eager")
    p.add_argument("--attention", default="auto", choices=["auto", *ATTENTION],
                   help="auto: flashinfer on CUDA in bf16/fp16 where installed, else torch")
    p.add_argument("--kernels", default="auto", choices=KERNELS,
                   help="fused Triton norms/rotary/SwiGLU (auto: on CUDA) or plain torch")
    p.add_argument("--draft-select", default="auto", choices=DRAFT_SELECT,
                   help="the speculative step's selection work (each draft level's top-k and next beam, the "
                        "tree's selection, the greedy acceptance and commit): torch ops, or one Triton kernel "
                        "each (bench/engine/draft_select.py, tree_kernels.py); auto: the kernels on CUDA")
    p.add_argument("--skinny", default="on", choices=["on", "off"],
                   help="16-bit products of 2-16 tokens (draft levels, verify at C = 1, plain decode at C <= 16) "
                        "through the skinny tensor-core GEMM of bench/engine/skinny.py, or the BLAS library")
    p.add_argument("--run-ahead", type=int, default=1,
                   help="verify steps queued before the host reads their accept lengths (0: a sync per step)")
    p.add_argument("--wait-at-request-end", action="store_true",
                   help="read the accept lengths whenever a request may have finished (batches change only with no "
                        "step in flight: the loop before run AP); default: run ahead through request ends")
    p.add_argument("--identity-check", action="store_true",
                   help="after the sweep, check in float32 that spec and dynamic outputs equal plain decoding")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "out" / "decode_loop"),
                   help="output prefix: writes PREFIX.json and PREFIX.png, replacing an earlier run's pair "
                        "(a prefix ending in .json or .png names the pair too); default out/decode_loop in the "
                        "checkout (ignored by git); recorded runs name bench/results/... explicitly")
    p.add_argument("-v", "--verbose", action="store_true")
    add_tp_arguments(p)
    return p.parse_args(argv)


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the device-dependent defaults and check every option before anything is built: a bad value
    exits with one line naming the option and what it takes (``SystemExit``), not after a sweep."""
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        _refuse("--device", f"takes auto, cpu, cuda or cuda:N, got {args.device!r}")
    gpu = device.type == "cuda"
    args.size = args.size if args.size != "auto" else ("medium" if gpu else "tiny")
    args.dtype = args.dtype if args.dtype != "auto" else ("bf16" if gpu else "fp32")
    if args.concurrency:
        args.concurrency = _positive_ints("--concurrency", args.concurrency)
    else:
        args.concurrency = (QUICK_C if args.quick else FULL_C) if gpu else CPU_C
    preset = PRESETS[args.size]
    defaults = {"steps": (40 if args.quick else 80) if gpu else 8, "warmup_steps": 3 if gpu else 1,
                "min_seconds": 1.0 if gpu and args.tp == 1 else 0.0,  # --tp: ranks must agree on the step count
                "prompt_len": preset.prompt_len, "min_new": preset.min_new, "max_new": preset.max_new,
                "draft_noise": preset.draft_noise}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name, least in (("steps", 1), ("warmup_steps", 0), ("prompt_len", 1), ("min_new", 1), ("max_new", 1),
                        ("topk", 1), ("draft_steps", 1), ("num_draft_tokens", 2), ("run_ahead", 0), ("tp", 1)):
        if getattr(args, name) < least:
            _refuse(f"--{name.replace('_', '-')}", f"must be >= {least}, got {getattr(args, name)}")
    for name in ("min_seconds", "draft_noise"):
        if not getattr(args, name) >= 0:
            _refuse(f"--{name.replace('_', '-')}", f"must be >= 0, got {getattr(args, name)}")
    if args.min_new > args.max_new:
        _refuse("--min-new", f"{args.min_new} is above --max-new {args.max_new} (request lengths are drawn "
                             f"between them)")
    try:
        main_spec = SpecConfig(topk=args.topk, steps=args.draft_steps, num_draft_tokens=args.num_draft_tokens,
                               draft_noise=args.draft_noise, draft_select=args.draft_select)
    except ValueError as exc:
        _refuse("--topk/--draft-steps/--num-draft-tokens", str(exc))
    try:
        args.tier_specs = decode_tiers.parse_tiers(args.tiers, main_spec)
    except ValueError as exc:
        _refuse("--tiers", str(exc))
    known = [v for v in LABELS if v != "tiers"] + decode_tiers.variants(args.tier_specs)
    args.variants = list(dict.fromkeys(v for v in (args.variants or ",".join(known)).split(",") if v))
    unknown = [v for v in args.variants if v not in known]
    if unknown or not args.variants:
        _refuse("--variants", f"takes a comma list of {', '.join(known)}; got {unknown or 'none'}")
    if args.tier_bounds != "auto":
        try:
            args.tier_bounds = decode_tiers.parse_bounds(args.tier_bounds, 1 + len(args.tier_specs))
        except ValueError as exc:
            _refuse("--tier-bounds", str(exc))
    elif gpu and "tiers" in args.variants:
        ladder = ["plain", "spec"] + decode_tiers.variants(args.tier_specs)[:-1]
        if any(v not in args.variants for v in ladder):
            _refuse("--tier-bounds", f"auto chooses the bounds from this run's {', '.join(ladder)}: run them too "
                                     f"(--variants), or give the bounds")
    if args.threshold != "auto" and not (args.threshold.isdigit()):
        _refuse("--threshold", f"takes auto or a batch size >= 0, got {args.threshold!r}")
    try:
        tier_modes(main_spec, args.tier_specs)  # shorter than the main tier, and one another
    except ValueError as exc:
        _refuse("--tiers", str(exc))
    if args.tp > 1:
        try:
            from bench.engine.parallel import TensorParallel
            TensorParallel.check_split(preset.model(), args.tp)
        except ValueError as exc:
            _refuse("--tp", str(exc))
    return args


def check_machine(args: argparse.Namespace) -> None:
    """What only this machine can say, before anything is built: the GPUs asked for exist, and ``--out`` can be
    written (``args.outputs``, the run's file pair)."""
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            _refuse("--device", f"{args.device!r}: this torch has no CUDA device (torch {torch.__version__}); use cpu")
        if args.tp > torch.cuda.device_count():
            _refuse("--tp", f"{args.tp} ranks need {args.tp} GPUs, this machine has {torch.cuda.device_count()}")
    try:
        args.outputs = output_set(args.out)
    except OutputError as exc:
        _refuse("--out", str(exc))


def _refuse(option: str, problem: str) -> None:
    raise SystemExit(f"decode_loop: {option}: {problem}")


def _positive_ints(option: str, text: str) -> list[int]:
    """A comma list of distinct positive integers, in the order given (duplicates dropped)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        _refuse(option, f"takes a comma list of positive integers, e.g. 1,4,16; got {text!r}")
    if any(v < 1 for v in values):
        _refuse(option, f"takes positive integers, got {text!r}")
    return list(dict.fromkeys(values))


def output_set(prefix: str) -> OutputSet:
    """The run's JSON and plot, ``PREFIX.json`` and ``PREFIX.png`` (checked writable now, written together at
    the end). A prefix that already ends in .json or .png names the same pair; any other dot stays in the name."""
    base = Path(prefix)
    if base.suffix in (".json", ".png"):
        base = base.with_suffix("")
    return OutputSet(Path(f"{base}.json"), Path(f"{base}.png"))


def run_variant(engine, pool, variant: str, c: int, args, policy: TierSchedule | None) -> dict:
    spec = engine.spec
    # Enough requests that C stay in flight for the whole window (a window that outlasts them ends early).
    n_req = c + math.ceil(4 * (args.warmup_steps + args.steps) * c * (spec.steps + 1) / args.min_new) + 1
    # and for a --min-seconds window: no sequence commits more than ~2000 tokens/s here (C = 1, speculation: ~1600)
    n_req += math.ceil(args.min_seconds * 2000 * c / args.min_new)
    reqs = make_requests(n_req, args.prompt_len, engine.cfg.vocab_size, args.min_new, args.max_new, args.seed)
    started = time.perf_counter()
    gc.collect()
    gc.disable()  # a collection inside a timed window is noise of the size the targets care about
    try:
        st = DecodeLoop(engine, pool, variant, policy, run_ahead=args.run_ahead,
                        wait_at_request_end=args.wait_at_request_end).run(
            reqs, c, warmup_steps=args.warmup_steps, max_steps=args.steps, min_seconds=args.min_seconds)
    finally:
        gc.enable()
    return {"variant": variant, "concurrency": c, "tokens": st.tokens, "seconds": st.seconds,
            "tokens_per_s": st.tokens_per_s, "steps": st.steps, "mean_accept": st.mean_accept,
            "accept_by_tier": st.mean_accept_by_tier, "switches": st.switches,
            "graph_misses": st.graph_misses, "catch_ups": st.catch_ups, "wall_s": time.perf_counter() - started,
            "outputs": {**st.partial, **st.outputs}}


def crossover(results: dict, cs: list[int]) -> int:
    """The largest C at which speculation beat plain decode (0: it never did)."""
    wins = [c for c in cs if results.get(("spec", c), {}).get("tokens_per_s", 0)
            > results.get(("plain", c), {}).get("tokens_per_s", math.inf)]
    return max(wins, default=0)


def choose_threshold(results: dict, cs: list[int]) -> tuple[int, int]:
    """The policy's ``(off_above, on_at_or_below)`` from this run's plain and spec figures.

    ``off_above`` is the candidate (0 or a swept C) under which "speculate at C <= off_above" loses the
    least throughput summed over the sweep, relative to the better mode at each C: one noisy win of
    speculation at a large C cannot drag the threshold up, as taking the largest winning C would.
    ``on_at_or_below`` is the swept C below it (hysteresis: a server whose batch shrinks back to the
    threshold does not flip modes every step). The two-tier case of :func:`bench.decode_tiers.choose_bounds`."""
    if not any(("spec", c) in results and ("plain", c) in results for c in cs):
        raise ValueError("--threshold auto needs the plain and spec variants; pass --threshold N instead")
    bounds = decode_tiers.choose_bounds(results, cs, ["spec"])
    return bounds[0][1:] if bounds else (0, 0)


def tier_bounds(args: argparse.Namespace, results: dict, gpu: bool, tp, engine) -> tuple[list, str]:
    """The tiers variant's ``(mode, off_above, on_at_or_below)`` per speculative tier, and how they were chosen:
    ``--tier-bounds``, else on a GPU from this run's fixed tiers (every rank takes rank 0's), else fixed at the
    smallest C (a CPU run times nothing)."""
    if args.tier_bounds != "auto":
        return [(m, *b) for m, b in zip(engine.tiers, args.tier_bounds)], "(--tier-bounds)"
    if not gpu:
        fixed = decode_tiers.cpu_bounds(args.concurrency, len(engine.tiers))
        return ([(m, *b) for m, b in zip(engine.tiers, fixed)],
                "(fixed at the smallest C on CPU, so the tiered runs take every tier; not chosen from timings)")
    modes = {"spec": "verify", **fixed_tier_variants(engine)}
    chosen = decode_tiers.choose_bounds(results, args.concurrency, list(modes))
    if tp is not None:
        chosen = tp.broadcast(chosen)
    # Plain decode won everywhere: the longest tier at batch size 0 only, so the schedule never speculates.
    return [(modes[v], off, on) for v, off, on in chosen] or [("verify", 0, 0)], "(from this run's fixed tiers)"


def cpu_threshold(cs: list[int]) -> tuple[int, int]:
    """A CPU smoke run's fixed ``(off_above, on_at_or_below)``: the smallest swept C, so the dynamic runs
    take both modes (speculating there, plain above), whatever the eager twin's timings say."""
    off = min(cs)
    return off, off


def match_rate(a: dict, b: dict) -> dict:
    """Requests with output in both runs, compared over the tokens both produced (runs stop mid-request):
    the share of requests whose common prefix is identical, and the share of equal tokens."""
    common = sorted(set(a) & set(b))
    pairs = [(a[r][:n], b[r][:n]) for r in common for n in [min(len(a[r]), len(b[r]))] if n]
    same = sum(x == y for x, y in pairs)
    toks = sum(len(x) for x, _ in pairs)
    eq = sum(p == q for x, y in pairs for p, q in zip(x, y))
    return {"requests": len(pairs), "identical": same / len(pairs) if pairs else None,
            "tokens": eq / toks if toks else None}


def main(argv: list[str] | None = None) -> int:
    args = resolve(parse_args(argv))
    check_machine(args)
    if args.tp > 1:  # every rank runs `run`; see bench/engine/tp_launch.py
        if args.min_seconds:
            raise SystemExit("--min-seconds cannot be used with --tp: each rank would end its windows on its own "
                             "clock, after a different number of steps, and the ranks' collectives would deadlock")
        backend = "nccl" if args.device.startswith("cuda") else "gloo"
        return run_ranks(run, args.tp, (args,), backend=backend, check=args.tp_check)[0]
    return run(None, args)


def run(tp, args: argparse.Namespace) -> int:
    """The benchmark on one process, or on one tensor-parallel rank (``tp``; only rank 0 writes files)."""
    if tp is not None and args.device.startswith("cuda"):
        args.device = f"cuda:{torch.cuda.current_device()}"  # the launcher set this rank's GPU
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    cfg = PRESETS[args.size].model()
    spec = SpecConfig(topk=args.topk, steps=args.draft_steps, num_draft_tokens=args.num_draft_tokens,
                      draft_noise=args.draft_noise, draft_select=args.draft_select)
    gpu = args.device.startswith("cuda")
    if not gpu:
        print("decode_loop: CPU smoke run of the code path: graphpool's eager twin calls the step functions "
              "(no CUDA graphs), so this run is not a speed measurement: it shows what ran (graphs, steps by mode, "
              "outputs against plain decoding) and draws no crossover, threshold or roofline conclusion. Run on a "
              "CUDA GPU for those.", flush=True)
    print(f"decode_loop: {args.size} model ({cfg.num_layers} layers, hidden {cfg.hidden_size}, MLP "
          f"{cfg.intermediate_size}, {count(total_params(cfg))} parameters) in {args.dtype} on {args.device}"
          + ("" if gpu else " (eager twin)")
          + (f", tensor parallel over {tp.size} ranks" if tp is not None else "")
          + f"; C in {args.concurrency}; draft tree topk {spec.topk} x steps {spec.steps}, "
          f"{spec.num_draft_tokens} tokens verified per sequence; draft noise {spec.draft_noise}; "
          f"outputs {args.min_new}-{args.max_new} tokens, {args.steps} timed steps per run", flush=True)
    t0 = time.perf_counter()
    try:
        use_skinny(args.skinny == "on")  # before the pool captures
        engine, pool = build(cfg, spec, args.concurrency, args.prompt_len, args.max_new, args.device,
                             dtype_from_name(args.dtype), args.backend, seed=args.seed, progress=True, tp=tp,
                             attention=args.attention, kernels=args.kernels, tiers=args.tier_specs)
    except ValueError as exc:  # an option this machine cannot serve (fused kernels on a CPU, say): say which
        raise SystemExit(f"decode_loop: {exc}") from None
    kernels = "fused" if engine.target.fused else "torch"
    selection = "fused" if engine.fused_draft_select else "torch"
    selection += " (auto)" if spec.draft_select == "auto" else ""
    graphs = len(pool.graph_keys)
    print(f"built engine and captured {graphs} graphs in {time.perf_counter() - t0:.1f} s "
          f"({pool.stats.backend} backend, {engine.attention} attention, {kernels} kernels, {selection} "
          f"draft selection, skinny GEMM {args.skinny}, run-ahead {args.run_ahead})", flush=True)
    keys = key_len(engine.max_context, 1)
    device_name = torch.cuda.get_device_name(args.device) if gpu else ""
    hw = device_roof(device_name) if gpu else None
    if gpu and hw is None:
        print(f"decode_loop: no roofline figures for {device_name} (bench/engine/costs.py DEVICE_ROOFS): the roofline "
              f"table and its two checks are left out", flush=True)
    roofline = roofline_table(cfg, spec, args.concurrency, keys, **hw) if hw else None
    roofline_ms = {c: (plain_step(cfg, c, keys, **hw).seconds * 1e3, spec_step(cfg, spec, c, keys, **hw).seconds * 1e3)
                   for c in args.concurrency} if hw else {}
    if roofline:
        print(roofline + "\n" + ROOFLINE_LEGEND, flush=True)
    results: dict = {}
    first = [v for v in args.variants if v not in CHOSEN]
    second = [v for v in args.variants if v in CHOSEN]
    total, done = len(args.variants) * len(args.concurrency), 0
    threshold = resume = bounds = None
    if gpu:  # first-use costs (cuBLAS picking kernels for new shapes, NCCL's lazy set-up, allocator growth,
        # clocks) would land in the first timed point of each variant: run each untimed at the smallest C first
        warm = argparse.Namespace(**{**vars(args), "min_seconds": 0.5})
        for v in first:
            run_variant(engine, pool, v, args.concurrency[0], warm, None)
    for phase in (first, second):
        if phase is second and phase:
            if args.threshold != "auto":
                threshold = resume = int(args.threshold)
                how = "(--threshold)"
            elif gpu:
                threshold, resume = choose_threshold(results, args.concurrency)
                if tp is not None:  # chosen from rank-local timings: every rank must use rank 0's choice
                    threshold, resume = tp.broadcast((threshold, resume))
                how = f"(from this run; spec beat plain up to C = {crossover(results, args.concurrency)})"
            else:
                threshold, resume = cpu_threshold(args.concurrency)
                how = "(fixed at the smallest C on CPU, so dynamic runs both modes; not chosen from timings)"
            print(f"speculation threshold: off above batch size {threshold}, back on at <= {resume} {how}",
                  flush=True)
            if "tiers" in phase:
                bounds, how = tier_bounds(args, results, gpu, tp, engine)
                print(f"tiers: {decode_tiers.schedule(bounds, pool.modes).describe()} {how}", flush=True)
        for c in args.concurrency:
            for v in phase:
                policy = (SpeculationPolicy(threshold, resume) if v.startswith("dynamic")
                          else decode_tiers.schedule(bounds, pool.modes) if v == "tiers" else None)
                r = results[(v, c)] = run_variant(engine, pool, v, c, args, policy)
                done += 1
                steps = ", ".join(f"{n} {k.replace('_decode', ' decode')}" for k, n in r["steps"].items() if n)
                speed = f"{r['tokens_per_s']:>10.1f} tok/s  " if gpu else ""  # the eager twin's: no measurement
                accept = f"{r['mean_accept']:.2f}" if r["mean_accept"] else "-"
                print(f"[{done}/{total}] {label(v):<10} C={c:<4} {speed}steps: {steps}  accept {accept}  "
                      f"misses {r['graph_misses']}  ({r['wall_s']:.1f} s)", flush=True)
    for (v, c), r in results.items():
        if v != "plain" and ("plain", c) in results:
            r["match_vs_plain"] = match_rate(results[("plain", c)]["outputs"], r["outputs"])
    rows = [{k: val for k, val in r.items() if k != "outputs"} for r in results.values()]
    checks = check_targets(results, args.concurrency) if gpu else [
        {"concurrency": c, "misses": sum(r["graph_misses"] for (_, rc), r in results.items() if rc == c)}
        for c in args.concurrency]
    meta = {"device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__,
            "runs_on": "cuda graphs" if pool.stats.backend == "cuda" else "eager twin (smoke run, no speed measurement)",
            "size": args.size, "dtype": args.dtype, "model": cfg.__dict__, "spec": spec.__dict__,
            "threshold": threshold, "resume_at": resume, "roofline": roofline.splitlines() if roofline else None,
            "tiers": {m: t.__dict__ for m, t in engine.tiers.items()}, "tier_bounds": bounds,
            "crossover": crossover(results, args.concurrency) if gpu else None,
            "graph_stats": {"replays": pool.stats.replays, "misses": dict(pool.stats.misses),
                            "graph_mib": pool.stats.graph_bytes / 2**20,
                            "graph_mib_by_mode": {m: pool.stats.mode_bytes(m) / 2**20 for m in pool.modes}},
            "graph_table": pool.stats.table(),
            "attention": engine.attention, "kernels": kernels,
            "draft_select": "fused" if engine.fused_draft_select else "torch", "skinny": args.skinny,
            "args": {k: v for k, v in vars(args).items() if k != "outputs"}, "total_s": time.perf_counter() - t0,
            "tp": tp.size if tp is not None else 1}
    modes = pool.modes
    identity = None
    if args.identity_check:
        if tp is not None:
            raise SystemExit("--identity-check runs a single-process float32 engine; run it without --tp")
        attention = "torch" if engine.attention == "torch" else "flashinfer-reference"
        del engine, pool  # the check builds its own float32 engine
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
        print(f"float32 greedy identity check ({attention} attention) ...", flush=True)
        identity = greedy_identity(cfg, spec, attention, args.device, args.kernels, prompt_len=args.prompt_len,
                                   run_ahead=args.run_ahead, seed=args.seed, tiers=args.tier_specs)
        print(f"identity: {identity}", flush=True)
    passed = acceptance(results, args.concurrency, checks, roofline_ms, identity)
    if tp is None or tp.rank == 0:
        outputs = args.outputs
        json_path, png_path = outputs.paths
        with outputs:  # both files or neither: an interrupt here leaves the previous pair as it was
            outputs.temporary(json_path).write_text(json.dumps(
                {"meta": meta, "results": rows, "checks": checks, "identity": identity, "acceptance": passed},
                indent=1, default=str))
            png = plot(results, args.concurrency, outputs.temporary(png_path),
                       title=f"{args.size} model, {args.dtype}, {meta['device']}" + (f", TP {tp.size}" if tp else ""),
                       gpu=gpu)
        print(f"wrote {json_path}" + (f" and {png_path}" if png else ""))
    print(meta["graph_table"])
    print(explain(STATS_LEGEND.format(verify=modes["verify"].tokens_per_seq, prefill=modes["prefill"].tokens_per_seq,
                                      mib="" if gpu else " (0 on the eager twin: no graphs)")
                  + (" " + TIERS_LEGEND if args.tier_specs else "")))
    note = ""
    if threshold is not None and gpu:
        seen = (f"spec beat plain up to C = {meta['crossover']}" if meta["crossover"] else "spec never beat plain")
        chosen = (f"dynamic speculated at batch size <= {threshold} (back on at <= {resume})" if threshold
                  else "dynamic decoded plainly at every batch size")
        note = f"crossover: {seen}; {chosen}"
    if identity is not None and not gpu:
        print(acceptance_lines(passed[-1:]))
    if gpu:
        print(table(results, args.concurrency, checks, note))
        print(f"acceptance (issue 11), {meta['attention']} attention, {kernels} kernels:")
        print(acceptance_lines(passed))
    else:
        print(steps_table(results, args.concurrency))
        steps = sum(sum(r["steps"].values()) for r in results.values())
        misses = sum(row["misses"] for row in checks)
        same, compared = identical(results)
        print(f"CPU smoke run done in {time.perf_counter() - t0:.1f} s: {graphs} graphs, {steps} timed steps over "
              f"{len(results)} runs, {misses} graph misses; runs identical to plain decode: {same} of {compared}. "
              "Speed, crossover and targets: run on a CUDA GPU.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

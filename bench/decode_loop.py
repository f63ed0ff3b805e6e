"""End-to-end decode-loop benchmark: plain decode vs speculation vs dynamic speculation, all on graphs.

For each concurrency C, requests arrive so that C are always in flight, and output tokens/s is
measured for four ways of running the steps:

  (i)   plain       every step a plain-decode graph
  (ii)  spec        every step a speculative graph (draft tree + verify + greedy acceptance)
  (iii) dynamic     SpeculationPolicy picks per step; both modes replayed from graphs (graphpool)
  (iv)  dyn-eager   the same choice, but plain steps run eagerly (a runner with verify graphs only)

Writes JSON and a PNG plot and prints a table last. On a CPU it runs a tiny model on the pool's eager
twin (no CUDA graphs), in well under a minute: the numbers then show the loop works, not GPU speed.

    python bench/decode_loop.py            # tiny on CPU (eager twin), or the full sweep on a GPU
    python bench/decode_loop.py --quick    # a shorter GPU sweep
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from bench.engine.config import ModelConfig, SpecConfig, dtype_from_name  # noqa: E402
from bench.engine.harness import build  # noqa: E402
from bench.engine.loop import DecodeLoop, make_requests  # noqa: E402
from bench.decode_report import LABELS, check_targets, plot, table  # noqa: E402
from graphpool import SpeculationPolicy  # noqa: E402

log = logging.getLogger("decode_loop")

FULL_C = [1, 2, 4, 8, 10, 16, 32, 64, 128]
QUICK_C = [1, 4, 16, 32, 128]
CPU_C = [1, 2, 4, 8]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    p.add_argument("--size", default="auto", choices=["auto", "small", "tiny"],
                   help="model size: small (hidden 2048, 8 layers) on GPU, tiny on CPU by default")
    p.add_argument("--dtype", default="auto", help="bf16 or fp32 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--concurrency", default=None, help=f"comma list (default GPU {FULL_C}, CPU {CPU_C})")
    p.add_argument("--quick", action="store_true", help=f"C in {QUICK_C} and fewer steps")
    p.add_argument("--variants", default="plain,spec,dynamic,dynamic_eager_plain")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 48 GPU, 10 CPU)")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--min-seconds", type=float, default=None,
                   help="each timed window lasts at least this long (default 0.4 GPU, 0 CPU)")
    p.add_argument("--threshold", default="auto",
                   help="speculate at batch sizes <= this; 'auto' takes the plain/spec crossover measured "
                        "in this run (needs both plain and spec)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 32 GPU, 12 CPU")
    p.add_argument("--min-new", type=int, default=None, help="default 64 GPU, 8 CPU")
    p.add_argument("--max-new", type=int, default=None, help="default 128 GPU, 24 CPU")
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--draft-steps", type=int, default=4)
    p.add_argument("--num-draft-tokens", type=int, default=16)
    p.add_argument("--draft-noise", type=float, default=None, help="default: the SpecConfig default")
    p.add_argument("--backend", default="auto", help="graphpool backend: auto, cuda or eager")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/decode_loop", help="output prefix (.json and .png)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the device-dependent defaults."""
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = args.device.startswith("cuda")
    args.size = args.size if args.size != "auto" else ("small" if gpu else "tiny")
    args.dtype = args.dtype if args.dtype != "auto" else ("bf16" if gpu else "fp32")
    if args.concurrency:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    else:
        args.concurrency = (QUICK_C if args.quick else FULL_C) if gpu else CPU_C
    small = args.size == "small"
    args.steps = args.steps or ((24 if args.quick else 48) if gpu else 10)
    if args.min_seconds is None:
        args.min_seconds = (0.25 if args.quick else 0.4) if gpu else 0.0
    args.prompt_len = args.prompt_len or (32 if small else 12)
    args.min_new = args.min_new or (64 if small else 8)
    args.max_new = args.max_new or (128 if small else 24)
    args.variants = [v for v in args.variants.split(",") if v]
    return args


def run_variant(engine, pool, variant: str, c: int, args, policy: SpeculationPolicy | None) -> dict:
    spec = engine.spec
    # Enough requests that C stay in flight for the whole window (a window that outlasts them ends early).
    n_req = c + math.ceil(4 * (args.warmup_steps + args.steps) * c * (spec.steps + 1) / args.min_new) + 1
    reqs = make_requests(n_req, args.prompt_len, engine.cfg.vocab_size, args.min_new, args.max_new, args.seed)
    started = time.perf_counter()
    gc.collect()
    gc.disable()  # a collection inside a timed window is noise of the size the targets care about
    try:
        st = DecodeLoop(engine, pool, variant, policy).run(reqs, c, warmup_steps=args.warmup_steps,
                                                           max_steps=args.steps, min_seconds=args.min_seconds)
    finally:
        gc.enable()
    return {"variant": variant, "concurrency": c, "tokens": st.tokens, "seconds": st.seconds,
            "tokens_per_s": st.tokens_per_s, "steps": st.steps, "mean_accept": st.mean_accept,
            "graph_misses": st.graph_misses, "catch_ups": st.catch_ups, "wall_s": time.perf_counter() - started,
            "outputs": st.outputs}


def crossover(results: dict, cs: list[int]) -> int:
    """The largest C at which speculation beat plain decode (0: it never did)."""
    wins = [c for c in cs if results.get(("spec", c), {}).get("tokens_per_s", 0)
            > results.get(("plain", c), {}).get("tokens_per_s", math.inf)]
    return max(wins, default=0)


def match_rate(a: dict, b: dict) -> dict:
    """Requests finished in both runs: the share with identical outputs, and the share of equal tokens."""
    common = sorted(set(a) & set(b))
    same = sum(a[r] == b[r] for r in common)
    toks = sum(len(a[r]) for r in common)
    eq = sum(x == y for r in common for x, y in zip(a[r], b[r]))
    return {"requests": len(common), "identical": same / len(common) if common else None,
            "tokens": eq / toks if toks else None}


def main(argv: list[str] | None = None) -> int:
    args = resolve(parse_args(argv))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    cfg = ModelConfig.small() if args.size == "small" else ModelConfig.tiny()
    kw = {} if args.draft_noise is None else {"draft_noise": args.draft_noise}
    spec = SpecConfig(topk=args.topk, steps=args.draft_steps, num_draft_tokens=args.num_draft_tokens, **kw)
    gpu = args.device.startswith("cuda")
    print(f"decode_loop: {args.size} model ({cfg.num_layers} layers, hidden {cfg.hidden_size}) in {args.dtype} on "
          f"{args.device}" + ("" if gpu else " using graphpool's eager twin (no CUDA graphs on CPU)")
          + f"; C in {args.concurrency}; draft tree topk {spec.topk} x steps {spec.steps}, "
          f"{spec.num_draft_tokens} tokens verified per sequence", flush=True)
    t0 = time.perf_counter()
    engine, pool = build(cfg, spec, args.concurrency, args.prompt_len, args.max_new, args.device,
                         dtype_from_name(args.dtype), args.backend, seed=args.seed, progress=True)
    print(f"built engine and captured {len(pool.keys.keys)} graphs in {time.perf_counter() - t0:.1f} s "
          f"({pool.stats.backend} backend)", flush=True)
    results: dict = {}
    first = [v for v in args.variants if not v.startswith("dynamic")]
    second = [v for v in args.variants if v.startswith("dynamic")]
    total, done = len(args.variants) * len(args.concurrency), 0
    threshold = None
    for phase in (first, second):
        if phase is second and phase:
            threshold = (crossover(results, args.concurrency) if args.threshold == "auto" else int(args.threshold))
            print(f"speculation threshold: speculate at batch size <= {threshold}"
                  + (" (the measured plain/spec crossover)" if args.threshold == "auto" else ""), flush=True)
        for c in args.concurrency:
            for v in phase:
                policy = SpeculationPolicy(threshold) if v.startswith("dynamic") else None
                r = results[(v, c)] = run_variant(engine, pool, v, c, args, policy)
                done += 1
                print(f"[{done}/{total}] {LABELS[v]:<10} C={c:<4} {r['tokens_per_s']:>10.1f} tok/s  steps {r['steps']}"
                      f"  accept {r['mean_accept'] or float('nan'):.2f}  misses {r['graph_misses']}  ({r['wall_s']:.1f} s)", flush=True)
    for (v, c), r in results.items():
        if v != "plain" and ("plain", c) in results:
            r["match_vs_plain"] = match_rate(results[("plain", c)]["outputs"], r["outputs"])
    rows = [{k: val for k, val in r.items() if k != "outputs"} for r in results.values()]
    checks = check_targets(results, args.concurrency)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__,
            "size": args.size, "dtype": args.dtype, "model": cfg.__dict__, "spec": spec.__dict__,
            "threshold": threshold, "graph_stats": {"replays": pool.stats.replays, "misses": dict(pool.stats.misses),
                                                    "graph_mib": pool.stats.graph_bytes / 2**20},
            "args": {k: v for k, v in vars(args).items()}, "total_s": time.perf_counter() - t0}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": rows, "checks": checks}, indent=1,
                                                   default=str))
    png = plot(results, args.concurrency, out.with_suffix(".png"), title=f"{args.size} model, {args.dtype}, {meta['device']}")
    print(f"wrote {out.with_suffix('.json')}" + (f" and {png}" if png else ""))
    print(pool.stats.table())
    print(table(results, args.concurrency, checks, gpu))
    return 0


if __name__ == "__main__":
    sys.exit(main())

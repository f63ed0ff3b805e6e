"""Where a decode step's time goes at C = 1: torch.profiler over plain and speculative steps of the decode loop.

For each engine configuration (attention backend x elementwise kernels) the script serves one long request
through :class:`bench.engine.loop.DecodeLoop` (plain decode, speculation with run-ahead, and speculation
reading the accept lengths after every step) under ``torch.profiler``, and reads off the GPU timeline, per
step (a step starts at its graph's staging kernel, graphpool's first node):

* kernels per step, and the GPU busy time (union of kernel and copy intervals) by category: GEMM,
  attention, the engine's Triton kernels, staging, copies, other torch kernels;
* the step period (staging kernel to staging kernel) and the GPU idle time in it (period - busy), and
  where it waited: each gap of at least ``MIN_WAIT_US`` with the kernels before and after it (a gap before
  the next step's staging kernel is the GPU waiting for the host's next launch; one inside the step is
  the step's own);
* host time per step: the interval between the host's graph launches (inflated by the profiler's own
  per-op cost; the unprofiled step time is printed beside it).

The roofline of each step (:mod:`bench.engine.costs`) is printed next to it. GPU only (on a CPU it says so)::

    python bench/profile_step.py                         # torch/torch, torch/fused, flashinfer/fused
    python bench/profile_step.py --configs flashinfer:fused --trace out/trace.json.gz
"""
from __future__ import annotations

import argparse
import gzip
import json
import logging
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from bench.engine.attention import key_len  # noqa: E402
from bench.engine.config import ModelConfig, SpecConfig, dtype_from_name  # noqa: E402
from bench.engine.costs import plain_step, spec_step  # noqa: E402
from bench.engine import gemv  # noqa: E402
from bench.engine.draft_select import DRAFT_SELECT  # noqa: E402
from bench.engine.harness import BLAS, build, select_blas  # noqa: E402
from bench.engine.loop import DecodeLoop, make_requests  # noqa: E402

log = logging.getLogger("profile_step")

CATEGORIES = [  # first match wins
    ("staging", re.compile(r"_stage_kernel")),
    ("triton", re.compile(r"^_(add_rmsnorm|rope_qk|silu_mul|store_kv|kv_indices|pack_mask|level|embed_rmsnorm|argmax_rows|select|accept|rope_q_store_kv)_kernel")),
    ("attention", re.compile(r"flashinfer|BatchPrefill|BatchDecode|PrefillWith|DecodeWith|MergeStates|fmha|flash|"
                             r"attention|efficient", re.I)),
    ("gemm", re.compile(r"gemm|gemv|skinny|split_reduce|cutlass|nvjet|xmma|cublas|splitk|wgmma", re.I)),  # the Triton GEMV and skinny GEMM too
    ("copy", re.compile(r"memcpy|memset", re.I)),
]
STEP_MARK = "_stage_kernel"  # graphpool's staging kernel: the first node of every step graph
TOP_KERNELS = 30  # kernel names kept per step kind, by GPU time
TOP_WAITS = 8     # GPU waits kept per step kind, by time
MIN_WAIT_US = 2.0  # a gap between kernels counted as a wait (launch gaps inside a graph are ~1 us)
NEXT_STEP = "(next step)"
VARIANTS = [("plain", "plain", 1), ("spec", "spec", 1), ("spec, sync per step", "spec", 0)]


def category(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if pattern.search(name):
            return cat
    return "other"


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``[start, end)`` intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def step_waits(inside: list[tuple[str, float, float]], end: float) -> list[tuple[str, str, float]]:
    """The GPU's waits in one step: ``(kernel before, kernel after, us)`` for every gap of at least
    ``MIN_WAIT_US`` between the union of the step's kernels and copies, and up to the next step's start
    (``end``; the kernel after it is ``NEXT_STEP``). Where the GPU waits says on what: a gap at the step's end
    is the host not having launched the next step yet; one inside the step is the graph's own."""
    waits, last_name, last_end = [], None, None
    for name, s, e in sorted(inside, key=lambda x: x[1]):
        if last_end is not None and s - last_end >= MIN_WAIT_US:
            waits.append((last_name, name, s - last_end))
        if last_end is None or e > last_end:
            last_name, last_end = name, min(e, end)
    if last_end is not None and end - last_end >= MIN_WAIT_US:
        waits.append((last_name, NEXT_STEP, end - last_end))
    return waits


def analyse(device_events: list[tuple[str, float, float]], launches: list[float], skip: int) -> dict:
    """Per-step medians from a GPU timeline.

    Args:
        device_events: ``(name, start_us, end_us)`` of every kernel and copy on the GPU.
        launches: start times (us) of the host's graph launches.
        skip: step marks to skip first (the prefill graph and the warm-up steps).
    Returns:
        medians over the steps between consecutive step marks (the last mark only closes a step).
    """
    events = sorted(device_events, key=lambda e: e[1])
    marks = [s for name, s, _ in events if STEP_MARK in name][skip:]
    if len(marks) < 2:
        return {"steps": 0}
    per_step, by_name, by_wait = [], {}, {}
    for a, b in zip(marks, marks[1:]):
        inside = [(n, s, e) for n, s, e in events if a <= s < b]
        for n, s, e in inside:
            count, us = by_name.get(n, (0, 0.0))
            by_name[n] = (count + 1, us + min(e, b) - s)
        for before, after, us in step_waits(inside, b):
            count, total = by_wait.get((before, after), (0, 0.0))
            by_wait[(before, after)] = (count + 1, total + us)
        kernels = [x for x in inside if category(x[0]) != "copy"]
        cats = {}
        for n, s, e in inside:
            cats.setdefault(category(n), []).append((s, min(e, b)))
        busy = union_us([(s, min(e, b)) for _, s, e in inside])
        per_step.append({"kernels": len(kernels), "busy_ms": busy / 1e3, "period_ms": (b - a) / 1e3,
                         "idle_ms": (b - a - busy) / 1e3, **{f"{c}_ms": union_us(v) / 1e3 for c, v in cats.items()}})
    out = {"steps": len(per_step)}
    for key in sorted({k for row in per_step for k in row}):
        out[key] = statistics.median(row.get(key, 0.0) for row in per_step)
    host = sorted(t for t in launches if marks[0] - 1e5 <= t <= marks[-1])
    gaps = [b - a for a, b in zip(host, host[1:])]
    out["host_ms"] = statistics.median(gaps) / 1e3 if gaps else None
    steps = len(per_step)
    out["top_kernels"] = [{"name": n, "per_step": c / steps, "us_per_step": us / steps}
                          for n, (c, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]]
    out["top_waits"] = [{"after": before, "before": after, "per_step": c / steps, "us_per_step": us / steps}
                        for (before, after), (c, us) in sorted(by_wait.items(), key=lambda kv: -kv[1][1])[:TOP_WAITS]]
    return out


def timeline(prof) -> tuple[list[tuple[str, float, float]], list[float]]:
    """The GPU's kernels and copies ``(name, start_us, end_us)`` and the host's graph-launch times (us),
    read from the profiler's raw events (building its per-op event tree is much slower and not needed)."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    device, launches = [], []
    for e in prof.profiler.kineto_results.events():
        kind, start = e.device_type(), e.start_ns() / 1e3
        if kind == cuda:
            device.append((e.name(), start, start + e.duration_ns() / 1e3))
        elif kind == cpu and e.name().startswith("cudaGraphLaunch"):
            launches.append(start)
    return device, launches


def write_trace(prof, path: Path) -> None:
    """The profile as a gzipped chrome trace at ``path``."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)


def profile_variant(engine, pool, variant: str, run_ahead: int, warmup: int, steps: int, max_new: int,
                    trace: Path | None) -> dict:
    """Serve one request for ``warmup + steps`` steps under the profiler; the timeline analysis, plus the
    same run's step time without the profiler."""
    from torch.profiler import ProfilerActivity, profile
    cfg = engine.cfg
    req = make_requests(1, engine.prompt_len, cfg.vocab_size, max_new, max_new, seed=5)
    loop = DecodeLoop(engine, pool, variant, run_ahead=run_ahead)
    plain = loop.run(req, 1, warmup_steps=warmup, max_steps=steps, keep_outputs=False)  # unprofiled timing
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        st = loop.run(req, 1, warmup_steps=warmup, max_steps=steps, keep_outputs=False)
    torch.cuda.synchronize()
    device, launches = timeline(prof)
    if trace is not None:
        write_trace(prof, trace)
    out = analyse(device, launches, skip=1 + warmup + 1)  # the prefill, the warm-up, the synced first step
    n_steps = sum(plain.steps.values())
    out.update(ms_per_step=1e3 * plain.seconds / n_steps if n_steps else None,
               tokens_per_step=plain.tokens / n_steps if n_steps else None, mean_accept=plain.mean_accept,
               profiled_ms_per_step=1e3 * st.seconds / max(sum(st.steps.values()), 1))
    return out


def profile_window(engine, pool, variant: str, steps: int, min_new: int, max_new: int,
                   trace: Path | None = None) -> dict:
    """The decode loop's own C = 1 window (``bench/decode_loop.py --quick``: its requests, 3 warm-up steps,
    ``steps`` timed), unprofiled then profiled: every graph period of the window (a decode, verify or prefill
    graph, from its staging kernel to the next) with its kernels, GPU busy and idle time and longest wait, so
    that request ends and prefills show beside the steady steps."""
    import gc
    from torch.profiler import ProfilerActivity, profile
    cfg = engine.cfg
    reqs = make_requests(8, engine.prompt_len, cfg.vocab_size, min_new, max_new, seed=0)
    loop = DecodeLoop(engine, pool, variant, run_ahead=1)
    # As decode_loop.py runs it: a first pass absorbs first-use costs (the first request switch compiles and
    # loads kernels: run AN's first pass took ~2x as long), and no garbage collection inside the windows.
    gc.collect()
    gc.disable()
    try:
        loop.run(reqs, 1, warmup_steps=3, max_steps=steps, keep_outputs=False)
        plain = loop.run(reqs, 1, warmup_steps=3, max_steps=steps, keep_outputs=False)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            loop.run(reqs, 1, warmup_steps=3, max_steps=steps, keep_outputs=False)
        torch.cuda.synchronize()
    finally:
        gc.enable()
    if trace is not None:
        write_trace(prof, trace)
    events, _ = timeline(prof)
    events.sort(key=lambda e: e[1])
    marks = [s for name, s, _ in events if STEP_MARK in name]
    periods = []
    for a, b in zip(marks, marks[1:]):
        inside = [(n, s, e) for n, s, e in events if a <= s < b]
        busy = union_us([(s, min(e, b)) for _, s, e in inside])
        waits = step_waits(inside, b)
        longest = max(waits, key=lambda w: w[2]) if waits else ("", "", 0.0)
        periods.append({"kernels": sum(category(n) != "copy" for n, _, _ in inside), "busy_us": busy,
                        "period_us": b - a, "idle_us": b - a - busy, "waits_us": sum(w[2] for w in waits),
                        "longest": f"{longest[2]:.1f} us {longest[0][:40]} -> {longest[1][:40]}"})
    n = sum(plain.steps.values())
    return {"variant": variant, "ms_per_step": 1e3 * plain.seconds / n, "tokens_per_s": plain.tokens_per_s,
            "steps": n, "periods": periods}


def window_table(w: dict) -> str:
    lines = [f"window of the decode loop at C = 1, {w['variant']}: {w['steps']} timed steps, {w['ms_per_step']:.3f} "
             f"ms/step, {w['tokens_per_s']:.1f} tok/s unprofiled; profiled graph periods (us):",
             f"{'#':>3} {'kern':>5} {'period':>8} {'busy':>8} {'idle':>7} {'waits':>7}  longest wait"]
    for i, p in enumerate(w["periods"]):
        lines.append(f"{i:>3} {p['kernels']:>5} {p['period_us']:>8.1f} {p['busy_us']:>8.1f} {p['idle_us']:>7.1f} "
                     f"{p['waits_us']:>7.1f}  {p['longest']}")
    tot = {k: sum(p[k] for p in w["periods"]) for k in ("period_us", "busy_us", "idle_us")}
    lines.append(f"total {tot['period_us'] / 1e3:.3f} ms: busy {tot['busy_us'] / 1e3:.3f}, idle {tot['idle_us'] / 1e3:.3f}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="torch:torch,torch:fused,flashinfer:fused",
                   help="comma list of attention:kernels (attention torch|flashinfer, kernels torch|fused)")
    p.add_argument("--size", default="medium", choices=["medium", "small", "tiny"])
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=12, help="profiled steps per variant (after the warm-up)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new", type=int, default=112)
    p.add_argument("--draft-noise", type=float, default=0.2)
    p.add_argument("--draft-select", default="auto", choices=DRAFT_SELECT,
                   help="the speculative step's selection and acceptance: torch ops, Triton kernels, or auto "
                        "(the kernels on CUDA)")
    p.add_argument("--blas", default="default", choices=BLAS,
                   help="torch's preferred BLAS library for the GEMMs (default: torch's choice)")
    p.add_argument("--gemv", default="on", choices=["on", "off"],
                   help="16-bit products of one token through the engine's Triton GEMV (on, the default) or the "
                        "BLAS library like every other GEMM (bench/engine/gemv.py)")
    p.add_argument("--skinny", default="on", choices=["on", "off"],
                   help="16-bit products of 2-16 tokens through the engine's skinny tensor-core GEMM "
                        "(bench/engine/skinny.py) or the BLAS library (off)")
    p.add_argument("--out", default="out/profile_step", help="output prefix (.json)")
    p.add_argument("--trace", default=None, help="also write the last config's spec trace (chrome, gzipped) here")
    p.add_argument("--trace-all", action="store_true", help="with --trace: every variant's trace, named by variant")
    p.add_argument("--window", action="store_true",
                   help="also profile the decode loop's own C = 1 windows (plain and spec; its requests, 40 steps) "
                        "with the last config, period by period")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if not torch.cuda.is_available():
        print("profile_step: needs a CUDA GPU (the profile reads the GPU timeline); nothing to do on CPU")
        return 0
    blas = select_blas(args.blas, "cuda")
    gemv.use_gemv(args.gemv == "on")  # before the engine captures its graphs
    gemv.use_skinny(args.skinny == "on")
    cfg = getattr(ModelConfig, args.size)()
    spec = SpecConfig(draft_noise=args.draft_noise, draft_select=args.draft_select)
    if (args.warmup + args.steps) * (spec.steps + 1) > args.max_new:
        raise SystemExit(f"--max-new {args.max_new} is too short for {args.warmup + args.steps} speculative steps")
    results, rows = {}, []
    configs = [c.split(":") for c in args.configs.split(",") if c]
    for i, (attention, kernels) in enumerate(configs):
        started = time.perf_counter()
        engine, pool = build(cfg, spec, [1], args.prompt_len, args.max_new, "cuda", dtype_from_name(args.dtype),
                             attention=attention, kernels=kernels)
        keys = key_len(engine.max_context, 1)
        roof = {"plain": plain_step(cfg, 1, keys).seconds * 1e3, "spec": spec_step(cfg, spec, 1, keys).seconds * 1e3}
        print(f"{attention}/{kernels}: built and captured in {time.perf_counter() - started:.1f} s", flush=True)
        for label, variant, ahead in VARIANTS:
            trace = None
            if args.trace and i == len(configs) - 1 and (label == "spec" or args.trace_all):
                trace = Path(args.trace)
                if label != "spec":  # --trace-all: the other variants beside it, named by variant
                    trace = trace.with_name(trace.name.split(".")[0] + "_" + re.sub(r"\W+", "_", label) + ".json.gz")
            r = profile_variant(engine, pool, variant, ahead, args.warmup, args.steps, args.max_new, trace)
            r.update(config=f"{attention}/{kernels}", step=label, roofline_ms=roof[variant])
            results[f"{attention}/{kernels}/{label}"] = r
            rows.append(r)
            print(f"  {label}: {r.get('kernels', 0):.0f} kernels, busy {r.get('busy_ms', 0):.3f} ms, period "
                  f"{r.get('period_ms', 0):.3f} ms, {r['ms_per_step']:.3f} ms/step unprofiled", flush=True)
        if args.window and i == len(configs) - 1:
            for variant in ("plain", "spec"):
                trace = Path(args.trace).with_name(f"window_{variant}.json.gz") if args.trace else None
                w = profile_window(engine, pool, variant, 40, 96, 112, trace)
                results[f"{attention}/{kernels}/window {variant}"] = w
                print(window_table(w), flush=True)
        del engine, pool
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                    "model": args.size, "dtype": args.dtype, "blas": blas,
                                                    "gemv": args.gemv, "skinny": args.skinny, "results": results},
                                                   indent=1, default=str))
    print(f"wrote {out.with_suffix('.json')}")
    print(f"GEMMs through {blas}; the Triton GEMV at one token {args.gemv}; the skinny GEMM at 2-16 tokens {args.skinny}")
    print(table(rows))
    print(kernel_table(rows[-2]))  # the last config's speculative step: what to fuse next
    return 0


def kernel_table(row: dict) -> str:
    """The step's kernels by GPU time: launches and microseconds per step, name shortened; then where the
    GPU waited (gaps of at least ``MIN_WAIT_US``): times and microseconds per step, between which kernels."""
    lines = [f"top kernels of {row['config']} {row['step']} (per step): launches, us, name"]
    for k in row.get("top_kernels", []):
        lines.append(f"{k['per_step']:>6.1f} {k['us_per_step']:>8.1f}  {k['name'][:110]}")
    lines.append(f"GPU waits >= {MIN_WAIT_US:g} us of {row['config']} {row['step']} (per step): times, us, "
                 "after -> before")
    for w in row.get("top_waits", []):
        lines.append(f"{w['per_step']:>6.1f} {w['us_per_step']:>8.1f}  {w['after'][:60]} -> {w['before'][:60]}")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    """The summary, one line per (config, step kind); times are per step, medians (ms)."""
    cats = ["gemm", "attention", "triton", "other", "staging", "copy"]
    head = (f"{'config':<17} {'step':<20} {'kern':>5} {'step ms':>8} {'roof ms':>8} {'x roof':>6} {'busy':>7} "
            f"{'idle':>6} {'host':>6} " + " ".join(f"{c[:6]:>6}" for c in cats) + f" {'tok/step':>8}")
    lines = ["per step at C = 1 (ms, medians): step = unprofiled loop time; busy/idle = GPU in the profiled step "
             "period; host = between graph launches (profiled)", head]
    for r in rows:
        if not r.get("steps"):
            lines.append(f"{r['config']:<17} {r['step']:<20} no GPU steps found in the profile")
            continue
        host = f"{r['host_ms']:>6.3f}" if r.get("host_ms") is not None else f"{'-':>6}"
        lines.append(f"{r['config']:<17} {r['step']:<20} {r['kernels']:>5.0f} {r['ms_per_step']:>8.3f} "
                     f"{r['roofline_ms']:>8.3f} {r['ms_per_step'] / r['roofline_ms']:>6.2f} {r['busy_ms']:>7.3f} "
                     f"{r['idle_ms']:>6.3f} {host} " + " ".join(f"{r.get(c + '_ms', 0.0):>6.3f}" for c in cats)
                     + f" {r['tokens_per_step']:>8.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

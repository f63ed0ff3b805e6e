"""One-token projections on the GPU: cuBLAS, cuBLASLt and the engine's Triton GEMV, per shape of the model.

A plain decode step at C = 1 is bound by reading the weights; this probe times each projection of the
model alone, the way the step runs it (inside a CUDA graph, so no launch cost is measured), with enough
weight copies that every call reads from HBM rather than from the 50 MB L2 cache. For every shape it
prints microseconds per call of one token (and of ``--m`` tokens through the libraries) and the weight
bytes per second, for

* ``cublas`` / ``cublaslt``: ``F.linear`` with torch's BLAS library set to each (gate/up: plus the SwiGLU
  kernel the model runs after it);
* ``gemv``: :func:`bench.engine.gemv.gemv` at :func:`bench.engine.gemv.gemv_config`'s choice (what the
  model runs at one token), and, with ``--sweep``, the best of a grid of ``(BLOCK_N, BLOCK_K, num_warps,
  stages)``.

With ``--skinny``, the few-token products of the speculative step instead (``--skinny-m`` rows, by
default 4, a draft level at C = 1, and 16, a verify step): cuBLAS against
:func:`bench.engine.skinny.skinny` over a grid of ``(BLOCK_N, BLOCK_K, num_warps, stages, split_k)``; the
best configuration per shape (scored as a speculative step at C = 1 uses it: four draft-level calls and
one verify call) goes to the JSON's ``skinny_best``, which ``BENCH_SKINNY_CONFIGS`` loads into the engine.

Every configuration, the swept ones too, is checked against ``F.linear`` in float32 before it is timed. GPU only::

    python bench/gemv_probe.py --sweep --json out/gemv_probe.json
    python bench/gemv_probe.py --skinny --json out/skinny_probe.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from bench.engine.config import ModelConfig, dtype_from_name  # noqa: E402
from bench.engine.fused import silu_mul  # noqa: E402
from bench.engine.gemv import gemv, gemv_config  # noqa: E402
from bench.engine.skinny import skinny, skinny_config  # noqa: E402

log = logging.getLogger("gemv_probe")

L2_FLUSH_BYTES = 256 << 20   # weight copies per shape cover this much, so each call reads HBM
SWEEP = list(itertools.product((1, 2, 4), (1024, 2048, 4096), (4, 8), (1, 3)))


# (BLOCK_N, BLOCK_K, num_warps, stages, split_k): row blocks of 32-128 (16 was 2x slower everywhere in run
# AT's first grid), stages deep enough to keep ~48-200 KB in flight per SM; over the shared memory: skipped
SKINNY_SWEEP = ([(32, bk, 4, st, sp) for bk in (128, 256) for st in (3, 4, 5) for sp in (1, 2)]
                + [(64, bk, 4, st, sp) for bk in (64, 128, 256) for st in (3, 4, 5) for sp in (1, 2, 4)
                   if (bk, st) != (64, 3)]
                + [(128, bk, w, st, sp) for bk in (64, 128) for w in (4, 8) for st in (3, 4) for sp in (1, 2, 4)])
SKINNY_USES = {4: 4, 16: 1}   # calls per speculative step at C = 1: four draft levels (4-5 rows), one verify


def sweep_configs(swiglu: bool) -> list[tuple[int, int, int, int]]:
    """The grid, less configurations over 64 float32 accumulator registers a thread (they spill)."""
    return [c for c in SWEEP if c[0] * c[1] * (2 if swiglu else 1) <= 64 * 32 * c[2]]


def model_shapes(cfg: ModelConfig, tp: int) -> list[tuple[str, int, int, bool]]:
    """``(name, weight rows, K, swiglu)`` of one layer's projections and the LM head, per rank of ``tp``."""
    q, kv, h, m = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return [("qkv", (q + 2 * kv) // tp, h, False), ("o", h, q // tp, False), ("gate_up+silu", 2 * m // tp, h, True),
            ("down", h, m // tp, False), ("lm_head", cfg.vocab_size // tp, h, False)]


def time_graph(fn, weights: list[torch.Tensor], calls: int) -> float:
    """Microseconds per call of ``fn(w)`` over ``weights`` in turn, ``calls`` calls captured in one CUDA
    graph, median of 5 replays after a warm-up replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights:  # compile and warm every path before the capture
            fn(w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(weights[i % len(weights)])
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def blas_fn(x: torch.Tensor, swiglu: bool):
    if swiglu:
        return lambda w: silu_mul(F.linear(x, w), True)
    return lambda w: F.linear(x, w)


def check(x: torch.Tensor, w: torch.Tensor, swiglu: bool, want: torch.Tensor, config, name: str) -> float:
    """The GEMV's relative error against ``want`` (``F.linear`` in float32) at ``config``; raises above 2 %,
    so a configuration that computes something else is never timed, let alone picked."""
    got = gemv(x, w, silu=swiglu, config=config)
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    if err > 2e-2:
        raise AssertionError(f"{name}: the GEMV at {config or 'its default config'} differs from F.linear by "
                             f"{err:.3g} (relative)")
    return err


def probe(shapes, ms, dtype, sweep: bool) -> list[dict]:
    rows = []
    for name, n_rows, k, swiglu in shapes:
        nbytes = n_rows * k * dtype.itemsize
        copies = max(2, math.ceil(L2_FLUSH_BYTES / nbytes))
        gen = torch.Generator(device="cuda").manual_seed(0)
        weights = [(torch.randn(n_rows, k, device="cuda", generator=gen) * k ** -0.5).to(dtype) for _ in range(copies)]
        calls = max(20, copies)
        for m in ms:
            x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
            want = blas_fn(x.float(), swiglu)(weights[0].float())
            row = {"shape": name, "n": n_rows, "k": k, "m": m, "mbytes": nbytes / 1e6}
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                row[lib] = time_graph(blas_fn(x, swiglu), weights, calls)
            torch.backends.cuda.preferred_blas_library("default")
            if m == 1:
                row["gemv_rel_err"] = check(x, weights[0], swiglu, want, None, name)
                row["gemv_config"] = list(gemv_config(n_rows // 2 if swiglu else n_rows, k, swiglu))
                row["gemv"] = time_graph(lambda w: gemv(x, w, silu=swiglu), weights, calls)
                if sweep:
                    timed = {}
                    for c in (c for c in sweep_configs(swiglu) if c[1] <= k):
                        check(x, weights[0], swiglu, want, c, name)
                        timed[c] = time_graph(lambda w, c=c: gemv(x, w, silu=swiglu, config=c), weights, calls)
                    best = min(timed, key=timed.get)
                    row["sweep_best"], row["sweep_config"] = timed[best], list(best)
                    row["sweep"] = {",".join(map(str, c)): us for c, us in timed.items()}
            rows.append(row)
            log.info("%s", format_row(row))
        del weights
        torch.cuda.empty_cache()
    return rows


def probe_skinny(shapes, ms, dtype) -> tuple[list[dict], list[dict]]:
    """cuBLAS and every :data:`SKINNY_SWEEP` configuration of the skinny GEMM at each of ``ms`` rows, per
    shape (the LM head has the o projection's shape and is not repeated); returns the rows and the best
    configuration per shape, scored by :data:`SKINNY_USES`."""
    rows, best = [], []
    for name, n_rows, k, swiglu in shapes:
        if name == "lm_head":
            continue
        n = n_rows // 2 if swiglu else n_rows
        nbytes = n_rows * k * dtype.itemsize
        copies = max(2, math.ceil(L2_FLUSH_BYTES / nbytes))
        gen = torch.Generator(device="cuda").manual_seed(0)
        weights = [(torch.randn(n_rows, k, device="cuda", generator=gen) * k ** -0.5).to(dtype) for _ in range(copies)]
        calls = max(20, copies)
        xs = {m: torch.randn(m, k, device="cuda", generator=gen).to(dtype) for m in ms}
        timed: dict[tuple, dict[int, float]] = {}
        for c in [skinny_config(n, k, swiglu)] + [c for c in SKINNY_SWEEP if c != skinny_config(n, k, swiglu)]:
            if k % c[4] or (k // c[4]) % c[1]:
                continue
            try:
                for m, x in xs.items():
                    want = blas_fn(x.float(), swiglu)(weights[0].float())
                    got = skinny(x, weights[0], silu=swiglu, config=c)
                    err = ((got.float() - want).abs().max() / want.abs().max()).item()
                    if err > 2e-2:
                        raise AssertionError(f"{name}: the skinny GEMM at {c} differs from F.linear by {err:.3g}")
                timed[c] = {m: time_graph(lambda w, c=c, x=x: skinny(x, w, silu=swiglu, config=c), weights, calls)
                            for m, x in xs.items()}
            except AssertionError:
                raise
            except Exception as exc:  # out of shared memory or registers: not a candidate
                log.info("%s %s skipped: %s", name, c, str(exc).splitlines()[0][:100])
        cublas = {m: time_graph(blas_fn(x, swiglu), weights, calls) for m, x in xs.items()}
        score = lambda t: sum(SKINNY_USES.get(m, 1) * t[m] for m in ms)  # noqa: E731
        top = min(timed, key=lambda c: score(timed[c]))
        best.append({"shape": name, "n": n, "k": k, "silu": swiglu, "config": list(top), "us": timed[top],
                     "cublas_us": cublas, "step_us": score(timed[top]), "cublas_step_us": score(cublas)})
        for m in ms:
            rows.append({"shape": name, "n": n_rows, "k": k, "m": m, "mbytes": nbytes / 1e6, "cublas": cublas[m],
                         "skinny_best": timed[top][m], "skinny_config": list(top),
                         "sweep": {",".join(map(str, c)): t[m] for c, t in timed.items()}})
            log.info("%s", format_skinny(rows[-1]))
        del weights
        torch.cuda.empty_cache()
    return rows, best


def format_skinny(r: dict) -> str:
    tbs = lambda us: r["mbytes"] / us  # noqa: E731
    return (f"{r['shape']:<13}{r['m']:>3}{r['mbytes']:>8.1f}{r['cublas']:>9.1f} {tbs(r['cublas']):>5.2f}"
            f"{r['skinny_best']:>9.1f} {tbs(r['skinny_best']):>5.2f}  {tuple(r['skinny_config'])}")


SKINNY_HEADER = f"{'shape':<13}{'M':>3}{'MB':>8}{'cublas':>9} {'TB/s':>5}{'skinny':>9} {'TB/s':>5}  best config   (us per call)"


def format_row(r: dict) -> str:
    tbs = lambda us: r["mbytes"] / us  # MB / us = TB/s  # noqa: E731
    line = (f"{r['shape']:<13}{r['m']:>3}{r['mbytes']:>8.1f}{r['cublas']:>9.1f}{r['cublaslt']:>9.1f}"
            f"  {tbs(min(r['cublas'], r['cublaslt'])):>5.2f}")
    if "gemv" in r:
        line += f"{r['gemv']:>8.1f} {tbs(r['gemv']):>5.2f}  {str(tuple(r['gemv_config'])):<18}"
    if "sweep_best" in r:
        line += f"{r['sweep_best']:>7.1f} {str(tuple(r['sweep_config']))}"
    return line


HEADER = (f"{'shape':<13}{'M':>3}{'MB':>8}{'cublas':>9}{'cublaslt':>9}  {'TB/s':>5}{'gemv':>8} {'TB/s':>5}  "
          f"{'gemv config':<18}{'sweep':>7} best config   (us per call)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bf16", help="bf16 or fp16 (the GEMV serves 16-bit models)")
    ap.add_argument("--m", default="1,2", help="tokens per call, comma-separated (the GEMV runs at 1)")
    ap.add_argument("--tp", type=int, default=1, help="per-rank shapes of this tensor-parallel degree")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of GEMV configurations per shape")
    ap.add_argument("--skinny", action="store_true",
                    help="the few-token products instead: cuBLAS against the skinny GEMM's grid (bench/engine/skinny.py)")
    ap.add_argument("--skinny-m", default="4,16", help="rows per call with --skinny")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        print("gemv_probe: needs a CUDA GPU (it times kernels inside CUDA graphs)")
        return 1
    dtype = dtype_from_name(args.dtype)
    if dtype not in (torch.bfloat16, torch.float16):
        ap.error(f"--dtype must be bf16 or fp16, got {args.dtype}")
    ms = [int(m) for m in args.m.split(",")]
    shapes = model_shapes(ModelConfig.medium(), args.tp)
    log.info("%s on %s, torch %s", args.dtype, torch.cuda.get_device_name(), torch.__version__)
    if args.skinny:
        ms = [int(m) for m in args.skinny_m.split(",")]
        log.info(SKINNY_HEADER)
        rows, best = probe_skinny(shapes, ms, dtype)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                             "dtype": args.dtype, "tp": args.tp, "rows": rows, "skinny_best": best},
                                            indent=1))
        print(SKINNY_HEADER)
        for r in rows:
            print(format_skinny(r))
        print(f"per speculative step at C = 1 ({' + '.join(f'{u} x M={m}' for m, u in SKINNY_USES.items())}), us:")
        for b in best:
            print(f"  {b['shape']:<13} cuBLAS {b['cublas_step_us']:7.1f}  skinny {b['step_us']:7.1f}  {tuple(b['config'])}")
        return 0
    log.info(HEADER)
    rows = probe(shapes, ms, dtype, args.sweep)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "dtype": args.dtype, "tp": args.tp, "rows": rows}, indent=1))
    print(HEADER)
    for r in rows:
        print(format_row(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())

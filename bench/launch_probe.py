"""Probe: what a CUDA graph launch costs the host, by the kind of node in the graph (issue 11).

The profile of the speculative step showed ``cudaGraphLaunch`` taking 180-450 us of host time for a graph of
~190 kernels, more with the Triton GEMV in the models than without. This times the host side of
``replay()`` (the GPU idle before each launch, and with the GPU busy), unprofiled, for graphs of N nodes of
one kind each, and for the engine's decode and verify graphs with the GEMV on and off.

    python bench/launch_probe.py [--nodes 188] [--engine]

Run AK in bench/RESULTS.md: unprofiled, the engine's graphs cost the host 8-10 us per replay with the GEMV on
or off; the profile's 180-460 us per ``cudaGraphLaunch`` is the profiler's own.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _tiny(x_ptr, N):
    i = tl.program_id(0)
    if i == 0:
        tl.store(x_ptr, tl.load(x_ptr) + 1)


def host_us(replay, reps: int = 60, busy: bool = False) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(2_000_000)
        t = time.perf_counter()
        replay()
        times.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times[5:])


def capture(body) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    return g


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=188)
    p.add_argument("--engine", action="store_true", help="also the engine's graphs, GEMV on and off")
    args = p.parse_args()
    dev = torch.device("cuda")
    n = args.nodes
    x = torch.zeros(1024, device=dev)
    a, b = torch.randn(16, 4096, device=dev, dtype=torch.bfloat16), torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    big = torch.zeros(1, device=dev)
    kinds = {
        "torch add": lambda: [x.add_(1) for _ in range(n)],
        "triton 1 program": lambda: [_tiny[(1,)](x, 1) for _ in range(n)],
        "triton 32000 programs": lambda: [_tiny[(32000,)](big, 1) for _ in range(n)],
        "cublas 16x4096x4096": lambda: [a @ b for _ in range(n // 2)],
    }
    print(f"host us per replay() (median), graphs of {n} nodes of one kind", flush=True)
    for name, body in kinds.items():
        g = capture(body)
        print(f"  {name:24} idle {host_us(g.replay):8.1f}   gpu busy {host_us(g.replay, busy=True):8.1f}", flush=True)
        del g
    if args.engine:
        from bench.engine import gemv
        from bench.engine.config import ModelConfig, SpecConfig
        from bench.engine.harness import build
        for on in (True, False):
            gemv.use_gemv(on)
            engine, pool = build(ModelConfig.medium(), SpecConfig(), [1], 32, 112, "cuda", torch.bfloat16,
                                 attention="flashinfer", kernels="fused")
            for mode in ("decode", "verify"):
                g = pool.graph(mode, 1)
                print(f"  engine {mode:7} gemv {'on ' if on else 'off'}   idle {host_us(g.replay):8.1f}   gpu busy "
                      f"{host_us(g.replay, busy=True):8.1f}", flush=True)
            del engine, pool
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

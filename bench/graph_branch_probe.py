"""What a side branch in a step's graph costs on the GPU (issue 14's question: can the next step's ring row
be prefetched beside the step, off its critical path?).

The default step (``bench/default_step.py``) is captured with graphpool's ring staging, and again with a
step function that forks a side stream inside the capture (the branch) and joins it at the end: an empty
kernel, a one-block kernel that reads 64 bytes of pinned host memory (what a prefetch of the ring row
does), or a host-to-device copy of 64 B / 4 KiB on the copy engine. Graphs are replayed back to back
(the host ahead of the GPU); each cell is GPU us per step (median over rounds of 20 steps, CUDA events)
and what it adds over the same graph without staging (``floor``, a ``staging="torch"`` pool replayed on
pre-staged buffers). ``floor+memcpy`` is the floor's graph with the 4 KiB copy branch. CUDA only.

Usage: ``python bench/graph_branch_probe.py [--rounds 40]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script from anywhere
import graphpool as gp  # noqa: E402
from bench import default_step  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _empty(x_ptr):
    pass


@triton.jit
def _read_host(src_addr, dst_ptr, N: tl.constexpr):
    cols = tl.arange(0, N)
    tl.store(dst_ptr + cols, tl.load(src_addr.to(tl.pointer_type(tl.int64)) + cols))


def with_branch(step_fn: Callable, work: Callable[[], None], side: torch.cuda.Stream) -> Callable:
    """``step_fn`` with ``work`` on a side stream forked at its start and joined at its end."""
    def fn(batch: gp.StepBatch):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            work()
        out = step_fn(batch)
        main.wait_stream(side)
        return out
    return fn


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=40)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("graph_branch_probe needs a CUDA GPU")
    dev = torch.device("cuda")
    modes, sizes = [gp.Mode("decode", 1), gp.Mode("verify", 16)], [1, 8, 32, 64]
    step = default_step.make(dev, 16 * sizes[-1])
    host64, host4k = (torch.zeros(n, dtype=torch.int64, pin_memory=True) for n in (8, 512))
    dev64, dev4k = (torch.zeros(n, dtype=torch.int64, device=dev) for n in (8, 512))
    side = torch.cuda.Stream(dev)
    works = {"empty-kern": lambda: _empty[(1,)](dev64, num_warps=1),
             "hostread-kern": lambda: _read_host[(1,)](host64.data_ptr(), dev64, N=8, num_warps=1),
             "memcpy-64B": lambda: dev64.copy_(host64, non_blocking=True),
             "memcpy-4KB": lambda: dev4k.copy_(host4k, non_blocking=True)}
    builds = {"floor": ("torch", step.step_fn), "ring": ("ring", step.step_fn),
              **{name: ("ring", with_branch(step.step_fn, w, side)) for name, w in works.items()},
              "floor+memcpy": ("torch", with_branch(step.step_fn, works["memcpy-4KB"], side))}
    pools = {}
    for name, (staging, fn) in builds.items():
        pools[name] = gp.GraphPool(modes, step.inputs, sizes, device=dev, staging=staging)
        pools[name].capture(fn, progress=False)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    print("GPU us per step, back to back (median over rounds of 20 steps); +x: added over floor")
    print(f"{'key':<11}" + "".join(f"{n:>16}" for n in pools), flush=True)
    for mode in modes:
        for bs in sizes:
            x = step.sample(mode, bs)
            for pool in pools.values():
                pool.run(mode.name, **x)  # stages the floor's buffers once, warms the others
            times: dict[str, list[float]] = {n: [] for n in pools}
            for _ in range(args.rounds):
                for name, pool in pools.items():
                    f = pool.graph(mode.name, bs).replay if name.startswith("floor") else \
                        (lambda pool=pool: pool.run(mode.name, **x))
                    torch.cuda.synchronize()
                    f(), f()  # lead-in: the timed steps start with the queue busy
                    start.record()
                    for _ in range(20):
                        f()
                    end.record()
                    end.synchronize()
                    times[name].append(start.elapsed_time(end) * 1e3 / 20)
            med = {n: statistics.median(v) for n, v in times.items()}
            print(f"{mode.name + ' ' + str(bs):<11}"
                  + "".join(f"{med[n]:>9.1f}{med[n] - med['floor']:>+7.1f}" for n in pools), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What handing out new tensor objects per run costs the host (issue 25: results of two runs never share a
tensor object whose metadata can be changed in place).

Two measurements, both in one process so that the machine's speed (which drifts by 2x between runs on a lent
H200 host) reaches every variant alike:

1. a two-output result (``logits``, ``next_tokens``) built alone: the shared views in a copied dict (graphpool
   before issue 25), ``detach`` from Python, the C++ extension's ``fresh_dict`` (what CUDA pools use now), and
   new slices ``t[:n]``;
2. ``pool.run`` of the embedded default step back to back (CUDA), with the result built each of those ways, in
   alternating blocks of 10 steps (the host never waits for the GPU inside a block).

The second swaps each graph's result builder, a private attribute: this probe measures the pool's internals.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import graphpool as gp
from graphpool.bench import default_step

_detach = torch.Tensor.detach


def per_call_us(fn, iters: int, repeats: int = 7) -> float:
    """Median over ``repeats`` of the mean host microseconds per call."""
    for _ in range(1000):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(samples)


def builders(keys: tuple[str, ...]) -> dict:
    """Result builders over a tuple of pre-cut views: the way before issue 25, and the ways after."""
    from graphpool.native import fresh_functions
    shared: dict[int, dict] = {}
    out = {"shared views, dict.copy (before)":
           lambda views: (shared.get(id(views)) or shared.setdefault(id(views), dict(zip(keys, views)))).copy(),
           "new views, Python detach": lambda views: dict(zip(keys, map(_detach, views))),
           "new slices, t[:n]": lambda views: {k: v[:v.shape[0]] for k, v in zip(keys, views)}}
    native = fresh_functions()
    if native is not None:
        out["new views, C++ fresh_dict (now)"] = lambda views: native[1](keys, views)
    return out


def in_pool(device: torch.device, rounds: int) -> dict[str, float]:
    """Back-to-back host us per ``pool.run`` with each result builder, blocks of 10 steps taking turns."""
    step = default_step(device, max_tokens=16 * 8)
    pool = gp.GraphPool([gp.Mode("decode", 1), gp.Mode("verify", 16)], step.inputs, [1, 8], device=device)
    pool.capture(step.step_fn, outputs=step.outputs, progress=False)
    layouts = [entry.layout for entry in pool._entries.values()]  # private: the probe swaps the builder
    keys = tuple(path[0] for path in layouts[0].paths)  # a flat dict: each leaf's path is its one key
    variants = builders(keys)
    inputs = step.sample(pool.modes["decode"], 8)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, build in variants.items():
            for entry in pool._entries.values():
                entry.fresh = build
            torch.cuda.synchronize()
            pool.run("decode", **inputs)
            pool.run("decode", **inputs)
            for _ in range(10):
                t0 = time.perf_counter()
                pool.run("decode", **inputs)
                times[name].append((time.perf_counter() - t0) * 1e6)
    pool.close()
    return {name: statistics.median(v) for name, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=300, help="blocks of 10 pool.run steps per variant (CUDA)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    logits, tokens = torch.zeros(64, 8192, device=device), torch.zeros(64, dtype=torch.int64, device=device)
    views = (logits[:5], tokens[:5])
    variants = builders(("logits", "next_tokens"))
    print(f"device {device}, torch {torch.__version__}")
    print(f"1. a two-tensor result built alone, {args.iters} per sample, median of 7")
    alone = {name: per_call_us(lambda: build(views), args.iters) for name, build in variants.items()}
    base = alone["shared views, dict.copy (before)"]
    for name, us in alone.items():
        print(f"   {name:<36} {us:6.3f} us per result   {(us - base) / 2:+.3f} us per tensor")
    if device.type != "cuda":
        print("2. pool.run back to back: CUDA only")
        return
    print(f"2. pool.run (default step, decode bs 8) back to back, median of {args.rounds} x 10 steps per variant")
    runs = in_pool(device, args.rounds)
    base = runs["shared views, dict.copy (before)"]
    for name, us in runs.items():
        print(f"   {name:<36} {us:6.3f} us per run      {us - base:+.3f} us per run")


if __name__ == "__main__":
    main()

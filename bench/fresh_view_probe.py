"""What handing out new tensor objects per run costs the host (issue 25: results of two runs never share a
tensor object). Times, back to back, the result of a two-output step built three ways: the old shared
views in a copied dict, new views (``detach`` of the pre-cut views, what ``GraphPool.run`` does now), and
new slices (``t[:n]``). Prints us per result and the difference per tensor. Runs on CPU or CUDA tensors.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200_000)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits, tokens = torch.zeros(64, 8192, device=device), torch.zeros(64, dtype=torch.int64, device=device)
    keys, views = ("logits", "next_tokens"), (logits[:5], tokens[:5])
    shared = dict(zip(keys, views))
    methods = {
        "shared views, dict.copy (before)": lambda: shared.copy(),
        "new views, detach (now)": lambda: dict(zip(keys, map(_detach, views))),
        "new slices, t[:n]": lambda: {"logits": logits[:5], "next_tokens": tokens[:5]},
    }
    print(f"device {device}, torch {torch.__version__}, {args.iters} results per sample, median of 7")
    times = {name: per_call_us(fn, args.iters) for name, fn in methods.items()}
    base = times["shared views, dict.copy (before)"]
    for name, us in times.items():
        print(f"{name:<36} {us:6.3f} us per result   {(us - base) / 2:+.3f} us per tensor")


if __name__ == "__main__":
    main()

"""Measure the draft's acceptance (tokens committed per verify step) for a model size and draft noise.

Acceptance depends on the weights and the noise, not on the device, so it can be tuned on a CPU in
float32 before a GPU run (the first H200 run, small model, bf16, noise 0.05: 4.05; this script on a
CPU in float32: 3.88). One target is built and each noise level reloads the draft's weights in place,
so the engine's captured steps keep pointing at the same tensors::

    python -m bench.engine.acceptance --size medium --noise 0.15,0.2,0.25   # ~2 min per level on 2 cores
    python -m bench.engine.acceptance --size tiny --noise 0,0.1,0.5
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from .config import ModelConfig, SpecConfig
from .engine import Engine
from .harness import build
from .loop import DecodeLoop, make_requests
from .model import build_draft


@torch.no_grad()
def set_draft_noise(engine: Engine, noise: float, seed: int = 1) -> None:
    """Redraw the draft from the target with another noise level, copying into the existing tensors."""
    fresh = build_draft(engine.target, engine.spec.draft_layers, noise, seed)
    engine.draft.load_state_dict(fresh.state_dict())


def measure(engine: Engine, pool, noises: list[float], concurrency: int, steps: int, min_new: int,
            seed: int = 0) -> dict[float, float]:
    """Mean tokens committed per sequence per verify step, for each draft noise level.

    Args:
        engine, pool: a built engine and its captured pool (decode, verify and prefill modes).
        noises: draft noise levels to try (each redraws the draft, see :func:`set_draft_noise`).
        concurrency: sequences per verify step.
        steps: verify steps per level (``concurrency x steps`` samples).
        min_new: output length of the requests (every request is at least this long, so none
            finishes within ``steps`` steps if ``min_new >= (spec.steps + 1) x steps``).
    """
    out = {}
    for noise in noises:
        set_draft_noise(engine, noise)
        reqs = make_requests(2 * concurrency, engine.prompt_len, engine.cfg.vocab_size, min_new, min_new, seed)
        st = DecodeLoop(engine, pool, "spec").run(reqs, concurrency, max_steps=steps, keep_outputs=False)
        out[noise] = st.mean_accept
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="medium", choices=["medium", "small", "tiny"])
    p.add_argument("--noise", default="0.1,0.2,0.3", help="comma list of draft noise levels")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="verify steps per noise level")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    cfg: ModelConfig = getattr(ModelConfig, args.size)()
    started = time.perf_counter()
    min_new = (SpecConfig().steps + 1) * (args.steps + 1)
    engine, pool = build(cfg, SpecConfig(), [args.concurrency], args.prompt_len, min_new, args.device,
                         prefill_batch_sizes=[args.concurrency])
    print(f"{args.size} model built in {time.perf_counter() - started:.0f} s; {args.concurrency} sequences x "
          f"{args.steps} verify steps per level (float32, {args.device})", flush=True)
    for noise in [float(x) for x in args.noise.split(",")]:
        t = time.perf_counter()
        acc = measure(engine, pool, [noise], args.concurrency, args.steps, min_new)[noise]
        print(f"draft noise {noise:<5}: {acc:.2f} tokens committed per verify step ({time.perf_counter() - t:.0f} s)",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What only real CUDA graphs can show: shared-pool memory, and staging while earlier steps are queued."""
from __future__ import annotations

import random

import pytest
import torch

import graphpool as gp
from bench import default_step

pytestmark = pytest.mark.gpu
SIZES = [1, 2, 4, 8, 16, 32, 64]


def graph_bytes(modes: list[gp.Mode]) -> int:
    device = torch.device("cuda")
    step = default_step.make(device, max_tokens=16 * SIZES[-1], hidden=1024)
    pool = gp.GraphPool(modes, step.inputs, SIZES, device=device)
    pool.capture(step.step_fn, progress=False)
    nbytes = pool.stats.graph_bytes
    del pool, step
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return nbytes


def test_decode_graphs_share_the_verify_graphs_memory():
    verify_only = graph_bytes([gp.Mode("verify", 16)])
    both = graph_bytes([gp.Mode("decode", 1), gp.Mode("verify", 16)])
    print(f"\ngraph memory: verify only {verify_only / 2**20:.1f} MiB, decode + verify {both / 2**20:.1f} MiB, "
          f"ratio {both / verify_only:.3f}")
    assert verify_only > 0
    assert both <= 1.10 * verify_only


@pytest.mark.parametrize("ring_slots", [4, 64])
def test_host_runs_ahead_of_queued_steps(ring_slots):
    """Hundreds of steps issued with no host sync: each must read its own inputs, not a later step's."""
    device = torch.device("cuda")
    step = default_step.make(device, max_tokens=16 * 16, hidden=256, dtype=torch.float32)
    modes = [gp.Mode("decode", 1), gp.Mode("verify", 16)]
    pool = gp.GraphPool(modes, step.inputs, [1, 2, 4, 8, 16], device=device, ring_slots=ring_slots)
    pool.capture(step.step_fn, progress=False)
    rng = random.Random(0)
    plan = [(rng.choice(modes), rng.randint(1, 16)) for _ in range(300)]
    inputs = [step.sample(mode, bs) for mode, bs in plan]
    torch.cuda.synchronize()
    # A long GPU job first, so the host gets far ahead of the queue.
    torch.cuda._sleep(50_000_000)
    outs = [pool.run(mode.name, copy=True, **x)["logits"] for (mode, _), x in zip(plan, inputs)]
    torch.cuda.synchronize()
    for (mode, bs), x, got in zip(plan, inputs, outs):
        want = step.step_fn(gp.StepBatch(mode, bs, bs * mode.tokens_per_seq, x, captured=False))["logits"]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"{mode.name} bs={bs}")

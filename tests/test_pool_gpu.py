"""What only real CUDA graphs can show: shared-pool memory, and staging while earlier steps are queued."""
from __future__ import annotations

import random

import pytest
import torch

import graphpool as gp
from graphpool.bench import step as default_step

pytestmark = pytest.mark.gpu
SIZES = [1, 2, 4, 8, 16, 32, 64]


def graph_bytes(modes: list[gp.Mode]) -> int:
    device = torch.device("cuda")
    step = default_step.make(device, max_tokens=16 * SIZES[-1], hidden=1024)
    pool = gp.GraphPool(modes, step.inputs, SIZES, device=device)
    pool.capture(step.step_fn, progress=False, outputs=step.outputs)
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


def pure_step(weight: torch.Tensor):
    """A step whose outputs depend on its inputs alone (no cache state), so any later eager run is an oracle."""
    def step(batch: gp.StepBatch) -> dict[str, torch.Tensor]:
        x, tps = batch.inputs, batch.mode.tokens_per_seq
        per_seq = (x["seq_lens"].float() * 3 + x["req_pool_indices"].float()).repeat_interleave(tps)
        per_token = (x["input_ids"] * 2 + x["positions"] + x["out_cache_loc"]).float() + x["out_cache_loc_swa"].float()
        return {"logits": torch.sin((per_token + per_seq)[:, None] * 1e-3) @ weight}
    return step


@pytest.mark.parametrize("ring_slots", [4, 64])
def test_host_runs_ahead_of_queued_steps(ring_slots):
    """Hundreds of steps issued with no host sync: each must read its own inputs, not a later step's."""
    device = torch.device("cuda")
    sampler = default_step.make(device, max_tokens=16 * 16, hidden=64, dtype=torch.float32)
    step = pure_step(torch.randn(1, 256, device=device))
    modes = [gp.Mode("decode", 1), gp.Mode("verify", 16)]
    pool = gp.GraphPool(modes, sampler.inputs, [1, 2, 4, 8, 16], device=device, ring_slots=ring_slots)
    pool.capture(step, progress=False, outputs="token")
    rng = random.Random(0)
    plan = [(rng.choice(modes), rng.randint(1, 16)) for _ in range(300)]
    inputs = [sampler.sample(mode, bs) for mode, bs in plan]
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # a long GPU job first, so the host gets far ahead of the queue
    outs, lag = [], 0
    for (mode, _), x in zip(plan, inputs):
        outs.append(pool.run(mode.name, copy=True, **x)["logits"])
        lag = max(lag, pool.steps_in_flight)
    assert lag == ring_slots, f"the host got {lag} steps ahead of the GPU; the ring should have filled"
    torch.cuda.synchronize()
    for (mode, bs), x, got in zip(plan, inputs, outs):
        want = step(gp.StepBatch(mode, bs, bs * mode.tokens_per_seq, x, captured=False))["logits"]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{mode.name} bs={bs}")


@pytest.mark.parametrize("ring_slots", [4, 64])
def test_ten_thousand_steps_run_ahead_with_inputs_dropped_and_cache_emptied(ring_slots):
    """The host runs ahead of queued replays; each step's inputs are dropped right after run() (only a
    clone is kept, for the oracle), and the caching allocator returns free memory to the driver every 100
    steps: the pool must keep every input alive until the GPU has read it. 0 mismatches allowed."""
    device = torch.device("cuda")
    sampler = default_step.make(device, max_tokens=16 * 16, hidden=64, dtype=torch.float32)
    step = pure_step(torch.randn(1, 256, device=device))
    modes = [gp.Mode("decode", 1), gp.Mode("verify", 16)]
    pool = gp.GraphPool(modes, sampler.inputs, [1, 2, 4, 8, 16], device=device, ring_slots=ring_slots)
    pool.capture(step, progress=False, outputs="token")
    rng = random.Random(ring_slots)
    kept, outs, lag = [], [], 0
    torch.cuda.synchronize()
    for i in range(10_000):
        if i % 1000 == 0:
            torch.cuda._sleep(200_000_000)  # a long GPU job now and then (~0.1 s), so the host gets ahead of the queue
        mode, bs = rng.choice(modes), rng.randint(1, 16)
        inputs = sampler.sample(mode, bs)
        kept.append((mode, bs, {k: v.clone() for k, v in inputs.items()}))
        outs.append(pool.run(mode.name, copy=True, **inputs)["logits"])
        del inputs
        lag = max(lag, pool.steps_in_flight)
        if i % 100 == 99:
            torch.cuda.empty_cache()
    torch.cuda.synchronize()
    bad = 0
    for (mode, bs, x), got in zip(kept, outs):
        want = step(gp.StepBatch(mode, bs, bs * mode.tokens_per_seq, x, captured=False))["logits"]
        bad += not torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    print(f"\nring {ring_slots}: 10000 steps, host up to {lag} steps ahead, {bad} mismatches")
    # Seen on the H200: 4 of 4 and 54 of 64 slots filled; at least 32 proves the host ran well ahead.
    assert bad == 0 and lag >= min(ring_slots - 1, 32)

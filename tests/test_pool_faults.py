"""Randomized fault injection: thousands of steps mixing valid steps with every kind of misuse.

Valid steps, every kind of bad input, steps whose step function or ``prepare`` raises midway, direct graph
replays, staging without replaying, inputs dropped right after ``stage``, and callers mutating returned
containers, in random order. Every valid step must equal the eager reference on its own unpadded inputs
(so no step ever stages another step's inputs), and every bad one must raise its documented typed error.
"""
from __future__ import annotations

import gc
import random

import pytest
import torch

import graphpool as gp
from test_pool import ToyStep, eager_reference, make_inputs, random_step

MODES = [gp.Mode("decode", 1), gp.Mode("verify", 4)]
SIZES = [1, 2, 3, 4, 8]
STEPS = 2000

# (device, staging, with a prepare hook)
SETUPS = [pytest.param(("cpu", "ring", False), marks=pytest.mark.interpreter),
          pytest.param(("cpu", "ring", True), marks=pytest.mark.interpreter), ("cpu", "torch", True),
          pytest.param(("cuda", "ring", False), marks=pytest.mark.gpu),
          pytest.param(("cuda", "ring", True), marks=pytest.mark.gpu)]


def bad_inputs(kind: str, good: dict, device: str) -> tuple[str, dict, type]:
    """A step broken in one way, and the error it must raise."""
    x = dict(good)
    if kind == "missing":
        x.pop("positions")
        return "verify", x, gp.MissingInputError
    if kind == "unknown":
        x["extra"] = x["positions"]
        return "verify", x, gp.MissingInputError
    if kind == "dtype":
        x["seq_lens"] = x["seq_lens"].long()
        return "verify", x, gp.InputDtypeError
    if kind == "device":
        x["positions"] = x["positions"].to("meta")
        return "verify", x, gp.InputDeviceError
    if kind == "type":
        x["input_ids"] = x["input_ids"].tolist()
        return "verify", x, gp.InputTypeError
    if kind == "trailing":
        x["features"] = torch.zeros(x["features"].shape[0], 2, device=device)
        return "verify", x, gp.InputShapeError
    if kind == "rows":  # the origin story: a plain-decode batch sent to a verify graph
        return "verify", {k: v[: v.shape[0] // 4] if k in ("input_ids", "positions", "out_cache_loc", "features")
                          else v for k, v in x.items()}, gp.InputRowsError
    if kind == "layout":
        x["features"] = x["features"].t().contiguous().t()
        return "verify", x, gp.InputLayoutError
    if kind == "mode":
        return "Verify", x, gp.UnknownModeError
    raise ValueError(kind)


BAD_KINDS = ("missing", "unknown", "dtype", "device", "type", "trailing", "rows", "layout", "mode")
ACTIONS = ("valid",) * 6 + ("bad", "step_raises", "prepare_raises", "direct_replay", "stage_only", "drop_inputs",
                            "mutate_outputs", "too_large")


@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: f"{s[0]}-{s[1]}-{'prepare' if s[2] else 'no_prepare'}")
def test_random_faults_never_corrupt_a_valid_step(setup):
    device, staging, with_prepare = setup
    pool = gp.GraphPool(MODES, make_inputs(), SIZES, device=device, staging=staging, on_miss="raise")
    step, reference = ToyStep(device), ToyStep(device)
    fail = {"step": False, "prepare": False}

    def step_fn(batch):
        out = step(batch)
        if fail["step"]:
            raise RuntimeError("injected step failure")
        return out

    def prepare(batch, real_bs):
        if fail["prepare"]:
            raise RuntimeError("injected prepare failure")

    pool.capture(step_fn, prepare=prepare if with_prepare else None, progress=False)
    rng = random.Random(20261130)
    counts: dict[str, int] = {}

    def check(mode: gp.Mode, inputs: dict, got: dict, what: str) -> None:
        want = eager_reference(reference, mode, inputs)
        for name in ("logits", "pooled"):
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=f"{what} {name}")

    for i in range(STEPS):
        action = rng.choice(ACTIONS)
        if action == "step_raises" and device == "cuda":
            action = "prepare_raises"  # a CUDA graph does not call the step function at replay
        if action == "prepare_raises" and not with_prepare:
            action = "valid"
        counts[action] = counts.get(action, 0) + 1
        mode = rng.choice(MODES)
        bs = rng.randint(1, SIZES[-1])
        inputs = random_step(mode, bs, device, rng)
        what = f"step {i} ({action}, {mode.name} bs={bs})"
        if action == "valid":
            check(mode, inputs, pool.run(mode.name, copy=True, **inputs), what)
        elif action == "bad":
            name, broken, error = bad_inputs(rng.choice(BAD_KINDS), random_step(MODES[1], bs, device, rng), device)
            with pytest.raises(error):
                pool.run(name, **broken)
        elif action in ("step_raises", "prepare_raises"):
            fail["step" if action == "step_raises" else "prepare"] = True
            try:
                with pytest.raises(RuntimeError, match="injected"):
                    pool.run(mode.name, **inputs)
            finally:
                fail["step"] = fail["prepare"] = False
        elif action == "direct_replay":
            pool.graph(mode.name, rng.choice(SIZES)).replay()
        elif action == "stage_only":
            pool.stage(mode.name, **inputs)
        elif action == "drop_inputs":
            kept = {k: v.clone() for k, v in inputs.items()}
            staged = pool.stage(mode.name, **inputs)
            del inputs
            gc.collect()
            junk = [torch.full((1024,), -99, dtype=torch.int64, device=device) for _ in range(8)]  # noqa: F841 (reuses the freed blocks)
            got = {k: v.clone() for k, v in pool.replay(staged).items()}
            del junk
            check(mode, kept, got, what)
        elif action == "mutate_outputs":
            out = pool.run(mode.name, **inputs)
            check(mode, inputs, {k: v.clone() for k, v in out.items()}, what)
            out.pop("logits")
            out["pooled"] = torch.zeros(1, device=device)
        elif action == "too_large":
            big = random_step(mode, SIZES[-1] + 1, device, rng)
            with pytest.raises(gp.BatchTooLargeError):
                pool.run(mode.name, **big)
    assert counts.get("valid", 0) > STEPS // 3 and all(counts.get(a, 0) > 0 for a in set(ACTIONS) - {
        "step_raises", "prepare_raises"}), counts

"""Randomized fault injection: every kind of misuse, each several times, in random order, each followed
by a valid step.

Valid steps, every kind of bad input (aliasing the static buffers and nested tensors included), steps
whose step function or ``prepare`` raises midway, direct graph replays, staging without replaying, inputs
dropped right after ``stage``, callers mutating returned containers and their tensors' metadata, and
re-captures with a declaration that cannot hold. Every valid step must equal the eager reference on its
own unpadded inputs (so no step ever stages another step's inputs), an output that is not indexed by row
must come back whole, and every bad step must raise its documented typed error.

Coverage comes from the deck, not from the number of steps: each action kind appears ``repeats`` times,
shuffled, with a checked valid step after each, so a fault that corrupts the next step cannot hide. By
default each kind comes twice (once may follow any other); the long version (``--runslow``, CI) six times.
"""
from __future__ import annotations

import gc
import random

import pytest
import torch

import graphpool as gp
from test_pool import TOY_OUTPUTS, ToyStep, eager_reference, make_inputs, random_step

MODES = [gp.Mode("decode", 1), gp.Mode("verify", 4)]
SIZES = [1, 2, 3, 4, 8]
STAT = 8  # rows of an output that is not indexed by row: as many as the largest graph's, by coincidence

# (device, staging, with a prepare hook)
SETUPS = [pytest.param(("cpu", "ring", False), marks=pytest.mark.interpreter),
          pytest.param(("cpu", "ring", True), marks=pytest.mark.interpreter), ("cpu", "torch", True),
          pytest.param(("cuda", "ring", False), marks=pytest.mark.gpu),
          pytest.param(("cuda", "ring", True), marks=pytest.mark.gpu)]


def bad_inputs(kind: str, good: dict, pool: gp.GraphPool) -> tuple[str, dict, type]:
    """A step broken in one way, and the error it must raise."""
    x, device = dict(good), good["positions"].device
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
    if kind == "alias":  # a view into another input's static buffer: staging would overwrite what it reads
        x["positions"] = pool.static_inputs["input_ids"][:x["positions"].shape[0]]
        return "verify", x, gp.InputLayoutError
    if kind == "nested":  # the input the batch size is read from
        x["seq_lens"] = torch.nested.nested_tensor(list(x["seq_lens"].split(1)))
        return "verify", x, gp.InputLayoutError
    if kind == "mode":
        return "Verify", x, gp.UnknownModeError
    raise ValueError(kind)


BAD_KINDS = ("missing", "unknown", "dtype", "device", "type", "trailing", "rows", "layout", "alias", "nested", "mode")
ACTIONS = (*(f"bad:{k}" for k in BAD_KINDS), "step_raises", "prepare_raises", "direct_replay", "stage_only",
           "drop_inputs", "mutate_outputs", "mutate_metadata", "too_large", "misdeclared")


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("repeats", [2, pytest.param(6, marks=pytest.mark.slow)])
@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: f"{s[0]}-{s[1]}-{'prepare' if s[2] else 'no_prepare'}")
def test_random_faults_never_corrupt_a_valid_step(setup, repeats):
    device, staging, with_prepare = setup
    pool = gp.GraphPool(MODES, make_inputs(), SIZES, device=device, staging=staging, on_miss="raise")
    step, reference = ToyStep(device), ToyStep(device)
    stat = torch.arange(float(STAT), device=device)
    fail = {"step": False, "prepare": False}

    def step_fn(batch):
        out = step(batch)
        if fail["step"]:
            raise RuntimeError("injected step failure")
        return {**out, "stat": stat * 1}  # undeclared: returned whole

    def prepare(batch, real_bs):
        if fail["prepare"]:
            raise RuntimeError("injected prepare failure")

    def capture(outputs=TOY_OUTPUTS):
        pool.capture(step_fn, prepare=prepare if with_prepare else None, progress=False, outputs=outputs)

    capture()
    rng = random.Random(20261201)

    def check(mode: gp.Mode, inputs: dict, got: dict, what: str) -> None:
        want = eager_reference(reference, mode, inputs)
        for name in ("logits", "pooled"):
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=f"{what} {name}")
        assert torch.equal(got["stat"], stat), f"{what}: an output not indexed by row came back as {got['stat']}"

    def valid(what: str) -> None:
        mode, bs = rng.choice(MODES), rng.randint(1, SIZES[-1])
        inputs = random_step(mode, bs, device, rng)
        check(mode, inputs, pool.run(mode.name, copy=True, **inputs), f"{what}, then {mode.name} bs={bs}")

    deck = [a for a in ACTIONS for _ in range(repeats)]
    rng.shuffle(deck)
    for i, action in enumerate(deck):
        if action == "step_raises" and device == "cuda":
            action = "prepare_raises"  # a CUDA graph does not call the step function at replay
        if action == "prepare_raises" and not with_prepare:
            action = "direct_replay"
        mode, bs = rng.choice(MODES), rng.randint(1, SIZES[-1])
        inputs = random_step(mode, bs, device, rng)
        what = f"step {i} ({action}, {mode.name} bs={bs})"
        if action.startswith("bad:"):
            name, broken, error = bad_inputs(action[4:], random_step(MODES[1], bs, device, rng), pool)
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
            got = pool.replay(staged, copy=True)
            del junk
            check(mode, kept, got, what)
        elif action == "mutate_outputs":
            out = pool.run(mode.name, **inputs)
            check(mode, inputs, {k: v.clone() for k, v in out.items()}, what)
            out.pop("logits")
            out["pooled"] = torch.zeros(1, device=device)
        elif action == "mutate_metadata":  # in-place metadata changes of one result's tensors
            out = pool.run(mode.name, **inputs)
            out["logits"].unsqueeze_(0)
            out["stat"].resize_(2)
            out["pooled"].t_()
        elif action == "too_large":
            big = random_step(mode, SIZES[-1] + 1, device, rng)
            with pytest.raises(gp.BatchTooLargeError):
                pool.run(mode.name, **big)
        elif action == "misdeclared":  # a declaration that cannot hold refuses the capture, then a good one
            with pytest.raises(gp.CaptureError, match="'stat' has shape"):
                capture({**TOY_OUTPUTS, "stat": rng.choice(["token", "seq"])})
            with pytest.raises(gp.CaptureError, match="last capture failed"):
                pool.run(mode.name, **inputs)
            capture()
        valid(what)

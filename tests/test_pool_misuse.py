"""Misuse a second review of the pool found: each case says what went wrong before, and checks the fix
against the eager oracle or the documented error. CPU (the eager twin, ring staging through Triton's
interpreter) and, marked ``gpu``, real CUDA graphs."""
from __future__ import annotations

import gc
import math
import random
import threading
import weakref

import pytest
import torch

import graphpool as gp
from test_pool import TOY_OUTPUTS, ToyStep, eager_reference, make_inputs, random_step
from test_pool_contract import pool_for as toy_pool

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SETUPS = [("cpu", "torch"), pytest.param(("cpu", "ring"), marks=pytest.mark.interpreter),
          pytest.param(("cuda", "ring"), marks=pytest.mark.gpu)]
MODES = [gp.Mode("decode", 1), gp.Mode("verify", 4)]
SIZES = [1, 2, 4, 8]


def assert_matches(got: dict, toy: ToyStep, mode: gp.Mode, inputs: dict, what: str = "") -> None:
    want = eager_reference(toy, mode, inputs)
    for name in ("logits", "pooled"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=f"{what} {name}")


# Aliasing inputs ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setup", SETUPS, ids="-".join)
def test_an_input_overlapping_the_static_buffers_is_refused_and_the_staged_step_survives(setup):
    """Before: torch staging failed inside the stager after earlier inputs were copied, and the step staged
    before it replayed the refused step's values."""
    device, staging = setup
    pool, toy = toy_pool(device, staging)
    rng = random.Random(0)
    good = random_step(MODES[0], 3, device, rng)
    staged = pool.stage("decode", **good)
    for name, into in (("positions", "positions"), ("positions", "input_ids"), ("seq_lens", "seq_lens")):
        bad = random_step(MODES[0], 3, device, rng)
        buffer = pool.static_inputs[into]
        bad[name] = buffer[1:4] if buffer.dtype == bad[name].dtype else buffer.view(bad[name].dtype)[1:4]
        with pytest.raises(gp.InputLayoutError, match=rf"input {name!r} shares memory with the pool's static buffers"):
            pool.stage("decode", **bad)
    assert_matches(pool.replay(staged, copy=True), toy, MODES[0], good, "the staged step")


@pytest.mark.parametrize("setup", SETUPS, ids="-".join)
def test_an_input_that_is_its_own_static_buffer_stages_without_a_copy(setup):
    device, staging = setup
    pool, toy = toy_pool(device, staging)
    inputs = random_step(MODES[1], 3, device, random.Random(1))
    own = pool.static_inputs["positions"][: inputs["positions"].shape[0]]
    own.copy_(inputs["positions"])
    got = pool.run("verify", copy=True, **dict(inputs, positions=own))
    assert_matches(got, toy, MODES[1], inputs)


# Declarations ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_float_bounds_are_compared_as_floats(device):
    """Before: bounds went through int(): (0.0, 2.5) refused 2.2, (0.5, 10) accepted 0.2, (0, inf) raised
    OverflowError."""
    def pool_with(bounds, fill):
        pool = gp.GraphPool([gp.Mode("decode", 1)], [gp.StepInput("temp", torch.float32, "seq", fill=fill,
                                                                  bounds=bounds)], [4], device=device, debug=True)
        pool.capture(lambda b: b.inputs["temp"] * 2, progress=False, outputs="seq")
        return pool
    run = lambda pool, v: pool.run("decode", temp=torch.tensor(v, device=device))  # noqa: E731
    assert run(pool_with((0.0, 2.5), 1.0), [2.2, 0.1]).tolist() == pytest.approx([4.4, 0.2])
    with pytest.raises(gp.IndexBoundsError, match=r"'temp' row 0 .* outside its bounds \[0.5, 10\)"):
        run(pool_with((0.5, 10), 1.0), [0.2])
    assert run(pool_with((0, math.inf), 1.0), [1e30]).tolist() == pytest.approx([2e30])
    with pytest.raises(TypeError, match="bounds must be"):
        gp.StepInput("temp", torch.float32, bounds=(0, float("nan")))


def test_self_is_not_an_input_name():
    """Before: accepted, then run/stage failed with "got multiple values for argument 'self'"."""
    with pytest.raises(ValueError, match=r"\['self'\] collide with GraphPool.run's own parameters"):
        gp.GraphPool([gp.Mode("decode", 1)], [gp.StepInput("self", torch.int64)], [1])


def test_a_float_fill_rounds_as_floats_do():
    """Before: StepInput("top_p", float32, fill=0.9) was refused as not representable."""
    pool = gp.GraphPool([gp.Mode("decode", 1)], [gp.StepInput("top_p", torch.float32, "seq", fill=0.9)], [4],
                        device="cpu")
    pool.capture(lambda b: b.inputs["top_p"] * 1, progress=False)
    pool.run("decode", top_p=torch.tensor([0.5]))
    assert pool.static_inputs["top_p"][1:].tolist() == [torch.tensor(0.9).item()] * 3
    with pytest.raises(ValueError, match="not representable in torch.float16"):
        gp.StepInput("x", torch.float16, fill=1e6)


# Inputs of the wrong form ---------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("device", DEVICES)
def test_a_nested_tensor_as_the_batch_size_input_is_a_layout_error(device):
    """Before: torch's "NestedTensorImpl doesn't support sizes" escaped, on CPU and CUDA pools alike."""
    pool, toy = toy_pool(device)
    inputs = random_step(MODES[0], 2, device, random.Random(2))
    inputs["seq_lens"] = torch.nested.nested_tensor(list(inputs["seq_lens"].split(1)))
    with pytest.raises(gp.InputLayoutError, match="'seq_lens' is a nested tensor"):
        pool.run("decode", **inputs)


@pytest.mark.parametrize("device", DEVICES)
def test_two_dimensional_token_ids_are_told_to_flatten(device):
    """Before: "its trailing shape must be ()", with no word of flattening HF's [bs, T] input_ids."""
    pool, _ = toy_pool(device)
    inputs = random_step(MODES[1], 2, device, random.Random(3))
    inputs["input_ids"] = inputs["input_ids"].view(2, 4)
    with pytest.raises(gp.InputShapeError, match=r"rows are flat .* input_ids.reshape\(-1\)"):
        pool.run("verify", **inputs)


@pytest.mark.parametrize("device", DEVICES)
def test_an_input_without_its_row_dimension_is_told_the_rule_and_the_fix(device):
    """Before: a 0-dim seq_lens got "has shape (): declared rows x (), so its trailing shape must be ()"."""
    pool, toy = toy_pool(device)
    inputs = random_step(MODES[0], 1, device, random.Random(4))
    for name, bad, message in (
            ("seq_lens", inputs["seq_lens"][0], r"'seq_lens' has shape \(\), without the row dimension .* one row "
                                                r"per sequence .* must be \(rows,\); for one sequence, pass "
                                                r"seq_lens.unsqueeze\(0\)"),
            ("features", inputs["features"][0], r"'features' has shape \(3,\), without the row dimension .* must be "
                                                r"\(rows, 3\); for one token, pass features.unsqueeze\(0\)")):
        with pytest.raises(gp.InputShapeError, match=message):
            pool.run("decode", **{**inputs, name: bad})
        fixed = pool.run("decode", copy=True, **{**inputs, name: bad.unsqueeze(0)})  # the fix it names works
        assert_matches(fixed, toy, MODES[0], inputs, f"{name} fixed")


def test_a_mode_object_is_accepted_and_a_foreign_one_named():
    """Before: a Mode (as pool.modes and StepBatch.mode hand out) got "add Mode(Mode(name='decode', ...)"."""
    pool, toy = toy_pool("cpu")
    inputs = random_step(MODES[1], 3, "cpu", random.Random(4))
    assert_matches(pool.run(pool.modes["verify"], copy=True, **inputs), toy, MODES[1], inputs)
    assert pool.route(pool.modes["decode"], 3) == 4 and pool.can_run(MODES[0], 8)
    with pytest.raises(gp.UnknownModeError, match=r"is not one of this pool's modes") as info:
        pool.run(gp.Mode("verify", 2), **inputs)
    assert "Mode(Mode(" not in str(info.value)


# The step's own state -------------------------------------------------------------------------------------
@pytest.mark.parametrize("setup", SETUPS, ids="-".join)
def test_batch_inputs_are_read_only_on_every_stager(setup):
    """Before: a prepare that added a key to batch.inputs worked with torch staging and failed capture with
    ring staging ("pack_into expected 3 items (got 4)"): batch.inputs was the pool's own dict."""
    device, staging = setup
    pool = gp.GraphPool(MODES, make_inputs(), SIZES, device=device, staging=staging)
    toy = ToyStep(device)

    def prepare(batch, real_bs):
        batch.inputs["attn_meta"] = batch.inputs["seq_lens"] + 1

    with pytest.raises(gp.CaptureError) as info:
        pool.capture(toy, prepare=prepare, progress=False, outputs=TOY_OUTPUTS)
    assert isinstance(info.value.__cause__, TypeError) and "StepBatch.inputs is read-only" in str(info.value)
    pool.capture(toy, progress=False, outputs=TOY_OUTPUTS)  # the same pool captures and runs after that
    inputs = random_step(MODES[0], 5, device, random.Random(5))
    assert_matches(pool.run("decode", copy=True, **inputs), toy, MODES[0], inputs)


@pytest.mark.parametrize("setup", [pytest.param(("cpu", "ring"), marks=pytest.mark.interpreter),
                                   pytest.param(("cuda", "ring"), marks=pytest.mark.gpu)], ids="-".join)
def test_close_drops_the_inputs_the_ring_held(setup):
    """Before: close() kept the caller's inputs of the last ring_slots steps referenced."""
    device, staging = setup
    pool, _ = toy_pool(device, staging, ring_slots=4)
    inputs = random_step(MODES[0], 2, device, random.Random(6))
    refs = [weakref.ref(t) for t in inputs.values()]
    pool.run("decode", **inputs)
    del inputs
    gc.collect()
    assert any(r() is not None for r in refs), "the ring holds a running step's inputs"
    pool.close()
    gc.collect()
    assert all(r() is None for r in refs), "close() must drop every input the ring held"


@pytest.mark.parametrize("device", DEVICES)
def test_capture_and_close_refuse_a_second_thread(device):
    """Before: while thread A was inside run, thread B's close() or capture() went through."""
    pool = gp.GraphPool(MODES, make_inputs(), SIZES, device=device)
    toy = ToyStep(device)
    inside, release, block = threading.Event(), threading.Event(), {"on": False}

    def prepare(batch, real_bs):  # holds thread A inside run() until the main thread has tried
        if block["on"]:
            inside.set()
            release.wait(10)

    pool.capture(toy, prepare=prepare, progress=False, outputs=TOY_OUTPUTS)
    block["on"] = True
    inputs = random_step(MODES[0], 2, device, random.Random(7))
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=pool.run("decode", copy=True, **inputs)))
    worker.start()
    assert inside.wait(10)
    try:
        for call in (pool.close, lambda: pool.capture(toy, progress=False, outputs=TOY_OUTPUTS)):
            with pytest.raises(gp.ConcurrentUseError):
                call()
    finally:
        release.set()
        worker.join(10)
    assert_matches(result["out"], toy, MODES[0], inputs, "thread A's step")


def test_a_replay_whose_step_raises_is_not_counted():
    """Before: the eager twin counted the replay (and its padded rows) before the step raised."""
    pool = gp.GraphPool(MODES, make_inputs(), SIZES, device="cpu")
    toy, fail = ToyStep("cpu"), {"on": False}

    def step(batch):
        if fail["on"]:
            raise RuntimeError("step failed")
        return toy(batch)
    pool.capture(step, progress=False, outputs=TOY_OUTPUTS)
    fail["on"] = True
    with pytest.raises(RuntimeError, match="step failed"):
        pool.run("decode", **random_step(MODES[0], 3, "cpu", random.Random(8)))
    key = gp.GraphKey("decode", 4)
    assert pool.stats.keys[key].replays == 0 and pool.stats.keys[key].padded_rows == 0


def test_a_capture_error_ends_its_cause_with_one_full_stop():
    pool = gp.GraphPool(MODES, make_inputs(), SIZES, device="cpu")

    def step(batch):
        raise RuntimeError("bad shape.")
    with pytest.raises(gp.CaptureError) as info:
        pool.capture(step, progress=False)
    assert "bad shape. No graph" in str(info.value) and ".." not in str(info.value)

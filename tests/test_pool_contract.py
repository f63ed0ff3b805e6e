"""The pool's contract under misuse, lifetimes, threads and faults: one test per defect a review found.

Each runs on the CPU (the eager twin; ring staging through Triton's interpreter where it matters) and,
marked ``gpu``, with real CUDA graphs on the H200, where outputs live in graph memory and the GPU reads
inputs when the step executes.
"""
from __future__ import annotations

import collections
import gc
import random
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import graphpool as gp
from test_pool import TOY_OUTPUTS, ToyStep, eager_reference, make_inputs, random_step

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
RING_SETUPS = [pytest.param(("cpu", "ring"), marks=pytest.mark.interpreter), ("cpu", "torch"), pytest.param(("cuda", "ring"), marks=pytest.mark.gpu)]
MODES = [gp.Mode("decode", 1), gp.Mode("verify", 4)]
SIZES = [1, 2, 4, 8]


def pool_for(device: str, staging: str = "auto", **kwargs) -> tuple[gp.GraphPool, ToyStep]:
    pool = gp.GraphPool(MODES, make_inputs(), SIZES, device=device, staging=staging, **kwargs)
    step = ToyStep(device)
    pool.capture(step, progress=False, outputs=TOY_OUTPUTS)
    return pool, step


def assert_step_exact(pool: gp.GraphPool, step: ToyStep, device: str, mode: str, bs: int, rng: random.Random,
                      what: str = "") -> None:
    inputs = random_step(pool.modes[mode], bs, device, rng)
    got = pool.run(mode, copy=True, **inputs)
    want = eager_reference(step, pool.modes[mode], inputs)
    for name in ("logits", "pooled"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=f"{what} {mode} bs={bs} {name}")


# 1. Ring desync ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setup", RING_SETUPS, ids=lambda s: "-".join(s))
def test_a_step_that_raises_midway_does_not_shift_later_steps(setup):
    device, staging = setup
    pool = gp.GraphPool(MODES, make_inputs(), SIZES, device=device, staging=staging)
    toy, fail = ToyStep(device), {"on": False}

    def step(batch):
        out = toy(batch)  # the staging kernel (ring) has already run when this raises
        if fail["on"]:
            raise RuntimeError("step failed midway")
        return out

    def prepare(batch, real_bs):
        if fail["on"]:
            raise RuntimeError("prepare failed")

    rng = random.Random(0)
    # On CUDA the step function is not called at replay (the graph is); only `prepare` can raise there.
    for hook in ((prepare,) if device == "cuda" else (None, prepare)):
        pool.capture(step, prepare=hook, progress=False, outputs=TOY_OUTPUTS)
        for i in range(6):
            fail["on"] = True
            with pytest.raises(RuntimeError, match="failed"):
                pool.run("verify" if i % 2 else "decode", **random_step(MODES[i % 2], 3, device, rng))
            fail["on"] = False
            for mode, bs in (("decode", 2), ("verify", 5), ("decode", 7)):
                assert_step_exact(pool, toy, device, mode, bs, rng, f"after failure {i} (prepare={hook})")


@pytest.mark.parametrize("setup", RING_SETUPS, ids=lambda s: "-".join(s))
def test_direct_graph_replay_keeps_later_steps_exact(setup):
    device, staging = setup
    pool, toy = pool_for(device, staging)
    rng = random.Random(1)
    for i in range(5):
        assert_step_exact(pool, toy, device, "verify", 3, rng)
        before = pool.static_inputs["input_ids"].clone()
        pool.graph("verify", 4).replay()  # runs on the buffers as the last step left them
        assert torch.equal(pool.static_inputs["input_ids"], before)
        assert_step_exact(pool, toy, device, "decode", 5, rng, f"after direct replay {i}")


# 2. Input lifetime ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("setup", RING_SETUPS, ids=lambda s: "-".join(s))
def test_inputs_dropped_after_stage_are_still_what_the_step_reads(setup):
    device, staging = setup
    pool, toy = pool_for(device, staging)
    rng = random.Random(2)
    for i in range(8):
        mode = MODES[i % 2]
        inputs = random_step(mode, 3, device, rng)
        want = eager_reference(toy, mode, {k: v.clone() for k, v in inputs.items()})
        staged = pool.stage(mode.name, **inputs)
        del inputs
        gc.collect()
        junk = [torch.full((4096,), -123456, dtype=torch.int64, device=device) for _ in range(16)]  # reuse freed memory
        if device == "cuda":
            torch.cuda.empty_cache()
        got = {k: v.clone() for k, v in pool.replay(staged).items()}
        del junk
        torch.testing.assert_close(got["pooled"], want["pooled"], rtol=1e-5, atol=1e-5, msg=f"step {i}")


# 3 and 4. Output containers --------------------------------------------------------------------------------
Pair = collections.namedtuple("Pair", ["logits", "pooled"])


@pytest.mark.parametrize("device", DEVICES)
def test_each_run_returns_its_own_container(device):
    pool, toy = pool_for(device)
    rng = random.Random(3)
    first = pool.run("decode", **random_step(MODES[0], 2, device, rng))
    first.pop("logits")
    first["pooled"] = None
    second = pool.run("decode", **random_step(MODES[0], 2, device, rng))
    assert set(second) == {"logits", "pooled"} and second["pooled"] is not None and first is not second


@pytest.mark.parametrize("device", DEVICES)
def test_namedtuple_outputs_stay_namedtuples(device):
    pool = gp.GraphPool(MODES, make_inputs(), SIZES, device=device)
    toy = ToyStep(device)
    pool.capture(lambda b: Pair(**toy(b)), progress=False, outputs=TOY_OUTPUTS)
    rng = random.Random(4)
    for mode, bs in (("verify", 3), ("decode", 6)):
        inputs = random_step(pool.modes[mode], bs, device, rng)
        got = pool.run(mode, copy=True, **inputs)
        assert isinstance(got, Pair), type(got)
        torch.testing.assert_close(got.pooled, eager_reference(toy, pool.modes[mode], inputs)["pooled"])


# 5 and 6. Declarations and inputs that cannot work are refused, with the right error ------------------------
def test_declarations_that_could_never_run_are_refused():
    for name in ("copy", "mode"):
        with pytest.raises(ValueError, match=rf"\['{name}'\] collide with GraphPool.run's own parameters"):
            gp.GraphPool(MODES, [gp.StepInput(name, torch.int64)], [1], device="cpu")
    with pytest.raises(ValueError, match=r"fill 0.7 is not representable in torch.int64 \(it would become 0\)"):
        gp.StepInput("ids", torch.int64, fill=0.7)
    with pytest.raises(ValueError, match="not representable in torch.int32"):
        gp.StepInput("lens", torch.int32, fill=2**40)
    with pytest.raises(ValueError, match="lies outside the bounds"):
        gp.StepInput("loc", torch.int64, fill=-1, bounds=(0, 10))
    gp.StepInput("half", torch.float16, fill=0.5)  # representable: accepted


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_get_the_error_that_names_them(device):
    pool, toy = pool_for(device)
    rng = random.Random(6)
    good = random_step(MODES[1], 3, device, rng)
    with pytest.raises(gp.InputDeviceError, match=r"'positions' is on meta"):
        pool.run("verify", **dict(good, positions=good["positions"].to("meta")))
    with pytest.raises(gp.InputLayoutError, match=r"'features' is not contiguous"):
        pool.run("verify", **dict(good, features=torch.zeros(3, 12, device=device).t()))
    with pytest.raises(gp.InputTypeError, match=r"'seq_lens' must be a torch.Tensor, got list"):
        pool.run("verify", **dict(good, seq_lens=[1, 2, 3]))
    with pytest.raises(gp.UnknownModeError, match=r"unknown mode 'Decode': did you mean 'decode'\?"):
        pool.run("Decode", **good)
    with pytest.raises(gp.UnknownModeError, match=r"unknown mode 'verfy': did you mean 'verify'\?"):
        pool.run("verfy", **good)
    with pytest.raises(gp.UnknownModeError):  # not a TypeError from a dict lookup
        pool.run(["verify"], **good)
    with pytest.raises(gp.InputLayoutError, match=r"'positions' is a lazily negated view .* positions.resolve_neg\(\)"):
        pool.run("verify", **dict(good, positions=torch._neg_view(good["positions"])))  # contiguous, raw memory unnegated
    assert_step_exact(pool, toy, device, "verify", 3, rng, "after refused steps")


@pytest.mark.parametrize("setup", RING_SETUPS, ids=lambda s: "-".join(s))
def test_a_lazily_conjugated_input_is_refused_not_staged_unconjugated(setup):
    """``z.conj()`` is contiguous but its memory holds z: the ring kernel would copy z itself."""
    device, staging = setup
    pool = gp.GraphPool([gp.Mode("decode", 1)], [gp.StepInput("z", torch.complex64, "seq")], [1, 4], device=device,
                        staging=staging)
    pool.capture(lambda batch: batch.inputs["z"] * 2, progress=False, outputs="seq")
    z = torch.randn(3, dtype=torch.complex64, device=device)
    with pytest.raises(gp.InputLayoutError, match=r"'z' is a lazily conjugated view .* z.resolve_conj\(\)"):
        pool.run("decode", z=z.conj())
    torch.testing.assert_close(pool.run("decode", z=z.conj().resolve_conj()), z.conj() * 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("returned", [None, 3, "logits", [torch.zeros(1), 2.0]], ids=["None", "int", "str", "list-float"])
def test_a_step_returning_non_tensors_fails_at_capture(device, returned):
    pool = gp.GraphPool(MODES, make_inputs(), SIZES, device=device)
    with pytest.raises(gp.CaptureError, match=r"the step( function returned|'s output '1' is a float)") as info:
        pool.capture(lambda b: returned if not isinstance(returned, list) else [returned[0].to(device), 2.0],
                     progress=False)
    assert isinstance(info.value.__cause__, gp.StepOutputError) and not pool.captured


# 7. Index bounds -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_debug_mode_refuses_out_of_range_indices_before_the_replay(device):
    inputs = [gp.StepInput("out_cache_loc", torch.int64, bounds=(0, 4096)) if s.name == "out_cache_loc" else s
              for s in make_inputs()]
    pool = gp.GraphPool(MODES, inputs, SIZES, device=device, debug=True)
    toy = ToyStep(device)
    pool.capture(toy, progress=False, outputs=TOY_OUTPUTS)
    rng = random.Random(7)
    bad = random_step(MODES[1], 2, device, rng)
    bad["out_cache_loc"][5] = 4096 + 17
    cache = toy.cache.clone()
    with pytest.raises(gp.IndexBoundsError, match=r"'out_cache_loc' row 5 holds 4113, outside its bounds \[0, 4096\)"):
        pool.run("verify", **bad)
    assert torch.equal(toy.cache, cache), "the step must not have run"
    assert_step_exact(pool, toy, device, "verify", 2, rng, "after a refused step")


# 8. Threads ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_concurrent_callers_get_an_error_never_a_wrong_step(device):
    pool, toy = pool_for(device)
    plans = [[(MODES[(t + i) % 2], 1 + (7 * t + i) % 8, random.Random(t * 1000 + i)) for i in range(60)]
             for t in range(4)]
    results: list = [[] for _ in plans]
    start = threading.Barrier(len(plans))

    def worker(t: int) -> None:
        start.wait()
        for mode, bs, rng in plans[t]:
            inputs = random_step(mode, bs, device, rng)
            try:
                out = pool.run(mode.name, copy=True, **inputs)
            except gp.ConcurrentUseError:
                results[t].append(None)
                continue
            results[t].append((mode, inputs, out))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(len(plans))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    ran = [r for rs in results for r in rs if r is not None]
    refused = sum(r is None for rs in results for r in rs)
    for mode, inputs, out in ran:
        torch.testing.assert_close(out["pooled"], eager_reference(ToyStep(device), mode, inputs)["pooled"])
    assert ran and refused, f"{len(ran)} ran, {refused} refused: the threads should have overlapped"

    staged = pool.stage("decode", **random_step(MODES[0], 2, device, random.Random(8)))
    other = threading.Thread(target=lambda: results.append(_raises(pool.replay, staged)))
    other.start()
    other.join()
    assert isinstance(results[-1], gp.ConcurrentUseError)


def _raises(fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the test inspects the type
        return exc
    return None


@pytest.mark.interpreter
def test_replaying_a_step_twice_or_after_a_later_stage_is_refused():
    pool, toy = pool_for("cpu", "ring")
    rng = random.Random(9)
    first = pool.stage("verify", **random_step(MODES[1], 2, "cpu", rng))
    pool.stage("decode", **random_step(MODES[0], 2, "cpu", rng))
    with pytest.raises(gp.StaleStepError):
        pool.replay(first)
    again = pool.stage("decode", **random_step(MODES[0], 2, "cpu", rng))
    pool.replay(again)
    with pytest.raises(gp.StaleStepError):
        pool.replay(again)
    staged = pool.stage("decode", **random_step(MODES[0], 3, "cpu", rng))
    pool.run("verify", **random_step(MODES[1], 1, "cpu", rng))  # a run in between rewrites the ring row
    with pytest.raises(gp.StaleStepError):
        pool.replay(staged)
    assert_step_exact(pool, toy, "cpu", "verify", 6, rng)


# 10. Stale and refused steps (found by an independent contract review) ------------------------------------
@pytest.mark.parametrize("setup", RING_SETUPS, ids=lambda s: "-".join(s))
def test_a_stale_step_of_the_same_mode_and_size_is_refused(setup):
    """Two stages of the same (mode, real bs) are two steps: replaying the first one is refused, never run on
    the second one's inputs."""
    device, staging = setup
    pool, toy = pool_for(device, staging)
    rng = random.Random(13)
    first, second = (random_step(MODES[0], 3, device, rng) for _ in range(2))
    stale = pool.stage("decode", **first)
    latest = pool.stage("decode", **second)
    assert stale is not latest
    with pytest.raises(gp.StaleStepError):
        pool.replay(stale)
    got = {k: v.clone() for k, v in pool.replay(latest).items()}
    torch.testing.assert_close(got["pooled"], eager_reference(toy, MODES[0], second)["pooled"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("setup", RING_SETUPS, ids=lambda s: "-".join(s))
def test_a_graph_replay_between_stage_and_replay_makes_the_step_stale(setup):
    """``graph(...).replay()`` rewrites the ring row a staged step would read: that step is refused after it."""
    device, staging = setup
    pool, toy = pool_for(device, staging)
    rng = random.Random(14)
    staged = pool.stage("decode", **random_step(MODES[0], 3, device, rng))
    pool.graph("decode", 4).replay()
    with pytest.raises(gp.StaleStepError):
        pool.replay(staged)
    assert_step_exact(pool, toy, device, "verify", 2, rng, "after the refused replay")


def _refusals(pool: gp.GraphPool, device: str, rng: random.Random) -> list:
    """Steps the pool must refuse (each with its error), from validation, the miss policy and debug bounds."""
    good = random_step(MODES[1], 2, device, rng)
    out_of_bounds = dict(random_step(MODES[1], 2, device, rng))
    out_of_bounds["out_cache_loc"] = out_of_bounds["out_cache_loc"].clone()
    out_of_bounds["out_cache_loc"][3] = 10**6
    return [
        (gp.InputRowsError, pool.run, "decode", random_step(MODES[1], 3, device, rng)),
        (gp.InputDtypeError, pool.stage, "verify", dict(good, seq_lens=good["seq_lens"].long())),
        (gp.BatchTooLargeError, pool.stage, "decode", random_step(MODES[0], 9, device, rng)),
        (gp.BatchTooLargeError, pool.run, "verify", random_step(MODES[1], 9, device, rng)),
        (gp.IndexBoundsError, pool.stage, "verify", out_of_bounds),
    ]


def _bounded_pool(device: str, staging: str, debug: bool) -> tuple[gp.GraphPool, ToyStep]:
    specs = [gp.StepInput(s.name, s.dtype, s.per, fill=s.fill, trailing=s.trailing,
                          bounds=(0, 4096) if s.name == "out_cache_loc" else None) for s in make_inputs()]
    pool = gp.GraphPool(MODES, specs, SIZES, device=device, staging=staging, on_miss="raise", debug=debug)
    toy = ToyStep(device)
    pool.capture(toy, progress=False, outputs=TOY_OUTPUTS)
    return pool, toy


def _check_refusals_keep_the_staged_step(pool: gp.GraphPool, toy: ToyStep, device: str) -> None:
    rng = random.Random(15)
    for error, call, mode, inputs in _refusals(pool, device, rng):
        if error is gp.IndexBoundsError and not pool.debug:
            continue  # bounds are debug mode's check
        staged_inputs = random_step(MODES[0], 3, device, rng)
        staged = pool.stage("decode", **staged_inputs)
        with pytest.raises(error):
            call(mode, **inputs)
        got = {k: v.clone() for k, v in pool.replay(staged).items()}
        want = eager_reference(toy, MODES[0], staged_inputs)
        torch.testing.assert_close(got["pooled"], want["pooled"], rtol=1e-5, atol=1e-5, msg=f"after {error.__name__}")
    assert_step_exact(pool, toy, device, "verify", 5, rng, "after the refusals")


@pytest.mark.parametrize("debug", [False, True], ids=["fast", "debug"])
@pytest.mark.parametrize("setup", RING_SETUPS, ids=lambda s: "-".join(s))
def test_a_refused_step_leaves_the_staged_step_intact(setup, debug):
    """A refused ``run``/``stage`` (input error, batch too large, out-of-bounds index in debug mode) touches
    nothing: the step staged before it still replays exactly, on every staging path."""
    device, staging = setup
    _check_refusals_keep_the_staged_step(*_bounded_pool(device, staging, debug), device)


@pytest.mark.interpreter
@pytest.mark.parametrize("debug", [False, True], ids=["fast", "debug"])
def test_a_refused_step_leaves_the_staged_step_intact_with_the_cpp_checker(debug):
    """The same through the C++ checker, which writes the ring row in the call that checks the step: a CUDA
    pool's hot path, run on the CPU by giving a CPU ring pool the checker (only CUDA pools get one)."""
    from graphpool.native import make_input_checker
    pool, toy = _bounded_pool("cpu", "ring", debug)
    checker = make_input_checker(pool._rules)
    if checker is None:
        pytest.skip("the C++ extension did not build here")
    pool._stager._check = checker.check
    _check_refusals_keep_the_staged_step(pool, toy, "cpu")


def test_can_run_is_false_before_a_capture():
    pool = gp.GraphPool(MODES, make_inputs(), SIZES, device="cpu")
    assert pool.route("decode", 3) == 4 and not pool.can_run("decode", 3)
    pool.capture(ToyStep("cpu"), progress=False, outputs=TOY_OUTPUTS)
    assert pool.can_run("decode", 3) and not pool.can_run("decode", 9)


# 9. Device faults ----------------------------------------------------------------------------------------
def test_a_device_error_at_a_wait_says_what_happened_and_what_to_do():
    pool, _ = pool_for("cpu")

    def faulting_sync() -> None:
        raise RuntimeError("CUDA error: device-side assert triggered")

    pool.backend.synchronize = faulting_sync
    with pytest.raises(gp.DeviceFaultError, match=r"failed on the device .*restart the process.*GRAPHPOOL_DEBUG=1"):
        pool.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("debug", [False, True])
def test_a_faulting_step_is_reported_as_a_device_fault(debug):
    """A real device-side assert (the CUDA context dies, so in a subprocess): debug mode names the graph at
    the run that faulted; the fast path raises DeviceFaultError at the next wait."""
    code = textwrap.dedent(f"""
        import torch, graphpool as gp
        pool = gp.GraphPool([gp.Mode("decode", 1)], [gp.StepInput("idx", torch.int64)], [1, 2], device="cuda",
                            debug={debug})
        table = torch.zeros(8, device="cuda")
        pool.capture(lambda b: table[b.inputs["idx"]] + 1, progress=False)
        pool.run("decode", idx=torch.tensor([1, 2], device="cuda"))
        try:
            pool.run("decode", idx=torch.tensor([10**9, 2], device="cuda"))
            pool.synchronize()
        except gp.DeviceFaultError as exc:
            print("FAULT", exc)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "FAULT" in result.stdout, result.stdout + result.stderr
    assert "restart the process" in result.stdout
    if debug:
        assert "graph (mode 'decode', bs 2) faulted" in result.stdout


# 10. Structure -------------------------------------------------------------------------------------------
def test_package_layout_has_one_module_object_per_file():
    code = ("import sys, graphpool, graphpool.kernels.stage as s\n"
            "import importlib.util\n"
            "import os\n"
            "spec = importlib.util.find_spec('graphpool.bench')  # the package's own, not the checkout's bench/\n"
            "assert spec.origin.endswith(os.path.join('graphpool', 'bench', '__init__.py')), spec.origin\n"
            "assert importlib.util.find_spec('graphpool.engine') is None  # bench/engine stays outside\n"
            "assert not [m for m in sys.modules if m == 'kernels' or m.startswith('kernels.')], sys.modules.keys()\n"
            "import graphpool.integrations\n"
            "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr


def test_capture_leaves_what_the_caller_froze_frozen():
    """A server that froze its start-up heap (gc.freeze) keeps it frozen through a capture: the pool's
    gc.unfreeze() after capture released it, and every later collection scanned it all again."""
    frozen_before = gc.get_freeze_count()
    keep = [[] for _ in range(100)]  # objects of the caller's, frozen below
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen >= len(keep)
        pool_for("cpu")
        assert gc.get_freeze_count() == frozen, "the capture unfroze the caller's frozen objects"
        assert gc.isenabled()
    finally:
        if not frozen_before:
            gc.unfreeze()


def test_capture_freezes_nothing_it_does_not_unfreeze():
    suite_froze = gc.get_freeze_count()  # tests/conftest.py freezes the heap after collection
    gc.unfreeze()
    try:
        pool_for("cpu")
        assert gc.get_freeze_count() == 0 and gc.isenabled()
    finally:
        if suite_froze:
            gc.collect()
            gc.freeze()


def test_cpu_pools_never_build_the_cpp_checker(monkeypatch):
    import graphpool.native as native

    def no_build():
        raise AssertionError("a CPU pool asked for the C++ checker")

    monkeypatch.setattr(native, "_extension", no_build)
    pool, toy = pool_for("cpu", fast_checks=True)
    assert_step_exact(pool, toy, "cpu", "decode", 3, random.Random(10))


@pytest.mark.parametrize("device", DEVICES)
def test_close_frees_the_graphs_and_capture_works_again(device):
    pool, toy = pool_for(device)
    pool.close()
    assert not pool.captured and not pool.stats.keys
    with pytest.raises(gp.NotCapturedError):
        pool.run("decode", **random_step(MODES[0], 2, device, random.Random(11)))
    pool.capture(toy, progress=False, outputs=TOY_OUTPUTS)
    assert_step_exact(pool, toy, device, "verify", 3, random.Random(12), "after close and capture")


# 11. A second review (each fails without its fix) ---------------------------------------------------------
@pytest.mark.parametrize("setup", RING_SETUPS, ids=lambda s: "-".join(s))
def test_an_input_that_requires_grad_leaves_the_static_buffers_plain(setup):
    """Staging copies raw rows (the CUDA ring copies memory): a draft's hidden states made outside no_grad
    must not pull the static buffers into autograd, nor grow a graph step after step."""
    device, staging = setup
    pool, toy = pool_for(device, staging)
    rng = random.Random(20)
    for _ in range(3):
        inputs = random_step(MODES[1], 3, device, rng)
        inputs["features"] = (inputs["features"].requires_grad_() * 1)  # a non-leaf with a grad_fn
        got = pool.run("verify", copy=True, **inputs)
        want = eager_reference(toy, MODES[1], {**inputs, "features": inputs["features"].detach()})
        torch.testing.assert_close(got["pooled"], want["pooled"], rtol=1e-5, atol=1e-5)
    for view in pool.static_inputs.values():
        assert not view.requires_grad and view.grad_fn is None


def test_a_pool_built_under_inference_mode_stages_outside_it():
    """Its static buffers are inference tensors; staging writes them as raw rows, from anywhere."""
    with torch.inference_mode():
        pool = gp.GraphPool(MODES, make_inputs(), SIZES, device="cpu")
    toy = ToyStep("cpu")
    pool.capture(toy, progress=False, outputs=TOY_OUTPUTS)
    assert_step_exact(pool, toy, "cpu", "verify", 3, random.Random(21))


def test_a_miss_counts_when_it_runs_not_when_it_is_staged():
    pool, _ = pool_for("cpu")
    big = random_step(MODES[0], SIZES[-1] + 3, "cpu", random.Random(22))
    pool.stage("decode", **big)
    step = pool.stage("decode", **big)
    assert sum(pool.stats.misses.values()) == 0, "staged, not run"
    pool.replay(step)
    assert pool.stats.misses == {f"decode: bs > {SIZES[-1]}": 1}


@pytest.mark.parametrize("device", DEVICES)
def test_a_graph_handle_refuses_to_replay_once_its_graph_is_freed(device):
    pool, toy = pool_for(device)
    old = pool.graph("decode", 2)
    pool.close()
    with pytest.raises(gp.NotCapturedError, match="pool.graph"):
        old.replay()
    pool.capture(toy, progress=False, outputs=TOY_OUTPUTS)
    with pytest.raises(gp.NotCapturedError):
        old.replay()  # a new capture made new graphs: the old handle's is gone
    pool.graph("decode", 2).replay()
    assert_step_exact(pool, toy, device, "decode", 2, random.Random(23), "after the refused replay")


def test_an_unknown_mode_raises_from_can_run_before_and_after_capture():
    pool = gp.GraphPool(MODES, make_inputs(), SIZES, device="cpu")
    with pytest.raises(gp.UnknownModeError):
        pool.can_run("decod", 1)
    pool.capture(ToyStep("cpu"), progress=False, outputs=TOY_OUTPUTS)
    with pytest.raises(gp.UnknownModeError):
        pool.can_run("decod", 1)


def test_close_after_a_failed_capture_says_not_captured():
    pool = gp.GraphPool(MODES, make_inputs(), SIZES, device="cpu")

    def broken(batch):
        raise RuntimeError("broken step")

    with pytest.raises(gp.CaptureError):
        pool.capture(broken, progress=False)
    pool.close()
    with pytest.raises(gp.NotCapturedError, match="no graphs yet"):
        pool.run("decode", **random_step(MODES[0], 1, "cpu", random.Random(24)))


@pytest.mark.parametrize("sizes", [[1.5, 2.7], ["4"], [2, True]])
def test_batch_sizes_must_be_integers(sizes):
    with pytest.raises(ValueError, match="ints >= 1"):
        gp.GraphPool(MODES, make_inputs(), sizes, device="cpu")
    with pytest.raises(ValueError, match="ints >= 1"):
        gp.Mode("decode", 1, batch_sizes=sizes)


@pytest.mark.parametrize("tokens", [True, 2.0, "2"])
def test_tokens_per_seq_must_be_an_integer(tokens):
    with pytest.raises(ValueError, match="tokens_per_seq must be an int"):
        gp.Mode("verify", tokens)


@pytest.mark.parametrize("dtype, fill", [(torch.int64, 2**70), (torch.float32, 10**400), (torch.int8, 300)],
                         ids=["int64-2**70", "float32-10**400", "int8-300"])
def test_an_unrepresentable_fill_names_the_input(dtype, fill):
    with pytest.raises(ValueError, match=r"StepInput 'x': fill .* is not representable in"):
        gp.StepInput("x", dtype, fill=fill)


def test_a_bool_input_takes_a_bool_fill():
    assert gp.StepInput("mask", torch.bool, fill=True).fill is True
    with pytest.raises(TypeError, match="a bool only for a bool input"):
        gp.StepInput("ids", torch.int64, fill=True)


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("0", False), ("false", False),
                                       ("no", False), ("off", False), ("", False)])
def test_graphpool_debug_reads_off_values_as_off(monkeypatch, value, on):
    monkeypatch.setenv("GRAPHPOOL_DEBUG", value)
    assert gp.GraphPool(MODES, make_inputs(), SIZES, device="cpu").debug is on


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("make", [lambda t: t.to_sparse(), lambda t: torch.nested.nested_tensor(list(t))],
                         ids=["sparse", "nested"])
def test_sparse_and_nested_inputs_are_refused_as_layout_errors(make):
    pool, toy = pool_for("cpu")
    inputs = random_step(MODES[0], 2, "cpu", random.Random(25))
    inputs["features"] = make(inputs["features"])
    with pytest.raises(gp.InputLayoutError, match="'features' is a .*(sparse|nested)"):
        pool.run("decode", **inputs)
    assert_step_exact(pool, toy, "cpu", "decode", 2, random.Random(26), "after the refusal")


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_whose_outputs_change_shape_is_refused(device):
    """A graph's outputs have fixed shapes; the twin says so at the replay where they change (on CUDA the
    capture fixes them: the replay just rewrites the same memory)."""
    captured = {"done": False}

    def step(batch):
        ids = batch.inputs["input_ids"]
        return ids[:1] * 1 if captured["done"] else ids * 1  # one row fewer once the capture is done

    pool = gp.GraphPool([gp.Mode("decode", 1)], [gp.StepInput("input_ids", torch.int64)], [1, 2, 4, 8],
                        device=device)
    pool.capture(step, progress=False, outputs="token")
    captured["done"] = True
    run = lambda: pool.run("decode", input_ids=torch.arange(4, device=device))  # noqa: E731
    if device == "cpu":
        with pytest.raises(gp.StepOutputError, match="outputs changed between its capture and a replay"):
            run()
    else:
        assert run().shape == (4,)  # the graph replays what it captured, whatever Python would do now


# 12. A third review (each fails without its fix) ----------------------------------------------------------
@pytest.mark.parametrize("setup", RING_SETUPS, ids=lambda s: "-".join(s))
@pytest.mark.parametrize("again", ["after_close", "after_a_failed_capture", "with_a_new_step"])
def test_a_recapture_runs_every_row_at_its_fill_values(setup, again):
    """Before: the buffers were set to their fills only when made, so a second capture warmed up and captured
    on the last step's real inputs, writing into real KV slots."""
    device, staging = setup
    pool, toy = pool_for(device, staging)
    rng = random.Random(30)
    for mode, bs in (("verify", 7), ("decode", 5), ("verify", 3)):
        assert_step_exact(pool, toy, device, mode, bs, rng, "before the recapture")
    kv = toy.cache.clone()
    seen = []  # what every warm-up and capture run read: `prepare` runs eagerly before each, on every backend

    def prepare(batch, real_bs):
        seen.append({name: t.clone() for name, t in batch.inputs.items()})

    def broken(batch):
        raise RuntimeError("broken step")

    if again == "after_close":
        pool.close()
    elif again == "after_a_failed_capture":
        with pytest.raises(gp.CaptureError):
            pool.capture(broken, prepare=prepare, progress=False, outputs=TOY_OUTPUTS)
    new_step = toy if again != "with_a_new_step" else (lambda batch: toy(batch))
    pool.capture(new_step, prepare=prepare, progress=False, outputs=TOY_OUTPUTS)
    fills = {spec.name: spec.fill for spec in make_inputs()}
    assert len(seen) >= 2 * len(pool.graph_keys)
    for inputs in seen:
        for name, t in inputs.items():
            assert torch.all(t == fills[name]), f"{again}: capture read {name} = {t.tolist()}, not its fill"
    assert torch.equal(toy.cache[1:], kv[1:]), "capture wrote KV slots that real sequences own"
    assert_step_exact(pool, toy, device, "verify", 5, rng, "after the recapture")

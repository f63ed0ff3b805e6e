"""The pool against an eager oracle: routing, padding, buffers, slicing, errors, on both backends.

Every test runs on the CPU with the eager twin (CI) and on CUDA with real graphs (`-m gpu`, the H200).
"""
from __future__ import annotations

import os
import random
import shutil

import pytest
import torch

import graphpool as gp
from graphpool import GraphKey

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# (device, staging, input checks): the eager twin with torch staging, the twin with the ring kernel (Triton's
# interpreter on CPU), and real CUDA graphs with the ring kernel as each graph's first node, checked by the
# C++ input checker (CUDA pools only) and by the Python checks.
SETUPS = [("cpu", "torch", "python"), pytest.param(("cpu", "ring", "python"), marks=pytest.mark.interpreter),
          pytest.param(("cuda", "auto", "cpp"), marks=pytest.mark.gpu),
          pytest.param(("cuda", "auto", "python"), marks=pytest.mark.gpu)]
SIZES = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
VERIFY_TOKENS = 16
NUM_SLOTS = 4096
DUMMY_SLOT = 0  # padded rows write the KV stand-in here; real rows never use it
FEAT = 3
TOY_OUTPUTS = {"logits": "token", "pooled": "seq"}  # ToyStep's rows: one logits row per token, one pooled per sequence


def make_inputs() -> list[gp.StepInput]:
    return [
        gp.StepInput("input_ids", torch.int64, "token", fill=0),
        gp.StepInput("positions", torch.int64, "token", fill=0),
        gp.StepInput("out_cache_loc", torch.int64, "token", fill=DUMMY_SLOT),
        gp.StepInput("features", torch.float32, "token", fill=0.5, trailing=(FEAT,)),
        gp.StepInput("seq_lens", torch.int32, "seq", fill=1),
        gp.StepInput("req_pool_indices", torch.int64, "seq", fill=0),
    ]


class ToyStep:
    """A step that mixes per-token and per-sequence inputs and writes a KV-cache stand-in in place."""

    def __init__(self, device: str):
        g = torch.Generator().manual_seed(0)
        self.weight = torch.randn(FEAT, 5, generator=g).to(device)
        self.cache = torch.zeros(NUM_SLOTS, dtype=torch.float32, device=device)

    def __call__(self, batch: gp.StepBatch) -> dict[str, torch.Tensor]:
        x = batch.inputs
        tps = batch.mode.tokens_per_seq
        per_seq = x["seq_lens"].float() * 0.25 + x["req_pool_indices"].float()
        token_term = (x["input_ids"] * 7 + x["positions"]).float()
        hidden = x["features"] @ self.weight + token_term[:, None] + per_seq.repeat_interleave(tps)[:, None]
        self.cache.index_copy_(0, x["out_cache_loc"], hidden[:, 0])
        logits = torch.tanh(hidden)
        pooled = logits.view(batch.bs, tps, -1).sum(1) + per_seq[:, None]
        return {"logits": logits, "pooled": pooled}


def random_step(mode: gp.Mode, bs: int, device: str, rng: random.Random) -> dict[str, torch.Tensor]:
    tokens = bs * mode.tokens_per_seq
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    slots = torch.randperm(NUM_SLOTS - 1, generator=g)[:tokens] + 1  # distinct, never the dummy slot
    data = {
        "input_ids": torch.randint(0, 50_000, (tokens,), generator=g),
        "positions": torch.randint(0, 4096, (tokens,), generator=g),
        "out_cache_loc": slots,
        "features": torch.randn(tokens, FEAT, generator=g),
        "seq_lens": torch.randint(1, 4096, (bs,), generator=g, dtype=torch.int32),
        "req_pool_indices": torch.randint(0, 256, (bs,), generator=g),
    }
    return {k: v.to(device) for k, v in data.items()}


def eager_reference(step: ToyStep, mode: gp.Mode, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    bs = inputs["seq_lens"].shape[0]
    return step(gp.StepBatch(mode, bs, bs * mode.tokens_per_seq, inputs, captured=False))


def build(device: str, **kwargs) -> tuple[gp.GraphPool, ToyStep]:
    modes = [gp.Mode("decode", 1), gp.Mode("verify", VERIFY_TOKENS)]
    pool = gp.GraphPool(modes, make_inputs(), SIZES, device=device, **kwargs)
    step = ToyStep(device)
    pool.capture(step, progress=False, outputs=TOY_OUTPUTS)
    return pool, step


@pytest.fixture(scope="module", params=SETUPS, ids=lambda p: "-".join(p))
def built(request) -> tuple[gp.GraphPool, ToyStep, str]:
    device, staging, checks = request.param
    pool, step = build(device, staging=staging, fast_checks=checks == "cpp")
    return pool, step, device


def check_step(pool: gp.GraphPool, step: ToyStep, device: str, mode_name: str, bs: int,
               rng: random.Random) -> None:
    mode = pool.modes[mode_name]
    inputs = random_step(mode, bs, device, rng)
    out = pool.run(mode_name, copy=True, **inputs)
    got_cache = step.cache.clone()
    want = eager_reference(step, mode, inputs)  # rewrites the same slots with the same values
    for name in ("logits", "pooled"):
        torch.testing.assert_close(out[name], want[name], rtol=1e-5, atol=1e-5, msg=f"{mode_name} bs={bs} {name}")
    loc = inputs["out_cache_loc"]
    torch.testing.assert_close(got_cache[loc], step.cache[loc], rtol=1e-5, atol=1e-5)
    padded = pool.route(mode_name, bs)
    if padded is None:
        return
    static = pool.static_inputs
    for spec in make_inputs():
        rows, padded_rows = spec.rows(bs, mode.tokens_per_seq), spec.rows(padded, mode.tokens_per_seq)
        assert torch.equal(static[spec.name][:rows], inputs[spec.name]), (mode_name, bs, spec.name)
        tail = static[spec.name][rows:padded_rows]
        assert torch.all(tail == spec.fill), f"{mode_name} bs={bs}: padded rows of {spec.name} are {tail}"


# Random steps after the sweep: with its 64 steps, 80 more take the 64-row staging ring around twice; the long
# version (CI) runs 520.
@pytest.mark.parametrize("random_steps", [80, pytest.param(520, marks=pytest.mark.slow)])
def test_every_batch_size_of_both_modes_then_random_steps(built, random_steps):
    pool, step, device = built
    rng = random.Random(1234)
    steps = [(m, bs) for m in ("decode", "verify") for bs in range(1, SIZES[-1] + 1)]
    steps += [(rng.choice(["decode", "verify"]), rng.randint(1, SIZES[-1])) for _ in range(random_steps)]
    replays_before = pool.stats.replays
    for mode_name, bs in steps:
        check_step(pool, step, device, mode_name, bs, rng)
    hits = pool.stats.replays - replays_before
    assert hits >= len(steps) and not pool.stats.misses
    assert all(s.replays > 0 for s in pool.stats.keys.values()), "every graph was used"


def test_outputs_are_graph_views_unless_copied(built):
    pool, step, device = built
    rng = random.Random(7)
    first = pool.run("decode", **random_step(pool.modes["decode"], 3, device, rng))["pooled"]
    kept = first.clone()
    copied = pool.run("decode", copy=True, **random_step(pool.modes["decode"], 3, device, rng))["pooled"]
    # graph memory (and the eager twin, which writes its outputs back the same way): the second run
    # overwrote the first result in place
    assert torch.equal(first, copied) and not torch.equal(first, kept)
    pool.run("decode", **random_step(pool.modes["decode"], 3, device, rng))
    assert not torch.equal(copied, pool.run("decode", **random_step(pool.modes["decode"], 3, device, rng))["pooled"])


def test_miss_runs_eagerly_and_is_counted(built):
    pool, step, device = built
    rng = random.Random(3)
    before = sum(pool.stats.misses.values())
    for mode_name in ("decode", "verify"):
        check_step(pool, step, device, mode_name, SIZES[-1] + 5, rng)
    assert sum(pool.stats.misses.values()) == before + 2
    assert pool.stats.misses[f"verify: bs > {SIZES[-1]}"] >= 1


@pytest.mark.parametrize("device", DEVICES)
def test_miss_raises_when_configured(device):
    pool, step = build(device, on_miss="raise")
    rng = random.Random(5)
    with pytest.raises(gp.BatchTooLargeError, match=r"batch size 40 is larger than the largest captured size 32"):
        pool.run("decode", **random_step(pool.modes["decode"], 40, device, rng))
    check_step(pool, step, device, "decode", 32, rng)


def test_typed_errors_then_next_step_exact(built):
    pool, step, device = built
    rng = random.Random(99)
    verify, decode = pool.modes["verify"], pool.modes["decode"]
    good = random_step(verify, 10, device, rng)

    with pytest.raises(gp.UnknownModeError, match=r"unknown mode 'draft'.*\['decode', 'verify'\]"):
        pool.run("draft", **good)

    # The crash this project grew from: a plain-decode batch (1 token per sequence) sent to a verify graph.
    plain = random_step(decode, 10, device, rng)
    with pytest.raises(gp.InputRowsError, match=r"mode 'verify' takes 16 .*'input_ids' needs 10 x 16 = 160 rows"
                                                r".*got 10.*fit mode 'decode'"):
        pool.run("verify", **plain)
    short = dict(good, out_cache_loc=good["out_cache_loc"][:2])
    with pytest.raises(gp.InputRowsError, match=r"'out_cache_loc' needs 10 x 16 = 160 rows .* got 2"):
        pool.run("verify", **short)

    with pytest.raises(gp.InputDtypeError, match=r"'seq_lens' has dtype torch.int64, declared torch.int32"):
        pool.run("verify", **dict(good, seq_lens=good["seq_lens"].long()))
    with pytest.raises(gp.InputShapeError, match=r"'features' has shape \(160, 4\).*trailing shape must be \(3,\)"):
        pool.run("verify", **dict(good, features=torch.zeros(160, 4, device=device)))
    with pytest.raises(gp.InputLayoutError, match=r"'features' is not contiguous"):
        pool.run("verify", **dict(good, features=torch.zeros(FEAT, 160, device=device).t()))
    with pytest.raises(gp.MissingInputError, match=r"missing inputs \['positions'\], unknown inputs \['pos'\]"):
        pool.run("verify", **{("pos" if k == "positions" else k): v for k, v in good.items()})
    if device == "cuda":
        with pytest.raises(gp.InputDeviceError, match=r"'positions' is on cpu, the pool on cuda:0"):
            pool.run("verify", **dict(good, positions=good["positions"].cpu()))
    for mode_name, bs in (("verify", 10), ("decode", 10), ("verify", 1)):
        check_step(pool, step, device, mode_name, bs, rng)


@pytest.mark.parametrize("device", DEVICES)
def test_run_before_capture_and_failed_capture(device):
    modes = [gp.Mode("decode", 1), gp.Mode("verify", 4)]
    pool = gp.GraphPool(modes, make_inputs(), [1, 2, 4], device=device)
    rng = random.Random(0)
    inputs = random_step(modes[0], 2, device, rng)
    with pytest.raises(gp.NotCapturedError, match=r"call pool.capture\(step_fn\) before pool.run"):
        pool.run("decode", **inputs)

    step = ToyStep(device)

    def breaks_on_small_verify(batch: gp.StepBatch):
        if batch.mode.name == "verify" and batch.bs == 1:  # captured after the larger keys
            raise RuntimeError("kernel not available for this shape")
        return step(batch)

    with pytest.raises(gp.CaptureError, match=r"mode 'verify', bs 1\) failed on the \w+ backend: RuntimeError: kernel not available"
                                              r"(.|\n)*No graph of this pool was kept(.|\n)*StaticCache") as info:
        pool.capture(breaks_on_small_verify, progress=False, outputs=TOY_OUTPUTS)
    # The remedies fit the backend: the eager twin is not told to try the eager backend.
    assert ("backend='eager'" in str(info.value)) == (device == "cuda") and "for this shape. No graph" in str(info.value)
    assert not pool.captured and not pool.stats.keys
    with pytest.raises(gp.CaptureError, match=r"last capture failed \(RuntimeError: kernel not available"):
        pool.run("decode", **inputs)
    pool.capture(step, progress=False, outputs=TOY_OUTPUTS)  # a good capture makes the pool usable again
    check_step(pool, step, device, "verify", 3, rng)
    check_step(pool, step, device, "decode", 2, rng)


@pytest.mark.parametrize("device", DEVICES)
def test_modes_captured_one_at_a_time_share_the_buffers_and_keep_the_earlier_graphs(device):
    """A server builds one speculation tier after another (SGLang's runner per tier): each tier's graphs are captured
    into the pool when it comes, the graphs already there stay (not captured again), and every mode still serves
    steps equal to the eager step."""
    modes = [gp.Mode("decode", 1), gp.Mode("verify_8", 8, batch_sizes=(1, 2)), gp.Mode("verify_4", 4)]
    pool = gp.GraphPool(modes, make_inputs(), [1, 2, 4], device=device)
    whole = gp.GraphPool(modes, make_inputs(), [1, 2, 4], device=device)
    assert pool.stats.buffer_bytes == whole.stats.buffer_bytes  # sized for every mode at construction
    rng = random.Random(0)
    step = ToyStep(device)
    broken = set()

    def tiers(batch: gp.StepBatch):
        if batch.mode.name in broken:
            raise RuntimeError("no kernel for this tier")
        return step(batch)

    pool.capture(tiers, progress=False, outputs=TOY_OUTPUTS, modes=["decode", "verify_8"])
    assert pool.can_run("verify_8", 2) and not pool.can_run("verify_4", 1)
    with pytest.raises(gp.NotCapturedError, match="mode 'verify_4' has no graphs yet"):
        pool.run("verify_4", **random_step(pool.modes["verify_4"], 1, device, rng))
    check_step(pool, step, device, "verify_8", 2, rng)
    with pytest.raises(ValueError, match="passes another step_fn"):
        pool.capture(step, progress=False, outputs=TOY_OUTPUTS, modes=["verify_4"])
    broken.add("verify_4")
    with pytest.raises(gp.CaptureError, match=r"No graph of mode\(s\) decode, verify_4 was kept \(the pool's other"):
        pool.capture(tiers, progress=False, outputs=TOY_OUTPUTS, modes=["decode", "verify_4"])
    assert pool.can_run("verify_8", 1) and not pool.can_run("decode", 1), "a failed capture of decode kept decode"
    with pytest.raises(gp.CaptureError, match="last capture failed .* no graphs of mode 'decode'"):
        pool.run("decode", **random_step(pool.modes["decode"], 1, device, rng))
    broken.clear()
    pool.capture(tiers, progress=False, outputs=TOY_OUTPUTS, modes=["decode"])
    pool.capture(tiers, progress=False, outputs=TOY_OUTPUTS, modes=[pool.modes["verify_4"]])
    assert sorted(pool.stats.keys) == sorted(whole.graph_keys)
    verify_8, verify_4 = pool.graph("verify_8", 1), pool.graph("verify_4", 1)
    pool.capture(tiers, progress=False, outputs=TOY_OUTPUTS, modes=["verify_4"])  # again: verify_8 stays as it was
    verify_8.replay()  # the handle of a kept graph stays valid; one of a recaptured mode's graph does not
    with pytest.raises(gp.NotCapturedError, match="freed by close"):
        verify_4.replay()
    for mode_name, bs in (("verify_4", 3), ("decode", 4), ("verify_8", 1), ("verify_4", 1), ("decode", 1)):
        check_step(pool, step, device, mode_name, bs, rng)
    with pytest.raises(ValueError, match="names no mode"):
        pool.capture(tiers, progress=False, outputs=TOY_OUTPUTS, modes=[])


def test_capture_order_and_routing_table():
    pool = gp.GraphPool([gp.Mode("decode", 1), gp.Mode("verify", 16, batch_sizes=(1, 2, 8))], make_inputs(),
                        [1, 4, 64], device="cpu")
    order = pool.graph_keys
    assert order[0] == GraphKey("verify", 8) and order[-1] == GraphKey("decode", 1)
    tokens = [k.bs * pool.modes[k.mode].tokens_per_seq for k in order]
    assert tokens == sorted(tokens, reverse=True)
    assert pool.batch_sizes == {"decode": (1, 4, 64), "verify": (1, 2, 8)}
    assert [pool.route("verify", b) for b in range(1, 10)] == [1, 2, 8, 8, 8, 8, 8, 8, None]
    assert [pool.route("decode", b) for b in (1, 2, 4, 5, 64, 65)] == [1, 4, 4, 64, 64, None]


def test_bad_declarations_are_refused():
    with pytest.raises(ValueError, match="tokens_per_seq must be an int >= 1"):
        gp.Mode("verify", 0)
    with pytest.raises(ValueError, match="per must be 'token' or 'seq'"):
        gp.StepInput("x", torch.int64, per="row")
    with pytest.raises(ValueError, match="Mode names must be unique"):
        gp.GraphPool([gp.Mode("a", 1), gp.Mode("a", 2)], make_inputs(), [1], device="cpu")
    with pytest.raises(ValueError, match="batch sizes must be a non-empty list"):
        gp.GraphPool([gp.Mode("a", 1)], make_inputs(), [], device="cpu")
    with pytest.raises(ValueError, match="on_miss must be"):
        gp.GraphPool([gp.Mode("a", 1)], make_inputs(), [1], device="cpu", on_miss="skip")


def test_policy_hysteresis():
    policy = gp.SpeculationPolicy(off_above=16, on_at_or_below=12)
    sizes = [1, 8, 16, 17, 16, 13, 12, 13, 17, 40, 12, 1]
    got = [policy.choose(b) for b in sizes]
    assert got == ["verify"] * 3 + ["decode"] * 3 + ["verify"] * 2 + ["decode"] * 2 + ["verify"] * 2
    assert policy.switches == 4
    with pytest.raises(ValueError, match="on_at_or_below <= off_above"):
        gp.SpeculationPolicy(off_above=4, on_at_or_below=8)


@pytest.mark.parametrize("setup", SETUPS, ids=lambda p: "-".join(p))
def test_prepare_sees_staged_inputs_before_replay(setup):
    """With a prepare hook, staging runs before it (outside the main graph), as attention metadata needs."""
    device, staging, _ = setup
    modes = [gp.Mode("decode", 1), gp.Mode("verify", 4)]
    pool = gp.GraphPool(modes, make_inputs(), [2, 4, 8], device=device, staging=staging)
    step = ToyStep(device)
    metadata = torch.zeros(1, device=device)  # written outside the graph, read inside it
    seen = []

    def prepare(batch: gp.StepBatch, real_bs: int) -> None:
        lens = batch.inputs["seq_lens"]
        metadata.copy_(lens[:real_bs].float().sum())
        seen.append((batch.mode.name, batch.bs, real_bs, bool((lens[real_bs:] == 1).all())))

    def step_with_metadata(batch: gp.StepBatch):
        out = step(batch)
        return {"pooled": out["pooled"] + metadata}

    pool.capture(step_with_metadata, prepare=prepare, progress=False, outputs="seq")
    rng = random.Random(11)
    for mode_name, bs in [("verify", 3), ("decode", 5), ("verify", 8), ("decode", 1), ("verify", 11)]:
        seen.clear()
        mode = pool.modes[mode_name]
        inputs = random_step(mode, bs, device, rng)
        got = pool.run(mode_name, copy=True, **inputs)["pooled"]
        want = eager_reference(step, mode, inputs)["pooled"] + inputs["seq_lens"].float().sum()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)
        padded = pool.route(mode_name, bs) or bs
        assert seen == [(mode_name, padded, bs, True)]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_cpp_checker_agrees_with_python_checks():
    """The C++ checker accepts exactly what the Python checks accept, with the same batch size and pointers."""
    from graphpool.native import extension_available, make_input_checker
    from graphpool.validation import InputRules
    if not extension_available():
        pytest.skip("the C++ extension did not build here")
    from graphpool.buffers import StaticBuffers
    from graphpool.modes import KeyTable
    modes = {"decode": gp.Mode("decode", 1), "verify": gp.Mode("verify", 4)}
    rules = InputRules(make_inputs(), torch.device("cpu"), list(modes.values()))
    static = StaticBuffers(rules.specs, KeyTable(list(modes.values()), [8, 12]), torch.device("cpu"))
    full = static.full
    rules.bind_static(static.span, [full[n].data_ptr() for n in rules.names],
                      [full[n].numel() * full[n].element_size() for n in rules.names])
    checker = make_input_checker(rules)

    def own_buffer(x):  # the static buffer itself, from row 0: allowed (staging copies it onto itself)
        full["positions"][:x["positions"].shape[0]] = x["positions"]
        x["positions"] = full["positions"][:x["positions"].shape[0]]

    def aliased(x, name="positions", into="input_ids"):  # overlaps a static buffer: refused
        rows = x[name].shape[0]
        x[name] = full[into][1:1 + rows] if rows < full[into].shape[0] else full["out_cache_loc"][:rows]
    row = torch.zeros(1 + len(rules.specs), dtype=torch.int64)
    rng = random.Random(42)
    mutations = [
        lambda x: x.pop("positions"),
        lambda x: x.update(extra=x["positions"]),
        lambda x: x.update(seq_lens=x["seq_lens"].long()),
        lambda x: x.update(input_ids=x["input_ids"][:-1]),
        lambda x: x.update(features=x["features"][:, :2].contiguous()),
        lambda x: x.update(features=torch.zeros(x["features"].shape[0], 4, 3)),
        lambda x: x.update(out_cache_loc=torch.stack([x["out_cache_loc"]] * 2, 1)[:, 0]),
        lambda x: x.update(req_pool_indices=x["req_pool_indices"].view(1, -1)),
        lambda x: x.update(positions="not a tensor"),
        lambda x: x.update(positions=x["positions"].to("meta")),
        lambda x: x.update(seq_lens=x["seq_lens"][:0], req_pool_indices=x["req_pool_indices"][:0]),
        lambda x: x.update(positions=torch._neg_view(x["positions"])),  # contiguous, but lazily negated
        lambda x: x.update(features=x["features"].to_sparse()),  # sparse: no flat rows to copy
        lambda x: x.update(input_ids=torch.nested.nested_tensor(list(x["input_ids"].split(1)))),  # nested
        lambda x: x.update(seq_lens=torch.nested.nested_tensor(list(x["seq_lens"].split(1)))),  # nested, bs input
        own_buffer, aliased, lambda x: aliased(x, "positions", "positions"),
        lambda x: None,  # valid
    ]
    for trial in range(300):
        mode = modes[rng.choice(["decode", "verify"])]
        inputs = random_step(mode, rng.randint(1, 12), "cpu", rng)
        rng.choice(mutations)(inputs)
        row.fill_(-1)
        max_bs = rng.choice([8, 12])  # the largest captured size: a larger step is the miss policy's, unwritten
        got = checker.check(inputs, mode.tokens_per_seq, row.data_ptr(), max_bs)
        try:
            real_bs, ordered = rules.check(mode, inputs, None)
        except gp.GraphPoolError:
            assert got < 0, f"trial {trial}: C++ accepted what Python rejects"
            assert row.tolist() == [-1] * row.numel(), f"trial {trial}: a refused step wrote the ring row"
            continue
        if real_bs > max_bs:
            assert got < 0 and row.tolist() == [-1] * row.numel(), f"trial {trial}: a step no graph serves wrote the row"
            continue
        assert got == real_bs and row.tolist() == [real_bs, *(t.data_ptr() for t in ordered)], f"trial {trial}"


def test_a_built_cpp_checker_is_imported_without_the_builder(tmp_path, monkeypatch):
    """torch's builder reruns ninja, whose file names the checkout and the venv: asked from another checkout or
    venv, it rebuilt the same module (~30 s), and the other one rebuilt it next."""
    from graphpool import native
    built = native._extension()
    if built is None:
        pytest.skip("the C++ extension did not build here")

    def no_build(**kwargs):
        raise AssertionError("the builder ran although the module was built")

    with monkeypatch.context() as m:
        m.setenv("GRAPHPOOL_EXTENSION_DIR", str(tmp_path))
        m.setattr("torch.utils.cpp_extension.load", no_build)
        directory = native._build_directory()
        os.makedirs(directory)
        shutil.copy(built.__file__, os.path.join(directory, "graphpool_input_check.so"))
        native._extension.cache_clear()
        module = native._extension()
    native._extension.cache_clear()  # the real cache folder again for later tests
    assert module is not None, "the cached module was not imported"  # the builder would have raised: None


def test_a_broken_cached_cpp_checker_is_built_again(tmp_path, monkeypatch):
    from graphpool import native
    calls = []
    with monkeypatch.context() as m:
        m.setenv("GRAPHPOOL_EXTENSION_DIR", str(tmp_path))
        m.setattr("torch.utils.cpp_extension.load", lambda **kwargs: calls.append(kwargs) or "rebuilt")
        native._extension.cache_clear()
        directory = native._build_directory()
        os.makedirs(directory)
        with open(os.path.join(directory, "graphpool_input_check.so"), "wb") as f:
            f.write(b"not a shared object: a build killed while linking")
        got = native._extension()
    native._extension.cache_clear()
    assert got == "rebuilt" and calls and calls[0]["build_directory"] == directory


def test_eager_twin_works_without_triton():
    """Triton is an extra: on a CPU install without it the eager twin stages with the torch reference."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, graphpool as gp\n"
            "pool = gp.GraphPool([gp.Mode('decode', 1), gp.Mode('verify', 4)],\n"
            "                    [gp.StepInput('ids', torch.int64, 'token'), gp.StepInput('lens', torch.int32, 'seq', fill=1)],\n"
            "                    [2, 4], device='cpu', fast_checks=False)\n"
            "pool.capture(lambda b: b.inputs['ids'] * 2, progress=False, outputs='token')\n"
            "out = pool.run('verify', ids=torch.arange(12), lens=torch.ones(3, dtype=torch.int32))\n"
            "assert torch.equal(out, torch.arange(12) * 2), out\n"
            "assert pool.static_inputs['lens'].tolist() == [1, 1, 1, 1]\n"
            "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr

"""The output rule: rows are declared at capture, never guessed from shapes; results keep their container
type and never share a tensor object across runs. On the CPU (the eager twin) and, marked ``gpu``, with
real CUDA graphs. The oracle is the step run eagerly on the real, unpadded inputs."""
from __future__ import annotations

import collections
import random

import pytest
import torch

import graphpool as gp
from test_pool import TOY_OUTPUTS, ToyStep, eager_reference, make_inputs, random_step

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
MODES = [gp.Mode("decode", 1), gp.Mode("verify", 2)]
SIZES = [1, 2, 4, 8]


def stats_step(device: str):
    """A step with row outputs and outputs that are not indexed by row: a per-layer statistic of 8 values
    (as long as the largest decode graph, by coincidence), and a [vocab] vector."""
    toy = ToyStep(device)
    layer_stats = torch.arange(8.0, device=device)
    vocab = torch.linspace(0, 1, 16, device=device)

    def step(batch: gp.StepBatch) -> dict:
        out = toy(batch)
        return {"logits": out["logits"], "pooled": out["pooled"], "layer_stats": layer_stats * 1,
                "vocab": vocab + out["pooled"].sum() * 0}
    return toy, step, layer_stats, vocab


@pytest.mark.parametrize("device", DEVICES)
def test_undeclared_outputs_come_back_whole_at_every_batch_size(device):
    pool = gp.GraphPool(MODES, make_inputs(), SIZES, device=device)
    toy, step, layer_stats, vocab = stats_step(device)
    pool.capture(step, progress=False, outputs=TOY_OUTPUTS)
    rng = random.Random(0)
    # decode bs 5 (graph 8: 8 rows, as many as layer_stats), verify bs 3 (graph 4, 8 tokens), decode bs 2,
    # and a batch larger than every graph (the eager miss path): the same rule on every path.
    for mode, bs in ((MODES[0], 5), (MODES[1], 3), (MODES[0], 2), (MODES[1], 11)):
        inputs = random_step(mode, bs, device, rng)
        got = pool.run(mode.name, copy=True, **inputs)
        want = eager_reference(toy, mode, inputs)
        assert torch.equal(got["layer_stats"], layer_stats), f"{mode.name} bs={bs}: {got['layer_stats']}"
        assert torch.equal(got["vocab"], vocab), f"{mode.name} bs={bs}"
        torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["pooled"], want["pooled"], rtol=1e-5, atol=1e-5)
    assert pool.stats.misses


@pytest.mark.parametrize("device", DEVICES)
def test_declarations_that_cannot_hold_fail_at_capture(device):
    _, step, _, _ = stats_step(device)
    cases = [({"logits": "token", "layer_stats": "token"}, r"'layer_stats' has shape \(8,\), declared per token"),
             ({"logits": "seq"}, r"'logits' has shape .*, declared per seq.*; declare it 'token'"),
             ({"logit": "token"}, r"declares 'logit', which is not among the step's outputs"),
             ("token", r"'pooled' has shape .*, declared per token.*; declare it 'seq'")]
    for outputs, message in cases:
        pool = gp.GraphPool(MODES, make_inputs(), SIZES, device=device)
        with pytest.raises(gp.CaptureError, match=message) as info:
            pool.capture(step, progress=False, outputs=outputs)
        assert isinstance(info.value.__cause__, gp.StepOutputError) and not pool.captured
    pool = gp.GraphPool(MODES, make_inputs(), SIZES, device=device)
    with pytest.raises(ValueError, match="must be 'token'.*'seq'.*or None"):
        pool.capture(step, progress=False, outputs={"logits": "tokens"})
    with pytest.raises(TypeError, match="outputs must be None, 'token', 'seq' or a mapping"):
        pool.capture(step, progress=False, outputs=["logits"])


def test_the_miss_path_checks_the_declaration_on_the_real_sizes():
    pool = gp.GraphPool(MODES, make_inputs(), SIZES, device="cpu")
    toy = ToyStep("cpu")
    state = {"eager": False}

    def step(batch):
        out = toy(batch)
        return {"logits": out["logits"][:8] if state["eager"] else out["logits"]}
    pool.capture(step, progress=False, outputs={"logits": "token"})
    state["eager"] = True  # the miss path calls the step itself: a per-token output with 8 rows is wrong
    with pytest.raises(gp.StepOutputError, match=r"eager step .* 'logits' has shape \(8, 5\), declared per token"):
        pool.run("verify", **random_step(MODES[1], 9, "cpu", random.Random(1)))


@pytest.mark.parametrize("device", DEVICES)
def test_nested_outputs_and_container_prefixes(device):
    pool = gp.GraphPool(MODES, make_inputs(), SIZES, device=device)
    toy = ToyStep(device)
    table = torch.ones(3, device=device)

    def step(batch):
        out = toy(batch)
        return {"rows": (out["logits"], out["logits"] * 2), "seq": [out["pooled"]], "table": table * 1}
    pool.capture(step, progress=False, outputs={"rows": "token", "seq.0": "seq"})
    inputs = random_step(MODES[1], 3, device, random.Random(2))
    got = pool.run("verify", copy=True, **inputs)
    want = eager_reference(toy, MODES[1], inputs)
    torch.testing.assert_close(got["rows"][1], want["logits"] * 2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["seq"][0], want["pooled"], rtol=1e-5, atol=1e-5)
    assert isinstance(got["rows"], tuple) and isinstance(got["seq"], list) and got["table"].shape == (3,)


@pytest.mark.parametrize("device", DEVICES)
def test_a_declared_path_names_whole_components_never_a_string_prefix(device):
    """Before: paths matched as string prefixes, so a declaration of "logits" also cut a sibling key
    "logits.layer_stats" (a dict key holding a dot): it came back cut, or the capture failed naming it."""
    pool = gp.GraphPool(MODES, make_inputs(), SIZES, device=device)
    toy, stats_of, layer_stats, _ = stats_step(device)

    def step(batch):
        out = stats_of(batch)
        return {"logits": out["logits"], "logits.layer_stats": out["layer_stats"], "rows": {"pooled.v2": out["pooled"]}}
    pool.capture(step, progress=False, outputs={"logits": "token", "rows.pooled.v2": "seq"})
    rng = random.Random(3)
    for mode, bs in ((MODES[0], 5), (MODES[1], 3), (MODES[1], 11)):  # graphs of 8 and 8 tokens, and a miss
        inputs = random_step(mode, bs, device, rng)
        got = pool.run(mode.name, copy=True, **inputs)
        want = eager_reference(toy, mode, inputs)
        assert torch.equal(got["logits.layer_stats"], layer_stats), f"{mode.name} bs={bs}: undeclared, so whole"
        torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["rows"]["pooled.v2"], want["pooled"], rtol=1e-5, atol=1e-5)

    def two_spellings(batch):  # "a.b" names the key "a.b" and the key "b" inside "a": refused, not guessed
        out = toy(batch)
        return {"a.b": out["logits"], "a": {"b": out["logits"] * 2}}
    with pytest.raises(gp.CaptureError, match=r"declares 'a.b', which names 2 outputs .*rename that key"):
        gp.GraphPool(MODES, make_inputs(), SIZES, device=device).capture(two_spellings, progress=False,
                                                                         outputs={"a.b": "token"})


class AttrDict(collections.OrderedDict):
    """A dict subclass with attribute access, as transformers' ModelOutput."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("copy", [False, True])
def test_the_container_type_is_kept_on_every_path(device, copy):
    pool = gp.GraphPool(MODES, make_inputs(), SIZES, device=device)
    toy = ToyStep(device)
    pool.capture(lambda b: AttrDict(toy(b)), progress=False, outputs=TOY_OUTPUTS)
    rng = random.Random(3)
    for bs in (3, SIZES[-1] + 2):  # a graph, then the eager miss path
        inputs = random_step(MODES[0], bs, device, rng)
        got = pool.run("decode", copy=copy, **inputs)
        assert type(got) is AttrDict, (bs, type(got))
        torch.testing.assert_close(got.pooled, eager_reference(toy, MODES[0], inputs)["pooled"], rtol=1e-5, atol=1e-5)


@pytest.mark.optional  # transformers comes with the sglang-classes extra
def test_transformers_model_output_keeps_its_attributes():
    outputs = pytest.importorskip("transformers.modeling_outputs")
    pool = gp.GraphPool(MODES, make_inputs(), SIZES, device="cpu")
    toy = ToyStep("cpu")
    pool.capture(lambda b: outputs.CausalLMOutputWithPast(logits=toy(b)["logits"]), progress=False,
                 outputs={"logits": "token"})
    for bs in (3, 9):
        inputs = random_step(MODES[1], bs, "cpu", random.Random(bs))
        got = pool.run("verify", **inputs)
        assert type(got) is outputs.CausalLMOutputWithPast and got.logits.shape == (bs * 2, 5)
        assert got.to_tuple()[0] is got["logits"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["dict", "tensor", "tuple", "namedtuple", "nested"])
def test_two_results_never_share_a_tensor_object(device, kind):
    """An in-place metadata change on one result (``unsqueeze_``) must not reach the next result."""
    Pair = collections.namedtuple("Pair", "logits pooled")
    toy = ToyStep(device)
    make = {"dict": lambda o: o, "tensor": lambda o: o["logits"], "tuple": lambda o: (o["logits"], o["pooled"]),
            "namedtuple": lambda o: Pair(o["logits"], o["pooled"]), "nested": lambda o: {"a": [o["logits"]], "b": None}}
    rules = {"dict": TOY_OUTPUTS, "tensor": "token", "tuple": {"0": "token", "1": "seq"}, "namedtuple": TOY_OUTPUTS,
             "nested": {"a": "token"}}
    pool = gp.GraphPool(MODES, make_inputs(), SIZES, device=device)
    pool.capture(lambda b: make[kind](toy(b)), progress=False, outputs=rules[kind])
    rng = random.Random(4)

    def first_tensor(out):
        return gp.outputs.leaves_of(out)[0]

    a = pool.run("verify", **random_step(MODES[1], 3, device, rng))
    b = pool.run("verify", **random_step(MODES[1], 3, device, rng))
    assert first_tensor(a) is not first_tensor(b)
    first_tensor(a).unsqueeze_(0)
    c = pool.run("verify", **random_step(MODES[1], 3, device, rng))
    assert first_tensor(c).shape == (6, 5), first_tensor(c).shape
    assert first_tensor(b).shape == (6, 5)


def test_the_cpp_fresh_views_are_new_objects_over_the_same_memory():
    """CUDA pools make each result's tensor objects in C++ (the input checker's extension): the same promise."""
    from graphpool.native import fresh_functions
    fresh = fresh_functions()
    if fresh is None:
        pytest.skip("the C++ extension did not build here")
    fresh_views, fresh_dict = fresh
    logits, tokens = torch.randn(8, 4), torch.arange(8)
    views = (logits[:3], None, tokens[:3])
    for made in (fresh_views(views), list(fresh_dict(("a", "b"), (views[0], views[2])).values())):
        made = [t for t in made if t is not None]
        assert all(m is not v and m.data_ptr() == v.data_ptr() and m.shape == v.shape
                   for m, v in zip(made, (views[0], views[2])))
        made[0].unsqueeze_(0)
        made[1][0] = -1  # values are shared: the graph's memory
        assert views[0].shape == (3, 4) and tokens[0] == -1
        tokens[0] = 0
    assert fresh_views(views)[1] is None

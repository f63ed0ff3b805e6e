"""graphpool.integrations.transformers: greedy tokens of the pool's loop equal ``model.generate(do_sample=False)``
per prompt (the oracle), for plain-only and mixed (plain + prompt lookup) loops, Llama and Qwen3 (every other
family: test_transformers_families.py), prompts of different lengths, requests ending at different steps (EOS and max tokens), a batch
larger than every graph (eager misses) and debug mode; and a wrong dummy-slot fill that the oracle catches.

CPU: the pool's eager twin. GPU (``-m gpu``): the same tests, float32, real CUDA graphs."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import graphpool as gp
from tests.hf_models import one_thread  # noqa: F401 (a fixture)
from tests.hf_models import needs_transformers, tfm
from tests.hf_models import reference, tiny_model

pytestmark = needs_transformers

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
#: Different lengths; repeated spans (a quoted line, an edited one) so that lookup finds drafts early.
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8], [11, 12, 13], [3] * 11, [21, 22, 23, 24, 21, 22, 23, 25, 21, 22],
           [40, 41], [60, 61, 62, 63, 64, 65, 60, 61, 62]]
MAX_NEW = [12, 20, 7, 15, 10, 20]
BATCH_SIZES = (1, 2, 4)  # 6 prompts: the first steps (bs 5 and 6) are larger than every graph


def choose_eos(model: torch.nn.Module) -> tuple[list[int], list[list[int]]]:
    """An EOS token that ends some requests early and leaves others to their max tokens, and the oracle's
    tokens with it."""
    free = reference(model, PROMPTS, MAX_NEW, [])
    for candidate in free[1][2:]:
        # Greedy: with EOS, a request's output is its output without, cut after the EOS's first occurrence.
        ended = [candidate in out[:-1] for out in free]
        if any(ended) and not all(ended):
            return [candidate], reference(model, PROMPTS, MAX_NEW, [candidate])
    raise AssertionError("no EOS candidate ends some requests but not all: change the prompts")


_ORACLES: dict = {}


def oracle(family: str, device: str) -> tuple[torch.nn.Module, list[int], list[list[int]]]:
    """The model of ``family`` on ``device``, its EOS and generate()'s tokens (made once per module)."""
    if (family, device) not in _ORACLES:
        model = tiny_model(family, device)
        _ORACLES[family, device] = (model, *choose_eos(model))
    return _ORACLES[family, device]


def run(model: torch.nn.Module, eos: list[int], mixed: bool, **kw) -> tfm.GenerationResult:
    generator = tfm.PoolGenerator(model, max_len=48, max_batch=6, batch_sizes=BATCH_SIZES, num_draft_tokens=3, **kw)
    # verify only once <= 2 requests run; never for the plain loop (no policy would speculate at every step)
    policy = gp.SpeculationPolicy(off_above=2 if mixed else 0)
    try:
        return generator.generate(PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=eos, policy=policy)
    finally:
        generator.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mixed", [False, True], ids=["plain", "mixed"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tokens_equal_generate_per_prompt(family: str, device: str, mixed: bool):
    model, eos, want = oracle(family, device)
    result = run(model, eos, mixed, debug=True)
    assert result.tokens == want
    assert set(result.finish) == {"eos", "length"}
    first = result.steps[0]
    assert first.batch_size > max(BATCH_SIZES) and first.graph_bs is None and result.misses > 0
    modes = {s.mode for s in result.steps}
    if mixed:
        assert modes == {"decode", "verify"} and result.accept_per_verify > 1
        assert all(s.batch_size <= 2 for s in result.steps_of("verify"))
    else:
        assert modes == {"decode"} and result.accept_per_verify is None
    assert sum(s.committed for s in result.steps) + len(PROMPTS) == result.num_tokens  # +1 each from prefill


@pytest.mark.parametrize("device", DEVICES)
def test_transformers_own_sdpa_mixed_loop_equals_generate(device: str):
    """grouped_attention=False: transformers' sdpa attention (keys repeated per query head) over the slot cache."""
    model, eos, want = oracle("llama", device)
    assert run(model, eos, mixed=True, grouped_attention=False).tokens == want


@pytest.mark.parametrize("device", DEVICES)
def test_eager_attention_and_waiting_prompts(device: str):
    """transformers' eager attention adds the mask itself; 6 prompts through 3 slots wait for free ones."""
    model = tiny_model("llama", device, attn="eager")
    want = reference(model, PROMPTS, MAX_NEW, [])
    generator = tfm.PoolGenerator(model, max_len=48, max_batch=3, batch_sizes=(1, 2), num_draft_tokens=2)
    result = generator.generate(PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=[], policy=gp.SpeculationPolicy(off_above=3))
    assert result.tokens == want
    assert max(s.batch_size for s in result.steps) == 3 and result.steps_of("verify")
    assert generator.cache.free_slots == 3  # every slot given back


@pytest.mark.parametrize("device", DEVICES)
def test_wrong_dummy_slot_fill_changes_the_output(device: str):
    """The oracle can fail: padded rows that write into slot 1 (a live request's) instead of the dummy slot
    overwrite that request's keys at position 0, and its tokens leave generate()'s."""
    model = tiny_model("llama", device)
    prompts, max_new = PROMPTS[:3], MAX_NEW[:3]  # 3 requests on graphs of 4 rows: one padded row every step
    want = reference(model, prompts, max_new, [])

    def wrong_fill(cache, vocab):
        return [dataclasses.replace(s, fill=1) if s.name == "slots" else s for s in tfm.step_inputs(cache, vocab)]

    for inputs, equal in ((tfm.step_inputs, True), (wrong_fill, False)):
        generator = tfm.PoolGenerator(model, max_len=48, batch_sizes=(4,), num_draft_tokens=0, inputs=inputs)
        got = generator.generate(prompts, max_new_tokens=max_new, eos_token_id=[]).tokens
        assert got[0][0] == want[0][0]  # the first token comes from the eager prefill, before any padded row
        assert (got == want) is equal, (inputs.__name__, got, want)
        if not equal:
            assert got[0] != want[0] and got[1:] == want[1:]  # only slot 1's request is hurt


def test_runs_with_autograd_on_and_keeps_the_cache_out_of_it():
    """The loop enters inference mode itself: with grad enabled (weights require grad) the cache records no
    autograd history."""
    model = tiny_model("llama")
    assert torch.is_grad_enabled() and next(model.parameters()).requires_grad
    generator = tfm.PoolGenerator(model, max_len=32, batch_sizes=(1, 2), num_draft_tokens=2)
    result = generator.generate(PROMPTS[:2], max_new_tokens=8, eos_token_id=[], policy=gp.SpeculationPolicy(off_above=2))
    assert result.tokens == reference(model, PROMPTS[:2], [8, 8], [])
    layer = generator.cache.layers[0]
    assert not layer.keys.requires_grad and layer.keys.grad_fn is None and layer.keys.is_inference()


@pytest.mark.parametrize("device", DEVICES)
def test_build_pool_sampler_feeds_both_modes(device: str):
    """build_pool's sampler gives valid steps of each mode (bounds checked in debug mode); the pool's rows
    equal the eager step on the same cache and inputs."""
    model = tiny_model("qwen3", device)
    pool, sample = tfm.build_pool(model, batch_sizes=(1, 4), max_len=40, num_draft_tokens=3, debug=True)
    assert {k.mode for k in pool.graph_keys} == {"decode", "verify"}
    for mode, width in (("decode", 1), ("verify", 4)):
        for bs in (1, 3, 4):
            inputs = sample(mode, bs, seed=bs)
            with torch.inference_mode():
                got = pool.run(mode, copy=True, **inputs)["out"]
            assert got.shape == (bs * width, 4) and got.dtype == torch.float64
            tokens = got[:, 0]
            assert ((0 <= tokens) & (tokens < model.config.vocab_size)).all() and (tokens == tokens.round()).all()
    pool.close()


def test_prefill_in_several_batches_under_a_token_budget():
    """Admitted prompts are prefilled in batches of at most prefill_tokens padded tokens: the same tokens."""
    model, eos, want = oracle("llama", "cpu")
    generator = tfm.PoolGenerator(model, max_len=48, max_batch=6, batch_sizes=BATCH_SIZES, num_draft_tokens=3,
                                  prefill_tokens=20)
    calls = []
    prefill = generator.forward.prefill
    generator.forward.prefill = lambda prompts, *args: calls.append(len(prompts)) or prefill(prompts, *args)
    assert generator.generate(PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=eos).tokens == want
    assert len(calls) > 1 and sum(calls) == len(PROMPTS) and max(calls) <= 2  # prompts of 9-11 tokens, 20 a batch


def test_a_failed_generation_gives_its_slots_back():
    model, eos, want = oracle("llama", "cpu")
    generator = tfm.PoolGenerator(model, max_len=48, max_batch=6, batch_sizes=BATCH_SIZES, num_draft_tokens=3)
    run_step = generator.pool.run
    calls = []

    def fail_on_the_fifth(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return run_step(*args, **kwargs)

    generator.pool.run = fail_on_the_fifth
    with pytest.raises(KeyboardInterrupt):
        generator.generate(PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=eos)
    assert generator.cache.free_slots == 6
    generator.pool.run = run_step
    assert generator.generate(PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=eos).tokens == want

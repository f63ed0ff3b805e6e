"""graphpool.integrations.transformers, its parts: prompt lookup against a brute-force search, the slot cache's
rules (allocation, binding, the mask), and the refusals (releases, families, attention, windows, lengths)."""
from __future__ import annotations

import inspect
import random

import pytest
import torch

import graphpool as gp
from tests.hf_models import one_thread  # noqa: F401 (a fixture)
from tests.hf_models import needs_transformers, tfm
from tests.hf_models import reference, tiny_model

pytestmark = needs_transformers


def brute_force_draft(tokens: list[int], count: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The longest suffix n-gram's latest earlier occurrence with tokens after it, by scanning everything."""
    for n in range(min(max_ngram, len(tokens)), min_ngram - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for end in range(len(tokens) - 2, n - 2, -1):  # an occurrence ending before the last token
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + count]
    return []


def test_lookup_equals_brute_force_search_as_the_history_grows():
    rng = random.Random(0)
    for trial in range(200):
        vocab, max_ngram = rng.choice([3, 5, 20]), rng.randint(1, 4)
        min_ngram = rng.randint(1, max_ngram)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        index = tfm.NgramIndex(list(tokens), max_ngram=max_ngram, min_ngram=min_ngram)
        for _ in range(12):
            count = rng.randint(1, 5)
            assert index.propose(count) == brute_force_draft(tokens, count, max_ngram, min_ngram), (trial, tokens)
            new = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
            tokens += new
            index.extend(new)


def test_lookup_examples():
    index = tfm.NgramIndex([1, 2, 3, 4, 1, 2, 3, 9, 7, 1, 2], max_ngram=3)
    assert index.propose(3) == [3, 9, 7]  # "1 2" last occurred before "3 9"; the longest match is 2 tokens
    assert tfm.NgramIndex([5, 6, 7]).propose(4) == []
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        tfm.NgramIndex([1], max_ngram=1, min_ngram=2)


def test_cache_slots_binding_and_mask():
    model = tiny_model("llama")
    cache = tfm.SlotCache(model, num_slots=3, max_len=8)
    layer = cache.layers[0]
    assert layer.keys.shape == (3, 2, 8, 16) and len(cache.layers) == 2 and cache.nbytes == 2 * 2 * 3 * 2 * 8 * 16 * 4
    assert [cache.allocate(), cache.allocate()] == [1, 2]  # never the dummy slot 0
    with pytest.raises(RuntimeError, match="all 2 sequence slots"):
        cache.allocate()
    cache.free(1)
    for bad in (0, 1, 3):
        with pytest.raises(ValueError, match="not a taken sequence slot"):
            cache.free(bad)
    with pytest.raises(NotImplementedError, match="no single length"):
        cache.get_seq_length()
    positions = torch.tensor([[2, 3], [0, 1]])
    mask = cache.attention_mask(positions)
    assert mask.shape == (2, 1, 2, 8) and mask.dtype == torch.float32
    visible = (mask == 0).squeeze(1)
    assert visible[0, 0].tolist() == [True] * 3 + [False] * 5 and visible[1, 1].tolist() == [True] * 2 + [False] * 6
    # A token's keys land at its (slot, position) and nowhere else.
    with torch.inference_mode():
        cache.bind(torch.tensor([2, 1]), positions)
        k = torch.arange(2 * 2 * 2 * 16, dtype=torch.float32).view(2, 2, 2, 16)
        keys, _ = layer.update(k, -k)
    assert torch.equal(layer.keys[2][:, 2:4], k[0]) and torch.equal(layer.keys[1][:, 0:2], k[1])
    assert layer.keys[0].abs().sum() == 0 and layer.keys[2][:, :2].abs().sum() == 0
    assert torch.equal(keys[0], layer.keys[2]) and torch.equal(keys[1], layer.keys[1])


def test_cache_refuses_a_forward_without_bind():
    model = tiny_model("llama")
    cache = tfm.SlotCache(model, num_slots=2, max_len=8)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # 5.24 renamed it
    with torch.inference_mode(), pytest.raises(RuntimeError, match="bind"):
        model(input_ids=torch.tensor([[1, 2]]), position_ids=torch.tensor([[0, 1]]),
              attention_mask=cache.attention_mask(torch.tensor([[0, 1]])), use_cache=True, **{name: cache})


@pytest.mark.parametrize("version, why", [("4.57.1", "older releases"), ("5.5.4", "older releases"),
                                          ("dev", "not a release number")])
def test_old_releases_are_refused(version: str, why: str):
    with pytest.raises(tfm.UnsupportedModelError, match=why) as e:
        tfm.check_version(version)
    assert f"found transformers {version}" in str(e.value) and "5.6.0 and later" in str(e.value)


def test_supported_releases_pass_and_a_newer_one_warns_once():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for a tested release
        for version in ("5.6.0", "5.17.0", "5.24.3", "5.25.0", "5.25.9"):
            tfm.check_version(version)
    with pytest.warns(tfm.UntestedReleaseWarning, match="transformers 5.26.0 is newer than every release"):
        tfm.check_version("5.26.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tfm.check_version("5.26.0")  # once per release


def test_the_extra_never_downgrades_a_newer_release():
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, "pyproject.toml")).read()
    extra = text.split("\ntransformers = [", 1)[1].split("]", 1)[0]
    assert extra == '"transformers>=5.6"', extra  # a floor only: pip keeps whatever newer release is installed


def test_a_changed_interface_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch):
    """A newer release whose interfaces changed: the construction-time check names what changed."""
    from graphpool.integrations.transformers import versions
    tfm.check_interfaces()  # the installed release has them all
    name = "transformers.integrations.sdpa_attention.sdpa_attention_forward"
    monkeypatch.setitem(versions.INTERFACES, name, lambda: False)
    with pytest.raises(tfm.UnsupportedModelError, match="changed interfaces .*sdpa_attention_forward"):
        tfm.PoolGenerator(tiny_model("llama"), max_len=16)
    from transformers.cache_utils import Cache
    monkeypatch.setitem(versions.INTERFACES, name, lambda: True)
    monkeypatch.setattr(Cache, "__init__", lambda self, layers_list=None: None)  # a renamed argument
    with pytest.raises(tfm.UnsupportedModelError, match=r"Cache\(layers=...\)"):
        tfm.check_interfaces()


def test_unsupported_attention_and_structures_are_refused_with_their_reason():
    import transformers
    model = tiny_model("llama")
    model.set_attn_implementation("flex_attention")
    with pytest.raises(tfm.UnsupportedModelError, match="attention implementation 'flex_attention'.*sdpa"):
        tfm.PoolGenerator(model, max_len=16)
    with pytest.raises(tfm.UnsupportedModelError, match="no language-model head"):
        tfm.SlotCache(tiny_model("llama").model, num_slots=2, max_len=16)
    t5 = transformers.T5ForConditionalGeneration._from_config(
        transformers.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=50), attn_implementation="eager")
    with pytest.raises(tfm.UnsupportedModelError, match="encoder-decoder"):
        tfm.PoolGenerator(t5.eval(), max_len=16)
    mamba = transformers.MambaForCausalLM._from_config(
        transformers.MambaConfig(hidden_size=32, num_hidden_layers=1, vocab_size=50), attn_implementation="eager")
    with pytest.raises(tfm.UnsupportedModelError, match="recurrent"):
        tfm.PoolGenerator(mamba.eval(), max_len=16)
    falcon = transformers.FalconForCausalLM._from_config(
        transformers.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, vocab_size=50),
        attn_implementation="sdpa")
    # Falcon computes its attention outside the interface (5.6) or asks its cache for one length (5.25).
    with pytest.raises(tfm.UnsupportedModelError, match="attention interface|one sequence length"):
        tfm.PoolGenerator(falcon.eval(), max_len=16)
    chunked = tiny_model("llama")
    chunked.config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(tfm.UnsupportedModelError, match="chunked attention"):
        tfm.PoolGenerator(chunked, max_len=16)
    trained = tiny_model("llama").train()
    with pytest.raises(tfm.UnsupportedModelError, match=r"training mode .*model.eval\(\)"):
        tfm.PoolGenerator(trained, max_len=16)


def test_a_window_the_attention_never_receives_is_refused():
    """A sliding-window layer by configuration whose attention gets no window: the step could not mask it."""
    from graphpool.integrations.transformers import structure
    model = tiny_model("gemma3")
    seen, calls = [(0, (1, 2, 2, 16), None), (1, (1, 2, 2, 16), None)], []
    module = model.model.layers[0].self_attn
    calls = [(module, (1, 4, 2, 16), None, {}), (model.model.layers[1].self_attn, (1, 4, 2, 16), None, {})]
    with pytest.raises(tfm.UnsupportedModelError, match="layer 0 is a sliding-window layer .* does not receive"):
        structure._layout(model, 2, seen, calls, torch.float32)


def test_requests_that_do_not_fit_are_refused_and_leave_the_generator_usable():
    model = tiny_model("llama")
    generator = tfm.PoolGenerator(model, max_len=16, batch_sizes=(1,), num_draft_tokens=2)
    with pytest.raises(ValueError, match=r"prompt 1: 10 tokens \+ max_new_tokens 5 \+ 2 drafts exceed .* max_len 16"):
        generator.generate([[1], [2] * 10], max_new_tokens=5)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        generator.generate([[]], max_new_tokens=2)
    with pytest.raises(ValueError, match="outside"):
        generator.generate([[1, 500]], max_new_tokens=2)
    with pytest.raises(ValueError, match="one per prompt"):
        generator.generate([[1], [2]], max_new_tokens=[3])
    assert generator.cache.free_slots == 1
    assert generator.generate([[1], [2] * 10], max_new_tokens=4, eos_token_id=[]).tokens == reference(
        model, [[1], [2] * 10], [4, 4], [])
    plain = tfm.PoolGenerator(model, max_len=16, batch_sizes=(1,), num_draft_tokens=0)
    with pytest.raises(ValueError, match="num_draft_tokens > 0"):
        plain.generate([[1]], max_new_tokens=2, policy=gp.SpeculationPolicy(off_above=1))
    assert plain.generate([], max_new_tokens=2).tokens == [] and tfm.generate(model, []).tokens == []


def test_no_prompts_get_the_same_empty_result_from_both_entry_points():
    """Before: generate(model, []) failed with "max() arg is an empty sequence" while PoolGenerator.generate([])
    returned an empty result. Both refuse a bad max_new_tokens with the same error."""
    model = tiny_model("llama")
    generator = tfm.PoolGenerator(model, max_len=16, batch_sizes=(1,), num_draft_tokens=0)
    want = generator.generate([], max_new_tokens=4)
    got = tfm.generate(model, [], max_new_tokens=4)
    assert (got.tokens, got.finish, got.steps) == (want.tokens, want.finish, want.steps) == ([], [], [])
    for bad in (0, [3]):
        with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1 or one per prompt"):
            generator.generate([], max_new_tokens=bad)
        with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1 or one per prompt"):
            tfm.generate(model, [], max_new_tokens=bad)


def test_grouped_attention_equals_transformers_sdpa():
    """Query heads that share a key/value head ride as rows of it: the same output as transformers' sdpa, which
    repeats the keys for them, on a mask of rows at different positions."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from graphpool.integrations.transformers.attention import grouped_sdpa
    model = tiny_model("llama")
    cache = tfm.SlotCache(model, num_slots=2, max_len=9)
    torch.manual_seed(0)
    rows, heads, kv_heads, tokens, dim = 3, 4, 2, 2, 16
    q = torch.randn(rows, heads, tokens, dim)
    k, v = torch.randn(rows, kv_heads, 9, dim), torch.randn(rows, kv_heads, 9, dim)
    positions = torch.tensor([[0, 1], [4, 5], [7, 8]])
    module = model.model.layers[0].self_attn  # num_key_value_groups = 2
    want, _ = sdpa_attention_forward(module, q, k, v, cache.attention_mask(positions), scaling=0.25)
    got, _ = grouped_sdpa(module, q, k, v, cache.attention_mask(positions, groups=2), scaling=0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    wrong, _ = grouped_sdpa(module, q, k, v, cache.attention_mask(positions.flip(0), groups=2), scaling=0.25)
    assert not torch.allclose(wrong, want, atol=1e-3)  # the check can fail: rows read their own positions


def test_the_step_attention_is_on_only_inside_the_step():
    model = tiny_model("qwen3")
    generator = tfm.PoolGenerator(model, max_len=24, batch_sizes=(1,), num_draft_tokens=0)
    seen = []
    attention = model.model.layers[0].self_attn
    attention.register_forward_pre_hook(lambda module, args: seen.append(module.config._attn_implementation))
    generator.generate([[1, 2, 3]], max_new_tokens=3, eos_token_id=[])
    assert seen and set(seen) == {generator.forward.attention} and model.config._attn_implementation == "sdpa"
    assert generator.forward.grouped
    plain = tfm.PoolGenerator(model, max_len=24, batch_sizes=(1,), num_draft_tokens=0, grouped_attention=False)
    assert not plain.forward.grouped and plain.forward.attention != generator.forward.attention


def test_static_cache_fails_at_the_second_batch_size_and_the_remedy_names_slot_cache():
    """Why SlotCache exists: transformers' StaticCache takes its batch size from its first write, so a pool's
    second batch size fails in index_copy_; the CaptureError's remedy names this package's cache, which exists."""
    from transformers import StaticCache
    model = tiny_model("llama")
    cache = StaticCache(config=model.config, max_cache_len=16)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    pool = gp.GraphPool([gp.Mode("decode", 1)], [gp.StepInput("input_ids", torch.int64),
                                                 gp.StepInput("positions", torch.int64)], [1, 2])

    def step(batch):
        ids, positions = (batch.inputs[n].view(batch.bs, 1) for n in ("input_ids", "positions"))
        return {"logits": model(input_ids=ids, position_ids=positions, use_cache=True, **{name: cache}).logits}

    with torch.inference_mode(), pytest.raises(gp.CaptureError, match="index_copy_") as e:
        pool.capture(step, outputs={"logits": "seq"}, progress=False)
    assert "graphpool.integrations.transformers.SlotCache" in str(e.value) and tfm.SlotCache.__name__ == "SlotCache"

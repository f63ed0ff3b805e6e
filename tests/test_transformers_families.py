"""Families by structure: every family of tests/hf_models.py (22, from tiny random configs) gives
``model.generate(do_sample=False)``'s tokens from the pool, in plain decode and with prompt lookup, on prompts
longer than the 8-token sliding windows of the families that have them; and the transformers release's own
refusals are not graphpool's (a family it serves is served here without its name appearing anywhere)."""
from __future__ import annotations

import pytest

import graphpool as gp
from tests.hf_models import one_thread  # noqa: F401 (a fixture)
from tests.hf_models import FAMILIES, needs_transformers, reference, tfm, tiny_model

pytestmark = needs_transformers

#: Repeated spans so that lookup finds drafts; 9 to 11 tokens, and 14 new ones: past every 8-token window.
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8], [11, 12, 13, 14, 11, 12, 13, 15, 11, 12], [3] * 11]
NEW = 14


#: The twelve families the default suite runs; the other ten are the long version (--runslow; CI runs them all).
DEFAULT = ("llama", "qwen3", "qwen2", "mistral", "gemma2", "gemma3", "phi3", "gpt_neox", "olmo2", "granite", "mixtral",
           "smollm3")


@pytest.mark.parametrize("family", [f if f in DEFAULT else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def test_family_tokens_equal_generate_plain_and_prompt_lookup(family: str):
    model = tiny_model(family)
    want = reference(model, PROMPTS, [NEW] * len(PROMPTS), [])
    generator = tfm.PoolGenerator(model, max_len=40, batch_sizes=(1, 2), num_draft_tokens=3)
    plain = generator.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[], policy=gp.SpeculationPolicy(off_above=0))
    lookup = generator.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[])
    assert plain.tokens == want and not plain.steps_of("verify")
    assert lookup.tokens == want and lookup.steps_of("verify")  # drafts verified (accepted or not)
    windows = {"mistral", "gemma2", "gemma3", "phi3", "starcoder2"}
    assert (generator.cache.layout.windows == (None, 8)) == (family in windows), generator.cache.layout


def test_a_window_mask_that_ignores_the_window_leaves_generate():
    """The oracle can fail: with every window's mask built as full attention, a windowed family's tokens leave
    generate()'s once the sequence passes the window."""
    model = tiny_model("mistral")
    want = reference(model, PROMPTS, [NEW] * len(PROMPTS), [])
    generator = tfm.PoolGenerator(model, max_len=40, batch_sizes=(1, 2), num_draft_tokens=0)
    right = generator.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[]).tokens
    build = generator.cache.attention_mask
    generator.cache.attention_mask = lambda positions, kv_len=None, groups=1, windows=(None,): build(
        positions, kv_len, groups, (None,) * len(windows))
    assert right == want and generator.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[]).tokens != want

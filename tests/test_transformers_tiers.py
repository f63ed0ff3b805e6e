"""Speculation tiers in the transformers integration: prompt lookup's draft length chosen by batch size.

Greedy tokens equal ``model.generate(do_sample=False)`` per prompt (the oracle of test_transformers_loop.py) with
every tier alone and with a schedule whose tier changes during the run, over a batch that shrinks from 6 requests
to 1 and so visits every tier; per-tier step counts reported; the graph is told exactly the drafts the host
counts, and a routing that tells it the longest tier's count instead is caught (greedy tokens cannot see it: the
sampled check, test_transformers_sampling.py, shows its harm); one pool's buffers are the longest tier's alone;
bad tiers are refused at construction, naming the fix.

CPU: the pool's eager twin. GPU (``-m gpu``): the same tests, float32, real CUDA graphs."""
from __future__ import annotations

import pytest
import torch

import graphpool as gp
from tests.hf_models import one_thread  # noqa: F401 (a fixture)
from tests.hf_models import needs_transformers, tfm, tiny_model
from tests.test_transformers_loop import DEVICES, MAX_NEW, PROMPTS, oracle

pytestmark = needs_transformers

DRAFTS = (4, 2, 1)  # verify (4 drafts), verify_2, verify_1
MODES = {"verify": 4, "verify_2": 2, "verify_1": 1}
#: 4 drafts at 1 request, 2 at <= 3, 1 at <= 5 (back at <= 4), plain decode at 6.
BOUNDS = [(4, 1), (2, 3), (1, 5, 4)]


def tiered(model: torch.nn.Module, **kw) -> tfm.PoolGenerator:
    return tfm.PoolGenerator(model, max_len=48, max_batch=6, batch_sizes=(1, 2, 4), num_draft_tokens=DRAFTS, **kw)


def told_drafts(generator: tfm.PoolGenerator) -> list[tuple[str, int, int]]:
    """Record, for every step the pool runs, its mode, rows and the drafts its ``sampling`` input tells the graph
    (the ``drafts`` column, summed over rows); returns the list it fills."""
    from graphpool.integrations.transformers.sampling import DRAFTS as COLUMN
    seen, run = [], generator.pool.run

    def recording(mode, **inputs):
        seen.append((mode, inputs["slots"].shape[0], int(inputs["sampling"][:, COLUMN].sum())))
        return run(mode, **inputs)

    generator.pool.run = recording
    return seen


@pytest.mark.parametrize("device", DEVICES)
def test_every_tier_alone_equals_generate(device: str):
    model, eos, want = oracle("llama", device)
    generator = tiered(model, debug=True)
    assert generator.verify_modes == MODES and generator.num_draft_tokens == 4
    assert {m: generator.draft_tokens(m) for m in MODES} == MODES
    for mode, length in MODES.items():
        result = generator.generate(PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=eos,
                                    policy=generator.tier_schedule([(length, 6)]))  # this tier at every size
        assert result.tokens == want, mode
        assert set(result.steps_by_mode) <= {mode, "decode"} and result.steps_by_mode[mode] > 0, result.steps_by_mode
        verify = result.steps_of(mode)
        assert sum(s.accepted for s in verify) > 0 and result.accept_by_mode[mode] > 1  # drafts landed
        assert all(s.drafted <= length * s.batch_size for s in verify)
    generator.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_schedule_changing_tier_as_the_batch_shrinks_equals_generate(device: str):
    """6 requests ending at different steps (EOS and max tokens): the batch walks 6 -> 1 through every tier."""
    model, eos, want = oracle("llama", device)
    generator = tiered(model, debug=True)
    told = told_drafts(generator)
    schedule = generator.tier_schedule(BOUNDS)
    assert schedule.modes == ("verify", "verify_2", "verify_1", "decode")
    result = generator.generate(PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=eos, policy=schedule)
    assert result.tokens == want
    by_mode = result.steps_by_mode
    assert set(by_mode) == {"decode", *MODES} and sum(by_mode.values()) == len(result.steps), by_mode
    assert result.switches >= 3 and schedule.switches >= 3
    served = {"verify": 1, "verify_2": 3, "verify_1": 5}  # each tier's largest batch (the bounds above)
    for mode, largest in served.items():
        assert all(s.batch_size <= largest for s in result.steps_of(mode)), mode
    # The hysteresis holds: a batch of 5 coming from 6 (plain decode) stays plain until it shrinks to 4.
    assert {s.mode for s in result.steps if s.batch_size == 5} == {"decode"}
    assert set(result.accept_by_mode) == set(MODES) and "mode switches" in result.summary()
    # The graph is told exactly the drafts the host verifies and counts, step by step, in each tier's width.
    assert [(s.mode, s.batch_size, s.drafted) for s in result.steps] == told
    assert sum(s.committed for s in result.steps) + len(PROMPTS) == result.num_tokens
    generator.close()


def test_drafts_column_from_the_longest_tier_is_caught():
    """A routing that tells every drafted row's graph the longest tier's draft count (not the row's own, as a
    shorter tier carries) leaves greedy tokens as they are, which is why the check above compares what the graph
    is told with what the host counts: it sees the fault. (Its harm shows when sampling: the statistical test
    in test_transformers_sampling.py fails with it.)"""
    from graphpool.integrations.transformers.sampling import DRAFTS as COLUMN
    model, eos, want = oracle("llama", "cpu")
    generator = tiered(model)
    told = told_drafts(generator)  # what reaches the pool, after the faulty routing below
    run = generator.pool.run

    def longest_count(mode, **inputs):
        sampling = inputs["sampling"].clone()
        sampling[:, COLUMN] = torch.where(sampling[:, COLUMN] > 0, float(generator.num_draft_tokens), 0.0)
        return run(mode, **{**inputs, "sampling": sampling})

    generator.pool.run = longest_count
    result = generator.generate(PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=eos,
                                policy=generator.tier_schedule(BOUNDS))
    assert result.tokens == want  # greedy cannot tell
    assert [(s.mode, s.batch_size, s.drafted) for s in result.steps] != told


def test_acceptance_lowers_a_tier_within_a_run():
    """A tier whose break-even its drafts never reach drops to the next one (its gate pauses it); tokens stay."""
    model, eos, want = oracle("llama", "cpu")
    generator = tiered(model)
    schedule = generator.tier_schedule([(4, 6), (2, 7)], min_accept={4: 4.5}, window=1, pause_steps=2)
    result = generator.generate(PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=eos, policy=schedule)
    assert result.tokens == want
    assert schedule.gate("verify").pauses > 0 and result.steps_by_mode.get("verify_2", 0) > 0
    assert "verify_1" not in result.steps_by_mode


def test_one_pool_holds_every_tier_in_the_longest_tiers_buffers():
    model = tiny_model("llama")
    tiers = tfm.PoolGenerator(model, max_len=32, batch_sizes=(1, 2), num_draft_tokens=(1, 4, 2))  # any order
    alone = tfm.PoolGenerator(model, max_len=32, batch_sizes=(1, 2), num_draft_tokens=4)
    assert list(tiers.pool.modes) == ["decode", "verify", "verify_2", "verify_1"]
    assert {k.mode for k in tiers.pool.graph_keys} == set(tiers.pool.modes)
    assert tiers.pool.stats.buffer_bytes == alone.pool.stats.buffer_bytes
    with pytest.raises(ValueError, match=r"prompt 0: 20 tokens \+ max_new_tokens 9 \+ 4 drafts exceed"):
        tiers.generate([[1] * 20], max_new_tokens=9)  # room for the longest tier's drafts


def test_speculation_policy_and_the_one_call_form_keep_working_with_tiers():
    """SpeculationPolicy names ``verify``: the longest tier. generate(model, ...) sizes max_len by it too."""
    model, eos, want = oracle("llama", "cpu")
    generator = tiered(model)
    result = generator.generate(PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=eos,
                                policy=gp.SpeculationPolicy(off_above=2))
    assert result.tokens == want and set(result.steps_by_mode) == {"decode", "verify"}
    schedule = gp.TierSchedule([gp.Tier("verify", 1), gp.Tier("verify_2", 3), gp.Tier("decode")])
    once = tfm.generate(model, PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=eos, policy=schedule,
                        generator_args={"batch_sizes": (1, 2, 4), "num_draft_tokens": (4, 2)})
    assert once.tokens == want and {"verify", "verify_2"} <= set(once.steps_by_mode)


@pytest.mark.parametrize("drafts, message", [
    (-1, "must be >= 0"),
    ((4, 0), "draft length must be >= 1 and appear once .* leave 0 out"),
    ((4, 4), "appear once"),
    ((), "non-empty list"),
    ((4, 2.5), "non-empty list of them"),
    ("4", "non-empty list"),
])
def test_bad_draft_lengths_are_refused(drafts, message: str):
    with pytest.raises(ValueError, match=message):
        tfm.PoolGenerator(tiny_model("llama"), max_len=16, batch_sizes=(1,), num_draft_tokens=drafts)


@pytest.fixture(scope="module")
def small():
    return tfm.PoolGenerator(tiny_model("llama"), max_len=24, batch_sizes=(1, 2), num_draft_tokens=(4, 2))


@pytest.mark.parametrize("bounds, kw, message", [
    ([(3, 2)], {}, r"no verify mode of 3 drafts \(its modes: verify \(4 drafts\), verify_2 \(2 drafts\), decode\); "
                   r"build the PoolGenerator with num_draft_tokens=\(4, 3, 2\)"),
    ([(2, 2), (4, 8)], {}, "tier 1 drafts 4 tokens, not fewer than tier 0 .* longest draft first"),
    ([(4, 8), (2, 4)], {}, "off_above=4 is not above tier 0 .* reorder the tiers"),
    ([(4, 4, 6)], {}, "on_at_or_below=6 is above off_above=4"),
    ([(4, 4), (2, 8, 3)], {}, "taken back at <= 3, not above tier 0"),
    ([(4,)], {}, r"is not \(draft length, off_above\)"),
    ([(2.5, 4)], {}, "not a draft length"),
    ([], {}, "at least one speculative tier"),
    ([(4, 4)], {"min_accept": {2: 1.5}}, r"min_accept names draft lengths \[2\]"),
])
def test_bad_tier_schedules_are_refused_at_construction(small, bounds, kw, message: str):
    with pytest.raises(ValueError, match=message):
        small.tier_schedule(bounds, **kw)


@pytest.mark.parametrize("policy, error, message", [
    (lambda: gp.TierSchedule([gp.Tier("verify_3", 2), gp.Tier("decode")]), ValueError,
     r"policy tier 0 names mode 'verify_3', which this generator lacks .* num_draft_tokens=\(4, 3, 2\)"),
    (lambda: gp.TierSchedule([gp.Tier("verify_4", 2), gp.Tier("decode")]), ValueError,
     "mode of 4 drafts is 'verify'"),
    (lambda: gp.TierSchedule([gp.Tier("verify_2", 2), gp.Tier("verify", 4), gp.Tier("decode")]), ValueError,
     "list the tiers longest draft first"),
    (lambda: gp.SpeculationPolicy(off_above=2, spec_mode="spec"), ValueError, "PoolGenerator.tier_schedule"),
    (lambda: object(), TypeError, "policy must be a graphpool.TierSchedule"),
])
def test_a_policy_the_generator_cannot_serve_is_refused_before_anything_runs(small, policy, error, message: str):
    with pytest.raises(error, match=message):
        small.generate([[1, 2, 3]], max_new_tokens=4, policy=policy())
    assert small.cache.free_slots == small.max_batch
    assert len(small.generate([[1, 2, 3]], max_new_tokens=4, policy=small.tier_schedule([(2, 2)])).tokens[0]) == 4

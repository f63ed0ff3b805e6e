"""Sampling on the graphs, against transformers' own processors and generate(do_sample=True).

* The step's logits processors and warpers equal transformers' classes on random logits (exact, or to float
  rounding where transformers computes the same sum in another order).
* Statistical, and able to fail: on a tiny model with an 8-token vocabulary, the first three sampled tokens'
  distributions from the pool without speculation, with prompt lookup (every step verifies drafts), at each
  speculation tier (2 drafts, 1 draft, and a schedule whose tier changes every step), and from
  ``generate(do_sample=True)`` each lie within an L1 bound of the exact distribution, which is computed from
  transformers' own processed scores. The bound comes from the sample count: for ``n`` draws over ``k``
  categories, P(||p_hat - p||_1 >= eps) <= 2^k exp(-n eps^2 / 2) (Bretagnolle-Huber-Carol), so
  eps = sqrt(2 (k ln 2 + ln(1 / delta)) / n) fails a correct sampler with probability <= delta = 1e-6 per check
  (15 checks: < 2e-5 in all). A deliberately wrong acceptance rule (accept with probability sqrt(p) instead of
  p) fails the same check, with and without tiers; so does a routing that tells a shorter tier's graph the
  longest tier's draft count (the token after the last real draft is then drawn as if that draft were followed
  by another, never equal to it).
"""
from __future__ import annotations

import math

import pytest
import torch

import graphpool as gp
from tests.hf_models import one_thread  # noqa: F401 (a fixture)
from tests.hf_models import needs_transformers, tfm, tiny_model

pytestmark = needs_transformers

VOCAB = 8
NEW = 3
SAMPLES = 4000
DELTA = 1e-6
SETTINGS = dict(do_sample=True, temperature=0.9, top_p=0.97, repetition_penalty=1.2)


def l1_bound(samples: int, categories: int, delta: float = DELTA) -> float:
    return math.sqrt(2 * (categories * math.log(2) + math.log(1 / delta)) / samples)


def processors(options: dict):
    from transformers.generation.logits_process import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                                                        MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    process = LogitsProcessorList()
    if options.get("repetition_penalty", 1.0) != 1.0:
        process.append(RepetitionPenaltyLogitsProcessor(options["repetition_penalty"]))
    if options.get("min_new_tokens"):
        process.append(MinNewTokensLengthLogitsProcessor(options["prompt_len"], options["min_new_tokens"],
                                                         options["eos"]))
    warp = LogitsProcessorList()
    if options.get("temperature", 1.0) != 1.0:
        warp.append(TemperatureLogitsWarper(options["temperature"]))
    if options.get("top_k"):
        warp.append(TopKLogitsWarper(options["top_k"]))
    if options.get("top_p", 1.0) < 1.0:
        warp.append(TopPLogitsWarper(options["top_p"]))
    if options.get("min_p"):
        warp.append(MinPLogitsWarper(options["min_p"]))
    return process, warp


@pytest.mark.parametrize("options", [
    dict(repetition_penalty=1.3, temperature=0.7, top_k=5, top_p=0.8, min_p=0.05),
    dict(repetition_penalty=0.8, min_new_tokens=4, prompt_len=6, eos=[3, 7], top_k=50),
    dict(temperature=1.5, top_p=0.5),
    dict(min_p=0.2),
    dict(),
])
def test_processors_and_warpers_equal_transformers_classes(options: dict):
    from graphpool.integrations.transformers import sampling
    torch.manual_seed(0)
    rows, vocab, length = 6, 40, 9
    logits = torch.randn(rows, vocab) * 3
    history = torch.randint(0, vocab, (rows, length))
    process, warp = processors(options)
    want_processed = process(history, logits.clone())
    want = warp(history, want_processed.clone())
    params = torch.tensor([sampling.NEUTRAL] * rows)
    params[:, sampling.SAMPLE] = 1
    for name, column in (("temperature", sampling.TEMPERATURE), ("top_k", sampling.TOP_K),
                         ("top_p", sampling.TOP_P), ("min_p", sampling.MIN_P),
                         ("repetition_penalty", sampling.PENALTY)):
        if name in options:
            params[:, column] = options[name]
    eos = torch.zeros(vocab, dtype=torch.bool)
    if options.get("min_new_tokens"):
        eos[options["eos"]] = True
        # generate counts new tokens past the prompt: here the history holds 9 tokens, 3 of them new.
        params[:, sampling.EOS_FROM] = options["prompt_len"] + options["min_new_tokens"] - 1
    positions = torch.full((rows,), length - 1)
    seen = sampling.seen_tokens(history, positions, vocab)
    processed = sampling.process(logits, seen, params, positions, eos)
    assert torch.equal(processed, want_processed)
    got = sampling.warp(processed, params)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = ~torch.isinf(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-6, atol=1e-6)


def test_draw_follows_the_weights_and_never_picks_a_zero_weight():
    from graphpool.integrations.transformers import sampling
    weights = torch.tensor([[0.0, 1.0, 0.0, 3.0, 0.0]]).expand(4, 5)
    uniform = torch.tensor([0.0, 0.2499, 0.25, 0.9999999])
    assert sampling.draw(weights, uniform).tolist() == [1, 1, 3, 3]
    assert sampling.draw(weights, torch.ones(4)).tolist() == [3, 3, 3, 3]  # past the end: the likeliest


def exact_distributions(model: torch.nn.Module, prompt: list[int]) -> list[torch.Tensor]:
    """P(t1), P(t2), P(t3) of the first three sampled tokens, from transformers' processed scores."""
    def next_probs(prefixes: list[list[int]]) -> torch.Tensor:
        ids = torch.tensor([prompt + p for p in prefixes])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=None, **SETTINGS)
        return out.scores[0].double().softmax(-1)

    p1 = next_probs([[]])[0]
    p2_given = next_probs([[a] for a in range(VOCAB)])  # [t1, t2]
    joint12 = p1[:, None] * p2_given
    p3_given = next_probs([[a, b] for a in range(VOCAB) for b in range(VOCAB)]).view(VOCAB, VOCAB, VOCAB)
    joint123 = joint12[:, :, None] * p3_given
    return [p1, joint12.sum(0), joint123.sum((0, 1))]


def histogram(tokens: list[list[int]]) -> list[torch.Tensor]:
    counts = torch.zeros(NEW, VOCAB, dtype=torch.float64)
    for row in tokens:
        for i, t in enumerate(row[:NEW]):
            counts[i, t] += 1
    return list(counts / len(tokens))


def distances(model: torch.nn.Module, prompt: list[int], tokens: list[list[int]]) -> list[float]:
    exact = exact_distributions(model, prompt)
    return [float((got - want).abs().sum()) for got, want in zip(histogram(tokens), exact)]


@pytest.fixture(scope="module")
def sampled():
    """The tiny model, a prompt in its own style, a generator of 64 rows with two tiers (``verify``: 2 drafts,
    ``verify_1``), and generate(do_sample=True)'s samples.

    The prompt: every token once, then the model's own sampled continuation, so that prompt lookup always finds a
    draft and the drafts are tokens the model gives middling to high probabilities (both branches of the rule run:
    a quarter to a half of the drafts are accepted). This seed's continuation ends in the model's favourite token,
    which it repeats: the token after an accepted draft often equals the draft, so a verify step that treats a
    row's last real draft as followed by another (and so never draws it again) moves the third token's law far
    (L1 ~ 0.8) past the bound."""
    model = tiny_model("llama", vocab_size=VOCAB, initializer_range=0.3)
    torch.manual_seed(15)
    start = torch.tensor([list(range(VOCAB))])
    prompt = model.generate(start, attention_mask=torch.ones_like(start), max_new_tokens=13, pad_token_id=0,
                            eos_token_id=None, do_sample=True, temperature=0.9)[0].tolist()
    generator = tfm.PoolGenerator(model, max_len=40, batch_sizes=(64,), num_draft_tokens=(2, 1), max_ngram=2)
    ids = torch.tensor([prompt] * SAMPLES)
    hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, pad_token_id=0,
                        eos_token_id=None, **SETTINGS)[:, len(prompt):].tolist()
    return model, prompt, generator, hf


def sample(generator, prompt: list[int], policy, seed: int) -> tfm.GenerationResult:
    return generator.generate([prompt] * SAMPLES, max_new_tokens=NEW, eos_token_id=[], policy=policy, seed=seed,
                              **SETTINGS)


@pytest.mark.slow  # ~8 s with the next one: CI runs them (--runslow), on the oldest and the newest release
def test_sampled_distributions_with_and_without_speculation_equal_generate(sampled):
    model, prompt, generator, hf = sampled
    bound = l1_bound(SAMPLES, VOCAB)
    plain = sample(generator, prompt, gp.SpeculationPolicy(off_above=0), seed=2)
    spec = sample(generator, prompt, None, seed=3)
    assert not plain.steps_of("verify")
    verify = spec.steps_of("verify")
    assert len(verify) == len(spec.steps) and sum(s.accepted for s in verify) > SAMPLES / 10  # drafts do land
    assert sum(s.drafted - s.accepted for s in verify) > SAMPLES  # and are rejected: the residual is drawn from
    for name, tokens in (("generate(do_sample=True)", hf), ("pool, plain", plain.tokens),
                         ("pool, prompt lookup", spec.tokens)):
        found = distances(model, prompt, tokens)
        assert max(found) < bound, (name, found, bound)


def alternating(generator) -> gp.TierSchedule:
    """Both tiers in one run, the tier changing at every step: ``verify`` (2 drafts) never reaches its break-even
    (2.99 tokens per sequence), so after each of its steps the next step drops to ``verify_1``, then it probes
    again; a request's three tokens come from steps of both tiers."""
    return generator.tier_schedule([(2, SAMPLES), (1, 2 * SAMPLES)], min_accept={2: 2.99}, window=1, pause_steps=1)


@pytest.mark.slow
def test_sampled_distributions_at_every_tier_equal_generate(sampled):
    model, prompt, generator, _ = sampled
    bound = l1_bound(SAMPLES, VOCAB)
    for name, policy, seed in (("verify_1 alone", generator.tier_schedule([(1, SAMPLES)]), 4),
                               ("tiers alternating", alternating(generator), 5)):
        result = sample(generator, prompt, policy, seed)
        by_mode = result.steps_by_mode
        tiers = ["verify_1"] if name.startswith("verify_1") else ["verify", "verify_1"]
        assert set(by_mode) == set(tiers), (name, by_mode)
        if len(tiers) > 1:
            assert result.switches >= len(result.steps) // 2, (name, result.switches)
        for mode in tiers:
            verify = result.steps_of(mode)
            assert sum(s.accepted for s in verify) > SAMPLES / 10, (name, mode)  # drafts land
            assert sum(s.drafted - s.accepted for s in verify) > SAMPLES / 10, (name, mode)  # and are rejected
        found = distances(model, prompt, result.tokens)
        assert max(found) < bound, (name, found, bound)


@pytest.mark.slow
@pytest.mark.parametrize("tiers", [False, True], ids=["longest", "tiers"])
def test_a_wrong_acceptance_rule_fails_the_same_check(sampled, monkeypatch: pytest.MonkeyPatch, tiers: bool):
    from graphpool.integrations.transformers import sampling
    model, prompt, generator, _ = sampled
    monkeypatch.setattr(sampling, "accept_draft", lambda p, u: u < p.sqrt())
    found = distances(model, prompt, sample(generator, prompt, alternating(generator) if tiers else None,
                                            seed=5 if tiers else 3).tokens)
    assert max(found) > l1_bound(SAMPLES, VOCAB), found


@pytest.mark.slow
def test_a_shorter_tier_told_the_longest_draft_count_fails_the_same_check(sampled,
                                                                          monkeypatch: pytest.MonkeyPatch):
    """A deliberately broken routing: each drafted row's ``drafts`` column says the generator's longest draft
    length (2) while a ``verify_1`` step carries one draft, so the token after an accepted draft is drawn with
    that draft's mass removed, as if a second draft had been rejected there."""
    from graphpool.integrations.transformers.sampling import DRAFTS
    model, prompt, generator, _ = sampled
    run = generator.pool.run

    def longest_count(mode, **inputs):
        told = inputs["sampling"].clone()
        told[:, DRAFTS] = torch.where(told[:, DRAFTS] > 0, float(generator.num_draft_tokens), 0.0)
        return run(mode, **{**inputs, "sampling": told})

    monkeypatch.setattr(generator.pool, "run", longest_count)
    result = sample(generator, prompt, generator.tier_schedule([(1, SAMPLES)]), seed=4)
    assert set(result.steps_by_mode) == {"verify_1"}
    found = distances(model, prompt, result.tokens)
    assert found[2] > l1_bound(SAMPLES, VOCAB), found


def test_new_settings_need_no_new_capture(sampled):
    """Per-row settings are step inputs: another temperature (or greedy) replays the same graphs."""
    _, prompt, generator, _ = sampled
    captured = [(k, s.capture_s) for k, s in generator.pool.stats.keys.items()]
    hot = generator.generate([prompt] * 4, max_new_tokens=4, do_sample=True, temperature=5.0, seed=0)
    greedy = generator.generate([prompt] * 4, max_new_tokens=4, do_sample=False)
    assert [(k, s.capture_s) for k, s in generator.pool.stats.keys.items()] == captured
    assert len({tuple(t) for t in greedy.tokens}) == 1 and len({tuple(t) for t in hot.tokens}) > 1

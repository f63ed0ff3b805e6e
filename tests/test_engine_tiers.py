"""Speculation tiers in the reference engine and its decode loop (issue 38, item 2), on the CPU twin.

The oracle of the tokens is plain greedy decoding (itself checked against a from-scratch greedy oracle in
tests/test_decode_loop.py). The draft's state has two: its KV after every verify step against the draft run
from scratch over the committed tokens, and the draft itself: with a draft identical to the target and chain
drafts (topk 1), every verify step accepts its whole draft when the draft's KV holds every committed token, so
each tier's acceptance must stay at its maximum after every resume (the check SGLang's STANDALONE draft gives
the SGLang tiers).
"""
from __future__ import annotations

import pytest
import torch

from bench.engine.config import ModelConfig, SpecConfig, tier_modes
from bench.engine.harness import build
from bench.engine.kv_cache import DUMMY_ROW
from bench.engine.identity import drain_schedule, greedy_identity
from bench.engine.loop import DecodeLoop, make_requests
from graphpool import Tier, TierSchedule

from test_decode_loop import DenseCausal

CFG, PROMPT = ModelConfig.tiny(), 12
SPEC = SpecConfig(topk=2, steps=3, num_draft_tokens=6, draft_noise=0.1)
SHORTER = [SpecConfig(topk=2, steps=2, num_draft_tokens=4, draft_noise=0.1),
           SpecConfig(topk=1, steps=1, num_draft_tokens=2, draft_noise=0.1)]


class Cycle:
    """A stand-in policy that walks a fixed list of modes, one per step, so every change of tier happens."""

    def __init__(self, modes):
        self.modes, self.calls = modes, 0

    def choose(self, bs):
        self.calls += 1
        return self.modes[(self.calls - 1) % len(self.modes)]


# verify -> shorter -> shorter, plain steps, resume at a short tier, longer tiers after it, and back down.
# Plain stretches outlast the draft's window (4 tokens here), so the draft needs a catch-up after them.
WALK = ["verify", "verify_4", "verify_2"] + ["decode"] * 5 + ["verify_2", "verify_4", "verify", "verify_2", "verify"]


@pytest.fixture(scope="module")
def tiered():
    return build(CFG, SPEC, [1, 2, 4], PROMPT, 24, "cpu", torch.float32, tiers=SHORTER)


def test_one_pool_holds_every_tier_and_the_engine_names_them(tiered):
    engine, pool = tiered
    assert list(engine.tiers) == ["verify", "verify_4", "verify_2"] and engine.window == SPEC.steps + 1
    assert {m: pool.modes[m].tokens_per_seq for m in ("verify", "verify_4", "verify_2", "decode")} == {
        "verify": 6, "verify_4": 4, "verify_2": 2, "decode": 1}
    # The engine's steps read per-sequence inputs only: no tier adds a byte to the static buffers.
    assert {n: t.shape[0] for n, t in pool.static_inputs.items()} == {"seq_lens": 4, "req_pool_indices": 4}


def test_every_tier_and_every_change_of_tier_commit_plain_decodings_tokens(tiered):
    _check_every_tier(*tiered)


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["torch", "flashinfer-reference"])
def test_every_tier_commits_plain_decodings_tokens_on_cuda_graphs_gpu(attention):
    """The same on CUDA graphs (float32; FlashInfer's in-graph metadata with the reference kernel): the tiers'
    trees of other shapes and the shared draft window, captured."""
    engine, pool = build(CFG, SPEC, [1, 2, 4], PROMPT, 24, "cuda", torch.float32, tiers=SHORTER, attention=attention)
    assert pool.stats.backend.startswith("cuda")
    _check_every_tier(engine, pool)


def _check_every_tier(engine, pool):
    reqs = make_requests(7, PROMPT, CFG.vocab_size, 8, 24, seed=3)
    plain = DecodeLoop(engine, pool, "plain").run(reqs, 3)
    runs = {v: DecodeLoop(engine, pool, v).run(reqs, 3) for v in ("spec", "spec_4", "spec_2")}
    runs["walk"] = DecodeLoop(engine, pool, "tiers", Cycle(WALK)).run(reqs, 3)
    runs["drain"] = DecodeLoop(engine, pool, "tiers", drain_schedule(engine)).run(reqs, 4)
    for name, st in runs.items():
        assert st.outputs == plain.outputs, name
        assert st.tokens == plain.tokens == sum(r.max_new for r in reqs) and st.graph_misses == 0, name
    assert runs["spec_4"].steps["verify_4"] and not runs["spec_4"].steps["verify"]
    assert runs["spec_2"].mean_accept_by_tier.keys() == {"verify_2"}
    walk = runs["walk"]
    assert all(walk.steps[m] for m in ("verify", "verify_4", "verify_2", "decode")), walk.steps
    assert walk.catch_ups > 0 and walk.switches >= len(WALK) - 1
    drain = runs["drain"]  # batch 4 decodes; as it drains to 3, 2, 1 the tiers lengthen
    assert all(drain.steps[m] for m in ("decode", "verify_2", "verify_4", "verify")), drain.steps
    assert drain.catch_ups > 0  # once, where speculation resumed after the plain steps


def test_changes_between_speculative_tiers_need_no_catch_up(tiered):
    engine, pool = tiered
    reqs = make_requests(5, PROMPT, CFG.vocab_size, 8, 20, seed=4)
    st = DecodeLoop(engine, pool, "tiers", Cycle(["verify", "verify_2", "verify_4", "verify_2"])).run(reqs, 2)
    assert st.catch_ups == 0 and st.switches > 0
    assert st.outputs == DecodeLoop(engine, pool, "plain").run(reqs, 2).outputs


def test_the_drafts_kv_holds_every_committed_token_after_every_verify_step():
    """After each verify step of any tier, the draft's KV at positions ``0..n-1`` (``n``: the step's input length)
    equals the draft run from scratch over those tokens: the first draft pass rewrote the window, and whatever it
    did not reach was right before (left by a deeper tier, or by plain steps and the catch-up)."""
    engine, pool = build(CFG, SPEC, [1, 2, 4], PROMPT, 24, "cpu", torch.float32, tiers=SHORTER)
    speculate, checked = engine.speculate, []

    def speculate_then_check(seq_lens, rows, mode="verify"):
        out = speculate(seq_lens, rows, mode)
        for n, row in zip(seq_lens.tolist(), rows.tolist()):
            if row == DUMMY_ROW:
                continue
            dense = DenseCausal()
            engine.draft(engine.token_table[row, :n], torch.arange(n), dense)
            slots = engine.req_to_token[row, :n]
            torch.testing.assert_close(engine.draft_attn.cache.k[0][slots], dense.keys[0], rtol=1e-4, atol=1e-4)
            checked.append(mode)
        return out

    engine.speculate = speculate_then_check  # the eager twin calls the step function at every step
    reqs = make_requests(6, PROMPT, CFG.vocab_size, 12, 24, seed=8)
    st = DecodeLoop(engine, pool, "tiers", Cycle(WALK)).run(reqs, 3)
    assert set(checked) == {"verify", "verify_4", "verify_2"} and st.catch_ups > 0


@pytest.mark.parametrize("run_ahead", [0, 1])
def test_the_drafts_state_survives_every_change_of_tier(run_ahead):
    """A draft identical to the target (one layer, no noise) with chain drafts accepts every draft token exactly
    when its KV holds every committed token; a tier after a deeper tier's step, or after plain steps, would lose
    acceptance if the draft's KV had a gap. Every tier's acceptance stays at steps + 1."""
    cfg = CFG.with_layers(1)
    chains = [SpecConfig(topk=1, steps=s, num_draft_tokens=s + 1, draft_noise=0.0) for s in (4, 2, 1)]
    engine, pool = build(cfg, chains[0], [1, 2, 4], PROMPT, 40, "cpu", torch.float32, tiers=chains[1:])
    reqs = make_requests(6, PROMPT, cfg.vocab_size, 24, 40, seed=5)
    walk = ["verify", "verify_2", "verify_3", "verify", "decode", "verify_2", "verify"] + ["decode"] * 6 + [
        "verify_3", "verify_2"]
    st = DecodeLoop(engine, pool, "tiers", Cycle(walk), run_ahead=run_ahead).run(reqs, 3)
    assert st.mean_accept_by_tier == {"verify": 5.0, "verify_3": 3.0, "verify_2": 2.0}
    assert st.catch_ups > 0
    assert st.outputs == DecodeLoop(engine, pool, "plain").run(reqs, 3).outputs


def test_acceptance_below_a_tiers_break_even_lowers_it_in_the_loop(tiered):
    """The loop reports each verify step's mean committed tokens to the schedule: a break-even the 6-token tier
    cannot reach (more than its 4 at most) sends its steps to the 4-token tier, which pays."""
    engine, pool = tiered
    schedule = TierSchedule([Tier("verify", 8, min_accept=4.5), Tier("verify_4", 16, min_accept=1.01),
                             Tier("verify_2", 32), Tier("decode")], modes=pool.modes, window=2, pause_steps=4)
    reqs = make_requests(6, PROMPT, CFG.vocab_size, 16, 24, seed=6)
    st = DecodeLoop(engine, pool, "tiers", schedule).run(reqs, 2)
    pauses = schedule.gate("verify").pauses
    assert pauses >= 2 and schedule.gate("verify_4").pauses == 0
    # Each pause sends 4 of verify's steps to verify_4 (the last pause may outlast the run).
    assert st.steps["verify_4"] >= 4 * (pauses - 1) and st.steps["verify"] > 0 and not st.steps["verify_2"]
    assert st.outputs == DecodeLoop(engine, pool, "plain").run(reqs, 2).outputs


def test_the_greedy_identity_check_covers_every_tier():
    run = greedy_identity(CFG, SPEC, "torch", "cpu", n_requests=5, min_new=8, max_new=16, tiers=SHORTER)
    assert run["ok"], run
    assert set(run["identical"]) == {"spec", "dynamic", "spec_4", "spec_2", "tiers"}
    assert set(run["tier_steps"]) == {"decode", "verify", "verify_4", "verify_2"} and run["catch_ups"] > 0


def test_tiers_are_refused_unless_shorter_and_on_the_same_draft():
    with pytest.raises(ValueError, match="not fewer than the tier before it"):
        tier_modes(SPEC, [SpecConfig(topk=2, steps=2, num_draft_tokens=6, draft_noise=0.1)])
    with pytest.raises(ValueError, match="every tier drafts with the one draft model"):
        tier_modes(SPEC, [SpecConfig(topk=2, steps=2, num_draft_tokens=4, draft_noise=0.3)])


def test_the_loop_refuses_a_tier_the_engine_lacks(tiered):
    engine, pool = tiered
    with pytest.raises(ValueError, match="unknown variant 'spec_3'.*spec_4"):
        DecodeLoop(engine, pool, "spec_3")
    with pytest.raises(ValueError, match="needs a policy"):
        DecodeLoop(engine, pool, "tiers")

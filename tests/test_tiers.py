"""TierSchedule (speculation tiers) against independent oracles: a rule-by-rule restatement of the hysteresis,
hand-run acceptance cycles, the two-tier SpeculationPolicy of before the tiers, and the eager computation of a
pool holding every tier's graphs."""
from __future__ import annotations

import random

import pytest
import torch

from graphpool import AcceptanceGate, GraphPool, Mode, SpeculationPolicy, StepInput, Tier, TierSchedule

FOUR = [Tier("v16", off_above=4, on_at_or_below=2), Tier("v8", off_above=16, on_at_or_below=12),
        Tier("v4", off_above=32, on_at_or_below=24), Tier("decode")]


def test_boundaries_and_hysteresis_growing_then_shrinking():
    s = TierSchedule(FOUR)
    up = {bs: s.choose(bs) for bs in (1, 4, 5, 12, 16, 17, 24, 32, 33, 100)}
    assert up == {1: "v16", 4: "v16", 5: "v8", 12: "v8", 16: "v8", 17: "v4", 24: "v4", 32: "v4", 33: "decode",
                  100: "decode"}
    assert s.switches == 3 and not s.speculating
    down = [s.choose(bs) for bs in (33, 25, 24, 13, 12, 3, 2, 1)]
    assert down == ["decode", "decode", "v4", "v4", "v8", "v8", "v16", "v16"]
    assert s.switches == 6


def test_jumps_cross_several_boundaries_and_flags_say_what_changed():
    s = TierSchedule(FOUR)
    assert s.choose(1) == "v16" and not s.changed and not s.resumed
    assert s.choose(100) == "decode" and s.changed and not s.resumed and s.previous == 0 and s.index == 3
    assert s.choose(30) == "decode" and not s.changed      # inside v4's band (24, 32]: the plain tier holds
    assert s.choose(3) == "v8" and s.changed and s.resumed  # below v8's resume point, above v16's: v8
    assert s.choose(3) == "v8" and not s.resumed
    assert s.choose(20) == "v4" and s.changed and not s.resumed  # between speculative tiers: no catch-up
    assert s.choose(1) == "v16" and s.switches == 4


def _oracle_walk(tiers: list[Tier], sizes: list[int]) -> list[str]:
    """The hysteresis restated as rules on bands: a tier is *valid* for a batch size when the size is within its
    bound and above the previous tier's resume point; the schedule keeps a valid tier, else moves to the nearest
    valid tier in the direction the batch moved (a plain-decode tier is valid for every larger size)."""
    last = len(tiers) - 1

    def valid(i, bs):
        return (i == last or bs <= tiers[i].off_above) and (i == 0 or bs > tiers[i - 1].resume_at)

    cur, out = 0, []
    for bs in sizes:
        if not valid(cur, bs):
            if cur < last and bs > tiers[cur].off_above:
                cur = min(j for j in range(cur + 1, last + 1) if valid(j, bs))
            else:
                cur = max(j for j in range(cur) if valid(j, bs))
        out.append(tiers[cur].mode)
    return out


def _random_tiers(rng: random.Random, n: int) -> list[Tier]:
    tiers, off, on = [], 0, -1
    for i in range(n - 1):
        off = off + rng.randint(1 if i else 0, 6)
        on = rng.randint(max(on + 1, 0), off) if on + 1 <= off else off
        tiers.append(Tier(f"t{i}", off_above=off, on_at_or_below=on))
    return tiers + [Tier("plain")]


@pytest.mark.parametrize("seed", range(6))
def test_random_walks_follow_the_band_rules(seed):
    rng = random.Random(seed)
    for _ in range(40):
        tiers = _random_tiers(rng, rng.randint(2, 5))
        top = tiers[-2].off_above + 4
        sizes, bs = [], rng.randint(1, top)
        for _ in range(60):  # mostly small moves (hovering at a bound), some jumps
            bs = max(1, min(top, bs + rng.choice([-1, 1, -1, 1, rng.randint(-top, top)])))
            sizes.append(bs)
        s = TierSchedule(tiers)
        assert [s.choose(b) for b in sizes] == _oracle_walk(tiers, sizes), (tiers, sizes)


class _SpeculationPolicyBefore:
    """SpeculationPolicy as it was before the tiers (commit 3e1dedd, graphpool/policy.py), the oracle of the
    two-tier case."""

    def __init__(self, off_above, on_at_or_below=None, spec_mode="verify", plain_mode="decode"):
        on = off_above if on_at_or_below is None else on_at_or_below
        if off_above < 0 or on < 0 or on > off_above:
            raise ValueError(f"need 0 <= on_at_or_below <= off_above, got on_at_or_below={on}, off_above={off_above}")
        self.off_above, self.on_at_or_below = off_above, on
        self.spec_mode, self.plain_mode = spec_mode, plain_mode
        self.speculating = True
        self.switches = 0

    def choose(self, batch_size):
        if self.speculating and batch_size > self.off_above:
            self.speculating, self.switches = False, self.switches + 1
        elif not self.speculating and batch_size <= self.on_at_or_below:
            self.speculating, self.switches = True, self.switches + 1
        return self.spec_mode if self.speculating else self.plain_mode


@pytest.mark.parametrize("seed", range(4))
def test_two_tier_case_equals_the_speculation_policy_of_before_step_by_step(seed):
    rng = random.Random(100 + seed)
    for _ in range(50):
        off = rng.randint(0, 12)
        on = rng.choice([None, rng.randint(0, off)])
        names = rng.choice([{}, {"spec_mode": "target_verify", "plain_mode": "plain"}])
        old, new = _SpeculationPolicyBefore(off, on, **names), SpeculationPolicy(off, on, **names)
        twin = TierSchedule([Tier(old.spec_mode, off, on), Tier(old.plain_mode)])
        assert (new.off_above, new.on_at_or_below, new.spec_mode, new.plain_mode) == (
            old.off_above, old.on_at_or_below, old.spec_mode, old.plain_mode)
        bs = rng.randint(0, 16)
        for _ in range(80):
            bs = max(0, bs + rng.choice([-2, -1, 0, 1, 2, rng.randint(-16, 16)]))
            want = old.choose(bs)
            assert new.choose(bs) == twin.choose(bs) == want
            assert new.speculating == twin.speculating == old.speculating
            assert new.switches == twin.switches == old.switches


@pytest.mark.parametrize("args", [(-1,), (4, 5), (4, -1), (-2, -3)])
def test_two_tier_case_refuses_what_it_refused_before_with_the_same_message(args):
    with pytest.raises(ValueError) as old:
        _SpeculationPolicyBefore(*args)
    with pytest.raises(ValueError) as new:
        SpeculationPolicy(*args)
    assert str(new.value) == str(old.value)


def test_acceptance_lowers_a_tier_for_its_pause_then_probes_it_again():
    s = TierSchedule([Tier("v16", 4, min_accept=2.5), Tier("v8", 16, min_accept=1.5), Tier("decode")],
                     window=2, pause_steps=3)
    assert s.choose(1) == "v16" and not s.record("v16", 2.0)
    assert s.choose(1) == "v16" and s.record("v16", 2.2)      # mean 2.1 < 2.5: v16 sits out 3 of its steps
    assert not s.record("v16", 1.0)                            # in flight when it was lowered: not counted
    seen = []
    for _ in range(3):
        seen.append(s.choose(1))
        assert s.lowered and s.changed == (len(seen) == 1)
        s.record("v8", 3.0)
    assert seen == ["v8"] * 3 and s.gate("v16").pauses == 1
    assert s.choose(1) == "v16" and not s.lowered           # the probe
    assert s.choose(8) == "v8" and not s.lowered            # batch size alone; the pause counts v16's steps only
    assert s.record("v8", 1.2) is False and s.record("v8", 1.1)  # rolling mean of (3.0, 3.0, 3.0, 1.2, 1.1)
    assert s.choose(8) == "decode" and s.lowered and not s.speculating
    assert s.choose(1) == "v16"  # v16 measures afresh; v8's pause counts only the steps v8 would have run
    assert [s.choose(8) for _ in range(3)] == ["decode", "decode", "v8"] and s.resumed
    assert s.gate("v8").pauses == 1 and s.gate("v16").last_mean == pytest.approx(2.1)


def test_both_tiers_lowered_fall_through_to_plain_decode():
    s = TierSchedule([Tier("v16", 4, min_accept=3.0), Tier("v8", 16, min_accept=1.5), Tier("decode")],
                     window=1, pause_steps=2)
    s.choose(2), s.record("v16", 1.0)
    s.choose(2), s.record("v8", 1.0)
    # Each lowered tier counts the steps it would have run: v16 every step here, v8 only those v16 passed on to it.
    assert [s.choose(2) for _ in range(3)] == ["decode", "v16", "v16"]
    assert [s.choose(8) for _ in range(2)] == ["decode", "v8"]


def test_record_names_the_schedules_verify_modes():
    s = TierSchedule(FOUR)
    assert s.record("v8", 1.0) is False  # no min_accept: nothing changes
    with pytest.raises(ValueError, match=r"\(v16, v8, v4\), got 'verify'"):
        s.record("verify", 2.0)
    with pytest.raises(ValueError, match="a plain step accepts no draft"):
        s.record("decode", 1.0)


def test_acceptance_gate_is_still_importable_from_the_policy_module():
    from graphpool.policy import AcceptanceGate as Gate
    assert Gate is AcceptanceGate


@pytest.mark.parametrize("tiers, says", [
    ([Tier("decode")], "two or more Tier objects"),
    ([("v8", 4), Tier("decode")], "two or more Tier objects"),
    ([Tier("v8", 4), Tier("v8", 8), Tier("decode")], "tiers 0 and 1 both name mode 'v8'"),
    ([Tier("v8", 4), Tier("decode", 8)], "takes no off_above"),
    ([Tier("v8", 4), Tier("decode", min_accept=2)], "append the plain-decode tier"),
    ([Tier("v8"), Tier("decode")], r"tier 0 \('v8'\) needs off_above"),
    ([Tier("v8", 4, 6), Tier("decode")], "hysteresis cannot hold.*set on_at_or_below <= 4"),
    ([Tier("v16", 8), Tier("v8", 4), Tier("decode")], "must rise down the list.*reorder the tiers"),
    ([Tier("v16", 8), Tier("v8", 8), Tier("decode")], "off_above=8 is not above tier 0"),
    ([Tier("v16", 8, 6), Tier("v8", 16, 5), Tier("decode")], "pass tier 1 by.*above 6"),
    ([Tier("v16", 8, 6), Tier("v8", 16, 6), Tier("decode")], "hysteresis cannot hold; set tier 1's on_at_or_below"),
])
def test_bad_schedules_are_refused_at_construction_naming_the_fix(tiers, says):
    with pytest.raises(ValueError, match=says):
        TierSchedule(tiers)


@pytest.mark.parametrize("kwargs, says", [
    ({"mode": ""}, "non-empty mode name"),
    ({"mode": "v", "off_above": -1}, "off_above must be a batch size >= 0"),
    ({"mode": "v", "off_above": True}, "off_above must be a batch size >= 0"),
    ({"mode": "v", "on_at_or_below": 2}, "needs an off_above"),
    ({"mode": "v", "off_above": 4, "min_accept": 1.0}, "min_accept must be > 1"),
])
def test_bad_tiers_are_refused(kwargs, says):
    with pytest.raises(ValueError, match=says):
        Tier(**kwargs)


def test_gates_need_a_window_and_a_pause():
    with pytest.raises(ValueError, match="window >= 1 and pause_steps >= 1"):
        TierSchedule([Tier("v8", 4, min_accept=1.5), Tier("decode")], window=0)


# ------------------------------------------------------------------------------------- one pool for all tiers
TIER_TOKENS = {"v16": 16, "v8": 8, "v4": 4, "decode": 1}
INPUTS = [StepInput("input_ids", torch.int64, per="token"), StepInput("positions", torch.int64, per="token"),
          StepInput("seq_lens", torch.int64, per="seq", fill=1)]
SIZES = [1, 2, 4, 8]


def _step(batch):
    """A step whose output depends on every row it reads: per sequence, the sum of ids x positions plus its length."""
    ids = batch.inputs["input_ids"].view(batch.bs, -1)
    pos = batch.inputs["positions"].view(batch.bs, -1)
    return (ids * pos).sum(1) + batch.inputs["seq_lens"]


def _pool(modes):
    pool = GraphPool([Mode(m, TIER_TOKENS[m]) for m in modes], INPUTS, SIZES, device="cpu", backend="eager")
    pool.capture(_step, outputs="seq")
    return pool


def test_one_pool_holds_every_tier_over_the_largest_tiers_buffers_alone():
    tiered, alone = _pool(["v16", "v8", "v4", "decode"]), _pool(["v16"])
    rows = max(SIZES) * 16  # the largest tier's token rows at the largest batch size
    assert tiered.stats.buffer_bytes == alone.stats.buffer_bytes == (2 * rows + max(SIZES)) * 8
    assert {n: t.shape for n, t in tiered.static_inputs.items()} == {"input_ids": (rows,), "positions": (rows,),
                                                                     "seq_lens": (max(SIZES),)}
    assert {k.mode for k in tiered.graph_keys} == set(TIER_TOKENS) and len(tiered.graph_keys) == 4 * len(SIZES)
    assert tiered.graph_keys[0].mode == "v16"  # the largest tier first: the others fit in what it used

    schedule = TierSchedule([Tier("v16", 1), Tier("v8", 2), Tier("v4", 4, 3), Tier("decode")], modes=tiered.modes)
    gen = torch.Generator().manual_seed(0)
    ran = set()
    for bs in (1, 2, 3, 4, 6, 8, 5, 4, 3, 2, 1, 7):
        mode = schedule.choose(bs)
        t = TIER_TOKENS[mode]
        ids, pos = torch.randint(0, 100, (bs * t,), generator=gen), torch.randint(0, 50, (bs * t,), generator=gen)
        lens = torch.randint(1, 60, (bs,), generator=gen)
        out = tiered.run(mode, input_ids=ids, positions=pos, seq_lens=lens)
        assert torch.equal(out, (ids * pos).view(bs, t).sum(1) + lens), (mode, bs)  # eager arithmetic
        ran.add(mode)
    assert ran == set(TIER_TOKENS) and not tiered.stats.misses


def test_schedule_checks_its_tiers_against_the_pools_modes():
    pool = GraphPool([Mode(m, t) for m, t in TIER_TOKENS.items()], INPUTS, SIZES, device="cpu", backend="eager")
    with pytest.raises(ValueError, match=r"mode 'v44', which the pool lacks.*did you mean 'v4'.*add Mode\('v44'"):
        TierSchedule([Tier("v16", 4), Tier("v44", 8), Tier("decode")], modes=pool.modes)
    with pytest.raises(ValueError, match="list the tiers longest draft first"):
        TierSchedule([Tier("v8", 4), Tier("v16", 8), Tier("decode")], modes=pool.modes)
    with pytest.raises(ValueError, match="the last tier is plain decode"):
        TierSchedule([Tier("v16", 4), Tier("v4")], modes=list(pool.modes.values()))
    assert TierSchedule([Tier("v16", 4), Tier("decode")], modes=pool.modes).modes == ("v16", "decode")
    unchecked = TierSchedule([Tier("v8", 4), Tier("v16", 8), Tier("decode")])  # built before the pool: check later
    with pytest.raises(ValueError, match="list the tiers longest draft first"):
        unchecked.check_modes(pool.modes)
    SpeculationPolicy(4, spec_mode="v16").check_modes(pool.modes)


def test_describe_names_each_tiers_bounds():
    s = TierSchedule([Tier("v16", 4, 2, min_accept=2.0), Tier("v8", 16), Tier("decode")])
    assert s.describe() == "v16 <= 4 (back at <= 2) while accepting >= 2.0 | v8 <= 16 | decode"
    assert repr(SpeculationPolicy(8, 4)) == "SpeculationPolicy(verify <= 8 (back at <= 4) | decode)"

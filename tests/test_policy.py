"""The mode policies against a hand-run oracle: SpeculationPolicy's hysteresis, AcceptanceGate's cycle."""
import pytest

from graphpool import AcceptanceGate, SpeculationPolicy


def test_size_policy_turns_off_above_and_back_on_at_or_below():
    policy = SpeculationPolicy(8, 4)
    modes = [policy.choose(bs) for bs in (1, 8, 9, 8, 5, 4, 8, 9)]
    assert modes == ["verify", "verify", "decode", "decode", "decode", "verify", "verify", "decode"]
    assert policy.switches == 3


def test_gate_measures_a_window_pauses_below_break_even_then_probes_again():
    gate = AcceptanceGate(1.5, window=3, pause_steps=4)
    allowed = []
    accepts = iter([1.0, 1.2, 1.1,        # window 1: mean 1.1 < 1.5 -> pause 4
                    2.0, 2.5, 3.0,        # probe: mean 2.5 -> keep speculating
                    1.0, 1.0])            # rolling: (3.0 + 1.0 + 1.0) / 3 = 1.67, then (1 + 1 + x) ...
    for _ in range(3 + 4 + 3 + 2):
        ok = gate.allow()
        allowed.append(ok)
        if ok:
            gate.record(next(accepts))
    assert allowed == [True] * 3 + [False] * 4 + [True] * 3 + [True] * 2
    assert gate.pauses == 1 and gate.last_mean == pytest.approx((3.0 + 1.0 + 1.0) / 3)
    assert gate.record(1.0)  # (1.0 + 1.0 + 1.0) / 3 < 1.5: paused again
    assert [gate.allow() for _ in range(5)] == [False] * 4 + [True] and gate.pauses == 2


def test_gate_refuses_a_break_even_that_cannot_be_one():
    for bad in ({"min_accept": 1.0}, {"min_accept": 2.0, "window": 0}, {"min_accept": 2.0, "pause_steps": 0}):
        with pytest.raises(ValueError, match="min_accept > 1"):
            AcceptanceGate(**bad)


def test_gate_ignores_verify_steps_recorded_during_a_pause():
    """Verify steps issued before a pause report late (run-ahead); before, three of them filled the window
    and the first probe step was judged at once (mean 1.10) and paused again."""
    gate = AcceptanceGate(1.5, window=4, pause_steps=2)
    assert [gate.record(1.1) for _ in range(4)] == [False, False, False, True] and gate.paused
    assert not any(gate.record(1.1) for _ in range(3))  # in flight when the pause began
    assert [gate.allow() for _ in range(3)] == [False, False, True]
    assert [gate.record(1.1) for _ in range(4)] == [False, False, False, True]  # judged after 4 fresh steps
    assert gate.pauses == 2

"""graphpool's DraftLag (shared by both speculation switches): positions, hidden states, the window cap,
forgetting, and restarts; plain tensors, checked against lists kept by hand."""
from __future__ import annotations

import logging

import pytest
import torch

from tests import sglang_harness  # noqa: F401,I001  (the package imports SGLang: test stand-ins on sys.path first)

from graphpool.integrations.sglang.draft_lag import DraftLag


def test_take_returns_each_lag_once_in_key_order_with_its_hidden_rows():
    lag = DraftLag(max_steps=8)
    lag.record(["a", "b"], [10, 20], torch.tensor([[1., 1.], [2., 2.]]))
    lag.record(["a", "b"], [11, 21], torch.tensor([[3., 3.], [4., 4.]]))
    got = lag.take(["b", "x", "a"])
    assert list(got) == ["b", "a"]
    assert (got["a"].start, got["a"].end, got["a"].skipped) == (10, 12, 0)
    assert got["a"].hidden.tolist() == [[1., 1.], [3., 3.]] and got["b"].hidden.tolist() == [[2., 2.], [4., 4.]]
    assert lag.catch_ups == 1 and lag.caught_up_requests == 2 and lag.caught_up_tokens == 4
    assert len(lag) == 0 and lag.take(["a", "b"]) == {} and lag.catch_ups == 1


def test_hidden_states_are_copied_from_the_runner_buffer():
    lag, buf = DraftLag(), torch.zeros(1, 2)
    lag.record(["a"], [5], buf)
    buf.fill_(7.)  # the next graph replay rewrites the output buffer
    assert lag.take(["a"])["a"].hidden.tolist() == [[0., 0.]]


def test_window_keeps_the_last_max_steps_and_catches_up_from_there():
    lag = DraftLag(max_steps=3)
    for step in range(7):
        lag.record(["a"], [100 + step], torch.full((1, 1), float(step)))
    chunk = lag.take(["a"])["a"]
    assert (chunk.start, chunk.end, chunk.skipped) == (104, 107, 4)
    assert chunk.hidden.flatten().tolist() == [4., 5., 6.] and lag.windowed == 1
    positions_only = DraftLag(keep_hidden=False, max_steps=3)
    for step in range(5):
        positions_only.record([1], [step])
    assert positions_only.take([1])[1] == (2, None, 5, 2)


def test_forget_retain_and_the_keep_hidden_rule():
    lag = DraftLag(keep_hidden=None)
    lag.record(["a", "b", "c"], [1, 2, 3])  # no hidden states: this lag keeps positions only
    assert lag.keep_hidden is False
    lag.forget(["a"])
    lag.retain(["b", "z"])
    assert "a" not in lag and "c" not in lag and "b" in lag and len(lag) == 1
    with pytest.raises(ValueError, match="needs the plain step's hidden states"):
        DraftLag(keep_hidden=True).record(["a"], [1])
    with pytest.raises(ValueError, match="one row per request"):
        DraftLag().record(["a", "b"], [1, 2], torch.zeros(1, 4))
    with pytest.raises(ValueError, match="max_steps >= 1"):
        DraftLag(max_steps=0)


def test_a_record_that_does_not_continue_the_lag_restarts_it(caplog):
    # A row reused by a new request (spec v2 keys by row) must not inherit the old request's lag.
    lag = DraftLag()
    lag.record([5], [40], torch.ones(1, 2))
    with caplog.at_level(logging.WARNING, logger="graphpool"):
        lag.record([5], [9], torch.zeros(1, 2))
    chunk = lag.take([5])[5]
    assert (chunk.start, chunk.end) == (9, 10) and chunk.hidden.tolist() == [[0., 0.]] and lag.restarts == 1
    assert "restarting its lag" in caplog.text


def test_positions_on_the_device_are_read_once_at_take_and_equal_host_positions():
    """Spec v2 under the overlap scheduler has no host KV lengths (seq_lens_cpu None for FA3, Triton,
    trtllm_mha): a plain step records the device tensor, which must not be read on the step path (a read waits
    for the GPU). A meta tensor has no values to read: recording it must work; take() then reads real ones."""
    never_read = DraftLag(keep_hidden=False)
    for step in range(3):
        never_read.record([4, 7], torch.empty(2, dtype=torch.int64, device="meta"))
    assert len(never_read) == 2
    on_device, on_host = DraftLag(max_steps=3), DraftLag(max_steps=3)
    lens = torch.tensor([30, 50])
    for step in range(4):
        hidden = torch.full((2, 1), float(step))
        on_device.record([4, 7], lens + step, hidden)
        on_host.record([4, 7], (lens + step).tolist(), hidden)
    on_device.record([9], torch.tensor([11]), torch.zeros(1, 1))  # a row that joined the plain phase late
    on_host.record([9], [11], torch.zeros(1, 1))
    got, want = on_device.take([7, 9, 4]), on_host.take([7, 9, 4])
    assert list(got) == list(want) == [7, 9, 4]
    for key in want:
        assert (got[key].start, got[key].end, got[key].skipped) == (want[key].start, want[key].end, want[key].skipped)
        assert torch.equal(got[key].hidden, want[key].hidden)
    assert (got[4].start, got[4].end, got[4].skipped) == (31, 34, 1)


def test_device_positions_are_copied_from_the_schedulers_tensor():
    lag, lens = DraftLag(keep_hidden=False), torch.tensor([8])
    lag.record(["a"], lens)
    lens.add_(100)  # the scheduler advances its seq_lens in place
    assert lag.take(["a"])["a"].start == 8

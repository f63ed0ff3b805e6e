"""The speculation switch under SGLang's real scheduler bookkeeping (spec v1, EAGLE worker, CPU).

Requests arrive in two waves and finish at different times (length, stop token, EOS, a grammar that
terminates, an abort); some return logprobs, one counts reasoning tokens. So the
running batch grows past the threshold and shrinks below it twice: the switch turns speculation off
and on twice. Every step goes through SGLang's own scheduler methods and EAGLE v1 worker (see
:mod:`tests.sglang_scheduler_harness` for what is real and what stands in). The oracle is plain greedy
decoding of the same prompts without speculation, eager (token ids and logprobs), and the draft model's
KV computed afresh. This is the test that the live server's crash showed missing: before the fix, plain
steps recorded no token on the request (nothing ever finished) and left the draft state holding
finished rows (``filter_batch``: "length of new_indices ... != length of topk_p").

A plain step does no draft work: the draft model's forwards are counted, and none may run on a plain
step. When speculation resumes, every request that decoded plainly (and is not finishing) is caught up
exactly once, in one draft extend over its plainly decoded positions, fed the target hidden states of
those positions (checked against a fresh target prefill); then the draft KV equals a fresh draft prefill.
With a small lag window (``max_lag_steps``) the catch-up covers the window only and outputs stay exact.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch

from tests import sglang_harness as H  # noqa: I001  (puts the test stand-ins on sys.path first)

H.require_api("classic")  # SGLang's EAGLE v1 worker and spec-v1 scheduler bookkeeping (0.5.9 to 0.5.12.x)
H.require_eagle_v1()  # the EAGLE v1 switch: SGLang 0.5.13.x has no EAGLE v1 worker

from tests import sglang_scheduler_harness as S  # noqa: E402

from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, FINISH_MATCHED_TOKEN
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.speculative.eagle_worker import EAGLEWorker

from graphpool.integrations.sglang import install_speculation_switch, uninstall_speculation_switch
from graphpool.integrations.sglang.draft_lag import DEFAULT_MAX_LAG_STEPS

# SGLang's Triton kernels run here in Triton's interpreter on CPU tensors (tests/conftest.py sets it
# without a GPU); on a CUDA machine they would be compiled for CUDA and refuse CPU tensors.
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU test: needs Triton's interpreter (TRITON_INTERPRET=1)")

PROMPT = 6
OFF_ABOVE, ON_AT_OR_BELOW = 4, 2
FIRST_WAVE, SECOND_WAVE = 8, 6


def greedy_reference(cfg: H.HarnessConfig, prompts: List[List[int]], n: int,
                     allowed: Dict[int, List[int]]) -> Tuple[List[List[int]], List[List[float]]]:
    """``n`` tokens of plain greedy decoding per prompt without speculation (eager), and their logprobs;
    prompt ``i`` in ``allowed`` picks only among those tokens (constrained decoding)."""
    mr = H.HarnessModelRunner(cfg, torch.device("cpu"), speculative=False, model_seed=0)
    reqs = H.Requests([list(p) for p in prompts])
    alloc = H.SlotAllocator(cfg.kv_slots)
    H.prefill(mr, reqs, alloc)
    logprobs: List[List[float]] = [[] for _ in prompts]
    rows = list(range(len(prompts)))
    for _ in range(n):
        logits = mr.forward(H.decode_batch(mr, reqs, rows, alloc)).logits_output.next_token_logits.clone()
        for i, tokens in allowed.items():
            keep = torch.zeros(cfg.vocab, dtype=torch.bool)
            keep[tokens] = True
            logits[i].masked_fill_(~keep, float("-inf"))
        tokens = logits.argmax(-1)
        chosen = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
        for r, t, lp in zip(rows, tokens.tolist(), chosen.tolist()):
            reqs.tokens[r].append(t)
            logprobs[r].append(lp)
    return [t[PROMPT:] for t in reqs.tokens], logprobs


def fresh_draft_kv_matches(world: S.SchedulerWorld) -> None:
    """The draft model's KV of every running request equals a fresh draft prefill (the draft was kept
    in step through plain and speculative steps alike). EAGLE's draft sees the sequence shifted by
    one: at position ``p`` it reads token ``p + 1`` (with the target's hidden state at ``p``, which the
    stand-in draft ignores), so its KV covers the committed positions with the tokens after them."""
    cfg, batch = world.cfg, world.running
    fresh = H.HarnessModelRunner(cfg, torch.device("cpu"), speculative=False, model_seed=world.draft_seed)
    alloc = H.SlotAllocator(cfg.kv_slots)
    table = world.target.req_to_token_pool.req_to_token
    for i, req in enumerate(batch.reqs):
        if req.finished():  # released by this step; the scheduler filters it out at the next
            continue
        n = req.kv_committed_len
        fresh.req_to_token_pool.req_to_token[i, :n] = alloc.alloc(n, torch.device("cpu")).to(torch.int32)
        H.extend(fresh, [i], [0], [(req.origin_input_ids + req.output_ids)[1:n + 1]])
        ours = world.draft.token_to_kv_pool.k_buffer[:, table[req.req_pool_idx, :n].long()]
        want = fresh.token_to_kv_pool.k_buffer[:, fresh.req_to_token_pool.req_to_token[i, :n].long()]
        torch.testing.assert_close(ours, want, atol=1e-9, rtol=0, msg=f"draft KV of {req.rid}")


def target_hidden_states(world: S.SchedulerWorld, req: Any, start: int, end: int) -> torch.Tensor:
    """The target's hidden states at positions ``[start, end)`` of ``req``'s sequence, from a fresh eager
    prefill of the sequence (what the draft reads at those positions)."""
    cfg = world.cfg
    fresh = H.HarnessModelRunner(cfg, torch.device("cpu"), speculative=False, model_seed=0)
    fresh.req_to_token_pool.req_to_token[0, :end] = H.SlotAllocator(cfg.kv_slots).alloc(end, torch.device("cpu")).int()
    out = H.extend(fresh, [0], [0], [(req.origin_input_ids + req.output_ids)[:end]], CaptureHiddenMode.FULL)
    return out.hidden_states[start:end]


class DraftWatch:
    """The draft model's forwards, counted, and every draft prefill (``EAGLEWorker.forward_draft_extend``:
    SGLang's after a target prefill, the switch's catch-up inside a decode step), recorded."""

    def __init__(self, world: S.SchedulerWorld):
        self.forwards = 0
        self.extends: List[Tuple[List[str], List[int], List[int], Optional[torch.Tensor]]] = []
        forward, extend = world.draft.model.forward, world.worker.forward_draft_extend

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.forwards += 1
            return forward(*args, **kwargs)

        def recorded(batch: Any, hidden_states: Any, next_token_ids: Any, seq_lens_cpu: Any, *rest: Any) -> Any:
            self.extends.append(([r.rid for r in batch.reqs], list(batch.prefix_lens), list(batch.extend_lens),
                                 None if hidden_states is None else hidden_states.clone()))
            return extend(batch, hidden_states, next_token_ids, seq_lens_cpu, *rest)

        world.draft.model.forward = counted
        world.worker.forward_draft_extend = recorded


class LagOracle:
    """Which requests' draft lags, from which position, kept by the test from the steps it sees: a plain
    step leaves every unfinished request lagging from the position it wrote; a speculative step catches
    up every lagging request of its batch that is not finishing."""

    def __init__(self, window: int):
        self.window = window
        self.first: Dict[str, int] = {}
        self.resumes = 0

    def check_step(self, world: S.SchedulerWorld, watch: DraftWatch, batch: Any, speculative: bool,
                   kv_len: Dict[str, int], finishing: set, forwards: int, extends: int) -> None:
        new = watch.extends[extends:]
        if not speculative:
            assert watch.forwards == forwards and not new, "a plain step runs no draft forward"
            for req in batch.reqs:
                if req.finished():
                    self.first.pop(req.rid, None)
                else:
                    self.first.setdefault(req.rid, kv_len[req.rid])
            return
        due = [r for r in batch.reqs if r.rid in self.first and r.rid not in finishing]
        if due:  # the first speculative step after plain steps: ONE draft extend, each lagging request once
            assert len(new) == 1, f"{len(new)} draft extends at a resume"
            rids, starts, lens, hidden = new[0]
            ends = [kv_len[r.rid] for r in due]
            want = [max(self.first[r.rid], e - self.window) for r, e in zip(due, ends)]
            assert rids == [r.rid for r in due] and starts == want, (rids, starts, [r.rid for r in due], want)
            assert lens == [e - s for s, e in zip(want, ends)]
            expected = torch.cat([target_hidden_states(world, r, s, e) for r, s, e in zip(due, want, ends)])
            torch.testing.assert_close(hidden, expected, atol=1e-9, rtol=0, msg="catch-up hidden states")
            self.resumes += 1
            if self.window >= DEFAULT_MAX_LAG_STEPS:  # the draft input is exact: every draft is accepted
                for req in batch.reqs:
                    committed = len(req.origin_input_ids) + len(req.output_ids) - 1 - kv_len[req.rid]
                    assert committed == world.cfg.draft_tokens or req.finished(), (req.rid, committed)
        else:
            assert not new, "a catch-up without lagging requests"
        for req in batch.reqs:
            self.first.pop(req.rid, None)


def test_switch_under_sglang_scheduler_flips_both_ways_and_finishes_every_request(caplog):
    run_scenario(caplog, max_lag_steps=DEFAULT_MAX_LAG_STEPS, check_draft_kv=True)


def test_switch_with_a_small_lag_window_catches_up_the_window_only(caplog):
    # Plain phases here last up to ~25 steps: a 3-step window cuts most catch-ups short. The draft's
    # older KV then stays stale (no fresh-prefill check); outputs must stay exact.
    run_scenario(caplog, max_lag_steps=3, check_draft_kv=False)


def run_scenario(caplog: Any, max_lag_steps: int, check_draft_kv: bool) -> None:
    caplog.set_level(logging.INFO, logger="graphpool")
    cfg = H.HarnessConfig(max_reqs=24, kv_slots=4000, batch_sizes=(1, 2, 4, 8, 16))
    world = S.SchedulerWorld(cfg, torch.device("cpu"), log_interval=3)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, cfg.vocab, (PROMPT,), generator=g).tolist() for _ in range(FIRST_WAVE + SECOND_WAVE)]
    grammars = {3: 10, 9: 12}      # request -> tokens its grammar allows before it terminates
    allowed = {i: torch.randperm(cfg.vocab, generator=g)[:40].tolist() for i in grammars}
    ref, ref_logprobs = greedy_reference(cfg, prompts, 40, allowed)

    # Per request: max_new_tokens, and what else it asks. Lengths are staggered so the batch shrinks
    # one request at a time; the second wave arrives once speculation is back on.
    max_new = [6, 34, 9, 30, 22, 15, 30, 38, 7, 25, 26, 16, 20, 33]
    stop_at = {2: 6, 10: 9}        # request -> index of its reference token used as a stop token
    eos_at = {4: 10}               # request -> index of its reference token used as its EOS
    logprobs = {1, 11}             # requests that return logprobs
    reasoning = {6}                # requests that count reasoning tokens up to think_end_id
    abort = 7                      # aborted (SGLang's abort of a running request) during a plain phase
    world.set_think_end_id(ref[6][8])
    reqs = {}

    def first_index(i: int, k: int) -> int:
        return ref[i].index(ref[i][k])

    def arrive(i: int) -> None:
        kw = {}
        if i in stop_at:
            kw.update(stop_token_ids=[ref[i][stop_at[i]]], ignore_eos=False)
        if i in eos_at:
            kw.update(eos_token_ids={ref[i][eos_at[i]]}, ignore_eos=False)
        if i in grammars:
            kw.update(grammar=S.TokenSetGrammar(allowed[i], grammars[i]))
        reqs[i] = world.add_request(f"r{i}", prompts[i], max_new[i], return_logprob=i in logprobs,
                                    top_logprobs_num=2 if i in logprobs else 0, require_reasoning=i in reasoning, **kw)

    switch = install_speculation_switch(OFF_ABOVE, ON_AT_OR_BELOW, max_lag_steps=max_lag_steps)
    lag = EAGLEWorker.forward_batch_generation.graphpool_lag
    watch, oracle = DraftWatch(world), LagOracle(max_lag_steps)
    decisions: List[Tuple[int, bool]] = []
    speculate = switch.speculate
    switch.speculate = lambda bs: decisions.append((bs, speculate(bs))) or decisions[-1][1]
    runner = world.target.graph_runner
    checked_draft_kv, verified_tokens, spec_since_flip = 0, 0, 0
    try:
        with S.cpu_stand_ins():
            for i in range(FIRST_WAVE):
                arrive(i)
            for step in range(2000):
                n_decisions, before = len(decisions), {r.rid: len(r.output_ids) for r in world.running.reqs}
                seen = list(world.running.reqs) + (list(world.last_batch.reqs) if world.last_batch is not None else [])
                kv_len = {r.rid: len(r.origin_input_ids) + len(r.output_ids) - 1 for r in seen}
                finishing = {r.rid for r in seen if r.to_finish is not None}
                forwards, extends = watch.forwards, len(watch.extends)
                batch = world.step()
                if batch is None and not world.waiting:
                    break
                if len(decisions) > n_decisions:
                    oracle.check_step(world, watch, batch, decisions[-1][1], kv_len, finishing, forwards, extends)
                assert not any(r in lag for r in reqs.values() if r.finished()), "a finished request still lags"
                if len(decisions) > n_decisions and decisions[-1][1]:  # a verify step: the tokens it committed
                    verified_tokens += sum(len(r.output_ids) - before[r.rid] for r in batch.reqs)
                    spec_since_flip += 1
                plain = bool(decisions) and not decisions[-1][1]
                if plain:
                    spec_since_flip = 0
                if plain and batch is not None and batch.forward_mode == ForwardMode.DECODE and \
                        reqs[abort].to_finish is None and not reqs[abort].finished() and len(decisions) > 6:
                    reqs[abort].to_finish = FINISH_ABORT()  # what Scheduler.abort_request does to a running request
                just_back_on = switch.switches in (2, 4) and checked_draft_kv < switch.switches // 2
                if just_back_on and not world.running.is_empty() and check_draft_kv:
                    fresh_draft_kv_matches(world)  # just back on: the draft kept up through the plain phase
                    checked_draft_kv += 1
                if switch.switches == 2 and spec_since_flip >= 2 and len(reqs) == FIRST_WAVE:
                    for i in range(FIRST_WAVE, FIRST_WAVE + SECOND_WAVE):
                        arrive(i)
            else:
                pytest.fail("requests still running after 2000 scheduler steps")
    finally:
        uninstall_speculation_switch()

    # The switch went off and on twice; every plain step replayed a DECODE graph, every verify a
    # TARGET_VERIFY graph, none ran eagerly.
    assert switch.switches >= 4 and checked_draft_kv == (2 if check_draft_kv else 0), decisions
    # One catch-up (one draft extend) per resume, every lagging request caught up once; none left.
    assert oracle.resumes == lag.catch_ups == 2 and len(lag) == 0
    assert (lag.windowed > 0) == (max_lag_steps < DEFAULT_MAX_LAG_STEPS), lag.windowed
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("graphpool")]
    assert not warnings, warnings
    assert all(spec for bs, spec in decisions if bs <= ON_AT_OR_BELOW)
    assert not any(spec for bs, spec in decisions if bs > OFF_ABOVE)
    spec_bs = [bs for bs, spec in decisions if spec]
    plain_steps = sum(1 for _, spec in decisions if not spec)
    assert runner.replay_log.counts == {ForwardMode.DECODE: plain_steps, ForwardMode.TARGET_VERIFY: len(spec_bs)}
    assert runner.refusals == {}

    # Every request finished for its own reason with the oracle's tokens (and logprobs).
    for i, req in reqs.items():
        sent = world.sent[req.rid]
        out = sent.output_ids
        if i == abort:
            assert isinstance(sent.finished_reason, FINISH_ABORT) and 0 < len(out) < max_new[i]
        elif i in grammars:
            assert isinstance(sent.finished_reason, FINISH_MATCHED_TOKEN) and len(out) == grammars[i], (i, out)
            assert req.grammar.accepted == out and set(out) <= set(allowed[i])
        elif i in stop_at or i in eos_at:
            k = first_index(i, (stop_at | eos_at)[i])
            assert isinstance(sent.finished_reason, FINISH_MATCHED_TOKEN) and len(out) == k + 1, (i, out, ref[i])
        else:
            assert isinstance(sent.finished_reason, FINISH_LENGTH) and len(out) == max_new[i], (i, out)
        assert out == ref[i][:len(out)], f"request {i}: {out} != {ref[i][:len(out)]}"
        if i in logprobs:
            torch.testing.assert_close(torch.tensor(sent.logprobs), torch.tensor(ref_logprobs[i][:len(out)]),
                                       atol=1e-9, rtol=0)
            assert len(req.output_top_logprobs_val) == len(out)
        if i in reasoning and hasattr(req, "update_reasoning_tokens"):  # SGLang 0.5.9 counts none
            assert req.reasoning_tokens == first_index(i, 8) + 1
    assert set(world.sent) == {r.rid for r in reqs.values()}

    # SGLang's speculation metrics count verify steps only: one forward per request per verify, and
    # the tokens those verifies committed (every draft is accepted here: accept length up to 4).
    s = world.scheduler
    assert s.spec_total_num_forward_ct + s.spec_num_forward_ct == sum(spec_bs)
    assert S.spec_accepted_tokens(s) == verified_tokens > 2 * sum(spec_bs)
    assert sum(r.spec_verify_ct for r in reqs.values()) == sum(spec_bs)
    # Nothing leaked: every KV slot and request row is free again.
    assert world.target.token_to_kv_pool_allocator.available_size() == cfg.kv_slots - 1
    assert world.target.req_to_token_pool.available_size() == cfg.max_reqs


def test_resume_on_a_mixed_batch_catches_up_the_lagging_rows_only(caplog):
    """Speculation resumes on a batch that mixes a lagging request, a lagging request aborted just before
    (never caught up: verify finishes it), and one prefilled after the last plain step (common under live
    traffic; its draft input from the prefill is merged behind the compacted plain-phase rows). Only the
    lagging row is caught up, every draft of the resume step is accepted, outputs are exact."""
    caplog.set_level(logging.INFO, logger="graphpool")
    cfg = H.HarnessConfig(max_reqs=8, kv_slots=2000, batch_sizes=(1, 2, 4))
    world = S.SchedulerWorld(cfg, torch.device("cpu"))
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, cfg.vocab, (PROMPT,), generator=g).tolist() for _ in range(5)]
    ref, _ = greedy_reference(cfg, prompts, 30, {})
    # r1 and r2 finish on the same plain step, leaving r0 and r3 (aborted then); r4 arrives then.
    max_new = [30, 10, 10, 30, 12]
    switch = install_speculation_switch(3, 3)
    lag = EAGLEWorker.forward_batch_generation.graphpool_lag
    watch, oracle = DraftWatch(world), LagOracle(DEFAULT_MAX_LAG_STEPS)
    decisions: List[bool] = []
    speculate = switch.speculate
    switch.speculate = lambda bs: decisions.append(speculate(bs)) or decisions[-1]
    reqs = [world.add_request(f"r{i}", prompts[i], max_new[i]) for i in range(4)]
    mixed_resume = None
    try:
        with S.cpu_stand_ins():
            for _ in range(300):
                seen = list(world.running.reqs) + (list(world.last_batch.reqs) if world.last_batch is not None else [])
                kv_len = {r.rid: len(r.origin_input_ids) + len(r.output_ids) - 1 for r in seen}
                finishing = {r.rid for r in seen if r.to_finish is not None}
                n_decisions, forwards, extends = len(decisions), watch.forwards, len(watch.extends)
                batch = world.step()
                if batch is None and not world.waiting:
                    break
                if len(decisions) > n_decisions:
                    oracle.check_step(world, watch, batch, decisions[-1], kv_len, finishing, forwards, extends)
                    if decisions[-2:] == [False, True]:  # the resume
                        mixed_resume = ([r.rid for r in batch.reqs], watch.extends[extends][0])
                        fresh_draft_kv_matches(world)
                if len(reqs) == 4 and reqs[1].finished() and reqs[2].finished():
                    assert not reqs[0].finished() and not reqs[3].finished() and len(lag) == 2
                    reqs[3].to_finish = FINISH_ABORT()  # what Scheduler.abort_request does to a running request
                    reqs.append(world.add_request("r4", prompts[4], max_new[4]))
            else:
                pytest.fail("requests still running after 300 scheduler steps")
    finally:
        uninstall_speculation_switch()
    assert mixed_resume == (["r0", "r3", "r4"], ["r0"]), mixed_resume
    assert lag.catch_ups == oracle.resumes == 1 and len(lag) == 0
    for i, req in enumerate(reqs):
        sent = world.sent[req.rid]
        if i == 3:
            assert isinstance(sent.finished_reason, FINISH_ABORT) and sent.output_ids == ref[3][:len(sent.output_ids)]
        else:
            assert sent.output_ids == ref[i][:max_new[i]], i
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("graphpool")]


def test_acceptance_gate_pauses_speculation_below_break_even_and_probes_again(caplog):
    """With a break-even above what verify steps commit (at most draft_tokens per sequence; the stand-in
    draft is the target's model, so nearly every draft is accepted), the gate lets one window of verify
    steps measure, then decodes plainly for its pause, then probes again, at batch sizes the size
    threshold would speculate at. The accepted counts come from SGLang's own GenerationBatchResult (each
    release's field): the gate records exactly the tokens each verify step appended to the requests.
    Outputs stay exact; with a break-even below, it never pauses."""
    caplog.set_level(logging.INFO, logger="graphpool")
    cfg = H.HarnessConfig(max_reqs=8, kv_slots=2000, batch_sizes=(1, 2, 4))
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, cfg.vocab, (PROMPT,), generator=g).tolist() for _ in range(2)]
    ref, _ = greedy_reference(cfg, prompts, 60, {})
    for min_accept, pauses in ((cfg.draft_tokens + 0.5, True), (1.5, False)):
        world = S.SchedulerWorld(cfg, torch.device("cpu"))
        switch = install_speculation_switch(4, 4, min_accept=min_accept)
        switch.gate.pause_steps = 5
        decisions: List[bool] = []
        speculate = switch.speculate
        switch.speculate = lambda bs: decisions.append(speculate(bs)) or decisions[-1]
        reqs = [world.add_request(f"r{i}", prompts[i], 60) for i in range(2)]
        recorded: List[float] = []
        record = switch.gate.record
        switch.gate.record = lambda mean: recorded.append(mean) or record(mean)
        committed: List[float] = []  # per verify step: tokens it appended per sequence, from the requests
        try:
            with S.cpu_stand_ins():
                for _ in range(300):
                    before, n_decisions = [len(r.output_ids) for r in reqs], len(decisions)
                    batch = world.step()
                    if batch is None and not world.waiting:
                        break
                    if len(decisions) > n_decisions and decisions[-1]:
                        committed.append(sum(len(r.output_ids) - n for r, n in zip(reqs, before)) / len(batch.reqs))
        finally:
            uninstall_speculation_switch()
            H.forget_graph_memory_pool()
        for i, req in enumerate(reqs):
            assert world.sent[req.rid].output_ids == ref[i][:60], (min_accept, i)
        assert recorded == committed and sum(c == cfg.draft_tokens for c in committed) > len(committed) // 2
        window = switch.gate.window
        if pauses:  # measure (window verifies), pause (5 plain), probe (window verifies), ...
            cycle = [True] * window + [False] * 5
            assert len(decisions) > 2 * len(cycle) and decisions == (cycle * 100)[:len(decisions)], decisions
            assert switch.gate.pauses >= 2 and switch.gate.last_mean <= cfg.draft_tokens < min_accept
            assert any("speculation paused for 5 decode steps" in r.getMessage() for r in caplog.records)
        else:
            # (requests near their last token commit fewer than draft_tokens)
            assert all(decisions) and switch.gate.pauses == 0 and min_accept <= switch.gate.last_mean <= cfg.draft_tokens


@pytest.fixture(autouse=True)
def _fresh_graph_memory_pool():
    H.forget_graph_memory_pool()

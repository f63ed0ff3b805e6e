"""The spec-v2 switch keeps its plain steps out of SGLang's speculation metrics (a live server showed each request's
``spec_verify_ct`` counting every plain token as a verify step that rejected its drafts).

Driven through the wrapper the switch installs around SGLang's ``SchedulerBatchResultProcessor.
process_batch_result_decode``, on SGLang's real
``Req`` (its ``spec_verify_ct`` and ``update_spec_correct_drafts_histogram``) and its real metrics reporter's
``update_spec_metrics``; SGLang's processing is stood in by what it does for a spec-v2 result (per request not
retracted or finished: one verify step with ``accept_len - 1`` correct drafts; the adaptive controller; the batch's
acceptance counters; the decode log line, which divides by the verify count).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests import sglang_runner_api_harness as R  # noqa: I001  (skips this module under the classic API)

from graphpool.integrations.sglang.eagle_v1_plain import PLAIN_STEP
from graphpool.integrations.sglang.spec_v2_metrics import process_decode_result


class Reporter:
    """SGLang's reporter's acceptance counters and ``update_spec_metrics``; its decode line divides by verify steps."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.spec_num_accept_tokens = self.spec_num_correct_drafts = self.spec_num_forward_ct = 0
        self.spec_num_block_accept_tokens = self.spec_num_cap_tokens = self.num_generated_tokens = 0
        self.lines = []

    def update_spec_metrics(self, bs, num_correct_drafts, num_accept_tokens=0, **kwargs):
        from sglang.srt.managers.scheduler_components.metrics_reporter import SchedulerMetricsReporter

        counters = SchedulerMetricsReporter.update_spec_metrics
        if "num_accept_tokens" in counters.__code__.co_varnames:
            return counters(self, bs, num_correct_drafts, num_accept_tokens, **kwargs)
        return counters(self, bs, num_correct_drafts)

    def report_decode_stats(self):
        accept = "none" if self.scheduler.spec_algorithm.is_none() else self.spec_num_accept_tokens / self.spec_num_forward_ct
        self.lines.append(accept)


def sglang_processing(processor, batch, result):
    """What SGLang's process_batch_result_decode does with a spec-v2 result's acceptance."""
    correct = [n - 1 for n in result.accept_lens]
    processor.model_worker.on_verify_complete_cpu(correct, batch_size=len(batch.reqs))
    for req, n in zip(batch.reqs, correct):
        if not (req.is_retracted or req.finished()):
            req.spec_verify_ct += 1
            req.spec_num_correct_drafts += n
            req.update_spec_correct_drafts_histogram(n)
    processor.metrics_reporter.update_spec_metrics(len(batch.reqs), sum(correct), num_accept_tokens=sum(result.accept_lens))
    processor.metrics_reporter.report_decode_stats()
    return [(req.spec_verify_ct, list(req.spec_correct_drafts_histogram)) for req in batch.reqs]  # what SGLang streams


@pytest.fixture
def scheduler():
    """SGLang's result processor as the wrapper sees it: its reporter (which asks the scheduler for the speculative
    algorithm) and its model worker (the adaptive controller's ``on_verify_complete_cpu``)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    seen = []
    reporter = Reporter(SimpleNamespace(spec_algorithm=SpeculativeAlgorithm.EAGLE))
    return SimpleNamespace(metrics_reporter=reporter, seen=seen,
                           model_worker=SimpleNamespace(on_verify_complete_cpu=lambda c, batch_size: seen.append(c)))


def test_a_plain_step_is_not_a_verify_step_in_any_metric(scheduler):
    reqs = R.bound_requests([1, 2], [[5], [6]])
    batch = SimpleNamespace(reqs=reqs)
    plain = SimpleNamespace(accept_lens=[1, 1], **{PLAIN_STEP: True})
    streamed = process_decode_result(sglang_processing, scheduler, batch, plain)
    assert streamed == [(0, []), (0, [])], "the meta_info SGLang streams counts no verify step"
    assert scheduler.seen == [] and scheduler.metrics_reporter.spec_num_forward_ct == 0
    assert scheduler.metrics_reporter.lines == ["none"], "a log interval of plain steps only reports no acceptance"
    verify = SimpleNamespace(accept_lens=[4, 2])
    assert process_decode_result(sglang_processing, scheduler, batch, verify) == [(1, [0, 0, 0, 1]), (1, [0, 1])]
    assert scheduler.seen == [[3, 1]] and scheduler.metrics_reporter.spec_num_forward_ct == 2
    assert "update_spec_correct_drafts_histogram" not in vars(reqs[0]) and "update_spec_metrics" not in vars(scheduler.metrics_reporter)


def test_a_request_finished_before_the_plain_step_keeps_its_count(scheduler):
    reqs = R.bound_requests([1, 2], [[5], [6]])
    reqs[0].spec_verify_ct = 3
    reqs[0].finished = lambda: True  # SGLang neither counts nor settles it
    plain = SimpleNamespace(accept_lens=[1, 1], **{PLAIN_STEP: True})
    assert process_decode_result(sglang_processing, scheduler, SimpleNamespace(reqs=reqs), plain) == [(3, []), (0, [])]


def test_the_installed_switch_marks_its_plain_steps_and_wraps_sglangs_result_processing():
    """What the live server runs: the plain step's result carries the mark, and the installed switch routes SGLang's
    ``process_batch_result_decode`` through the wrapper (``uninstall`` restores SGLang's)."""
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor as Scheduler

    from graphpool.integrations.sglang import spec_switch_v2 as v2
    from graphpool.integrations.sglang.draft_lag import DraftLag

    mr, reqs, alloc = R.world()
    idx, lens, bonus = R.plain_step_inputs(mr, reqs, alloc, [0, 1])
    result = v2.eagle_v2_plain_decode(R.spec_v2_worker(mr), R.spec_v2_batch(mr, idx, lens, bonus), DraftLag())
    assert getattr(result, PLAIN_STEP, False)
    original = Scheduler.process_batch_result_decode
    v2.install_speculation_switch(4, 2)
    try:
        assert Scheduler.process_batch_result_decode is not original
        assert Scheduler.process_batch_result_decode.__wrapped__ is original
    finally:
        v2.uninstall_speculation_switch()
    assert Scheduler.process_batch_result_decode is original

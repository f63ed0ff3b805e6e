"""Spec v2 (SGLang 0.5.14+): the switch's plain steps are kept out of SGLang's speculation metrics.

A plain step's result looks to SGLang like a verify step that accepted no draft (one token per request,
``accept_lens`` 1), and SGLang's ``SchedulerBatchResultProcessor.process_batch_result_decode`` would count it as one: each request's
``spec_verify_ct`` and ``spec_correct_drafts_histogram[0]`` (so ``meta_info`` said every plain token was a verify
step that rejected its drafts, seen on a live server), the acceptance counters behind the decode log's
``accept len``, and the adaptive controller's acceptance history (``--speculative-adaptive`` would step down for
drafts that were never proposed). For a result marked :data:`~.eagle_v1_plain.PLAIN_STEP` these are left as they
were, as the classic switch does for spec v1: per request ``spec_verify_ct``, ``spec_num_correct_drafts`` and the
histogram count verify steps only (``meta_info.spec_accept_length``, completion tokens over verify steps, then
counts plain tokens too: read ``1 + spec_num_correct_drafts / spec_verify_ct``). A decode log interval of plain
steps only prints no acceptance instead of dividing by zero verify steps. The KV bookkeeping, grammar, finish
checks and streaming run as SGLang does them.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from .eagle_v1_plain import PLAIN_STEP


def process_decode_result(original: Any, processor: Any, batch: Any, result: Any) -> Any:
    """SGLang's ``process_batch_result_decode`` (``original``) of its result ``processor`` for ``result``; a plain
    step's leaves the metrics."""
    if not getattr(result, PLAIN_STEP, False):
        return original(processor, batch, result)
    with _verify_steps_only(processor, batch):
        return original(processor, batch, result)


def _no_spec_metrics(*args: Any, **kwargs: Any) -> None:
    """A plain step proposes no draft: nothing to add to the acceptance counters or the adaptive controller."""


@contextlib.contextmanager
def _verify_steps_only(processor: Any, batch: Any) -> Iterator[None]:
    # SGLang counts a verify step for each request it commits tokens to (neither retracted nor finished before this
    # step): those requests' count is taken back by one before SGLang adds it, so it is settled before SGLang streams
    # the request's meta_info at the end of the call. Attributes shadow the methods for this call only.
    counted = [req for req in batch.reqs if not (req.is_retracted or req.finished())]
    reporter = processor.metrics_reporter
    with contextlib.ExitStack() as stack:
        for req in counted:
            req.spec_verify_ct -= 1
            stack.enter_context(_shadow(req, "update_spec_correct_drafts_histogram", _no_spec_metrics))
        stack.enter_context(_shadow(reporter, "update_spec_metrics", _no_spec_metrics))
        stack.enter_context(_shadow(processor.model_worker, "on_verify_complete_cpu", _no_spec_metrics))
        stack.enter_context(_shadow(reporter, "report_decode_stats", _without_acceptance_if_no_verify(reporter)))
        yield


@contextlib.contextmanager
def _shadow(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.<name>`` is ``value`` inside the block; then what it was (its own attribute, or its class's)."""
    had, before = name in vars(owner), vars(owner).get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, before)
        else:
            delattr(owner, name)


def _without_acceptance_if_no_verify(reporter: Any) -> Any:
    """The reporter's decode-stats line, made to survive a log interval without a verify step (SGLang divides the
    accepted tokens by the verify count): that line then reports no acceptance, as a server without speculation."""
    report = reporter.report_decode_stats

    def guarded(*args: Any, **kwargs: Any) -> Any:
        if reporter.spec_num_forward_ct > 0:
            return report(*args, **kwargs)
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        scheduler = reporter.scheduler  # whose speculative algorithm the reporter asks
        algorithm, scheduler.spec_algorithm = scheduler.spec_algorithm, SpeculativeAlgorithm.NONE
        try:
            return report(*args, **kwargs)
        finally:
            scheduler.spec_algorithm = algorithm

    return guarded

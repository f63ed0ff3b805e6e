"""Tensor parallelism: every TP rank of an SGLang server makes the same step decision, and holds the same graphs.

Under TP every rank's scheduler runs the same batch and every rank replays its own graphs, whose NCCL
collectives must meet. A rank that replays a plain DECODE graph while another replays a verify graph (or
another batch size) hangs the server. So every decision graphpool makes per step derives only from state
SGLang itself keeps identical on every TP rank:

* the switch's mode (:class:`~.spec_switch.SpeculationSwitch`): the batch size (``batch.batch_size()``,
  ``batch.seq_lens.shape[0]``: every rank schedules the same requests) through the size policy's hysteresis,
  a pure function of the sequence of batch sizes;
* the acceptance gate's pause and probe (classic API, ``--graphpool-spec-min-accept``): the verify step's
  accepted draft counts, which SGLang computes on every rank from the same all-gathered logits and applies to
  every rank's requests (were they to differ, SGLang's own schedulers would diverge first);
* SGLang's adaptive step count (``activate_step_by_batch``): the batch size;
* the padded batch size: the pool's routing table, a function of the batch size and the captured sizes,
  which every rank captures alike (:func:`capture_on_every_rank`);
* the catch-up: which requests lag, from the plain steps each rank ran for the same requests.

Nothing reads a timer, a rank-local count or a rank-local tensor. What :func:`step_agreement` adds is a check
of that claim: with graphpool's debug mode on (``GRAPHPOOL_DEBUG=1``) and TP > 1, each decision and each
replay all-gathers (step, mode, padded bs, real bs) over SGLang's TP CPU group (gloo, no device sync) and
raises :class:`graphpool.RankDisagreementError` on every rank, naming each rank's choice, instead of hanging.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from graphpool.agreement import StepAgreement, agree_on_outcome
from graphpool.pool import debug_from_env

log = logging.getLogger(__name__)


def tp_cpu_group() -> Optional[Any]:
    """SGLang's TP group's gloo group where tensor parallelism spans more than one rank, else ``None``."""
    try:
        from sglang.srt.distributed import parallel_state
    except ImportError:
        return None
    if not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_tp_group()
    return group.cpu_group if group.world_size > 1 else None


class LazyAgreement:
    """A :class:`StepAgreement` over SGLang's TP group, made at the first check (the group exists by then),
    or nothing without debug mode or without TP > 1. ``gloo_group`` overrides the group (tests)."""

    def __init__(self, enabled: Optional[bool] = None, gloo_group: Any = None):
        self.enabled = debug_from_env() if enabled is None else enabled
        self._group = gloo_group
        self._agreement: Optional[StepAgreement] = None
        self._resolved = False

    def check(self, what: str, bs: int, real_bs: int) -> None:
        """Raise :class:`graphpool.RankDisagreementError` unless every TP rank is at the same step (no-op off)."""
        if not self.enabled:
            return
        if not self._resolved:
            group = self._group if self._group is not None else tp_cpu_group()
            self._agreement = None if group is None else StepAgreement(None, gloo_group=group)
            self._resolved = True
        if self._agreement is not None:
            self._agreement.check(what, bs, real_bs)


def capture_on_every_rank(capture: Callable[[], None], gloo_group: Any = None) -> None:
    """Run ``capture``; under TP > 1, a capture that failed on any rank fails on every rank, naming the rank and
    its reason (:func:`graphpool.agreement.agree_on_outcome`), instead of leaving ranks with different graphs."""
    group = gloo_group if gloo_group is not None else tp_cpu_group()
    if group is None:
        capture()
        return
    try:
        capture()
    except Exception as exc:  # every rank must reach the exchange, the failed one too; it raises on all
        agree_on_outcome(group, exc, "graphpool's graph capture")
    else:
        agree_on_outcome(group, None, "graphpool's graph capture")

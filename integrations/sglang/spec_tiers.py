"""graphpool's speculation tiers on SGLang's spec-v2 worker (runner API, 0.5.14+), at any topk: ``--graphpool-tiers``.

Each decode step a :class:`graphpool.TierSchedule` chooses the tier from the batch size (:class:`TierChoice`): a
speculative tier of the table (:mod:`.tier_table`), or plain decode above the last bound. A plain step is the
switch's (:mod:`.spec_switch_v2`): the target on a DECODE graph, no draft work, the draft's KV caught up in one
draft extend when speculation resumes. A speculative tier is one of SGLang's own worker states
(``SpecRuntimeState``: draft and target attention backends, draft graphs, the target's verify runner), built once
after the worker's graphs by SGLang's ``EAGLEWorkerV2.build_adaptive_runtime_state`` with the table's step count
and draft tokens, and swapped in by its ``apply_runtime_state`` when the schedule changes tier. Those two methods
take any topk; SGLang's ``--speculative-adaptive`` refuses topk > 1 only in its argument checks and its own
controller, which tiers do not use (the launcher refuses the two together: one chooser per server). Every tier's
target verify runner is graphpool's, over the target model's one pool (:mod:`.target_graphs`): the DECODE graphs
captured once, each tier's TARGET_VERIFY graphs at the batch sizes it serves.

One thing SGLang sizes by the running state that tiers must size by the largest: the KV slots the scheduler
reserves per request before a decode step (``get_alloc_len_per_decode``: ``max(steps * topk, draft tokens)``). The
scheduler reserves them before the worker chooses the step's tier, so a step that moves to a longer tier would draft
into slots never reserved; :func:`install_speculation_tiers` makes the reservation the first (largest) tier's.
Everything else SGLang sizes at start-up (KV pool, logits buffer, ``req_to_token`` rows, the tokenizer's reserved
tokens) it sizes from the server's own shape, which the launcher makes the first tier's.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from . import tier_plan
from .spec_switch_v2 import install_step_choice
from .tier_table import TierTable

log = logging.getLogger(__name__)

#: The attribute a speculative step's ``GenerationBatchResult`` carries: the index of the tier it ran.
TIER_STEP = "graphpool_tier"

#: Processed verify steps between two tier statistics lines (the environment variable overrides it).
DEFAULT_EVERY = int(os.environ.get("GRAPHPOOL_REPLAY_LOG_EVERY", "500"))

#: Where each release keeps the per-decode KV reservation (0.5.17+, 0.5.14).
_ALLOCATION_MODULES = ("sglang.srt.mem_cache.allocation_sizing", "sglang.srt.mem_cache.common")

_active: Optional["TierChoice"] = None
_original_init_graphs: Optional[Any] = None
_original_alloc: Optional[tuple] = None  # (module, SGLang's get_alloc_len_per_decode)


@dataclass
class TierStats:
    """One speculative tier's verify steps, those in which every request committed the tier's most, and the tokens
    they committed per request (summed over steps)."""

    steps: int = 0
    at_most: int = 0
    committed: float = 0.0


class TierChoice:
    """The step choice of graphpool's tiers (:class:`~.spec_switch_v2.StepChoice`): the schedule's tier, swapped into
    the worker when it changes; the acceptance of every verify step, per tier, in the log.

    Args:
        table: the tiers.
        every: processed verify steps between two statistics lines.
    """

    def __init__(self, table: TierTable, every: int = DEFAULT_EVERY):
        self.table = table
        self.schedule = table.schedule()
        self.every = max(1, every)
        #: SGLang's ``SpecRuntimeState`` of each speculative tier (:meth:`build_states`, after the worker's graphs).
        self.states: Optional[List[Any]] = None
        self.stats = {t.label: TierStats() for t in table.tiers}
        self.plain_steps = 0
        self._unheard: set = set()  # tiers entered whose first verify step the scheduler has not processed yet
        self._processed = 0

    # ----------------------------------------------------------------------------------- set-up
    def build_states(self, worker: Any) -> None:
        """The worker's state of every tier: its own (the first tier's, the server's shape), then one built by
        SGLang's ``build_adaptive_runtime_state`` per other tier, with the table's steps and draft tokens and the
        batch sizes graphpool's pool captures that tier's verify graphs at."""
        from sglang.srt.speculative.adaptive_runtime_state import SpecRuntimeState

        first = self.table.tiers[0]
        shape = (worker.topk, worker.speculative_num_steps, worker.speculative_num_draft_tokens)
        if shape != (first.topk, first.steps, first.num_draft_tokens):
            raise ValueError(f"graphpool tiers: the worker runs {shape[0]}x{shape[1]}:{shape[2]}, but the first tier is "
                             f"{first.label}: start the server with the first tier's --speculative-eagle-topk, "
                             f"--speculative-num-steps and --speculative-num-draft-tokens (the launcher checks this)")
        draft, target = worker._draft_worker, worker._target_worker.model_runner
        states = [SpecRuntimeState(
            speculative_num_steps=first.steps, speculative_num_draft_tokens=first.num_draft_tokens,
            draft_attn_backend=draft.draft_attn_backend, cuda_graph_runner=draft.cuda_graph_runner,
            target_attn_backend=target.attn_backend, target_graph_runner=target.decode_cuda_graph_runner,
            draft_extend_attn_backend=draft.draft_extend_attn_backend,
            cuda_graph_runner_for_draft_extend=draft.cuda_graph_runner_for_draft_extend)]
        sizes = _planned_batch_sizes(target, self.table)
        with _draft_contexts(worker):
            for i, tier in enumerate(self.table.tiers[1:], 1):
                states.append(worker.build_adaptive_runtime_state(
                    tier.steps, tier.num_draft_tokens, cuda_graph_bs=None if sizes is None else list(sizes[i])))
        self.states = states
        log.info("graphpool tiers: %s built (%s)", ", ".join(t.label for t in self.table.tiers), self.schedule.describe())

    # ----------------------------------------------------------------------------------- steps
    def speculate(self, worker: Any, batch_size: int) -> bool:
        """The schedule's tier for this step, swapped into the worker when it changed; False for plain decode."""
        schedule = self.schedule
        schedule.choose(batch_size)
        if schedule.changed:
            log.info("graphpool tiers: %s -> %s at %d running requests", schedule.tiers[schedule.previous].mode,
                     schedule.mode, batch_size)
            if schedule.speculating:
                self._unheard.add(schedule.index)
        if not schedule.speculating:
            self.plain_steps += 1
            return False
        if self.states is None:
            raise RuntimeError("graphpool tiers: no tier state was built (EAGLEWorkerV2.init_cuda_graphs did not run "
                               "under install_speculation_tiers); install the tiers before SGLang builds its worker")
        worker.apply_runtime_state(self.states[schedule.index])  # SGLang's own swap (a no-op for the running tier)
        return True

    def ran(self, worker: Any, result: Any) -> None:
        """Mark the step's result with its tier (the scheduler may process it after the next step has begun)."""
        setattr(result, TIER_STEP, self.schedule.index)

    def processed(self, batch: Any, result: Any) -> None:
        """One verify step's acceptance, per request on the host (SGLang's scheduler computed it): counted for its
        tier, fed to the schedule, logged for the first step after a change and every :attr:`every` steps."""
        index = getattr(result, TIER_STEP, None)
        drafts = getattr(result, "num_correct_drafts_per_req_cpu", None)
        if index is None or not drafts:
            return
        tier = self.table.tiers[index]
        mean = 1 + sum(drafts) / len(drafts)
        stats = self.stats[tier.label]
        stats.steps += 1
        stats.at_most += all(d + 1 == tier.max_committed for d in drafts)
        stats.committed += mean
        self.schedule.record(tier.label, mean)
        if index in self._unheard:
            self._unheard.discard(index)
            log.info("graphpool tiers: first verify step at %s after a change: %.2f tokens per request (at most %d)",
                     tier.label, mean, tier.max_committed)
        self._processed += 1
        if self._processed % self.every == 0:
            log.info("%s", self.line())

    def line(self) -> str:
        """``graphpool tiers: verify steps (at their tier's most/all) 4x3:8=12/12 ...; plain steps P; tier changes C``."""
        tiers = " ".join(f"{label}={s.at_most}/{s.steps}" for label, s in self.stats.items())
        return (f"graphpool tiers: verify steps (at their tier's most/all) {tiers}; plain steps {self.plain_steps}; "
                f"tier changes {self.schedule.switches}")


def _planned_batch_sizes(target: Any, table: TierTable) -> Optional[List[tuple]]:
    """Each tier's verify batch sizes in the target's graphpool pool (``None``: no graphs, e.g.
    ``--disable-cuda-graph``; SGLang then captures none either)."""
    from .patch_runner_api import target_graphs

    graphs = target_graphs(target)
    if graphs is None:
        return None
    return [graphs.pool.batch_sizes[graphs.verify_mode(t.steps, t.topk, t.num_draft_tokens)] for t in table.tiers]


def _draft_contexts(worker: Any) -> contextlib.ExitStack:
    """The contexts SGLang builds its own adaptive states in: the draft's tensor-parallel group and the speculative
    MoE backends (0.5.23 names the TP one by the draft's parallel layout, 0.5.14 to 0.5.17 by its TP group)."""
    from sglang.srt.speculative import eagle_worker_v2 as module

    stack, draft = contextlib.ExitStack(), worker._draft_worker
    if hasattr(draft, "draft_tp_context"):  # 0.5.14 to 0.5.17: the draft worker's own, by its TP group
        stack.enter_context(draft.draft_tp_context(draft.draft_runner.tp_group))
    elif hasattr(draft, "parallel_layout"):  # 0.5.23: by the draft's resolved parallel layout
        stack.enter_context(module.draft_tp_context(draft.parallel_layout))
    for name in ("speculative_moe_backend_context", "speculative_moe_a2a_backend_context"):
        if hasattr(module, name):
            stack.enter_context(getattr(module, name)())
    return stack


# ----------------------------------------------------------------------------------- install
def install_speculation_tiers(table: TierTable, every: int = DEFAULT_EVERY) -> TierChoice:
    """Serve ``table``'s tiers on SGLang's spec-v2 worker in this process (its scheduler process: the launcher does
    it there). Install before SGLang builds the worker; graphpool's runner patch (``install()``) too, for the plain
    steps' DECODE graphs and the tiers' one pool."""
    global _active, _original_init_graphs
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    choice = _active = TierChoice(table, every)
    original = _original_init_graphs or EAGLEWorkerV2.init_cuda_graphs

    @functools.wraps(original)
    def init_cuda_graphs(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if _active is not None and getattr(self, "_draft_worker", None) is not None:
            _reserve_for_the_largest_tier()  # the first tier runs now: its reservation is the largest
            _active.build_states(self)
        return out

    _original_init_graphs = original
    EAGLEWorkerV2.init_cuda_graphs = init_cuda_graphs
    tier_plan.note_tiers(table)  # the target's pool plans every tier's verify graphs
    _wrap_the_reservation()
    install_step_choice(choice)
    log.info("graphpool: speculation tiers %s (plain decode above the last bound)", choice.schedule.describe())
    return choice


def _wrap_the_reservation() -> None:
    """SGLang's per-decode KV reservation, never below the first tier's (:func:`_reserve_for_the_largest_tier`)."""
    global _original_alloc
    if _original_alloc is not None:
        return
    for name in _ALLOCATION_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        original = getattr(module, "get_alloc_len_per_decode", None)
        if original is not None:
            break
    else:
        raise RuntimeError(f"graphpool tiers: this SGLang has no get_alloc_len_per_decode in {_ALLOCATION_MODULES}: "
                           f"the tiers cannot size the KV reservation per decode step (SGLang 0.5.14 to 0.5.23 have)")
    floor: Dict[str, int] = {}

    @functools.wraps(original)
    def get_alloc_len_per_decode(*args: Any, **kwargs: Any) -> int:
        return max(original(*args, **kwargs), floor.get("largest", 0))

    get_alloc_len_per_decode.graphpool_floor = floor  # type: ignore[attr-defined]
    _original_alloc = (module, original)
    module.get_alloc_len_per_decode = get_alloc_len_per_decode


def _reserve_for_the_largest_tier() -> None:
    """Record the reservation of the running state, the first tier's: every later step reserves at least that."""
    module, original = _original_alloc
    module.get_alloc_len_per_decode.graphpool_floor["largest"] = original()


def uninstall_speculation_tiers() -> None:
    """Undo :func:`install_speculation_tiers` (and the switch wrapper it installed)."""
    global _active, _original_init_graphs, _original_alloc
    from .spec_switch_v2 import uninstall_speculation_switch

    if _original_init_graphs is not None:
        from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

        EAGLEWorkerV2.init_cuda_graphs = _original_init_graphs
        _original_init_graphs = None
    if _original_alloc is not None:
        module, original = _original_alloc
        module.get_alloc_len_per_decode = original
        _original_alloc = None
    _active = None
    tier_plan.note_tiers(None)
    uninstall_speculation_switch()

"""Which TARGET_VERIFY tiers a target model's one pool (:class:`~.target_graphs.TargetGraphs`) is sized and planned for.

SGLang builds the target's first decode runner before any other tier's, so the pool must know every tier then, to
size its static buffers for the largest and capture each tier's graphs into it as its runner comes:

* graphpool's tiers (``--graphpool-tiers``, :mod:`.spec_tiers`): each tier of the table, at the batch sizes it serves
  (up to the captured size that holds its bound);
* SGLang's ``--speculative-adaptive``: one tier per candidate step count ``s`` (``s + 1`` draft tokens, topk 1), at the
  batch sizes SGLang itself prunes that step count's graphs to (``AdaptiveSpeculativeParams.cuda_graph_bs_for_step``).
  Step 0 is none where graphpool routes it to plain steps on the DECODE graphs (the switch's, or the adaptive
  routing's): its runner holds no verify graph;
* otherwise the one shape the server runs.
"""
from __future__ import annotations

import logging
from typing import Any, List, Optional, Sequence

from .fields import setting
from .runner_api_support import SpecSettings
from .target_graphs import VerifyTier
from .tier_table import TierTable

log = logging.getLogger(__name__)

#: What this process installed that a target's pool plans around, noted by the installers
#: (:func:`~.spec_tiers.install_speculation_tiers`, :func:`~.spec_switch_v2.install_step_choice`).
_installed: dict = {"tiers": None, "plain_steps": False}


def note_tiers(table: Optional[TierTable]) -> None:
    """graphpool's tiers are installed in this process (``None``: no longer)."""
    _installed["tiers"] = table


def note_plain_steps(on: bool) -> None:
    """Plain steps are routed to DECODE graphs in this process (the switch, the adaptive step-0 routing, the tiers)."""
    _installed["plain_steps"] = on


def active_table() -> Optional[TierTable]:
    """The tiers installed in this process (``None``: none)."""
    return _installed["tiers"]


def routes_plain_steps() -> bool:
    """Whether SGLang's adaptive step 0 runs as a plain step on a DECODE graph here: then no runner needs 1-token
    TARGET_VERIFY graphs for it."""
    return _installed["plain_steps"]


def planned_tiers(model_runner: Any, startup: SpecSettings, decode_batch_sizes: Sequence[int]) -> List[VerifyTier]:
    """The verify tiers of ``model_runner``'s pool; the first runner's own shape (``startup``) always among them."""
    table = active_table()
    if table is not None:
        tiers = [VerifyTier(t.steps, t.topk, t.num_draft_tokens, sizes)
                 for t, sizes in zip(table.tiers, table.batch_sizes(decode_batch_sizes))]
    elif setting(model_runner, "spec", ("speculative_adaptive",), False):
        tiers = [t for t in _adaptive_tiers(model_runner, startup, decode_batch_sizes)
                 if t.steps > 0 or not routes_plain_steps()]
    else:
        tiers = []
    if not any(t.same_shape(startup.num_steps, startup.topk, startup.num_draft_tokens) for t in tiers) \
            and not (startup.num_steps == 0 and routes_plain_steps()):
        tiers.insert(0, VerifyTier(startup.num_steps, startup.topk, startup.num_draft_tokens))
    return tiers


def _adaptive_tiers(model_runner: Any, startup: SpecSettings, decode_batch_sizes: Sequence[int]) -> List[VerifyTier]:
    """SGLang's adaptive states: ``s`` steps and ``s + 1`` draft tokens per candidate ``s``, at SGLang's pruned sizes."""
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

    params = AdaptiveSpeculativeParams(initial_steps=startup.num_steps,
                                       cfg_path=setting(model_runner, "spec", ("speculative_adaptive_config",)))
    params.set_cuda_graph_bs(list(decode_batch_sizes))
    tiers = []
    for steps in params.candidate_steps:
        sizes = params.cuda_graph_bs_for_step(steps)
        if sizes:  # SGLang captures no graph for a step count no batch size reaches
            tiers.append(VerifyTier(steps, 1, steps + 1, tuple(sizes)))
    return tiers

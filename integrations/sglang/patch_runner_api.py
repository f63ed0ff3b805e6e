"""install() for SGLang's runner API (0.5.14+): SGLang builds graphpool's decode runner for the target model.

Where SGLang 0.5.14+ builds a decode graph runner for the target model:

* ``ModelRunner.init_decode_cuda_graph`` (0.5.14) and ``ModelRunner._decode_cuda_graph_runner_cls``
  (0.5.2x) import ``DecodeCudaGraphRunner`` from ``sglang.srt.model_executor.runner.decode_cuda_graph_runner``
  when they run, so replacing that module attribute swaps what they build;
* SGLang's adaptive speculation (``--speculative-adaptive``) builds one more target verify runner per step
  count in ``EAGLEWorkerV2.build_adaptive_runtime_state``, by the name imported into ``eagle_worker_v2``.

The replacement is a factory, not a class: it builds :class:`~.runner_api.MultiModeDecodeRunner` for a
target model runner it serves and SGLang's class otherwise (draft workers, refused setups, with a warning
naming why), and answers class-level questions (``decode_graph_gather_requirements``) with SGLang's class.
The EAGLE draft runners subclass SGLang's class from the package ``sglang.srt.model_executor.runner``,
which is left alone.

Every runner the factory builds for one target model is a view of that model's one pool
(:class:`~.target_graphs.TargetGraphs`, kept on the ``ModelRunner``: :func:`target_graphs`): the first runner sizes
it for every tier planned (:mod:`.tier_plan`) and captures its DECODE graphs, each tier's runner adds its
TARGET_VERIFY graphs. A runner of a shape the pool does not plan gets a pool of its own (with a warning).
"""
from __future__ import annotations

import importlib
import logging
from typing import Any, Dict, Optional

log = logging.getLogger(__name__)

#: Modules whose ``DecodeCudaGraphRunner`` name builds a *target* model runner.
PATCHED_MODULES = ("sglang.srt.model_executor.runner.decode_cuda_graph_runner",
                   "sglang.srt.speculative.eagle_worker_v2")

_originals: Dict[str, Any] = {}


class DecodeRunnerFactory:
    """Stands where SGLang looks ``DecodeCudaGraphRunner`` up; builds graphpool's runner where it serves."""

    def __init__(self, sglang_class: type):
        self.sglang_class = sglang_class

    def __call__(self, model_runner: Any, **kwargs: Any) -> Any:
        from .runner_api import MultiModeDecodeRunner
        from .runner_api_support import refusal_reasons

        reasons = refusal_reasons(model_runner, kwargs.get("record_nolora_graph", False))
        if reasons:
            if not getattr(model_runner, "is_draft_worker", False):  # draft runners are SGLang's by design
                log.warning("graphpool: %s not served by the multi-mode runner; using SGLang's "
                            "DecodeCudaGraphRunner", "; ".join(reasons))
            return self.sglang_class(model_runner, **kwargs)
        return MultiModeDecodeRunner(model_runner, **kwargs, graphs=_pool_for(model_runner, kwargs))

    def __getattr__(self, name: str) -> Any:
        # Class-level lookups (SGLang 0.5.2x asks the class for decode_graph_gather_requirements).
        return getattr(self.sglang_class, name)


#: The ``ModelRunner`` attribute holding the target model's one pool.
_GRAPHS = "_graphpool_target_graphs"


def target_graphs(model_runner: Any) -> Optional[Any]:
    """The one pool (:class:`~.target_graphs.TargetGraphs`) of the target ``model_runner``'s runners, if built and open."""
    graphs = getattr(model_runner, _GRAPHS, None)
    return None if graphs is None or graphs.closed else graphs


def _pool_for(model_runner: Any, kwargs: Dict[str, Any]) -> Optional[Any]:
    """The pool a new runner of ``model_runner`` is a view of: the model's own (made and planned by its first runner),
    or ``None`` (a pool of the runner's own) for a shape the model's pool does not plan."""
    from . import common
    from .runner_api_support import decode_batch_sizes, spec_settings
    from .target_graphs import TargetGraphs
    from .tier_plan import planned_tiers, routes_plain_steps

    settings = spec_settings(model_runner, kwargs.get("speculative_num_steps"),
                             kwargs.get("speculative_num_draft_tokens"))
    speculative = common.is_speculative(model_runner.spec_algorithm)
    graphs = target_graphs(model_runner)
    if graphs is None:
        backend = kwargs.get("attn_backend") or model_runner.attn_backend
        decode_bs = decode_batch_sizes(model_runner, settings.num_draft_tokens if speculative else 1)
        tiers = planned_tiers(model_runner, settings, decode_bs) if speculative else []
        from .runner_api import MultiModeDecodeRunner

        graphs = TargetGraphs(model_runner, tiers, decode_bs, backend.get_cuda_graph_seq_len_fill_value(),
                              MultiModeDecodeRunner.pool_backend)
        setattr(model_runner, _GRAPHS, graphs)
        return graphs
    if not speculative or graphs.verify_mode(settings.num_steps, settings.topk, settings.num_draft_tokens) \
            or (settings.num_steps == 0 and routes_plain_steps()):  # step 0 runs on the DECODE graphs
        return graphs
    log.warning("graphpool: a target runner of %dx%d:%d, which the target's pool does not plan (%s): its graphs go "
                "into a pool of their own (the DECODE graphs captured again)", settings.topk, settings.num_steps,
                settings.num_draft_tokens, ", ".join(t.label for t in graphs.tiers) or "no verify tier")
    return None


def install() -> None:
    """Swap the decode runner SGLang builds for target models, in this process. Idempotent."""
    for name in PATCHED_MODULES:
        if name in _originals:
            continue
        try:
            module = importlib.import_module(name)
        except ImportError as exc:  # e.g. the spec workers without their kernels: nothing to build there
            if name == PATCHED_MODULES[0]:
                raise
            log.debug("graphpool: %s not importable (%s); not patched", name, exc)
            continue
        original = getattr(module, "DecodeCudaGraphRunner", None)
        if original is None:
            raise RuntimeError(f"graphpool.install(): {name} has no DecodeCudaGraphRunner; this SGLang layout is "
                               f"not the runner API graphpool knows (0.5.14 to 0.5.23)")
        if isinstance(original, DecodeRunnerFactory):
            original = original.sglang_class
        _originals[name] = original
        module.DecodeCudaGraphRunner = DecodeRunnerFactory(original)
    log.info("graphpool: SGLang target decode graph runner replaced in %s", sorted(_originals))


def uninstall() -> None:
    """Put SGLang's own ``DecodeCudaGraphRunner`` back wherever :func:`install` replaced it."""
    for name, original in list(_originals.items()):
        importlib.import_module(name).DecodeCudaGraphRunner = original
        del _originals[name]


def installed() -> bool:
    """Whether :func:`install` is in effect in this process."""
    return bool(_originals)

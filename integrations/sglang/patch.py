"""install() / uninstall(): make SGLang build graphpool's runner instead of its own ``CudaGraphRunner``.

``ModelRunner.init_device_graphs`` looks ``CudaGraphRunner`` up in ``sglang.srt.model_executor.model_runner``
when it runs, so replacing that module attribute swaps the target model's runner only; the EAGLE draft
runners keep SGLang's classes (they call ``CudaGraphRunner.capture`` from their own imports) and share
the global graph memory pool with ours. SGLang's adaptive speculation builds extra target runners by the
same name in the EAGLE worker modules, so those are swapped too when they import.

:func:`plain_step_refusal` tells the speculation switch whether the runner that install() left in place
can take a plain decode step.

The patch is per process. SGLang starts its schedulers with ``spawn``: use the launcher
(``python -m graphpool.integrations.sglang.launch``), which installs it inside every scheduler process.
"""
from __future__ import annotations

import importlib
import logging
from typing import Any, Dict, Optional

from . import versions
from .support import unsupported_reasons

log = logging.getLogger(__name__)

#: Modules whose ``CudaGraphRunner`` name builds a *target* model runner.
PATCHED_MODULES = ("sglang.srt.model_executor.model_runner", "sglang.srt.speculative.eagle_worker",
                   "sglang.srt.speculative.eagle_worker_v2")

_originals: Dict[str, Any] = {}


def build_graph_runner(model_runner: Any, **kwargs: Any) -> Any:
    """What the patched name builds: graphpool's runner, or SGLang's for a setup ours does not serve."""
    reasons = unsupported_reasons(model_runner)
    if reasons:
        log.warning("graphpool: %s not supported by the multi-mode runner; using SGLang's CudaGraphRunner",
                    ", ".join(reasons))
        from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner

        return CudaGraphRunner(model_runner, **kwargs)
    from .runner import MultiModeCudaGraphRunner

    return MultiModeCudaGraphRunner(model_runner, **kwargs)


def install() -> None:
    """Swap the runner SGLang builds for the target model, in this process. Idempotent."""
    # --- runner API (SGLang 0.5.14+): its own patch (issue 13) ---
    if versions.runner_api() == versions.RUNNER:
        from . import patch_runner_api

        return patch_runner_api.install()
    # --- classic API ---
    for name in PATCHED_MODULES:
        if name in _originals:
            continue
        try:
            module = importlib.import_module(name)
        except ImportError as exc:  # e.g. the EAGLE workers without sgl_kernel: nothing there to build
            if name == PATCHED_MODULES[0]:
                raise ImportError(f"graphpool.install(): cannot import {name} ({exc}); install SGLang "
                                  f"({versions.SUPPORTED[versions.CLASSIC]})") from exc
            log.debug("graphpool: %s not importable (%s); not patched", name, exc)
            continue
        if not hasattr(module, "CudaGraphRunner"):
            if name == PATCHED_MODULES[0]:
                raise RuntimeError(f"graphpool.install(): {name} has no CudaGraphRunner; SGLang "
                                   f"{versions.sglang_version()} does not use the classic runner API "
                                   f"({versions.SUPPORTED[versions.CLASSIC]})")
            # The EAGLE workers build extra target runners (adaptive speculation) only in some versions.
            log.debug("graphpool: %s builds no CudaGraphRunner in this SGLang; not patched", name)
            continue
        _originals[name] = module.CudaGraphRunner
        module.CudaGraphRunner = build_graph_runner
    log.info("graphpool: SGLang target graph runner replaced in %s", sorted(_originals))


def uninstall() -> None:
    """Put SGLang's own ``CudaGraphRunner`` back wherever :func:`install` replaced it."""
    from . import patch_runner_api  # runner API (issue 13); a no-op when it installed nothing

    patch_runner_api.uninstall()
    for name, original in list(_originals.items()):
        importlib.import_module(name).CudaGraphRunner = original
        del _originals[name]


def installed() -> bool:
    """Whether :func:`install` is in effect in this process."""
    from . import patch_runner_api  # runner API (issue 13)

    return bool(_originals) or patch_runner_api.installed()


def plain_step_refusal(runner: Any, ours: type) -> Optional[str]:
    """Why the speculation switch must not run a plain step on the target's decode graph runner ``runner``
    (``None``: it may), ``ours`` being graphpool's runner class of this SGLang API.

    A plain DECODE step needs graphpool's runner. Where install() handed the server to SGLang's own (a setup
    graphpool's runner does not serve; install() logged which), that runner holds TARGET_VERIFY graphs only
    and would replay one for the plain step: the shape crash. No runner (``--disable-cuda-graph``) runs
    plain steps eagerly; SGLang's runner without install() in effect is ``--graphpool-keep-sglang-runner``,
    which exists to reproduce that crash, so it is let through.
    """
    if runner is None or isinstance(runner, ours) or not installed():
        return None
    return (f"the target model's graph runner is SGLang's own {type(runner).__name__} (graphpool's runner does not "
            f"serve this server: see install()'s warning), which holds verify graphs only and would crash on a "
            f"plain decode step; speculation stays on at every batch size")

"""Which SGLang graph-runner API is installed: the classic ``CudaGraphRunner`` or the runner package.

SGLang changed how it builds decode graphs in 0.5.14:

* **classic** (0.5.9 to 0.5.13.post1): ``sglang.srt.model_executor.cuda_graph_runner.CudaGraphRunner``
  with ``can_run`` / ``replay_prepare`` / ``replay``, held as ``ModelRunner.graph_runner``;
* **runner** (0.5.14 and later, checked up to 0.5.23): the ``sglang.srt.model_executor.runner`` package,
  ``DecodeCudaGraphRunner`` with ``can_run_graph`` / ``load_batch`` / ``execute``, held as
  ``ModelRunner.decode_cuda_graph_runner``.

The answer is read from which modules exist, not from the version string, so a patch release that
keeps one API or the other is handled; the version is reported in messages. SGLang 0.5.13.x sits between
the two: it keeps the classic ``CudaGraphRunner`` class but drives attention through the new
out-of-graph hooks (the classic adapter drives those there, :mod:`.attn_hooks`) and has no EAGLE v1
worker, so the classic speculation switch refuses it (:func:`has_eagle_v1`).
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from typing import Optional

CLASSIC = "classic"
RUNNER = "runner"

#: Module that exists only in each generation.
_MARKERS = ((RUNNER, "sglang.srt.model_executor.runner.decode_cuda_graph_runner"),
            (CLASSIC, "sglang.srt.model_executor.cuda_graph_runner"))

#: The EAGLE v1 worker: every classic release up to 0.5.12.x has it; 0.5.13.x does not.
_EAGLE_V1 = "sglang.srt.speculative.eagle_worker"

#: What each generation covers and what graphpool was verified against (for messages and the README).
SUPPORTED = {CLASSIC: "SGLang 0.5.9 to 0.5.13.post1 (verified: 0.5.12.post1 live; 0.5.9 to 0.5.12.post1 in CI, "
                      "CPU; 0.5.13.post1 once, CPU, runner only: no EAGLE v1 switch)",
             RUNNER: "SGLang 0.5.14 to 0.5.23 (verified: 0.5.16 to 0.5.23 served live in CI, CPU; 0.5.14 and 0.5.15.x "
                     "classes in CI, CPU; 0.5.17 live on a GPU)"}


#: The SGLang releases graphpool is tested against: CI drives each one's real classes (.ci/sglang-classic-range.sh,
#: .ci/sglang-current.sh), and serves every release from 0.5.16 to 0.5.23 live on CPU (.ci/sglang-live.sh). Others of a
#: supported generation (0.5.10, 0.5.12, 0.5.13) are served the same way, untested (the launcher says so once).
TESTED_RELEASES = ("0.5.9", "0.5.10.post1", "0.5.11", "0.5.12.post1", "0.5.13.post1", "0.5.14", "0.5.15", "0.5.15.post1",
                   "0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")


def untested_release_warning() -> Optional[str]:
    """One line naming the tested releases when the installed SGLang is not one of them (else ``None``)."""
    version = sglang_version()
    if version in TESTED_RELEASES or version == "not installed":
        return None
    return (f"graphpool: SGLang {version} is not a release graphpool is tested against ({', '.join(TESTED_RELEASES)}); "
            f"its {runner_api()} graph-runner API is served as theirs is, untested")


def sglang_version() -> str:
    """The installed SGLang's version string, or ``"not installed"``."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@functools.lru_cache(maxsize=None)
def runner_api() -> str:
    """:data:`CLASSIC` or :data:`RUNNER`, for the installed SGLang.

    Raises:
        ImportError: SGLang is not installed, or has neither API (too old, or a layout graphpool does not know).
    """
    try:
        found = importlib.util.find_spec("sglang") is not None
    except ValueError:  # sglang is in sys.modules as None (hidden), or half-imported
        found = False
    if not found:
        raise ImportError("graphpool's SGLang integration needs SGLang; install one of: "
                          + "; ".join(SUPPORTED.values()), name="sglang")
    for api, module in _MARKERS:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError as exc:
            if exc.name and module.startswith(exc.name + "."):  # a parent package of the marker: not this generation
                continue
            raise ImportError(f"SGLang {sglang_version()} is installed but does not import ({exc}): install its "
                              f"dependencies (pip install sglang=={sglang_version()})", name=exc.name) from exc
        if found:
            return api
    raise ImportError(f"SGLang {sglang_version()} has neither the classic CudaGraphRunner nor the runner package; "
                      f"graphpool supports " + "; ".join(SUPPORTED.values()))


def has_eagle_v1() -> bool:
    """Whether this SGLang has the EAGLE v1 worker the classic speculation switch drives (not 0.5.13.x)."""
    try:
        return importlib.util.find_spec(_EAGLE_V1) is not None
    except (ImportError, ValueError):
        return False


def require(api: str) -> None:
    """Raise ``ImportError`` naming both versions when the installed SGLang is not of generation ``api``."""
    found = runner_api()
    if found != api:
        raise ImportError(f"this module needs the {api} graph-runner API ({SUPPORTED[api]}); the installed SGLang "
                          f"{sglang_version()} has the {found} API ({SUPPORTED[found]})")

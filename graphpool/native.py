"""The optional C++ input checker: GraphPool's per-input checks at C++ speed, for CUDA pools.

Checking six inputs in Python costs ~3-4 us per step (five attribute calls per tensor), as much as a
graph replay. ``csrc/input_check.cpp`` does the same checks and writes the ring-table row in one call.
It only pays where replays are that cheap, so only CUDA pools build it (the eager twin's steps cost
milliseconds). It is compiled on first use with torch's extension builder (about a minute) into a cache
folder keyed by the torch build, the Python version and the source's hash. A folder that holds the built
module is imported directly, without the builder: the builder's ninja file names the checkout's source path
and the environment's torch headers, so from another checkout or virtual environment it would rebuild the
same module (~30 s) and make the other one rebuild next. "building" is said only when it builds. Without a compiler, or with
``GRAPHPOOL_NO_EXTENSION=1``, the pool uses its Python checks, which accept and refuse the same steps.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import sys
import time
from typing import Any

import torch

from .validation import InputRules

log = logging.getLogger("graphpool")
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "input_check.cpp")


def _build_directory() -> str:
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    # The exact torch build (two builds may share a version string), so that a cached module always fits.
    build = (torch.version.git_version or "")[:8]
    tag = f"torch{torch.__version__}-{build}-py{sys.version_info[0]}{sys.version_info[1]}-{digest}".replace("+", "_")
    root = os.environ.get("GRAPHPOOL_EXTENSION_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "graphpool")
    return os.path.join(root, tag)


@functools.lru_cache(maxsize=1)
def _extension() -> Any:
    if os.environ.get("GRAPHPOOL_NO_EXTENSION", "") not in ("", "0"):
        return None
    try:
        from torch.utils.cpp_extension import load

        directory = _build_directory()
        os.makedirs(directory, exist_ok=True)
        _drop_stale_lock(directory)
        cached = _load_built(directory)
        if cached is not None:
            return cached
        # a wait of up to a minute deserves a line; a cached load does not
        sys.stderr.write(f"graphpool: building the C++ input checker (once per torch build, cached in "
                         f"{directory}) ...\n")
        return load(name="graphpool_input_check", sources=[SOURCE], extra_cflags=["-O2"],
                    build_directory=directory, verbose=False)
    except Exception as exc:  # no compiler, no ninja, headers missing: the Python checks still work
        log.warning("graphpool: C++ input checker unavailable (%s: %s); using Python checks (~0.5 us more per "
                    "input per step)", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None


def _load_built(directory: str) -> Any:
    """The module already built in ``directory``, imported as torch's builder would import it; ``None`` when
    there is none, or it does not import (a build killed while linking): then the builder builds it again."""
    path = os.path.join(directory, "graphpool_input_check.so")
    if not os.path.isfile(path) or os.path.exists(os.path.join(directory, "lock")):
        return None  # not built yet, or a build is under way: the builder waits for it
    try:
        spec = importlib.util.spec_from_file_location("graphpool_input_check", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except (ImportError, OSError) as exc:
        log.debug("graphpool: the cached C++ input checker in %s does not import (%s); rebuilding", directory, exc)
        return None


def _drop_stale_lock(directory: str, stale_s: float = 600.0) -> None:
    """torch's extension builder waits forever on the lock file of a build that was killed; a build takes
    about a minute, so a lock older than ``stale_s`` belongs to no running build."""
    lock = os.path.join(directory, "lock")
    try:
        if time.time() - os.path.getmtime(lock) > stale_s:
            log.warning("graphpool: removing a stale build lock %s (a build was interrupted)", lock)
            os.remove(lock)
    except OSError:
        pass


def make_input_checker(rules: InputRules) -> Any:
    """An ``InputChecker`` for these rules' declarations, or ``None`` where the extension is unavailable."""
    ext = _extension()
    if ext is None:
        return None
    specs = rules.specs
    return ext.InputChecker(list(rules.names), [s.dtype for s in specs], [list(s.trailing) for s in specs],
                            [s.per == "token" for s in specs], rules.device_index, rules.bs_index,
                            *rules.static_span, list(rules.static_starts))


def fresh_functions() -> Any:
    """The extension's ``(fresh_views, fresh_dict)``, what :class:`graphpool.outputs.OutputLayout` makes each
    result's new tensor objects with (~3x cheaper than ``detach`` from Python), or ``None`` without it."""
    ext = _extension()
    return None if ext is None else (ext.fresh_views, ext.fresh_dict)


def extension_available() -> bool:
    """Whether the C++ checker builds (or is cached) here; builds it if needed."""
    return _extension() is not None


__all__ = ["make_input_checker", "fresh_functions", "extension_available"]

"""The optional C++ input checker: GraphPool.run's per-input checks at C++ speed.

Checking six inputs in Python costs ~3-4 us per step (five attribute calls per tensor), as much as the
graph replay itself. ``csrc/input_check.cpp`` does the same checks and writes the ring-table row in
one call. It is compiled on first use with torch's JIT extension builder (about a minute, cached per
torch version under ``TORCH_EXTENSIONS_DIR``); without a compiler, or with ``GRAPHPOOL_NO_EXTENSION=1``,
the pool uses its Python checks, which raise the same errors.
"""
from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any, Sequence

import torch

from .modes import StepInput

log = logging.getLogger("graphpool")
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "input_check.cpp")


@functools.lru_cache(maxsize=1)
def _extension() -> Any:
    if os.environ.get("GRAPHPOOL_NO_EXTENSION", "") not in ("", "0"):
        return None
    try:
        from torch.utils.cpp_extension import load

        # Progress for a wait of up to a minute (first use per torch version only; cached afterwards).
        sys.stderr.write("graphpool: building the C++ input checker (once per torch version) ...\n")
        return load(name="graphpool_input_check", sources=[SOURCE], extra_cflags=["-O2"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, headers missing: the Python checks still work
        log.warning("graphpool: C++ input checker unavailable (%s: %s); using Python checks (~0.5 us more per "
                    "input per step)", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None


def make_input_checker(specs: Sequence[StepInput], device_index: int, bs_index: int) -> Any:
    """An ``InputChecker`` for these declarations, or ``None`` where the extension is unavailable."""
    ext = _extension()
    if ext is None:
        return None
    return ext.InputChecker([s.name for s in specs], [s.dtype for s in specs], [list(s.trailing) for s in specs],
                            [s.per == "token" for s in specs], device_index, bs_index)


def extension_available() -> bool:
    return _extension() is not None


__all__ = ["make_input_checker", "extension_available"]

"""graphpool for SGLang: a multi-mode ``CudaGraphRunner``, its install patch, and the dynamic speculation
switch (EAGLE v1 plain-decode fallback above a batch-size threshold).

Import name ``graphpool.integrations.sglang``; needs SGLang (tested against 0.5.12.post1). See README.md
beside this file for running a server with it.

The names below load on first use, not when the package is imported: ``python -m
graphpool.integrations.sglang.launch`` imports this package first, and without SGLang it must still get
as far as its own one-line message saying what to install.
"""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "install": "patch", "uninstall": "patch", "installed": "patch",
    "MultiModeCudaGraphRunner": "runner", "MODE_NAMES": "runner",
    "SpeculationSwitch": "spec_switch", "install_speculation_switch": "spec_switch",
    "uninstall_speculation_switch": "spec_switch", "plain_decode_batch": "spec_switch",
    "capture_batch_sizes": "support", "unsupported_reasons": "support",
}
__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)

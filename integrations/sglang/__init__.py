"""graphpool for SGLang: multi-mode decode graph runners, their install patch, and the dynamic speculation
switch (plain-decode steps on DECODE graphs above a batch-size threshold).

Import name ``graphpool.integrations.sglang``. Two SGLang API generations are served (see
:mod:`.versions`): the classic ``CudaGraphRunner`` (0.5.9 to 0.5.13.post1; :class:`MultiModeCudaGraphRunner`)
and the runner package (0.5.14 to 0.5.23; :class:`MultiModeDecodeRunner`). :func:`install` picks the one of
the installed SGLang. See README.md beside this file for running a server with it.
"""
from typing import Any

from . import versions
from .patch import install, installed, uninstall
from .spec_switch import (SpeculationSwitch, install_speculation_switch, plain_decode_batch,
                          uninstall_speculation_switch)
from .support import capture_batch_sizes, unsupported_reasons

__all__ = ["MultiModeCudaGraphRunner", "MultiModeDecodeRunner", "install", "uninstall", "installed", "MODE_NAMES",
           "capture_batch_sizes", "unsupported_reasons", "SpeculationSwitch", "install_speculation_switch",
           "uninstall_speculation_switch", "plain_decode_batch", "versions"]

# The runner classes import their SGLang generation's modules: loaded on first use, with a clear error
# when the installed SGLang has the other API.
_LAZY = {"MultiModeCudaGraphRunner": (versions.CLASSIC, ".runner"), "MODE_NAMES": (None, ".common"),
         "MultiModeDecodeRunner": (versions.RUNNER, ".runner_api")}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    api, module = _LAZY[name]
    if api is not None:
        versions.require(api)
    import importlib

    return getattr(importlib.import_module(module, __name__), name)

"""graphpool for SGLang: multi-mode decode graph runners, their install patch, and the dynamic speculation
switch (plain-decode steps on DECODE graphs above a batch-size threshold).

Import name ``graphpool.integrations.sglang``. Two SGLang API generations are served (see
:mod:`.versions`): the classic ``CudaGraphRunner`` (0.5.9 to 0.5.13.post1; :class:`MultiModeCudaGraphRunner`)
and the runner package (0.5.14 to 0.5.23; :class:`MultiModeDecodeRunner`). :func:`install` picks the one of
the installed SGLang, and so do the speculation switch's names (:mod:`.spec_switch` for SGLang's EAGLE v1
worker, :mod:`.spec_switch_v2` for its spec-v2 worker). See README.md beside this file for running a server.

The names below load on first use, not when the package is imported: ``python -m
graphpool.integrations.sglang.launch`` imports this package first, and without SGLang it must still get
as far as its own one-line message saying what to install. A runner class of the other API generation
than the installed SGLang's raises an ImportError that names both.
"""
from __future__ import annotations

import importlib
from typing import Any

#: The speculation switch's module for each SGLang API generation: EAGLE v1 (classic), spec v2 (runner).
_SWITCH = {"classic": ".spec_switch", "runner": ".spec_switch_v2"}

# name -> (module, or a module per API generation; the API generation it needs: "classic", "runner" or None)
_WHERE = {
    "install": (".patch", None), "uninstall": (".patch", None), "installed": (".patch", None),
    "versions": (".versions", None), "MODE_NAMES": (".common", None),
    "MultiModeCudaGraphRunner": (".runner", "classic"), "MultiModeDecodeRunner": (".runner_api", "runner"),
    "SpeculationSwitch": (_SWITCH, None), "install_speculation_switch": (_SWITCH, None),
    "uninstall_speculation_switch": (_SWITCH, None), "plain_decode_batch": (_SWITCH, None),
    "capture_batch_sizes": (".support", None), "unsupported_reasons": (".support", None),
}
__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, api = _WHERE[name]
    if name == "versions":
        value = importlib.import_module(module, __name__)
    else:
        versions = importlib.import_module(".versions", __name__)
        if api is not None:
            versions.require(versions.CLASSIC if api == "classic" else versions.RUNNER)
        if isinstance(module, dict):  # the installed SGLang's generation picks the module
            module = module[versions.runner_api()]
        value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)

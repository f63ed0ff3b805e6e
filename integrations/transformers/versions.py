"""Which transformers releases this integration runs on, and a check of the interfaces it relies on.

Checked at construction (:class:`~graphpool.integrations.transformers.SlotCache`,
:class:`~graphpool.integrations.transformers.PoolGenerator`), not at import, so the package imports (and its
docs read) with any transformers installed.

* **transformers 5.6.0 and later** (tested: :data:`TESTED`). 5.x's ``Cache`` is a list of per-layer objects
  whose ``update(key, value, layer_idx)`` returns the keys and values attention reads, a 4-D
  ``attention_mask`` reaches attention as given, and attention runs through the ``AttentionInterface``: the
  hooks the slot cache and the step use. 4.x builds masks from the cache's single length: refused.
* **A release newer than the newest tested** runs with one warning, unless :func:`check_interfaces` finds that an
  interface listed in :data:`INTERFACES` changed: then an error naming what changed.
* **Models**: by structure, not by name (:mod:`.structure`).
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import re
import warnings
from typing import Callable

#: The oldest release served, (major, minor).
OLDEST = (5, 6)
#: The releases the CPU tests ran on: CI's main environment, one between (.ci/transformers-range.sh), the newest.
TESTED = ("5.6.0", "5.17.0", "5.25.0")
#: The newest release tested, (major, minor): newer ones run with a warning.
NEWEST_TESTED = (5, 25)
SUPPORTED = f"transformers {OLDEST[0]}.{OLDEST[1]}.0 and later (tested: {', '.join(TESTED)})"


class UnsupportedModelError(ValueError):
    """A model, transformers release or setting this integration cannot serve; the message says why and the fix."""


class UntestedReleaseWarning(UserWarning):
    """The installed transformers is newer than every release this integration was tested on."""


def transformers_version() -> str:
    """The installed transformers' version string, or ``"not installed"``."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _release(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_version(version: str | None = None) -> None:
    """Refuse a release older than :data:`OLDEST` (default: the installed one); warn, once per release, about one
    newer than :data:`NEWEST_TESTED`.

    Raises:
        UnsupportedModelError: naming the release found and the supported range.
    """
    version = transformers_version() if version is None else version
    found = _release(version)
    if found is None or found < OLDEST:
        why = ("not a release number" if found is None else
               "older releases build attention masks from one cache length and lack the per-layer Cache API")
        raise UnsupportedModelError(
            f"graphpool.integrations.transformers supports {SUPPORTED}; found transformers {version} ({why}): "
            f"install a supported release, e.g. pip install 'transformers=={TESTED[-1]}'")
    if found > NEWEST_TESTED:
        _warn_untested(version)


@functools.lru_cache(maxsize=None)
def _warn_untested(version: str) -> None:
    warnings.warn(f"transformers {version} is newer than every release graphpool.integrations.transformers was tested "
                  f"on ({', '.join(TESTED)}); the interfaces it relies on were checked and are in place, so it runs",
                  UntestedReleaseWarning, stacklevel=4)


def _has(module: str, name: str) -> Callable[[], bool]:
    return lambda: hasattr(importlib.import_module(module), name)


def _takes(module: str, path: str, *params: str) -> Callable[[], bool]:
    def check() -> bool:
        target = importlib.import_module(module)
        for part in path.split("."):
            target = getattr(target, part)
        return set(params) <= set(inspect.signature(target).parameters)
    return check


#: What this integration relies on in transformers, each with a check: the name of what changed, if one fails.
INTERFACES: dict[str, Callable[[], bool]] = {
    "transformers.cache_utils.Cache(layers=...)": _takes("transformers.cache_utils", "Cache.__init__", "layers"),
    "transformers.cache_utils.CacheLayerMixin": _has("transformers.cache_utils", "CacheLayerMixin"),
    "transformers.AttentionInterface.register(name, function)": _takes("transformers", "AttentionInterface.register",
                                                                        "key", "value"),
    "transformers.integrations.sdpa_attention.sdpa_attention_forward": _has("transformers.integrations.sdpa_attention",
                                                                            "sdpa_attention_forward"),
    "GenerationMixin._prepare_generation_config(generation_config, **kwargs)": _takes(
        "transformers.generation.utils", "GenerationMixin._prepare_generation_config", "generation_config"),
    "transformers.generation.StopStringCriteria(tokenizer, stop_strings)": _takes(
        "transformers.generation", "StopStringCriteria.__init__", "tokenizer", "stop_strings"),
    "transformers.GenerationConfig.update(**kwargs) returning the unused keys": _takes(
        "transformers", "GenerationConfig.update"),
    "GenerationConfig._get_default_generation_params() (generate()'s defaults)": lambda: callable(
        getattr(importlib.import_module("transformers").GenerationConfig, "_get_default_generation_params", None)),
}


def check_interfaces() -> None:
    """Check every interface of :data:`INTERFACES` in the installed transformers.

    Raises:
        UnsupportedModelError: naming each interface that changed, and the release.
    """
    changed = []
    for name, check in INTERFACES.items():
        try:
            ok = check()
        except (ImportError, AttributeError, TypeError, ValueError):
            ok = False
        if not ok:
            changed.append(name)
    if changed:
        raise UnsupportedModelError(
            f"transformers {transformers_version()} changed interfaces graphpool.integrations.transformers relies on: "
            f"{'; '.join(changed)}. Install a tested release ({', '.join(TESTED)}), e.g. "
            f"pip install 'transformers=={TESTED[-1]}'")

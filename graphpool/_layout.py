"""``graphpool.kernels`` and ``graphpool.integrations`` in an uninstalled source checkout.

setup.py installs the top-level folders ``kernels/`` and ``integrations/`` as ``graphpool.kernels`` and
``graphpool.integrations`` (a top-level ``kernels`` package would clash with an unrelated PyPI package).
When graphpool runs from a checkout without being installed (tests with ``pytest``, scripts), those two
names are registered here from the folders beside this package, and nothing else: no other folder of the
checkout becomes part of ``graphpool``, and each file is loaded as one module object.
"""
from __future__ import annotations

import importlib.util
import os
import sys

_SUBPACKAGES = ("kernels", "integrations")


def map_checkout_packages() -> None:
    """Register ``graphpool.<name>`` for each folder of :data:`_SUBPACKAGES` that no installer provides."""
    checkout = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # through a linked package folder
    for name in _SUBPACKAGES:
        full = f"graphpool.{name}"
        init = os.path.join(checkout, name, "__init__.py")
        if full in sys.modules or not os.path.isfile(init) or _installed(full):
            continue
        spec = importlib.util.spec_from_file_location(full, init, submodule_search_locations=[os.path.dirname(init)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)
        setattr(sys.modules["graphpool"], name, module)


def _installed(full: str) -> bool:
    """Whether an installed graphpool (e.g. ``pip install -e .``) already resolves ``full``."""
    parent = sys.modules["graphpool"]
    if any(os.path.isdir(os.path.join(p, full.rsplit(".", 1)[1])) for p in getattr(parent, "__path__", [])):
        return True
    return any(finder.find_spec(full, parent.__path__) is not None for finder in sys.meta_path
               if hasattr(finder, "find_spec") and type(finder).__module__ != "_frozen_importlib_external")

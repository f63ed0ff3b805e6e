"""``graphpool.kernels`` and ``graphpool.integrations`` when graphpool runs from a source checkout.

pyproject.toml installs the top-level folders ``kernels/`` and ``integrations/`` as ``graphpool.kernels`` and
``graphpool.integrations`` (a top-level ``kernels`` package would clash with an unrelated PyPI package).

Why this stays although ``pip install -e .`` is the documented set-up: graphpool also runs from checkouts
that no installer mapped. The tests import it from the checkout (pytest.ini's ``pythonpath = .``), the GPU
machine runs a copied checkout without pip, and quickstart.sh links the bare ``graphpool/`` folder into the
environment where pip refuses. There the two names exist only because they are registered here. And where an
editable install of *another* checkout is active (a shared venv), registering this checkout's folders keeps
the package and its subpackages from one tree instead of mixing two.

Rule: when the imported ``graphpool`` package has no ``kernels``/``integrations`` folder of its own (a wheel
has them inside) and its checkout has them beside it, those folders are ``graphpool.kernels`` and
``graphpool.integrations``; nothing else of the checkout becomes part of ``graphpool``, and each file is loaded
as one module object.
"""
from __future__ import annotations

import importlib.util
import os
import sys

_SUBPACKAGES = ("kernels", "integrations")


def map_checkout_packages() -> None:
    """Register ``graphpool.<name>`` from the checkout beside this package, for each of :data:`_SUBPACKAGES`
    that the package does not hold itself."""
    package = sys.modules["graphpool"]
    checkout = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # through a linked package folder
    if not os.path.isfile(os.path.join(checkout, "pyproject.toml")):
        return  # not graphpool's checkout: e.g. an installed copy beside an unrelated `kernels` package
    for name in _SUBPACKAGES:
        full = f"graphpool.{name}"
        init = os.path.join(checkout, name, "__init__.py")
        inside = any(os.path.isdir(os.path.join(p, name)) for p in getattr(package, "__path__", []))
        if full in sys.modules or inside or not os.path.isfile(init):
            continue
        spec = importlib.util.spec_from_file_location(full, init, submodule_search_locations=[os.path.dirname(init)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)
        setattr(package, name, module)

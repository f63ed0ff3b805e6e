"""Test-only stand-in for ``sgl_kernel`` (SGLang's CUDA kernel package).

The real package is built for another torch and cannot load here. SGLang's
speculative modules import ``sgl_kernel.kvcacheio`` unconditionally; every
other kernel import sits behind a CUDA check or a try/except with a CPU
fallback. So this package is deliberately empty apart from ``kvcacheio``:
a stand-in that answered every name would switch those fallbacks off.
"""

import importlib.abc as _abc
import importlib.machinery as _machinery
import sys as _sys
import types as _types

import torch as _torch


class _StandIn:
    """A kernel (or kernel constant) that is not here: any attribute is another stand-in, and calling
    it fails loudly. SGLang reads some of them at import time (e.g. ``scalar_types.uint4b8``)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> "_StandIn":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _StandIn(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name} is a test stand-in; the real sgl-kernel is not installed")

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


def _stand_in_attribute(name: str) -> _StandIn:
    """Module-level ``__getattr__``: any kernel name imports, and fails loudly only if it is called."""
    if name.startswith("__"):
        raise AttributeError(name)
    return _StandIn(f"sgl_kernel.{name}")


class _StandInSubmodules(_abc.MetaPathFinder, _abc.Loader):
    """``sgl_kernel.<anything>`` that is not on disk here becomes a module answering every name."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return _machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _stand_in_attribute
        return module

    def exec_module(self, module):
        pass


def _answer_every_kernel_import() -> None:
    global __getattr__
    __getattr__ = _stand_in_attribute
    _sys.meta_path.append(_StandInSubmodules())  # last: real files here (kvcacheio) are found first
    # SGLang registers fake (meta) implementations of sgl_kernel's torch ops at import time; the ops
    # themselves come with the real package. Skip those registrations for ops that do not exist.
    register_fake = _torch.library.register_fake

    def register_fake_if_defined(op, *args, **kwargs):
        if isinstance(op, str) and op.startswith("sgl_kernel::"):
            namespace, name = op.split("::")
            if not hasattr(getattr(_torch.ops, namespace), name.split(".")[0]):
                return lambda fn=None, *a, **k: fn
        return register_fake(op, *args, **kwargs)

    _torch.library.register_fake = register_fake_if_defined


if _torch.cuda.is_available():
    # On a CUDA machine SGLang's modules import many kernels by name behind `if _is_cuda:` (no CPU
    # fallback is taken there). The tests drive SGLang's runner and routing with our own model and
    # attention backend, which never call them: answer the imports, and fail loudly if one is called.
    _answer_every_kernel_import()

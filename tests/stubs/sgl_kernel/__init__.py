"""Test-only stand-in for ``sgl_kernel`` (SGLang's CUDA kernel package).

The real package is built for another torch and cannot load here. SGLang's
speculative modules import ``sgl_kernel.kvcacheio`` unconditionally; every
other kernel import sits behind a CUDA check or a try/except with a CPU
fallback. So this package is deliberately empty apart from ``kvcacheio``:
a stand-in that answered every name would switch those fallbacks off.
"""

import torch as _torch

if _torch.cuda.is_available():
    # On a CUDA machine SGLang's modules import many kernels by name behind `if _is_cuda:` (no CPU
    # fallback is taken there). The tests drive SGLang's runner and routing with our own model and
    # attention backend, which never call them: answer the import, and fail loudly if one is called.
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def _not_available(*args, **kwargs):
            raise NotImplementedError(f"sgl_kernel.{name} is a test stand-in; the real sgl-kernel is not installed")
        return _not_available

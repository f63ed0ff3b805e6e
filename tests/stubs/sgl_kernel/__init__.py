"""Test-only stand-in for ``sgl_kernel`` (SGLang's CUDA kernel package).

The real package is built for another torch and cannot load here. SGLang's
speculative modules import ``sgl_kernel.kvcacheio`` unconditionally; every
other kernel import sits behind a CUDA check or a try/except with a CPU
fallback. So this package is deliberately empty apart from ``kvcacheio``:
a stand-in that answered every name would switch those fallbacks off.
"""

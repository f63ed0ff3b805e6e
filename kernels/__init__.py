"""Triton kernels of graphpool, each beside the plain-torch reference that is its test oracle.

Imported as ``graphpool.kernels`` (pyproject.toml maps this folder). Kernels never import the pool.
"""

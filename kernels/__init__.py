"""Triton kernels of graphpool, each beside the plain-torch reference that is its test oracle.

Imported as ``graphpool.kernels`` (setup.py maps this folder). Kernels never import the pool.
"""

"""The one part of graphpool's packaging that pyproject.toml cannot state: which subpackages to install.

pyproject.toml holds the metadata and maps the folders kernels/ and integrations/ to graphpool.kernels and
graphpool.integrations. setuptools' package finder names what it finds after the folders (``integrations.x``)
and cannot put them under ``graphpool``, and a static list would miss each new integration. So every package
below those two folders is found here, on disk, and listed under its installed name: a new
``integrations/<name>/__init__.py`` is installed as ``graphpool.integrations.<name>`` with no edit here.
"""
import os

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
MAPPED = ("kernels", "integrations")  # the top-level folders pyproject.toml maps under graphpool
FOUND = find_packages(ROOT, include=[pattern for name in MAPPED for pattern in (name, f"{name}.*")])
OWN = find_packages(ROOT, include=["graphpool.*"])  # graphpool's own subpackages (graphpool.bench)

setup(packages=["graphpool", *OWN, *(f"graphpool.{name}" for name in FOUND)])

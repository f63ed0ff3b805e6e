"""Test-only stand-in for ``torchvision``.

PyPI's torchvision does not load beside the CPU build of torch that CI uses
("operator torchvision::nms does not exist"), yet SGLang imports a few of its
names at module level. This package provides exactly those names so that
SGLang's model-executor modules import in tests. Nothing here is functional:
calling an image function raises, because no test decodes images.
"""

from torchvision import io, transforms  # noqa: F401

__version__ = "0.0.0+graphpool-test-stub"

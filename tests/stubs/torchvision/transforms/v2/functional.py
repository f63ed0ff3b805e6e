"""Stand-in for ``torchvision.transforms.v2.functional``: image ops raise when called."""

from torchvision.transforms.functional import __getattr__  # noqa: F401  (same rule)

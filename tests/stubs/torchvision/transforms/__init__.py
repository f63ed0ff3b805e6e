"""Stand-in for ``torchvision.transforms``: only the names SGLang imports."""

import enum

from torchvision.transforms import functional, v2  # noqa: F401


class InterpolationMode(enum.Enum):
    """Same member names and values as torchvision's enum."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name: str):
    # Transform classes (Compose, Normalize, ...) are looked up only when an
    # image processor runs, which no test does: fail loudly if one ever does.
    raise AttributeError(f"torchvision test stand-in: transforms.{name} is not available in tests")

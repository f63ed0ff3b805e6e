"""Stand-in for ``torchvision.io``: only the names SGLang and transformers import."""

import enum


class ImageReadMode(enum.Enum):
    """Same member names as torchvision's enum (values are irrelevant here)."""

    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4
    RGBA = 4


def _unavailable(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(f"torchvision test stand-in: io.{name} cannot run in tests (no image decoding)")

    call.__name__ = name
    return call


decode_jpeg = _unavailable("decode_jpeg")
decode_image = _unavailable("decode_image")

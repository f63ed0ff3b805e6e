"""Stand-in for ``torchvision.transforms.functional``: image ops raise when called."""


def __getattr__(name: str):
    if name == "InterpolationMode":
        from torchvision.transforms import InterpolationMode

        return InterpolationMode
    if name.startswith("__"):
        raise AttributeError(name)

    # Image functions are only imported at module level by SGLang and
    # transformers; none is called by a test, so a call fails loudly.
    def call(*args, **kwargs):
        raise NotImplementedError(f"torchvision test stand-in: transforms.functional.{name} cannot run in tests")

    call.__name__ = name
    return call

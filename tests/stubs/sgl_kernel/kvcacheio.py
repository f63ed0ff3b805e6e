"""Stand-in for ``sgl_kernel.kvcacheio``: importable, not callable."""


def __getattr__(name: str):
    def _unavailable(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel test stand-in: kvcacheio.{name} is not available in tests")

    return _unavailable

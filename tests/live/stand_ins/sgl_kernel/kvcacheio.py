"""``sgl_kernel.kvcacheio``: SGLang's speculative modules import it unconditionally; nothing here is called."""


def __getattr__(name: str):
    def not_here(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.kvcacheio.{name} is not in graphpool's live-tier stand-in")
    return not_here

"""Typed errors of graphpool.

Every error the pool raises derives from :class:`GraphPoolError`. Input errors are raised by
validation, before anything touches the device, so a rejected step leaves the pool exactly as it was.
Messages name the bad value, the rule it broke and the fix.
"""
from __future__ import annotations


class GraphPoolError(Exception):
    """Base class of every error raised by graphpool."""


class UnknownModeError(GraphPoolError, KeyError):
    """A step named a mode the pool was not built with."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class MissingInputError(GraphPoolError, TypeError):
    """A step left out a declared input, or passed one the pool does not know."""


class InputRowsError(GraphPoolError, ValueError):
    """An input's row count does not fit the mode (rows = bs x tokens_per_seq for per-token inputs)."""


class InputDtypeError(GraphPoolError, TypeError):
    """An input has a different dtype from its declaration."""


class InputTypeError(GraphPoolError, TypeError):
    """An input is not a ``torch.Tensor``."""


class InputDeviceError(GraphPoolError, ValueError):
    """An input lives on another device than the pool."""


class InputLayoutError(GraphPoolError, ValueError):
    """An input is not contiguous, or is a lazily conjugated/negated view (the pool copies rows as one block
    of raw memory)."""


class IndexBoundsError(GraphPoolError, ValueError):
    """Debug mode: an input holds a value outside its declared ``bounds``."""


class InputShapeError(GraphPoolError, ValueError):
    """An input's trailing shape (after the row dimension) differs from its declaration."""


class BatchTooLargeError(GraphPoolError, ValueError):
    """The batch is larger than the largest captured size and the pool was told to raise on misses."""


class NotCapturedError(GraphPoolError, RuntimeError):
    """A step was run before :meth:`GraphPool.capture` finished."""


class CaptureError(GraphPoolError, RuntimeError):
    """Capture failed; the pool holds no graphs and refuses to run until captured again."""


class StepOutputError(GraphPoolError, TypeError):
    """A step function returned something the pool cannot slice and hand back (checked at capture)."""


class ConcurrentUseError(GraphPoolError, RuntimeError):
    """Two threads used one pool at once, or a step staged on one thread was replayed on another."""


# A non-blocking acquire of the pool's lock cannot miss an overlap (a plain flag could) and costs ~0.1 us.
CONCURRENT_USE = ("two calls used one GraphPool at once: a second thread, a call from inside step_fn or prepare, or "
                  "a replay of a step another thread staged; a pool serves one caller at a time: use one pool per "
                  "thread, or hold a lock around each run / stage+replay, and never call the pool from its step")


class StaleStepError(GraphPoolError, RuntimeError):
    """A staged step was replayed after a later ``stage`` overwrote its inputs."""


class RingDesyncError(GraphPoolError, RuntimeError):
    """Debug mode: the host's and the device's count of executed staging steps differ."""


class DeviceFaultError(GraphPoolError, RuntimeError):
    """A CUDA error surfaced while the pool waited for the device (a step enqueued earlier faulted)."""

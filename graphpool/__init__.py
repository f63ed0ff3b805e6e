"""graphpool: CUDA graphs for several step shapes ("modes") over shared static buffers and one memory pool.

A speculative-decoding server needs target-verify steps (``num_draft_tokens`` tokens per sequence) and
plain decode steps (one token per sequence). :class:`GraphPool` captures a graph for every
(mode, batch size), all reading one set of static buffers and sharing one memory pool, and routes each
step to the graph of its own mode.
"""
import os as _os

# setup.py installs the folders kernels/ and integrations/ as graphpool.kernels and graphpool.integrations.
# In an uninstalled source checkout they sit beside this package: let the same names resolve there too.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "kernels", "stage.py")) and _checkout not in __path__:
    __path__.append(_checkout)

from .errors import (BatchTooLargeError, CaptureError, GraphPoolError, InputDeviceError, InputDtypeError,
                     InputRowsError, InputShapeError, MissingInputError, NotCapturedError, UnknownModeError)
from .modes import GraphKey, Mode, StepInput
from .policy import SpeculationPolicy
from .pool import GraphPool, Step, StepBatch
from .stats import KeyStats, PoolStats

__all__ = [
    "GraphPool", "Mode", "StepInput", "StepBatch", "Step", "GraphKey", "SpeculationPolicy", "PoolStats",
    "KeyStats", "GraphPoolError", "UnknownModeError", "MissingInputError", "InputRowsError", "InputDtypeError",
    "InputDeviceError", "InputShapeError", "BatchTooLargeError", "NotCapturedError", "CaptureError",
]
__version__ = "0.1.0"

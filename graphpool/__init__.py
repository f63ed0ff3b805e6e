"""graphpool: CUDA graphs for several step shapes ("modes") over shared static buffers and one memory pool.

A speculative-decoding server needs target-verify steps (``num_draft_tokens`` tokens per sequence) and
plain decode steps (one token per sequence). :class:`GraphPool` captures a graph for every
(mode, batch size), all reading one set of static buffers and sharing one memory pool, and routes each
step to the graph of its own mode.
"""
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

"""graphpool: CUDA graphs for several step shapes ("modes") over shared static buffers and one memory pool.

A speculative-decoding server needs target-verify steps (``num_draft_tokens`` tokens per sequence) and
plain decode steps (one token per sequence). :class:`GraphPool` captures a graph for every
(mode, batch size), all reading one set of static buffers and sharing one memory pool, and routes each
step to the graph of its own mode.
"""
from ._layout import map_checkout_packages

map_checkout_packages()

from .agreement import RankDisagreementError  # noqa: E402
from .capture import CapturedGraph, StepBatch  # noqa: E402
from .errors import (BatchTooLargeError, CaptureError, ConcurrentUseError, DeviceFaultError,  # noqa: E402
                     GraphPoolError, IndexBoundsError, InputDeviceError, InputDtypeError, InputLayoutError,
                     InputRowsError, InputShapeError, InputTypeError, MissingInputError, NotCapturedError,
                     RingDesyncError, StaleStepError, StepOutputError, UnknownModeError)
from .acceptance import AcceptanceGate  # noqa: E402
from .modes import GraphKey, Mode, StepInput  # noqa: E402
from .policy import SpeculationPolicy  # noqa: E402
from .pool import GraphPool, Step  # noqa: E402
from .stats import KeyStats, PoolStats  # noqa: E402
from .tiers import Tier, TierSchedule  # noqa: E402

__all__ = [
    "GraphPool", "Mode", "StepInput", "StepBatch", "Step", "GraphKey", "CapturedGraph", "SpeculationPolicy",
    "AcceptanceGate", "Tier", "TierSchedule", "PoolStats", "KeyStats", "GraphPoolError", "UnknownModeError",
    "MissingInputError", "InputTypeError",
    "InputRowsError", "InputDtypeError", "InputDeviceError", "InputShapeError", "InputLayoutError",
    "IndexBoundsError", "BatchTooLargeError", "NotCapturedError", "CaptureError", "StepOutputError",
    "ConcurrentUseError", "StaleStepError", "RingDesyncError", "DeviceFaultError", "RankDisagreementError",
]
__version__ = "0.1.0"

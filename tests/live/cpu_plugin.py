"""What a real SGLang server on CPU needs to serve its target's DECODE and TARGET_VERIFY steps through graphpool's runner.

SGLang builds no decode graph runner on CPU (unless ``--enable-torch-compile``: its ``CPUGraphRunner``, which refuses
speculation), sends only DECODE steps to a graph runner there, and its CPU attention backend (intel_amx) has no
graph hooks. This module, loaded in every SGLang process as a general plugin (SGLang's ``sglang.srt.plugins``
entry point, declared in ``plugin/`` beside it), changes exactly that, test-side:

* in the scheduler processes: where SGLang would build no decode runner for a CPU target model, it builds the one its
  own ``_decode_cuda_graph_runner_cls`` names (0.5.16: its runner module's ``DecodeCudaGraphRunner``), which is
  graphpool's factory, installed by graphpool's launcher (a server started by SGLang's own launcher, the tests'
  oracle, keeps SGLang's eager CPU path), TARGET_VERIFY reaches the runner as DECODE does, and intel_amx gets the
  hooks a graph runner calls (state: none; metadata: its eager ``init_forward_metadata``; padded lengths: 1). The
  runner class that serves is graphpool's own.
* SGLang 0.5.17's intel_amx ``forward_extend`` hands its kernel the batch's ``seq_lens``, which in TARGET_VERIFY
  leave out the draft tokens (its own extend metadata adds them, and 0.5.23 passes those): a verify step then
  attends to a prefix ``num_draft_tokens`` short (and a padded row to a negative one). The plugin passes the
  metadata's lengths, as 0.5.23 does.
* in the scheduler processes, for the tests: SGLang's dummy weights (``--load-format dummy``) drawn from
  uniform(-0.25, 0.25) instead of its uniform(-1e-3, 1e-3), same seed per parameter. With SGLang's range the tiny
  model's logits differ by about a float32 ulp of their log-softmax, so greedy choices are near-ties that another
  batch shape's rounding can flip; with these the top two tokens stand well apart. Then the output head (``lm_head``)
  times :data:`LOGIT_SCALE`, a power of two: every logit scaled exactly, so every greedy token is the same, but the
  distribution is sharp (its top token near probability 1, where the random model's is near 1/vocab). A draft tree
  (topk > 1) ranks its candidates by their probability products, so only a sharp draft keeps its own greedy chain
  in the tree at every depth: then a STANDALONE draft (the target) accepts as deep as its tree reaches, at any topk.
  Every server of the tier (the oracle included) loads the same weights.
* in the scheduler processes, for the tests: every model forward is counted by model (target, draft) and forward
  mode into the JSON file ``GRAPHPOOL_LIVE_COUNTS`` names (what shows that a plain step does no draft work).
* on a GPU (``GRAPHPOOL_LIVE_DEVICE=cuda``), in the scheduler processes: SGLang's platform ops (norms, activation,
  rotary embedding) take their plain-torch paths. The GPU tier runs in float32, as the CPU tier does, because in
  bfloat16 a verify step's rounding differs from a decode step's and flips greedy tokens of the random model
  (SGLang's own speculation then differs from its plain decode; an H100 showed it, 2026-12-05), and sgl_kernel's
  fused norms take no float32. Every server of the tier, the oracle included, runs the same ops.
* in the launcher process: SGLang's argument resolution is told the CPU has AMX tiles, so it keeps ``intel_amx``
  (EAGLE's CPU draft backends exist for it only) instead of falling back to ``torch_native``. The server processes
  keep the true answer, so the layers take their plain-torch paths.
"""
from __future__ import annotations

import json
import logging
import multiprocessing
import os

log = logging.getLogger(__name__)


def install() -> None:
    """SGLang's plugin entry point (``load_plugins()``: the launcher, then each scheduler process)."""
    if multiprocessing.parent_process() is None:
        if os.environ.get("GRAPHPOOL_LIVE_DEVICE", "cpu") == "cpu":
            _keep_intel_amx()
    else:
        _serve_target_steps_with_graphpool()
        _plain_torch_ops_on_gpu()
        _decisive_dummy_weights()
        _count_forwards(os.environ.get("GRAPHPOOL_LIVE_COUNTS"))


def _keep_intel_amx() -> None:
    from sglang.srt import runtime_context

    if hasattr(runtime_context, "override_platform"):  # 0.5.23: the platform context answers the check
        runtime_context.override_platform(has_amx=True).install()
    else:  # 0.5.17: the resolution calls cpu_has_amx_support() by the name it imported
        from sglang.srt.arg_groups import overrides

        overrides.cpu_has_amx_support = lambda: True


def _decode_runner_class(model_runner):
    """What SGLang builds as the target's decode runner: its ``_decode_cuda_graph_runner_cls()`` (0.5.17+), else
    (0.5.16) the ``DecodeCudaGraphRunner`` its runner module holds at the time, as its own capture looks it up."""
    named = getattr(model_runner, "_decode_cuda_graph_runner_cls", None)
    if named is not None:
        return named()
    from sglang.srt.model_executor.runner import decode_cuda_graph_runner
    return decode_cuda_graph_runner.DecodeCudaGraphRunner


def _serve_target_steps_with_graphpool() -> None:
    import time

    import msgspec

    from sglang.srt import utils

    if not utils.is_cpu():  # a GPU server (GRAPHPOOL_LIVE_DEVICE=cuda) builds its graph runners itself
        return
    from sglang.srt.layers.attention.intel_amx_backend import IntelAMXAttnBackend
    from sglang.srt.model_executor import model_runner as model_runner_module
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.model_runner_components import cuda_graph_setup
    original = cuda_graph_setup.capture_decode_graph

    def capture_decode_graph(*, model_runner):
        from graphpool.integrations.sglang import patch

        capture = original(model_runner=model_runner)
        if capture.runner is not None or model_runner.device != "cpu" or model_runner.is_draft_worker \
                or not patch.installed():
            return capture
        started = time.perf_counter()
        runner = _decode_runner_class(model_runner)(model_runner)
        fields = {"runner": runner}
        if "capture_time" in capture.__struct_fields__:  # 0.5.17+ (0.5.16: runner and graph_mem_usage only)
            fields["capture_time"] = time.perf_counter() - started
        return msgspec.structs.replace(capture, **fields)

    cuda_graph_setup.capture_decode_graph = capture_decode_graph
    model_runner_module.capture_decode_graph = capture_decode_graph
    ForwardMode.is_cpu_graph = lambda self: self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)
    IntelAMXAttnBackend.init_cuda_graph_state = lambda self, max_bs, max_num_tokens: None
    IntelAMXAttnBackend.get_cuda_graph_seq_len_fill_value = lambda self: 1
    IntelAMXAttnBackend.init_forward_metadata_out_graph = lambda self, fb, in_capture=False: self.init_forward_metadata(fb)
    IntelAMXAttnBackend.init_forward_metadata_in_graph = lambda self, fb: None
    IntelAMXAttnBackend.forward_extend = _verify_with_draft_lengths(IntelAMXAttnBackend.forward_extend)
    log.info("graphpool live tier: CPU target steps served by the decode runner SGLang builds")


def _plain_torch_ops_on_gpu() -> None:
    from sglang.srt import utils

    if utils.is_cpu():
        return
    from sglang.srt.layers.utils import MultiPlatformOp

    original = MultiPlatformOp.dispatch_forward

    def dispatch_forward(self):
        has_native = type(self).forward_native is not MultiPlatformOp.forward_native
        return self.forward_native if has_native else original(self)

    MultiPlatformOp.dispatch_forward = dispatch_forward
    log.info("graphpool live tier: SGLang's platform ops on their plain-torch paths (float32 on the GPU)")


def _verify_with_draft_lengths(forward_extend):
    """``forward_extend`` seeing, in TARGET_VERIFY, the lengths with the draft tokens (its extend metadata's)."""
    import copy
    import functools

    @functools.wraps(forward_extend)
    def with_draft_lengths(self, q, k, v, layer, forward_batch, *args, **kwargs):
        if forward_batch.forward_mode.is_target_verify() and self.extend_metadata is not None:
            forward_batch = copy.copy(forward_batch)
            forward_batch.seq_lens = self.extend_metadata[0]
        return forward_extend(self, q, k, v, layer, forward_batch, *args, **kwargs)
    return with_draft_lengths


#: The range the tests' dummy weights are drawn from (see the module's docstring).
DUMMY_WEIGHT_RANGE = 0.25
#: The output head's factor (see the module's docstring): a power of two, so the logits scale exactly.
LOGIT_SCALE = 2.0 ** 10


def _decisive_dummy_weights() -> None:
    import functools

    import torch

    from sglang.srt.model_loader import loader

    original = getattr(loader.initialize_dummy_weights, "graphpool_original", loader.initialize_dummy_weights)

    @functools.wraps(original)
    def initialize_dummy_weights(model, *args, **kwargs):
        kwargs.update(low=-DUMMY_WEIGHT_RANGE, high=DUMMY_WEIGHT_RANGE)
        out = original(model, *args, **kwargs)
        head = getattr(getattr(model, "lm_head", None), "weight", None)
        if isinstance(head, torch.Tensor):
            with torch.no_grad():
                head.mul_(LOGIT_SCALE)
        return out

    initialize_dummy_weights.graphpool_original = original
    loader.initialize_dummy_weights = initialize_dummy_weights


def _count_forwards(path: "str | None") -> None:
    """Count every ``ModelRunner.forward`` by model and forward mode into the JSON file at ``path``."""
    if not path:
        return
    from sglang.srt.model_executor.model_runner import ModelRunner

    original, counts = ModelRunner.forward, {}

    def forward(self, forward_batch, *args, **kwargs):
        key = f"{'draft' if self.is_draft_worker else 'target'} {forward_batch.forward_mode.name}"
        counts[key] = counts.get(key, 0) + 1
        with open(path + ".tmp", "w") as out:
            json.dump(counts, out)
        os.replace(path + ".tmp", path)
        return original(self, forward_batch, *args, **kwargs)

    ModelRunner.forward = forward

"""MultiModeDecodeRunner: SGLang's ``DecodeCudaGraphRunner`` API (0.5.14+) over one :class:`~graphpool.GraphPool`.

From 0.5.14 SGLang builds decode graphs with ``sglang.srt.model_executor.runner.DecodeCudaGraphRunner``
(``can_run_graph`` / ``load_batch`` / ``execute``), still for ONE forward mode: with speculation on,
TARGET_VERIFY graphs of ``num_draft_tokens`` tokens per sequence, and any other step runs eagerly
(0.5.23's ``can_run_graph`` refuses a width it did not capture). This runner keeps TARGET_VERIFY **and**
plain DECODE graphs for every batch size over one set of static buffers and SGLang's global graph memory
pool, and routes each step by its own forward mode. Which graphs exist and how they are captured is
shared with the classic adapter (:mod:`.common`); this module is the runner-API glue:

* attention metadata through ``init_forward_metadata_out_graph(fb, in_capture)`` (outside the graph) and
  ``init_forward_metadata_in_graph(fb)`` (inside it), each step passing its OWN forward mode;
* spec v2's split use: ``can_run_graph`` + ``load_batch`` on the plan stream, ``mark_forward_metadata_ready``,
  then ``execute`` re-stages only the inputs the draft changed (``needs_forward_metadata_init()`` False);
* ``--cuda-graph-config`` decode backend ``full`` is served; ``breakable`` and ``tc_piecewise`` are
  refused with the reason (:mod:`.runner_api_support`).

.. warning:: graph outputs are views into graph memory, overwritten by the next replay (as in SGLang).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, Optional, Union

import torch

from graphpool import Step, StepBatch
from sglang.srt.layers.dp_attention import DpPaddingMode, set_dp_buffer_len, set_is_extend_in_batch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.model_executor import forward_batch_info
from sglang.srt.model_executor.forward_batch_info import (CaptureHiddenMode, ForwardBatch, ForwardMode,
                                                          PPProxyTensors)
from sglang.srt.model_executor.runner_utils import pool as sglang_pool
from sglang.srt.model_executor.runner_utils.capture_mode import model_capture_mode

from . import attn_hooks, common, tp
from .replay_log import ReplayLog
from .runner_api_support import (decode_batch_sizes, disable_padding, publish_read_done, read_done_point,
                                 refusal_reasons, server_hidden_mode, spec_settings)


log = logging.getLogger(__name__)

# Per-token tensor fields of the model's output a replay returns sliced; every other field of the captured
# output is kept as captured, as SGLang's execute keeps "extension fields" (``dataclasses.replace``).
_SLICED_OUTPUTS = tuple(name for name in ("next_token_logits", "hidden_states", "last_hidden_states")
                        if name in {f.name for f in dataclasses.fields(LogitsProcessorOutput)})


class MultiModeDecodeRunner:
    """Drop-in for SGLang's ``DecodeCudaGraphRunner`` (0.5.14+) holding graphs of several forward modes.

    Args:
        model_runner: SGLang's ``ModelRunner`` of the target model.
        attn_backend: the attention backend the graphs use (default ``model_runner.attn_backend``);
            SGLang's adaptive speculation passes one per step count.
        speculative_num_steps, speculative_num_draft_tokens: the speculation shape (default: the server's).
        record_nolora_graph: SGLang's LoRA variant switch; LoRA is not served, so True is refused.

    Raises:
        ValueError: the server uses a feature or decode graph backend this runner does not serve (the
            message names each and why); :func:`graphpool.integrations.sglang.install` hands such servers
            to SGLang's own runner.
        graphpool.CaptureError: a graph failed to capture.
    """

    #: GraphPool backend: "auto" replays CUDA graphs on CUDA and runs the eager twin elsewhere.
    pool_backend = "auto"

    def __init__(self, model_runner: Any, *, attn_backend: Any = None, speculative_num_steps: Optional[int] = None,
                 speculative_num_draft_tokens: Optional[int] = None, record_nolora_graph: bool = False):
        reasons = refusal_reasons(model_runner, record_nolora_graph)
        if reasons:
            raise ValueError(f"MultiModeDecodeRunner does not support {'; '.join(reasons)}. Run this server with "
                             f"SGLang's own DecodeCudaGraphRunner (graphpool's install() does so automatically)")
        self.model_runner = model_runner
        self.device = model_runner.device
        self.attn_backend = attn_backend or model_runner.attn_backend
        spec = model_runner.spec_algorithm
        settings = spec_settings(model_runner, speculative_num_steps, speculative_num_draft_tokens)
        self.speculative_num_steps, self.speculative_num_draft_tokens = settings.num_steps, settings.num_draft_tokens
        self.topk = settings.topk
        self.speculative = common.is_speculative(spec)
        self.disable_padding = disable_padding(model_runner)
        self.is_encoder_decoder = False
        self.enable_torch_compile = False
        self.compile_bs: list = []

        # SGLang's single capture mode ("primary"); DECODE graphs are captured besides it.
        self.capture_forward_mode = ForwardMode.TARGET_VERIFY if self.speculative else ForwardMode.DECODE
        self.tokens_per_mode = common.tokens_per_mode(self.speculative, self.speculative_num_draft_tokens)
        self.captured_req_width = self.num_tokens_per_bs = self.tokens_per_mode[self.capture_forward_mode]
        self.capture_hidden_modes = common.initial_hidden_modes(spec, server_hidden_mode(model_runner))

        self.capture_bs = decode_batch_sizes(model_runner, self.captured_req_width)
        self.max_bs = max(self.capture_bs)
        self.max_num_token = self.max_bs * max(self.tokens_per_mode.values())
        # Once, sized for the largest mode: backends reallocate buffers that captured graphs point at.
        self.attn_backend.init_cuda_graph_state(self.max_bs, self.max_num_token)
        self.seq_len_fill_value = self.attn_backend.get_cuda_graph_seq_len_fill_value()

        self.pool = common.build_pool(
            self.tokens_per_mode, common.step_inputs(self.seq_len_fill_value, torch.int64), self.capture_bs,
            self.device, self.pool_backend, common.graph_memory_pool(
                self.device, sglang_pool.get_global_graph_memory_pool, sglang_pool.set_global_graph_memory_pool))
        # Inputs the pool does not route: the CPU copy of seq_lens for attention planning, the dummy tree
        # mask verify graphs are captured with, and the non-padded token count some models read.
        self.seq_lens_cpu = torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int64)
        self.custom_mask = torch.ones((self.max_bs * self.seq_len_fill_value + self.max_num_token)
                                      * self.captured_req_width, dtype=torch.bool, device=self.device)
        self.num_token_non_padded = torch.zeros((1,), dtype=torch.int32, device=self.device)
        self.logits_buffer = shared_logits_buffer(model_runner, self.max_num_token)
        if self.logits_buffer is None:
            self.logits_buffer = common.logits_buffer(model_runner, self.max_num_token, self.device)
        #: SGLang's graph backend slot: elastic EP's recapture calls ``backend.cleanup()`` before rebuilding.
        self.backend = _PoolBackend(self)

        #: Eager fallbacks by reason (``can_run_graph`` refusals of a mode with graphs), and replays by mode,
        #: both in one periodic log line.
        self.refusals: Dict[str, int] = {}
        self.replay_log = ReplayLog(self.refusals)
        self.tp_check = tp.LazyAgreement(enabled=self.pool.debug)  # debug under TP > 1: ranks replay alike
        self.graphs: Dict[common.GraphId, Any] = {}
        self.output_buffers: Dict[common.GraphId, Any] = {}
        self._captured_outputs: Dict[common.GraphId, LogitsProcessorOutput] = {}  # non-tensor fields, as captured
        self.bs = self.raw_bs = self.raw_num_token = 0
        self.forward_mode = self.capture_forward_mode  # mode of the last loaded step
        self._step: Optional[Step] = None  # the step load_batch staged, for execute
        self._capture_batches: Dict[common.GraphId, ForwardBatch] = {}
        self._capturing = False
        self.capture()

    # ----------------------------------------------------------------------------------- set-up
    @property
    def capture_hidden_mode(self) -> CaptureHiddenMode:
        """Hidden-state capture mode of the primary mode (SGLang's single runner-wide value)."""
        return self.capture_hidden_modes[self.capture_forward_mode]

    @classmethod
    def decode_graph_gather_requirements(cls, model_runner: Any) -> tuple:
        """(mlp_tp_gather, attn_tp_gather) of SGLang's runner (0.5.2x asks the class): none, since this
        runner is refused wherever SGLang's ``require_gathered_buffer()`` holds (DP attention, an MoE
        all-to-all backend, ``--moe-dense-tp-size``: :func:`~.support.unsupported_reasons`). install()'s
        factory answers this question with SGLang's class anyway, as it may build SGLang's runner."""
        return (False, False)

    def capture(self) -> None:
        """Capture every (forward mode, batch size), largest token count first, into the shared pool."""
        common.capture_graphs(self)

    def _capture_context(self) -> Any:
        from sglang.srt.distributed.device_communicators.pynccl_allocator import set_graph_pool_id

        return common.capture_context(self.device, self.pool.memory_pool, set_graph_pool_id, model_capture_mode)

    def _prepare_capture(self, batch: StepBatch, real_bs: int) -> None:
        """Pool hook, outside the graph. At capture: build the key's ForwardBatch and plan its attention
        (first call), then the backend's post-warm-up hook (second call). At replay: nothing, because
        :meth:`load_batch` plans attention itself (spec v2 calls it apart from :meth:`execute`)."""
        if not self._capturing:
            return
        mode = common.forward_mode_of(batch)
        graph_id = (mode, batch.bs)
        if graph_id in self._capture_batches:
            getattr(self.attn_backend, "on_after_cuda_graph_warmup", lambda: None)()
            return
        self.num_token_non_padded.fill_(batch.num_tokens)
        spec_info = self._capture_spec_info(batch.num_tokens) if mode == ForwardMode.TARGET_VERIFY else None
        hidden = self.capture_hidden_modes[mode]
        if spec_info is not None and spec_info.capture_hidden_mode > hidden:
            hidden = self.capture_hidden_modes[mode] = spec_info.capture_hidden_mode
        fb = common.capture_forward_batch(
            self.model_runner, self.attn_backend, batch, seq_lens_cpu=self.seq_lens_cpu, spec_info=spec_info,
            capture_hidden_mode=hidden, num_token_non_padded=self._masked_token_count(), logits=self.logits_buffer,
            dp_padding_mode=DpPaddingMode.get_default_mode_in_cuda_graph(), can_run_decode_cuda_graph=True)
        self.attn_backend.init_forward_metadata_out_graph(fb, in_capture=True)
        self._capture_batches[graph_id] = fb

    def _masked_token_count(self) -> Optional[torch.Tensor]:
        """The non-padded token count graphs read where SGLang's do (expert parallelism, DP gather, custom
        all-to-all MoE: its MoE layers mask padded rows); ``None`` elsewhere, as SGLang captures."""
        try:
            masked = forward_batch_info.enable_num_token_non_padded()
        except (AssertionError, AttributeError, RuntimeError):  # no parallel state: a single-process tool
            masked = False
        return self.num_token_non_padded if masked else None

    def _capture_spec_info(self, num_tokens: int) -> Any:
        info = common.verify_capture_input(self.model_runner, self.custom_mask, num_steps=self.speculative_num_steps,
                                           num_draft_tokens=self.speculative_num_draft_tokens, topk=self.topk)
        mc = self.model_runner.model_config  # MTP models read spec_info.hidden_states in the forward
        info.hidden_states = torch.zeros((num_tokens, mc.hidden_size), dtype=mc.dtype, device=self.device)
        return info

    #: What :meth:`_run_model` returns, each with one row per token (the pool's output rule).
    output_names = _SLICED_OUTPUTS

    def _run_model(self, batch: StepBatch) -> Dict[str, Optional[torch.Tensor]]:
        """The pool's step function: in-graph attention metadata, then the model on the key's ForwardBatch."""
        graph_id = (common.forward_mode_of(batch), batch.bs)
        fb = self._capture_batches[graph_id]
        with attn_hooks.forward_context_for(self.attn_backend, fb):
            self.attn_backend.init_forward_metadata_in_graph(fb)
            set_dp_buffer_len(None, batch.num_tokens, fb.dp_padding_mode.is_max_len())
            set_is_extend_in_batch(False)
            out = self.model_runner.model.forward(fb.input_ids, fb.positions, fb)
        result = {name: getattr(out, name) for name in _SLICED_OUTPUTS}
        if self._capturing:
            self.output_buffers[graph_id] = result  # the last call of a key at capture is the captured one
            self._captured_outputs[graph_id] = out
        return result

    # ----------------------------------------------------------------------------------- steps
    def can_run_graph(self, forward_batch: ForwardBatch) -> bool:
        """Whether a graph serves this batch: its forward mode, size, token count and hidden mode. A ``False``
        makes SGLang run the step eagerly; each is counted by reason (:attr:`refusals`, in the periodic
        ``graphpool replays by mode: ...; eager fallbacks: ...`` log line)."""
        reason = self._refusal(forward_batch)
        if reason is None:
            return True
        if forward_batch.forward_mode in self.tokens_per_mode:  # a step of a mode with graphs ran eagerly
            self.replay_log.refused(forward_batch, reason)
        return False

    def _refusal(self, forward_batch: ForwardBatch) -> Optional[str]:
        """Why no graph serves ``forward_batch`` (None: one does)."""
        mode, bs = forward_batch.forward_mode, forward_batch.batch_size
        tokens = self.tokens_per_mode.get(mode)
        name = getattr(mode, "name", mode)
        if tokens is None:
            return f"no {name} graphs"
        if forward_batch.replace_embeds is not None:
            return f"{name} with replaced embeddings"
        if bs < 1 or not (bs in self.capture_bs if self.disable_padding else bs <= self.max_bs):
            return f"{name} bs {bs} not captured" if self.disable_padding else f"{name} bs {bs} > {self.max_bs}"
        # The check a single-mode runner lacks: a step carries exactly bs x tokens_per_seq tokens of its mode.
        if forward_batch.input_ids is None or forward_batch.input_ids.shape[0] != bs * tokens:
            got = None if forward_batch.input_ids is None else forward_batch.input_ids.shape[0]
            return f"{name} with {got} tokens for {bs} x {tokens}"
        requested = common.requested_hidden_mode(forward_batch)
        if not common.hidden_mode_served(requested, self.capture_hidden_modes[mode]):
            return f"{name} asking hidden states {requested.name}"
        return None

    def load_batch(self, forward_batch: ForwardBatch, pp_proxy_tensors: Optional[PPProxyTensors] = None) -> None:
        """Stage the batch into its mode's static buffers and plan attention; sets ``bs``, ``raw_bs``,
        ``raw_num_token``. A batch already loaded (``needs_forward_metadata_init()`` False: spec v2 loaded
        it on the plan stream) only has its inputs staged again, since the draft changed them."""
        if not attn_hooks.needs_metadata(forward_batch) and self._step is not None:
            self._step = self._stage(forward_batch)
            return
        step = self._stage(forward_batch)
        mode, bs, raw_bs = forward_batch.forward_mode, step.batch.bs, forward_batch.batch_size
        if forward_batch.seq_lens_cpu is not None:
            self.seq_lens_cpu[raw_bs:bs].fill_(self.seq_len_fill_value)
            self.seq_lens_cpu[:raw_bs].copy_(forward_batch.seq_lens_cpu)
        if forward_batch.num_token_non_padded is not None:  # read by MoE models under expert parallelism
            self.num_token_non_padded.copy_(forward_batch.num_token_non_padded)
        self.attn_backend.init_forward_metadata_out_graph(
            attn_hooks.replay_view(forward_batch, step, self.seq_lens_cpu, self.seq_len_fill_value))
        self.forward_mode, self.bs, self.raw_bs = mode, bs, raw_bs
        self.raw_num_token = raw_bs * self.tokens_per_mode[mode]
        self._step = step

    def execute(self, forward_batch: ForwardBatch,
                pp_proxy_tensors: Optional[PPProxyTensors] = None) -> Union[LogitsProcessorOutput, PPProxyTensors]:
        """Load (or re-stage) the batch and replay the graph of its own forward mode; outputs sliced to
        the real tokens."""
        self.load_batch(forward_batch, pp_proxy_tensors)
        step = self._step
        self.tp_check.check(step.mode.name, step.batch.bs, step.real_bs)
        read_done = read_done_point(self.attn_backend, forward_batch.forward_mode)
        if read_done == "pre":
            publish_read_done(self.model_runner)
        out = self.pool.replay(step)
        if read_done == "post":
            publish_read_done(self.model_runner)
        self.replay_log.count(forward_batch.forward_mode)
        return dataclasses.replace(self._captured_outputs[(forward_batch.forward_mode, step.batch.bs)], **out)

    def _stage(self, forward_batch: ForwardBatch) -> Step:
        return self.pool.stage(
            common.pool_mode(forward_batch.forward_mode, self.tokens_per_mode), input_ids=forward_batch.input_ids,
            positions=forward_batch.positions, out_cache_loc=forward_batch.out_cache_loc.to(torch.int64),
            seq_lens=forward_batch.seq_lens.to(torch.int64), req_pool_indices=forward_batch.req_pool_indices)

    def get_spec_info(self, num_tokens: int) -> Any:
        """The verify input the primary mode's graphs are captured with (SGLang's method name)."""
        return self._capture_spec_info(num_tokens) if self.speculative else None



def shared_logits_buffer(model_runner: Any, rows: int) -> Optional[torch.Tensor]:
    """SGLang's process-wide graph logits buffer (``model_runner.graph_shared_output``, 0.5.17+), ``rows``
    long, which every one of SGLang's graph runners of a vocabulary writes into (its adaptive speculation's
    runners too); ``None`` where this SGLang has none or it is shorter than ``rows``."""
    shared = getattr(model_runner, "graph_shared_output", None)
    vocab = getattr(getattr(model_runner, "model_config", None), "vocab_size", None)
    if shared is None or not vocab or rows > getattr(shared, "max_rows", 0):
        return None
    return shared.get_logits_buffer(vocab, rows=rows)


class _PoolBackend:
    """What SGLang asks of a decode runner's ``backend`` outside the runner: ``cleanup()`` (elastic EP drops
    the graphs before it recaptures)."""

    def __init__(self, runner: MultiModeDecodeRunner):
        self._runner = runner

    def cleanup(self) -> None:
        """Release every graph and the pool's buffers; the runner serves no more steps (SGLang builds a new one)."""
        runner = self._runner
        runner.pool.close()
        runner.graphs.clear()
        runner.output_buffers.clear()
        runner._captured_outputs.clear()
        runner._capture_batches.clear()
        runner._step = None

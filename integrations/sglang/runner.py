"""MultiModeCudaGraphRunner: SGLang's ``CudaGraphRunner`` API over one :class:`~graphpool.GraphPool`.

SGLang's runner captures graphs for one forward mode. With speculation on that mode is TARGET_VERIFY,
and a plain DECODE step of ``bs`` sequences is routed into a graph that expects ``bs *
num_draft_tokens`` tokens: "The size of tensor a (160) must match the size of tensor b (2)". This runner
captures a graph for every (forward mode, batch size) over one set of static buffers and SGLang's
global graph memory pool, and routes each step by its own forward mode:

* speculation on: TARGET_VERIFY graphs (``num_draft_tokens`` tokens per sequence) AND plain DECODE
  graphs (one token per sequence, ``spec_info=None``);
* speculation off: DECODE graphs only, like SGLang.

The attention backend's graph state is initialised once, sized for the largest mode, and receives the
batch's own forward mode at capture and at replay. The hidden-state capture mode is kept per forward
mode and fixed at construction: nothing is recaptured on the step path. The split use of EAGLE v2
(``can_run``, ``replay_prepare``, ``.bs``, ``replay(...,
skip_attn_backend_init=True)``, or from 0.5.13 a batch marked ``mark_forward_metadata_ready()``) keeps
working. SGLang 0.5.13 keeps this class API but plans attention through the out-of-graph / in-graph hooks
and the forward context; :mod:`.attn_hooks` (shared with :mod:`.runner_api`) drives those there.

.. warning:: graph outputs are views into graph memory, overwritten by the next replay (as in SGLang).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, Optional, Union

import torch

from graphpool import GraphPool, Mode, Step, StepBatch
from sglang.srt.layers.dp_attention import DpPaddingMode, set_dp_buffer_len, set_is_extend_in_batch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.model_executor import cuda_graph_runner as sglang_runner
from sglang.srt.model_executor.forward_batch_info import (CaptureHiddenMode, ForwardBatch, ForwardMode,
                                                          PPProxyTensors)

from . import attn_hooks, common, tp
from .common import MODE_NAMES, GraphId
from .replay_log import ReplayLog
from .support import capture_batch_sizes, unsupported_reasons

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

log = logging.getLogger(__name__)


class MultiModeCudaGraphRunner:
    """Drop-in for SGLang's ``CudaGraphRunner`` that holds graphs for several forward modes.

    Args:
        model_runner: SGLang's ``ModelRunner`` (or an object with the same attributes).
        attn_backend: the attention backend the graphs use (default: ``model_runner.attn_backend``).
        speculative_num_steps: override of ``server_args.speculative_num_steps`` (SGLang 0.5.11+).
        speculative_num_draft_tokens: override of ``server_args.speculative_num_draft_tokens``.

    Raises:
        ValueError: the server uses a feature this runner does not stage (the message lists them);
            :func:`graphpool.integrations.sglang.install` hands such servers to SGLang's runner.
        graphpool.CaptureError: a graph failed to capture.
    """

    #: GraphPool backend: "auto" replays CUDA graphs on CUDA and runs the eager twin elsewhere.
    pool_backend = "auto"

    def __init__(self, model_runner: "ModelRunner", *, attn_backend: Any = None,
                 speculative_num_steps: Optional[int] = None, speculative_num_draft_tokens: Optional[int] = None):
        reasons = unsupported_reasons(model_runner)
        if reasons:
            raise ValueError(f"MultiModeCudaGraphRunner does not support {', '.join(reasons)}; run this server "
                             f"with SGLang's own CudaGraphRunner (graphpool's install() does so automatically)")
        self.model_runner = model_runner
        self.device = model_runner.device
        server_args = model_runner.server_args
        self.attn_backend = attn_backend or model_runner.attn_backend
        self.speculative_num_steps = (server_args.speculative_num_steps if speculative_num_steps is None
                                      else speculative_num_steps)
        self.speculative_num_draft_tokens = (server_args.speculative_num_draft_tokens
                                             if speculative_num_draft_tokens is None else speculative_num_draft_tokens)
        self.speculative_algorithm = server_args.speculative_algorithm
        self.enable_torch_compile = False
        self.disable_padding = bool(getattr(server_args, "disable_cuda_graph_padding", False))
        self.is_encoder_decoder = False

        spec = model_runner.spec_algorithm
        self.speculative = common.is_speculative(spec)
        # The "primary" mode is SGLang's single capture mode; DECODE is always captured besides it.
        self.capture_forward_mode = ForwardMode.TARGET_VERIFY if self.speculative else ForwardMode.DECODE
        self.num_tokens_per_bs = self.speculative_num_draft_tokens if self.speculative else 1
        self.tokens_per_mode: Dict[ForwardMode, int] = {ForwardMode.DECODE: 1}
        if self.speculative:
            self.tokens_per_mode[ForwardMode.TARGET_VERIFY] = self.speculative_num_draft_tokens
        self.capture_hidden_modes = self._initial_hidden_modes(spec, server_args)

        self.capture_bs = capture_batch_sizes(model_runner)
        self.compile_bs: list = []
        self.max_bs = max(self.capture_bs)
        self.max_num_token = self.max_bs * max(self.tokens_per_mode.values())
        # Once, sized for the largest mode: backends reallocate buffers that captured graphs point at.
        self.attn_backend.init_cuda_graph_state(self.max_bs, self.max_num_token)
        self.seq_len_fill_value = self.attn_backend.get_cuda_graph_seq_len_fill_value()

        self.pool = GraphPool(
            [Mode(MODE_NAMES[m], n) for m, n in self.tokens_per_mode.items()],
            self._step_inputs(), self.capture_bs, device=self.device, backend=self.pool_backend,
            on_miss="raise", memory_pool=self._shared_memory_pool())
        # Inputs the pool does not route: a CPU copy of seq_lens for attention planning, the dummy tree
        # mask verify graphs are captured with, and the non-padded token count some models read.
        self.seq_lens_cpu = torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int32)
        self.custom_mask = torch.ones((self.max_bs * self.seq_len_fill_value + self.max_num_token)
                                      * self.num_tokens_per_bs, dtype=torch.bool, device=self.device)
        self.num_token_non_padded = torch.zeros((1,), dtype=torch.int32, device=self.device)
        self.logits_buffer = common.logits_buffer(model_runner, self.max_num_token, self.device)
        self._seq_lens_int32 = torch.zeros((self.max_bs,), dtype=torch.int32, device=self.device)
        #: Eager fallbacks by reason (``can_run`` refusals), and replays by forward mode, both logged.
        self.refusals: Dict[str, int] = {}
        self.replay_log = ReplayLog(self.refusals)
        self.tp_check = tp.LazyAgreement(enabled=self.pool.debug)  # debug under TP > 1: ranks replay alike

        self.graphs: Dict[GraphId, Any] = {}
        self.output_buffers: Dict[GraphId, Any] = {}
        self.bs = self.raw_bs = self.raw_num_token = 0
        self.forward_mode = self.capture_forward_mode  # mode of the last prepared step
        self._capture_batches: Dict[GraphId, ForwardBatch] = {}
        self._capturing = False
        self.capture()

    # ----------------------------------------------------------------------------------- set-up
    @staticmethod
    def _initial_hidden_modes(spec: Any, server_args: Any) -> Dict[ForwardMode, CaptureHiddenMode]:
        server_mode = CaptureHiddenMode.FULL if server_args.enable_return_hidden_states else CaptureHiddenMode.NULL
        return common.initial_hidden_modes(spec, server_mode)

    def _step_inputs(self) -> list:
        return common.step_inputs(self.seq_len_fill_value, torch.int32)  # int32 seq_lens, as DecodeInputBuffers

    def _shared_memory_pool(self) -> Any:
        """SGLang's global graph memory pool, shared with the EAGLE draft runners (which call SGLang's
        ``CudaGraphRunner.capture`` unbound)."""
        return common.graph_memory_pool(self.device, sglang_runner.get_global_graph_memory_pool,
                                        sglang_runner.set_global_graph_memory_pool)

    @property
    def capture_hidden_mode(self) -> CaptureHiddenMode:
        """Hidden-state capture mode of the primary mode (SGLang's single runner-wide value)."""
        return self.capture_hidden_modes[self.capture_forward_mode]

    @capture_hidden_mode.setter
    def capture_hidden_mode(self, value: CaptureHiddenMode) -> None:
        self.capture_hidden_modes[self.capture_forward_mode] = value

    # ----------------------------------------------------------------------------------- capture
    def capture(self) -> None:
        """Capture every (forward mode, batch size), largest token count first, into the shared pool."""
        common.capture_graphs(self)

    def _capture_context(self) -> Any:
        return common.capture_context(self.device, self.pool.memory_pool, sglang_runner.set_graph_pool_id,
                                      sglang_runner.model_capture_mode)

    def _prepare_capture(self, batch: StepBatch, real_bs: int) -> None:
        """Pool hook, run outside the graph. At capture: build the key's ForwardBatch and attention
        metadata (first call), then the backend's post-warm-up hook (second call). At replay: nothing,
        because :meth:`replay_prepare` plans attention itself (EAGLE v2 calls it apart from replay)."""
        if not self._capturing:
            return
        forward_mode = ForwardMode[batch.mode.name.upper()]
        graph_id = (forward_mode, batch.bs)
        if graph_id in self._capture_batches:
            after_warmup = getattr(self.attn_backend, "on_after_cuda_graph_warmup", None)  # SGLang 0.5.12+
            if after_warmup is not None:
                after_warmup()
            return
        fb = self._capture_batch(forward_mode, batch)
        if attn_hooks.NEW_HOOKS:  # SGLang 0.5.13: the out-of-graph hook, in the forward context, as its runner
            with attn_hooks.forward_context_for(self.attn_backend, fb):
                self.attn_backend.init_forward_metadata_out_graph(fb, in_capture=True)
        else:
            self.attn_backend.init_forward_metadata_capture_cuda_graph(
                batch.bs, batch.num_tokens, fb.req_pool_indices, fb.seq_lens, None, forward_mode, fb.spec_info)
        self._capture_batches[graph_id] = fb

    def _capture_batch(self, forward_mode: ForwardMode, batch: StepBatch) -> ForwardBatch:
        self.num_token_non_padded.fill_(batch.num_tokens)
        spec_info = self._capture_spec_info() if forward_mode == ForwardMode.TARGET_VERIFY else None
        hidden = self.capture_hidden_modes[forward_mode]
        if spec_info is not None and spec_info.capture_hidden_mode > hidden:
            hidden = self.capture_hidden_modes[forward_mode] = spec_info.capture_hidden_mode
        return common.capture_forward_batch(
            self.model_runner, self.attn_backend, batch, seq_lens_cpu=self.seq_lens_cpu, spec_info=spec_info,
            capture_hidden_mode=hidden, num_token_non_padded=self.num_token_non_padded, logits=self.logits_buffer,
            dp_padding_mode=DpPaddingMode.get_default_mode_in_cuda_graph())

    def _capture_spec_info(self) -> Any:
        """The verify input TARGET_VERIFY graphs are captured with (no draft yet; static tree mask)."""
        return common.verify_capture_input(
            self.model_runner, self.custom_mask, num_steps=self.speculative_num_steps,
            num_draft_tokens=self.speculative_num_draft_tokens,
            topk=self.model_runner.server_args.speculative_eagle_topk)

    #: What :meth:`_run_model` returns, each with one row per token (the pool's output rule).
    output_names = ("next_token_logits", "hidden_states")

    def _run_model(self, batch: StepBatch) -> Dict[str, Optional[torch.Tensor]]:
        """The pool's step function: the model's forward on the key's static ForwardBatch."""
        graph_id = (ForwardMode[batch.mode.name.upper()], batch.bs)
        fb = self._capture_batches[graph_id]
        with attn_hooks.forward_context_for(self.attn_backend, fb):  # a no-op before SGLang 0.5.13
            if attn_hooks.NEW_HOOKS:
                self.attn_backend.init_forward_metadata_in_graph(fb)
            set_dp_buffer_len(None, batch.num_tokens, fb.dp_padding_mode.is_max_len())
            set_is_extend_in_batch(False)
            out = self.model_runner.model.forward(fb.input_ids, fb.positions, fb)
        result = {"next_token_logits": out.next_token_logits, "hidden_states": out.hidden_states}
        if self._capturing:
            self.output_buffers[graph_id] = result  # the last call of a key at capture is the captured one
        return result

    # ----------------------------------------------------------------------------------- steps
    def can_run(self, forward_batch: ForwardBatch) -> bool:
        """Whether a graph serves this batch: its forward mode, size, token count and hidden mode.

        The pool routes (``pool.route``: the smallest captured batch size >= the batch's); this adds what
        only SGLang's batch tells: one token per sequence of the mode, and hidden states the mode's graphs
        return. A ``False`` makes SGLang run the step eagerly, as its own runner does for a hidden mode it
        did not capture; every refusal is counted by reason (:attr:`refusals`).
        """
        name = MODE_NAMES.get(forward_batch.forward_mode)
        if name is None or forward_batch.forward_mode not in self.tokens_per_mode:  # EXTEND, IDLE, or TARGET_VERIFY
            return False  # without speculation: SGLang never asks for those, but a caller may
        reason = self._refusal(name, forward_batch)
        if reason is not None:
            self.replay_log.refused(forward_batch, reason)
            return False
        return True

    def _refusal(self, name: str, forward_batch: ForwardBatch) -> Optional[str]:
        """Why no graph serves the batch, ``None`` when one does."""
        bs = forward_batch.batch_size
        padded = self.pool.route(name, bs)
        if padded is None:
            return f"{name} bs {bs} > {self.max_bs}"
        if self.disable_padding and padded != bs:
            return f"{name} bs {bs} not captured (padding disabled)"
        if getattr(forward_batch, "replace_embeds", None) is not None:  # a ForwardBatch field from 0.5.11
            return "replace_embeds"
        if forward_batch.input_ids is None:  # input_embeds only: the graphs read token ids
            return f"{name} without input_ids"
        # The check SGLang lacks: a step carries exactly bs x tokens_per_seq tokens of its own mode.
        if forward_batch.input_ids.shape[0] != bs * self.pool.modes[name].tokens_per_seq:
            return f"{name} with {forward_batch.input_ids.shape[0]} tokens for bs {bs}"
        requested = _requested_hidden_mode(forward_batch)
        captured = self.capture_hidden_modes[forward_batch.forward_mode]
        if requested != CaptureHiddenMode.NULL and requested != captured:
            return f"{name} asks hidden states {requested.name}, captured {captured.name}"
        return None

    def replay_prepare(self, forward_batch: ForwardBatch, pp_proxy_tensors: Optional[PPProxyTensors] = None) -> Step:
        """Stage the batch into its mode's static buffers and plan attention; sets ``bs``, ``raw_bs``,
        ``raw_num_token``. Returns the staged step (SGLang ignores the return value).

        Never recaptures: hidden-state modes are fixed at construction, and :meth:`can_run` sends a batch
        that needs another one to SGLang's eager path.
        """
        step = self._stage(forward_batch)
        mode, bs, raw_bs = forward_batch.forward_mode, step.batch.bs, forward_batch.batch_size
        if forward_batch.seq_lens_cpu is not None:
            self.seq_lens_cpu[raw_bs:bs].fill_(self.seq_len_fill_value)
            self.seq_lens_cpu[:raw_bs].copy_(forward_batch.seq_lens_cpu)
        if forward_batch.num_token_non_padded is not None:  # read by MoE models under expert parallelism
            self.num_token_non_padded.copy_(forward_batch.num_token_non_padded)
        # A DECODE step with a spec_info is a draft decode to FlashInfer/FA3: plain decode passes None.
        spec_info = forward_batch.spec_info if mode == ForwardMode.TARGET_VERIFY else None
        if attn_hooks.NEW_HOOKS:  # SGLang 0.5.13: the out-of-graph hook on a padded view (as runner_api's)
            self.attn_backend.init_forward_metadata_out_graph(
                attn_hooks.replay_view(forward_batch, step, self.seq_lens_cpu, self.seq_len_fill_value))
        else:
            # SGLang 0.5.12 hands the batch to backends that plan from it (DeepSeek-V4's) out of band, as here.
            self.attn_backend._replay_forward_batch = forward_batch
            self.attn_backend.init_forward_metadata_replay_cuda_graph(
                bs, step.batch.inputs["req_pool_indices"], step.batch.inputs["seq_lens"],
                forward_batch.seq_lens_sum + (bs - raw_bs) * self.seq_len_fill_value, None, mode, spec_info,
                seq_lens_cpu=self.seq_lens_cpu[:bs])
            self.attn_backend._replay_forward_batch = None
        self.forward_mode, self.bs, self.raw_bs = mode, bs, raw_bs
        self.raw_num_token = raw_bs * self.tokens_per_mode[mode]
        return step

    if attn_hooks.NEW_HOOKS:
        def replay(self, forward_batch: ForwardBatch, pp_proxy_tensors: Optional[PPProxyTensors] = None, *,
                   skip_attn_backend_init: Optional[bool] = None) -> Union[LogitsProcessorOutput, PPProxyTensors]:
            """SGLang 0.5.13's signature: a batch whose ``needs_forward_metadata_init()`` is False was planned
            by :meth:`replay_prepare` already (EAGLE v2); ``skip_attn_backend_init`` overrides the marker."""
            if skip_attn_backend_init is None:
                skip_attn_backend_init = not attn_hooks.needs_metadata(forward_batch)
            return self._replay(forward_batch, skip_attn_backend_init)
    else:
        def replay(self, forward_batch: ForwardBatch, skip_attn_backend_init: bool = False,
                   pp_proxy_tensors: Optional[PPProxyTensors] = None) -> Union[LogitsProcessorOutput, PPProxyTensors]:
            """SGLang 0.5.9 to 0.5.12's signature (see :meth:`_replay`)."""
            return self._replay(forward_batch, skip_attn_backend_init)

    def _replay(self, forward_batch: ForwardBatch, skip_attn_backend_init: bool) -> LogitsProcessorOutput:
        """Replay the graph of the batch's own forward mode; outputs sliced to the real tokens.

        With ``skip_attn_backend_init`` the caller already ran :meth:`replay_prepare` (EAGLE v2) and
        only the inputs are staged again, since the draft changed ``input_ids`` and ``positions``.
        """
        step = self._stage(forward_batch) if skip_attn_backend_init else self.replay_prepare(forward_batch)
        self.tp_check.check(step.mode.name, step.batch.bs, step.real_bs)
        out = self.pool.replay(step)
        self.replay_log.count(forward_batch.forward_mode)
        return LogitsProcessorOutput(next_token_logits=out["next_token_logits"], hidden_states=out["hidden_states"])

    def _stage(self, forward_batch: ForwardBatch) -> Step:
        return self.pool.stage(
            common.pool_mode(forward_batch.forward_mode, self.tokens_per_mode), input_ids=forward_batch.input_ids,
            positions=forward_batch.positions, out_cache_loc=forward_batch.out_cache_loc,
            seq_lens=self._int32_seq_lens(forward_batch), req_pool_indices=forward_batch.req_pool_indices)

    def _int32_seq_lens(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """``seq_lens`` as int32, the dtype of SGLang's graph buffers and what its attention backends read
        in graphs. The scheduler's are int64: converted into a buffer allocated once, not a new tensor."""
        seq_lens = forward_batch.seq_lens
        if seq_lens.dtype == torch.int32:
            return seq_lens
        if seq_lens.shape[0] > self.max_bs:  # no graph serves it: the pool raises BatchTooLargeError naming the size
            return seq_lens.to(torch.int32)
        staged = self._seq_lens_int32[:seq_lens.shape[0]]
        staged.copy_(seq_lens)
        return staged

    def get_spec_info(self, num_tokens: int) -> Any:
        """The verify input graphs of the primary mode are captured with (SGLang's method name)."""
        return self._capture_spec_info() if self.speculative else None


_requested_hidden_mode = common.requested_hidden_mode

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

The graphs live in a :class:`~.target_graphs.TargetGraphs`, which the runners SGLang builds per speculation tier
share (the factory of :mod:`.patch_runner_api` hands each the target model's one pool): each runner is then a view,
DECODE steps on the shared DECODE graphs, TARGET_VERIFY steps on its own tier's.

.. warning:: graph outputs are views into graph memory, overwritten by the next replay (as in SGLang).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, Optional, Union

import torch

from graphpool import Step
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode, PPProxyTensors

from . import attn_hooks, common
from .runner_api_support import (decode_batch_sizes, disable_padding, publish_read_done, read_done_point,
                                 refusal_reasons, spec_settings)
from .target_graphs import DECODE, SLICED_OUTPUTS, TargetGraphs, VerifyTier, shared_logits_buffer

log = logging.getLogger(__name__)

__all__ = ["MultiModeDecodeRunner", "shared_logits_buffer"]


class MultiModeDecodeRunner:
    """Drop-in for SGLang's ``DecodeCudaGraphRunner`` (0.5.14+) holding graphs of several forward modes.

    Args:
        model_runner: SGLang's ``ModelRunner`` of the target model.
        attn_backend: the attention backend the graphs use (default ``model_runner.attn_backend``);
            SGLang's adaptive speculation passes one per step count.
        speculative_num_steps, speculative_num_draft_tokens: the speculation shape (default: the server's).
        record_nolora_graph: SGLang's LoRA variant switch; LoRA is not served, so True is refused.
        graphs: the target model's shared pool (:class:`~.target_graphs.TargetGraphs`) this runner is a view of:
            its DECODE graphs are captured once, by the first runner, and this runner's tier's TARGET_VERIFY graphs
            when it is built (none where the pool plans no tier of this shape: its verify steps then run eagerly).
            ``None``: a pool of this runner's own (DECODE and its TARGET_VERIFY graphs).

    Raises:
        ValueError: the server uses a feature or decode graph backend this runner does not serve (the
            message names each and why); :func:`graphpool.integrations.sglang.install` hands such servers
            to SGLang's own runner.
        graphpool.CaptureError: a graph failed to capture.
    """

    #: GraphPool backend: "auto" replays CUDA graphs on CUDA and runs the eager twin elsewhere.
    pool_backend = "auto"

    def __init__(self, model_runner: Any, *, attn_backend: Any = None, speculative_num_steps: Optional[int] = None,
                 speculative_num_draft_tokens: Optional[int] = None, record_nolora_graph: bool = False,
                 graphs: Optional[TargetGraphs] = None):
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
        self.captured_req_width = self.num_tokens_per_bs = common.tokens_per_mode(
            self.speculative, self.speculative_num_draft_tokens)[self.capture_forward_mode]
        if graphs is None:
            tier = VerifyTier(self.speculative_num_steps, self.topk, self.speculative_num_draft_tokens)
            graphs = TargetGraphs(model_runner, [tier] if self.speculative else [],
                                  decode_batch_sizes(model_runner, self.captured_req_width),
                                  self.attn_backend.get_cuda_graph_seq_len_fill_value(), self.pool_backend)
        self.shared = graphs
        verify = graphs.verify_mode(self.speculative_num_steps, self.topk, self.speculative_num_draft_tokens) \
            if self.speculative else None
        #: The pool mode serving each forward mode this runner has graphs for.
        self.pool_modes: Dict[ForwardMode, str] = {ForwardMode.DECODE: DECODE}
        if verify is not None:
            self.pool_modes[ForwardMode.TARGET_VERIFY] = verify
        self.tokens_per_mode = {m: graphs.tokens[name] for m, name in self.pool_modes.items()}
        self._sizes = {m: graphs.pool.batch_sizes[name] for m, name in self.pool_modes.items()}  # per step: no dict
        # The first runner of a pool captures its DECODE graphs, with its own backend; each its tier's verify graphs.
        graphs.capture(list(self.pool_modes.values()), self.attn_backend)
        self.capture_bs = list(graphs.pool.batch_sizes[self.pool_modes.get(self.capture_forward_mode, DECODE)])
        self.max_bs = max(self.capture_bs)
        self.seq_len_fill_value = graphs.seq_len_fill_value
        self.graphs = graphs.graphs(list(self.pool_modes.values()))
        #: SGLang's graph backend slot: elastic EP's recapture calls ``backend.cleanup()`` before rebuilding.
        self.backend = _PoolBackend(self)
        self.bs = self.raw_bs = self.raw_num_token = 0
        self.forward_mode = self.capture_forward_mode  # mode of the last loaded step

    # ----------------------------------------------------------------------------------- the shared pool
    @property
    def pool(self) -> Any:
        """The :class:`~graphpool.GraphPool` (shared with the target model's other tiers' runners)."""
        return self.shared.pool

    @property
    def refusals(self) -> Dict[str, int]:
        """Eager fallbacks by reason (of every runner of the pool)."""
        return self.shared.refusals

    @property
    def replay_log(self) -> Any:
        return self.shared.replay_log

    @property
    def logits_buffer(self) -> Optional[torch.Tensor]:
        return self.shared.logits_buffer

    @property
    def seq_lens_cpu(self) -> torch.Tensor:
        return self.shared.seq_lens_cpu

    @property
    def capture_hidden_modes(self) -> Dict[ForwardMode, CaptureHiddenMode]:
        """Hidden-state capture mode of each forward mode this runner has graphs for."""
        return {m: self.shared.hidden_modes[name] for m, name in self.pool_modes.items()}

    @property
    def capture_hidden_mode(self) -> CaptureHiddenMode:
        """Hidden-state capture mode of the primary mode (SGLang's single runner-wide value)."""
        return self.capture_hidden_modes.get(self.capture_forward_mode, CaptureHiddenMode.NULL)

    @property
    def output_buffers(self) -> Dict[common.GraphId, Any]:
        return {(m, bs): out for (name, bs), out in self.shared.output_buffers.items()
                for m, own in self.pool_modes.items() if own == name}

    @property
    def _capture_batches(self) -> Dict[common.GraphId, ForwardBatch]:
        """(forward mode, bs) -> the ForwardBatch each of this runner's graphs was captured with."""
        return {(m, bs): fb for (name, bs), fb in self.shared.capture_batches.items()
                for m, own in self.pool_modes.items() if own == name}

    @property
    def _step(self) -> Optional[Step]:
        return self.shared.step

    def backend_of(self, mode: ForwardMode) -> Any:
        """The attention backend a step of ``mode`` is planned with: the one its graphs were captured with."""
        return self.shared.backends.get(self.pool_modes.get(mode), self.attn_backend)

    def capture(self) -> None:
        """Capture this runner's graphs again (SGLang's method name; the constructor captured them): its DECODE
        graphs and its tier's TARGET_VERIFY graphs, each with the attention backend it was captured with; the other
        tiers' graphs in the pool stay."""
        self.shared.capture(list(self.pool_modes.values()), self.attn_backend, again=True)
        self.graphs = self.shared.graphs(list(self.pool_modes.values()))

    @classmethod
    def decode_graph_gather_requirements(cls, model_runner: Any) -> tuple:
        """(mlp_tp_gather, attn_tp_gather) of SGLang's runner (0.5.2x asks the class): none, since this
        runner is refused wherever SGLang's ``require_gathered_buffer()`` holds (DP attention, an MoE
        all-to-all backend, ``--moe-dense-tp-size``: :func:`~.support.unsupported_reasons`). install()'s
        factory answers this question with SGLang's class anyway, as it may build SGLang's runner."""
        return (False, False)

    # ----------------------------------------------------------------------------------- steps
    def can_run_graph(self, forward_batch: ForwardBatch) -> bool:
        """Whether a graph serves this batch: its forward mode, size, token count and hidden mode. A ``False``
        makes SGLang run the step eagerly; each is counted by reason (:attr:`refusals`, in the periodic
        ``graphpool replays by mode: ...; eager fallbacks: ...`` log line)."""
        reason = self._refusal(forward_batch)
        if reason is None:
            return True
        if forward_batch.forward_mode in common.MODE_NAMES:  # a step of a mode graphpool serves ran eagerly
            self.replay_log.refused(forward_batch, reason)
        return False

    def _refusal(self, forward_batch: ForwardBatch) -> Optional[str]:
        """Why no graph serves ``forward_batch`` (None: one does)."""
        mode, bs = forward_batch.forward_mode, forward_batch.batch_size
        tokens = self.tokens_per_mode.get(mode)
        name = getattr(mode, "name", mode)
        if tokens is None:
            return f"no {name} graphs" + (f" of {self.topk}x{self.speculative_num_steps}:"
                                          f"{self.speculative_num_draft_tokens}" if mode in common.MODE_NAMES else "")
        if forward_batch.replace_embeds is not None:
            return f"{name} with replaced embeddings"
        sizes = self._sizes[mode]
        if bs < 1 or not (bs in sizes if self.disable_padding else bs <= sizes[-1]):
            return f"{name} bs {bs} not captured" if self.disable_padding else f"{name} bs {bs} > {sizes[-1]}"
        # The check a single-mode runner lacks: a step carries exactly bs x tokens_per_seq tokens of its mode.
        if forward_batch.input_ids is None or forward_batch.input_ids.shape[0] != bs * tokens:
            got = None if forward_batch.input_ids is None else forward_batch.input_ids.shape[0]
            return f"{name} with {got} tokens for {bs} x {tokens}"
        requested = common.requested_hidden_mode(forward_batch)
        if not common.hidden_mode_served(requested, self.shared.hidden_modes[self.pool_modes[mode]]):
            return f"{name} asking hidden states {requested.name}"
        return None

    def load_batch(self, forward_batch: ForwardBatch, pp_proxy_tensors: Optional[PPProxyTensors] = None) -> None:
        """Stage the batch into its mode's static buffers and plan attention; sets ``bs``, ``raw_bs``,
        ``raw_num_token``. A batch already loaded (``needs_forward_metadata_init()`` False: spec v2 loaded
        it on the plan stream) only has its inputs staged again, since the draft changed them."""
        shared = self.shared
        if not attn_hooks.needs_metadata(forward_batch) and shared.step is not None:
            shared.step = self._stage(forward_batch)
            return
        step = self._stage(forward_batch)
        mode, bs, raw_bs = forward_batch.forward_mode, step.batch.bs, forward_batch.batch_size
        if forward_batch.seq_lens_cpu is not None:
            shared.seq_lens_cpu[raw_bs:bs].fill_(self.seq_len_fill_value)
            shared.seq_lens_cpu[:raw_bs].copy_(forward_batch.seq_lens_cpu)
        if forward_batch.num_token_non_padded is not None:  # read by MoE models under expert parallelism
            shared.num_token_non_padded.copy_(forward_batch.num_token_non_padded)
        self.backend_of(mode).init_forward_metadata_out_graph(
            attn_hooks.replay_view(forward_batch, step, shared.seq_lens_cpu, self.seq_len_fill_value))
        self.forward_mode, self.bs, self.raw_bs = mode, bs, raw_bs
        self.raw_num_token = raw_bs * self.tokens_per_mode[mode]
        shared.step = step

    def execute(self, forward_batch: ForwardBatch,
                pp_proxy_tensors: Optional[PPProxyTensors] = None) -> Union[LogitsProcessorOutput, PPProxyTensors]:
        """Load (or re-stage) the batch and replay the graph of its own forward mode; outputs sliced to
        the real tokens."""
        self.load_batch(forward_batch, pp_proxy_tensors)
        shared, mode = self.shared, forward_batch.forward_mode
        step = shared.step
        shared.tp_check.check(step.mode.name, step.batch.bs, step.real_bs)
        read_done = read_done_point(self.backend_of(mode), mode)
        if read_done == "pre":
            publish_read_done(self.model_runner)
        out = self.pool.replay(step)
        if read_done == "post":
            publish_read_done(self.model_runner)
        shared.replay_log.count(shared.labels[step.mode.name])
        return dataclasses.replace(shared.captured_outputs[(step.mode.name, step.batch.bs)], **out)

    def _stage(self, forward_batch: ForwardBatch) -> Step:
        mode = self.pool_modes.get(forward_batch.forward_mode)
        if mode is None:
            common.pool_mode(forward_batch.forward_mode, self.tokens_per_mode)  # raises, saying what to ask first
        return self.pool.stage(
            mode, input_ids=forward_batch.input_ids, positions=forward_batch.positions,
            out_cache_loc=forward_batch.out_cache_loc.to(torch.int64), seq_lens=forward_batch.seq_lens.to(torch.int64),
            req_pool_indices=forward_batch.req_pool_indices)

    def get_spec_info(self, num_tokens: int) -> Any:
        """The verify input the primary mode's graphs are captured with (SGLang's method name)."""
        verify = self.pool_modes.get(ForwardMode.TARGET_VERIFY)
        return self.shared.capture_spec_info(verify, num_tokens) if verify is not None else None

    #: What the step returns, each with one row per token (the pool's output rule).
    output_names = SLICED_OUTPUTS


class _PoolBackend:
    """What SGLang asks of a decode runner's ``backend`` outside the runner: ``cleanup()`` (elastic EP drops
    the graphs before it recaptures)."""

    def __init__(self, runner: MultiModeDecodeRunner):
        self._runner = runner

    def cleanup(self) -> None:
        """Release every graph and the pool's buffers, those of every tier sharing the pool (SGLang builds new
        runners); this runner serves no more steps."""
        runner = self._runner
        runner.shared.close()
        runner.graphs.clear()

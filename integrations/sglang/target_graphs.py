"""TargetGraphs: one :class:`~graphpool.GraphPool` behind every decode runner SGLang builds for one target model.

SGLang (runner API, 0.5.14+) builds one target decode runner at start-up and, with speculation tiers (its own
``--speculative-adaptive``, or graphpool's ``--graphpool-tiers``), one more per tier, each with an attention
backend of its own (``EAGLEWorkerV2.build_adaptive_runtime_state``). Built apart, each runner would capture the
DECODE graphs again and keep its own static buffers. Here they share one pool: the DECODE graphs are captured
once, with the first runner's attention backend, and each tier's TARGET_VERIFY graphs are captured into the same
pool when SGLang builds that tier's runner (:meth:`GraphPool.capture` with ``modes=``), with that tier's backend.
The static buffers are sized at construction for the largest (mode, batch size) of every tier planned, so the
later tiers add no buffer byte, and on CUDA every graph goes into one graph memory pool (SGLang's global one).

Each runner (:class:`~.runner_api.MultiModeDecodeRunner`) is a view: DECODE steps go to the shared DECODE graphs
(planned with the backend they were captured with), TARGET_VERIFY steps to its own tier's graphs. SGLang runs one
runner at a time (the active tier's), so one staged step, one replay log and one set of per-step buffers serve
all of them.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from graphpool import GraphPool, Mode, StepBatch
from sglang.srt.layers.dp_attention import DpPaddingMode, set_dp_buffer_len, set_is_extend_in_batch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.model_executor import forward_batch_info
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.model_executor.runner_utils import pool as sglang_pool
from sglang.srt.model_executor.runner_utils.capture_mode import model_capture_mode

from . import attn_hooks, common, tp
from .replay_log import ReplayLog
from .runner_api_support import server_hidden_mode

log = logging.getLogger(__name__)

#: Per-token tensor fields of the model's output a replay returns sliced; every other field of the captured
#: output is kept as captured, as SGLang's execute keeps "extension fields" (``dataclasses.replace``).
SLICED_OUTPUTS = tuple(name for name in ("next_token_logits", "hidden_states", "last_hidden_states")
                       if name in {f.name for f in dataclasses.fields(LogitsProcessorOutput)})

#: The pool's mode of plain DECODE steps.
DECODE = "decode"

GraphKey = Tuple[str, int]  # (pool mode, padded batch size)


@dataclass(frozen=True)
class VerifyTier:
    """One speculation tier's TARGET_VERIFY shape: ``steps`` draft steps of ``topk`` branches, verifying
    ``num_draft_tokens`` tokens per request, captured at ``batch_sizes`` (``None``: every decode batch size)."""

    steps: int
    topk: int
    num_draft_tokens: int
    batch_sizes: Optional[Tuple[int, ...]] = None

    @property
    def label(self) -> str:
        """``TOPKxSTEPS:TOKENS``, the tier notation of graphpool's tiers (``bench/decode_loop.py --tiers``)."""
        return f"{self.topk}x{self.steps}:{self.num_draft_tokens}"

    def same_shape(self, steps: int, topk: int, num_draft_tokens: int) -> bool:
        return (self.steps, self.topk, self.num_draft_tokens) == (steps, topk, num_draft_tokens)


class TargetGraphs:
    """One pool for a target model's DECODE graphs and every speculation tier's TARGET_VERIFY graphs.

    Args:
        model_runner: SGLang's ``ModelRunner`` of the target model.
        tiers: every verify tier a runner may be built for (none: plain decode only), each its own pool mode.
        decode_batch_sizes: the batch sizes of the DECODE graphs (and of tiers that name none).
        seq_len_fill_value: the attention backends' padded sequence length (SGLang's backends of one kind agree).
        pool_backend: GraphPool backend: "auto" replays CUDA graphs on CUDA and runs the eager twin elsewhere.

    Nothing is captured here: :meth:`capture` captures the modes a runner needs, with its attention backend.
    """

    def __init__(self, model_runner: Any, tiers: Sequence[VerifyTier], decode_batch_sizes: Sequence[int],
                 seq_len_fill_value: int, pool_backend: str = "auto"):
        self.model_runner = model_runner
        self.device = model_runner.device
        self.tiers = tuple(tiers)
        # One verify tier keeps SGLang's own names ("target_verify" / TARGET_VERIFY); several are told apart by shape.
        self.verify_modes: Dict[VerifyTier, str] = {
            t: "target_verify" if len(self.tiers) == 1 else f"target_verify_{t.label}" for t in self.tiers}
        self.labels: Dict[str, Any] = {DECODE: ForwardMode.DECODE}
        self.labels.update({m: ForwardMode.TARGET_VERIFY if m == "target_verify" else f"TARGET_VERIFY_{t.label}"
                            for t, m in self.verify_modes.items()})
        self.tier_of: Dict[str, VerifyTier] = {m: t for t, m in self.verify_modes.items()}
        self.tokens: Dict[str, int] = {DECODE: 1, **{m: t.num_draft_tokens for t, m in self.verify_modes.items()}}
        decode_bs = tuple(sorted(decode_batch_sizes))
        modes = [Mode(DECODE, 1, batch_sizes=decode_bs)] + [
            Mode(m, t.num_draft_tokens, batch_sizes=t.batch_sizes or decode_bs) for t, m in self.verify_modes.items()]
        self.seq_len_fill_value = seq_len_fill_value
        self.pool = GraphPool(modes, common.step_inputs(seq_len_fill_value, torch.int64), decode_bs, device=self.device,
                              backend=pool_backend, on_miss="raise", memory_pool=common.graph_memory_pool(
                                  self.device, sglang_pool.get_global_graph_memory_pool,
                                  sglang_pool.set_global_graph_memory_pool))
        self.max_bs = max(max(sizes) for sizes in self.pool.batch_sizes.values())
        self.max_num_token = max(max(sizes) * self.tokens[m] for m, sizes in self.pool.batch_sizes.items())

        # Inputs the pool does not route: the CPU copy of seq_lens for attention planning, each tier's dummy tree
        # mask its verify graphs are captured with, and the non-padded token count some models read.
        self.seq_lens_cpu = torch.full((self.max_bs,), seq_len_fill_value, dtype=torch.int64)
        self.custom_masks = {m: torch.ones((max(self.pool.batch_sizes[m]) * (seq_len_fill_value + t.num_draft_tokens))
                                           * t.num_draft_tokens, dtype=torch.bool, device=self.device)
                             for m, t in self.tier_of.items()}
        self.num_token_non_padded = torch.zeros((1,), dtype=torch.int32, device=self.device)
        self.logits_buffer = shared_logits_buffer(model_runner, self.max_num_token)
        if self.logits_buffer is None:
            self.logits_buffer = common.logits_buffer(model_runner, self.max_num_token, self.device)
        self.hidden_modes: Dict[str, CaptureHiddenMode] = {
            m: common.initial_hidden_modes(model_runner.spec_algorithm, server_hidden_mode(model_runner))[
                ForwardMode.DECODE] for m in self.tokens}
        #: The attention backend each captured mode's graphs were captured with (and are planned with).
        self.backends: Dict[str, Any] = {}
        self._sized_backends: List[Any] = []  # backends whose graph state is sized (once: they reallocate)

        #: Eager fallbacks by reason, and replays by mode, of every runner of this pool, in one log line.
        self.refusals: Dict[str, int] = {}
        self.replay_log = ReplayLog(self.refusals)
        self.tp_check = tp.LazyAgreement(enabled=self.pool.debug)  # debug under TP > 1: ranks replay alike
        self.capture_batches: Dict[GraphKey, Any] = {}
        self.output_buffers: Dict[GraphKey, Any] = {}
        self.captured_outputs: Dict[GraphKey, LogitsProcessorOutput] = {}  # non-tensor fields, as captured
        self.step = None  # the step a runner's load_batch staged, for its execute
        self.capturing = False
        self.closed = False

    # ----------------------------------------------------------------------------------- set-up
    def verify_mode(self, steps: int, topk: int, num_draft_tokens: int) -> Optional[str]:
        """The pool mode of the tier of this shape (``None``: no tier of this pool has it)."""
        return next((m for t, m in self.verify_modes.items() if t.same_shape(steps, topk, num_draft_tokens)), None)

    def captured(self, mode: str) -> bool:
        return mode in self.backends

    def capture(self, modes: Sequence[str], attn_backend: Any, again: bool = False) -> None:
        """Capture ``modes`` (the ones not captured yet) with ``attn_backend``, into the shared pool; ``again``:
        capture ``modes`` anew, each with the backend it was captured with (the other modes' graphs stay)."""
        if again:
            for backend in {id(self.backends[m]): self.backends[m] for m in modes}.values():
                self._capture([m for m in modes if self.backends[m] is backend], backend)
            return
        modes = [m for m in modes if m not in self.backends]
        if modes:
            self._capture(modes, attn_backend)

    def _capture(self, modes: List[str], attn_backend: Any) -> None:
        if not any(b is attn_backend for b in self._sized_backends):
            # Once per backend, sized for every mode it serves: backends reallocate buffers that graphs point at.
            attn_backend.init_cuda_graph_state(max(max(self.pool.batch_sizes[m]) for m in modes),
                                               max(max(self.pool.batch_sizes[m]) * self.tokens[m] for m in modes))
            self._sized_backends.append(attn_backend)
        for m in modes:
            self.backends[m] = attn_backend
        self.capturing = True
        try:
            with self._capture_context():  # under TP > 1 a capture that fails on one rank fails on every rank
                tp.capture_on_every_rank(lambda: self.pool.capture(
                    self._run_model, prepare=self._prepare_capture, progress=False,
                    outputs=dict.fromkeys(SLICED_OUTPUTS, "token"), modes=modes))
        except BaseException:
            for m in modes:  # the pool kept none of their graphs
                del self.backends[m]
            raise
        finally:
            self.capturing = False
        log.info("graphpool captured %d graphs for %s at batch sizes %s (one pool: %s)",
                 sum(len(self.pool.batch_sizes[m]) for m in modes), [self.label(m) for m in modes],
                 sorted({bs for m in modes for bs in self.pool.batch_sizes[m]}),
                 ", ".join(self.label(m) for m in self.tokens))

    def label(self, mode: str) -> str:
        """How the logs name a pool mode: ``DECODE``, ``TARGET_VERIFY``, or ``TARGET_VERIFY_<TOPKxSTEPS:TOKENS>``."""
        label = self.labels[mode]
        return getattr(label, "name", label)

    def graphs(self, modes: Sequence[str]) -> Dict[Tuple[ForwardMode, int], Any]:
        """(forward mode, bs) -> the captured graph, of ``modes`` (one pool mode per forward mode)."""
        return {(common.forward_mode_of_name(m), bs): self.pool.graph(m, bs)
                for m in modes for bs in self.pool.batch_sizes[m]}

    def _capture_context(self) -> Any:
        from sglang.srt.distributed.device_communicators.pynccl_allocator import set_graph_pool_id

        return common.capture_context(self.device, self.pool.memory_pool, set_graph_pool_id, model_capture_mode)

    def _prepare_capture(self, batch: StepBatch, real_bs: int) -> None:
        """Pool hook, outside the graph. At capture: build the key's ForwardBatch and plan its attention
        (first call), then the backend's post-warm-up hook (second call). At replay: nothing, because the runner's
        ``load_batch`` plans attention itself (spec v2 calls it apart from ``execute``)."""
        if not self.capturing:
            return
        mode = batch.mode.name
        key, backend = (mode, batch.bs), self.backends[mode]
        if key in self.capture_batches:
            getattr(backend, "on_after_cuda_graph_warmup", lambda: None)()
            return
        self.num_token_non_padded.fill_(batch.num_tokens)
        spec_info = self._capture_spec_info(mode, batch.num_tokens) if mode in self.tier_of else None
        hidden = self.hidden_modes[mode]
        if spec_info is not None and spec_info.capture_hidden_mode > hidden:
            hidden = self.hidden_modes[mode] = spec_info.capture_hidden_mode
        fb = common.capture_forward_batch(
            self.model_runner, backend, batch, seq_lens_cpu=self.seq_lens_cpu, spec_info=spec_info,
            capture_hidden_mode=hidden, num_token_non_padded=self._masked_token_count(), logits=self.logits_buffer,
            dp_padding_mode=DpPaddingMode.get_default_mode_in_cuda_graph(), can_run_decode_cuda_graph=True)
        backend.init_forward_metadata_out_graph(fb, in_capture=True)
        self.capture_batches[key] = fb

    def _masked_token_count(self) -> Optional[torch.Tensor]:
        """The non-padded token count graphs read where SGLang's do (expert parallelism, DP gather, custom
        all-to-all MoE: its MoE layers mask padded rows); ``None`` elsewhere, as SGLang captures."""
        try:
            masked = forward_batch_info.enable_num_token_non_padded()
        except (AssertionError, AttributeError, RuntimeError):  # no parallel state: a single-process tool
            masked = False
        return self.num_token_non_padded if masked else None

    def capture_spec_info(self, mode: str, num_tokens: int) -> Any:
        """The verify input the graphs of verify mode ``mode`` are captured with (SGLang's ``get_spec_info``)."""
        return self._capture_spec_info(mode, num_tokens)

    def _capture_spec_info(self, mode: str, num_tokens: int) -> Any:
        tier = self.tier_of[mode]
        info = common.verify_capture_input(self.model_runner, self.custom_masks[mode], num_steps=tier.steps,
                                           num_draft_tokens=tier.num_draft_tokens, topk=tier.topk)
        mc = self.model_runner.model_config  # MTP models read spec_info.hidden_states in the forward
        info.hidden_states = torch.zeros((num_tokens, mc.hidden_size), dtype=mc.dtype, device=self.device)
        return info

    def _run_model(self, batch: StepBatch) -> Dict[str, Optional[torch.Tensor]]:
        """The pool's step function: in-graph attention metadata, then the model on the key's ForwardBatch."""
        key = (batch.mode.name, batch.bs)
        fb, backend = self.capture_batches[key], self.backends[batch.mode.name]
        with attn_hooks.forward_context_for(backend, fb):
            backend.init_forward_metadata_in_graph(fb)
            set_dp_buffer_len(None, batch.num_tokens, fb.dp_padding_mode.is_max_len())
            set_is_extend_in_batch(False)
            out = self.model_runner.model.forward(fb.input_ids, fb.positions, fb)
        result = {name: getattr(out, name) for name in SLICED_OUTPUTS}
        if self.capturing:
            self.output_buffers[key] = result  # the last call of a key at capture is the captured one
            self.captured_outputs[key] = out
        return result

    def close(self) -> None:
        """Release every graph of every tier and the pool's buffers; no runner of this pool serves more steps (SGLang
        builds new ones), and the model runner's next runner starts a new pool."""
        self.pool.close()
        self.backends.clear()
        self.output_buffers.clear()
        self.captured_outputs.clear()
        self.capture_batches.clear()
        self.step = None
        self.closed = True


def shared_logits_buffer(model_runner: Any, rows: int) -> Optional[torch.Tensor]:
    """SGLang's process-wide graph logits buffer (``model_runner.graph_shared_output``, 0.5.17+), ``rows``
    long, which every one of SGLang's graph runners of a vocabulary writes into (its adaptive speculation's
    runners too); ``None`` where this SGLang has none or it is shorter than ``rows``."""
    shared = getattr(model_runner, "graph_shared_output", None)
    vocab = getattr(getattr(model_runner, "model_config", None), "vocab_size", None)
    if shared is None or not vocab or rows > getattr(shared, "max_rows", 0):
        return None
    return shared.get_logits_buffer(vocab, rows=rows)

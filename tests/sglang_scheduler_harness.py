"""SGLang's scheduler and EAGLE v1 worker, real, around the stand-in model runners of :mod:`sglang_harness`.

What is real SGLang here: ``Req``, ``SamplingParams``, ``ScheduleBatch`` (``prepare_for_extend``,
``filter_batch``, ``merge_batch``, ``get_model_worker_batch``), ``ReqToTokenPool``,
``TokenToKVPoolAllocator``, ``ChunkCache``, ``ForwardBatch.init_new``, ``TpModelWorker.forward_batch_generation``,
``ModelRunner.sample`` and the ``Sampler``; the EAGLE v1 worker's ``forward_batch_generation`` (both
branches), ``forward_target_extend``, ``forward_draft_extend``, ``_draft_preprocess_decode``, ``draft`` and
``draft_forward``, ``verify`` with ``EagleVerifyInput.prepare_for_verify`` / ``verify``,
``forward_draft_extend_after_decode`` and ``capture_for_decode``; the scheduler's ``run_batch``,
``process_batch_result`` (``process_batch_result_prefill`` / ``_decode``), ``update_running_batch``,
``update_spec_metrics`` and ``report_decode_stats``. SGLang's Triton kernels run in Triton's interpreter.

What stands in (no GPU kernels on a CPU machine): the model and paged attention (the engine's, through
:mod:`sglang_harness`, with a multi-step draft-decode backend here), SGLang's two tree kernels from
``sgl_kernel`` (``build_tree_kernel_efficient`` and ``verify_tree_greedy`` for a chain, topk = 1), and the
scheduler's output to the tokenizer (``stream_output`` records what it would send). The draft model is a
plain language model (as with STANDALONE speculation): it ignores the hidden states EAGLE feeds it.
"""
from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace
from unittest import mock
from typing import Any, Dict, List, Optional

import torch

from tests import sglang_harness as H  # noqa: I001  (puts the test stand-ins on sys.path first)

from sglang.srt import server_args as sglang_server_args
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject
from sglang.srt.layers import sampler as sampler_module
from sglang.srt.layers.sampler import Sampler
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor import cuda_graph_runner, forward_batch_info
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative import eagle_info, eagle_worker
from sglang.srt.speculative.eagle_worker import EAGLEWorker
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from graphpool.integrations.sglang import MultiModeCudaGraphRunner

EOS = 2  # the stand-in model's end-of-sequence token


def server_args(**overrides: Any) -> Any:
    """SGLang's ``ServerArgs`` with every field at its default (no ``__post_init__``: it would load a
    model config), plus ``overrides``, installed as the global server args."""
    args = sglang_server_args.ServerArgs.__new__(sglang_server_args.ServerArgs)
    for f in dataclasses.fields(args):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            value = f.default_factory()  # type: ignore[misc]
        else:
            value = None
        object.__setattr__(args, f.name, value)
    for name, value in overrides.items():
        setattr(args, name, value)
    sglang_server_args.set_global_server_args_for_scheduler(args)
    return args


# ----------------------------------------------------------------------------------- model runners
class SchedModelRunner(H.HarnessModelRunner):
    """The harness's model runner over SGLang's real request and KV-slot pools, with SGLang's sampler."""

    sample = ModelRunner.sample
    _preprocess_logits = ModelRunner._preprocess_logits
    if hasattr(ModelRunner, "maybe_update_ngram_token_table"):  # 0.5.10 on (TpModelWorker calls it)
        maybe_update_ngram_token_table = ModelRunner.maybe_update_ngram_token_table

    def __init__(self, cfg: H.HarnessConfig, device: torch.device, speculative: bool, model_seed: int,
                 req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator, args: Any):
        super().__init__(cfg, device, speculative=speculative, model_seed=model_seed)
        self.req_to_token_pool, self.token_to_kv_pool_allocator = req_to_token_pool, allocator
        self.attn_backend = H.TorchPagedAttention(cfg, req_to_token_pool, self.token_to_kv_pool)
        self.server_args.attention_backend = args.attention_backend
        self.server_args.enable_lora = False
        self.use_ngram_embedding = self.model_is_mrope = self.is_hybrid_swa = False
        self.hybrid_gdn_config = self.mamba2_config = self.hybrid_lightning_config = None
        self.model_config.spec_hidden_size = cfg.hidden
        self.sampler = _one_rank_sampler()
        self.tp_group = None


def _one_rank_sampler() -> Sampler:
    """SGLang's ``Sampler`` for a single rank: it looks its tensor-parallel group up at construction and
    all-reduces token ids over it under a grammar; with one rank that reduction is the identity."""
    with mock.patch.object(sampler_module, "get_tp_group", lambda: SimpleNamespace(device_group=None)):
        sampler = Sampler()
    sampler._sync_token_ids_across_tp = lambda next_token_ids, sampling_info: None
    return sampler


class TargetWorker:
    """SGLang's ``TpModelWorker`` for the target: its ``forward_batch_generation`` (forward + sampling)."""

    forward_batch_generation = TpModelWorker.forward_batch_generation

    def __init__(self, model_runner: SchedModelRunner):
        self.model_runner = model_runner
        self.pp_group = SimpleNamespace(is_last_rank=True)
        self.enable_overlap, self.enable_spec = False, True

    def set_hicache_consumer(self, index: Any) -> None:
        pass

    def is_dllm(self) -> bool:
        return False


class DraftStepBackend(H.TorchPagedAttention):
    """One step of EAGLE's multi-step draft decode (topk = 1): the step-``i`` token sits at position
    ``seq_len + i``, whose slot ``_draft_preprocess_decode`` recorded in ``req_to_token``; it attends
    every earlier position. (FlashInfer/FA3 build the same per-step lengths from ``seq_lens + i + 1``.)"""

    def __init__(self, base: H.TorchPagedAttention, step: int):
        super().__init__(base.cfg, base.req_to_token_pool, base.kv_pool)
        self.step = step

    def init_forward_metadata(self, forward_batch: Any) -> None:
        fb = forward_batch
        lens = fb.seq_lens[:fb.batch_size] + self.step + 1  # counts the step's own token, as in DECODE
        tree = torch.ones((fb.batch_size, 1, 1), dtype=torch.bool, device=lens.device)
        self.forward_metadata = self._meta(ForwardMode.DECODE, fb.batch_size, fb.req_pool_indices, lens, tree)
        self.ragged = None


class DraftMultiStepBackend:
    """SGLang's multi-step draft attention surface: ``attn_backends[i]`` per draft step."""

    def __init__(self, base: H.TorchPagedAttention, steps: int):
        self.attn_backends = [DraftStepBackend(base, i) for i in range(steps)]

    def init_forward_metadata(self, forward_batch: Any) -> None:
        for backend in self.attn_backends:
            backend.init_forward_metadata(forward_batch)


# ----------------------------------------------------------------------------------- sgl_kernel stand-ins
def build_chain_tree(bonus_tokens, parent_list, top_scores_index, draft_tokens, seq_lens, seq_lens_sum, topk,
                     spec_steps, num_verify_tokens, tree_mask_mode=0, tree_mask_buf=None, position_buf=None):
    """``sgl_kernel.build_tree_kernel_efficient`` for a chain (topk = 1): the bonus token then the
    drafts in order, each seeing the prefix and the chain before it (SGLang's flattened full mask)."""
    if topk != 1:
        raise NotImplementedError("the CPU stand-in builds chains only (topk = 1)")
    tokens = torch.cat((bonus_tokens.unsqueeze(1), draft_tokens), dim=1).flatten()
    bs, t, dev = seq_lens.numel(), num_verify_tokens, seq_lens.device
    causal = torch.ones((t, t), dtype=torch.bool, device=dev).tril()
    masks = [torch.cat([torch.ones((t, int(n)), dtype=torch.bool, device=dev), causal], 1).reshape(-1)
             for n in seq_lens.tolist()]
    cols = torch.arange(t, device=dev)
    positions = (seq_lens.long()[:, None] + cols[None, :]).reshape(-1)
    retrieve_index = torch.arange(bs * t, device=dev).view(bs, t)
    retrieve_next_token = torch.where(cols < t - 1, cols + 1, -1).expand(bs, t).contiguous()
    retrieve_next_sibling = torch.full((bs, t), -1, dtype=torch.long, device=dev)
    return torch.cat(masks), positions, retrieve_index, retrieve_next_token, retrieve_next_sibling, tokens


def verify_chain_greedy(predicts, accept_index, accept_token_num, candidates, retrieve_index=None,
                        retrieve_next_token=None, retrieve_next_sibling=None, target_predict=None, topk=-1, *,
                        retrive_index=None, retrive_next_token=None, retrive_next_sibling=None):
    """``sgl_kernel.verify_tree_greedy`` for chains: accept drafts while they equal the target's greedy
    token, record the accepted indices, and put the target's token after each accepted one. (SGLang up to
    0.5.10 passes the ``retrive_*`` keywords, later releases ``retrieve_*``.)"""
    if retrieve_index is None:
        retrieve_index, retrieve_next_token = retrive_index, retrive_next_token
    bs, t = candidates.shape
    for i in range(bs):
        last, accepted = int(retrieve_index[i, 0]), 0
        accept_index[i, 0] = last
        cur = 0
        for _ in range(1, accept_index.shape[1]):
            cur = int(retrieve_next_token[i, cur])
            if cur == -1 or int(candidates[i, cur]) != int(target_predict[i, last - i * t]):
                break
            predicts[last] = target_predict[i, last - i * t]
            accepted += 1
            last = int(retrieve_index[i, cur])
            accept_index[i, accepted] = last
        accept_token_num[i] = accepted
        predicts[last] = target_predict[i, last - i * t]
    return predicts, accept_index, accept_token_num


def assign_req_to_token_pool(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, batch_size):
    """SGLang's ``assign_req_to_token_pool_func``: sequence ``i``'s slots, taken in turn from
    ``out_cache_loc``, go to its ``req_to_token`` row at positions ``[start_i, end_i)``."""
    taken = 0
    for row, start, end in zip(req_pool_indices[:batch_size].tolist(), start_offset[:batch_size].tolist(),
                               end_offset[:batch_size].tolist()):
        req_to_token[row, start:end] = out_cache_loc[taken:taken + end - start].to(req_to_token.dtype)
        taken += end - start


class _AssignDraftCacheLocs:
    """SGLang's ``assign_draft_cache_locs`` Triton kernel (``kernel[grid](...)``) for page size 1 or
    topk 1: sequence ``i``'s ``topk * steps`` scratch slots go to its row from position ``seq_len``."""

    def __getitem__(self, grid: Any) -> Any:
        return self

    def __call__(self, req_pool_indices, req_to_token, seq_lens, extend_lens, num_new_pages_per_topk, out_cache_loc,
                 source_cache_loc, target_cache_loc, last_page_lens_cumsum, duplicate_cache_len, pool_len, topk,
                 speculative_num_steps, page_size, bs_upper, iter_upper) -> None:
        if page_size != 1 and topk != 1:
            raise NotImplementedError("the CPU stand-in covers page size 1 or topk 1")
        n = topk * speculative_num_steps
        for i, (row, start) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
            req_to_token[row, start:start + n] = out_cache_loc[i * n:(i + 1) * n].to(req_to_token.dtype)


@contextlib.contextmanager
def cpu_stand_ins():
    """Install the kernel stand-ins where SGLang's EAGLE code looks them up (the two tree kernels of
    ``sgl_kernel``; two index-writing Triton kernels whose data-dependent loops Triton's interpreter
    cannot run with NumPy 2), and answer SGLang's question about expert parallelism for a single
    process (its group is not initialised here)."""
    with mock.patch.object(eagle_worker, "build_tree_kernel_efficient", build_chain_tree), \
            mock.patch.object(eagle_info, "verify_tree_greedy_func", verify_chain_greedy), \
            mock.patch.object(eagle_info, "assign_req_to_token_pool_func", assign_req_to_token_pool), \
            mock.patch.object(eagle_worker, "assign_draft_cache_locs", _AssignDraftCacheLocs()), \
            mock.patch.object(forward_batch_info, "enable_num_token_non_padded", lambda *a: False), \
            mock.patch.object(cuda_graph_runner, "enable_num_token_non_padded", lambda *a: False):
        yield


class TokenSetGrammar(BaseGrammarObject):
    """A grammar for tests: any of ``allowed`` tokens, ``length`` of them, then terminated. It keeps
    xgrammar's contract as SGLang uses it: packed int32 bitmasks (bit set = allowed; rows of a fresh
    mask allow everything), ``accept_token`` raising ``ValueError`` on a token it forbids, ``rollback``
    for the speculative tree walk."""

    def __init__(self, allowed: List[int], length: int):
        super().__init__()
        self.allowed, self.length = sorted(set(allowed)), length
        self.accepted: List[int] = []

    def accept_token(self, token: int) -> None:
        if token not in self.allowed or self.is_terminated():
            raise ValueError(f"TokenSetGrammar: token {token} not allowed after {self.accepted}")
        self.accepted.append(token)

    def rollback(self, k: int) -> None:
        del self.accepted[len(self.accepted) - k:]

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length

    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device: Any) -> torch.Tensor:
        return torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32)

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        bits = torch.zeros(vocab_mask.shape[1] * 32, dtype=torch.int64)
        bits[self.allowed] = 1
        words = (bits.view(-1, 32) << torch.arange(32)).sum(1)
        vocab_mask[idx] = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)

    @staticmethod
    def move_vocab_mask(vocab_mask: torch.Tensor, device: Any) -> torch.Tensor:
        return vocab_mask.to(device)

    @staticmethod
    def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        vocab = logits.shape[-1]
        allowed = ((vocab_mask.to(torch.int64)[:, :, None] >> torch.arange(32)) & 1).reshape(vocab_mask.shape[0], -1)
        logits.masked_fill_(allowed[:, :vocab].to(logits.device) == 0, float("-inf"))


# ----------------------------------------------------------------------------------- the EAGLE v1 worker
def make_eagle_worker(target: SchedModelRunner, draft: SchedModelRunner, args: Any) -> EAGLEWorker:
    """SGLang's ``EAGLEWorker`` on the two stand-in runners, with the attributes its constructor would
    set (its constructor loads a model); no draft CUDA graphs (CPU)."""
    worker = object.__new__(EAGLEWorker)
    worker.server_args = args
    worker.topk, worker.speculative_num_steps = args.speculative_eagle_topk, args.speculative_num_steps
    worker.speculative_num_draft_tokens = args.speculative_num_draft_tokens
    worker.device, worker.page_size, worker.gpu_id = target.device, args.page_size, 0
    worker.target_worker = TargetWorker(target)
    worker.speculative_algorithm = SpeculativeAlgorithm.from_string(args.speculative_algorithm)
    worker.adaptive_controller = None
    worker.enable_nan_detection = args.enable_nan_detection  # read by the worker up to 0.5.9
    worker.req_to_token_pool = target.req_to_token_pool
    worker.token_to_kv_pool_allocator = target.token_to_kv_pool_allocator
    worker.hot_token_id = None
    worker._model_runner = draft  # the worker runs the draft model (draft_model_runner is a property)
    worker.draft_tp_context = lambda group: contextlib.nullcontext()
    worker.eagle_use_aux_hidden_state = False
    worker.draft_attn_backend = DraftMultiStepBackend(draft.attn_backend, args.speculative_num_steps)
    worker.draft_extend_attn_backend = draft.attn_backend
    worker.cuda_graph_runner = worker.cuda_graph_runner_for_draft_extend = None
    worker.num_new_pages_per_topk = torch.empty((), dtype=torch.int64)
    worker.extend_lens = torch.empty((), dtype=torch.int64)
    # The draft model's config (SGLang up to 0.5.11 sizes the idle draft input from it; 0.5.12 from the runner's)
    worker.model_config = SimpleNamespace(hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]),
                                          hidden_size=draft.cfg.hidden, spec_hidden_size=draft.cfg.hidden,
                                          dtype=draft.cfg.dtype)
    return worker


# ----------------------------------------------------------------------------------- the scheduler
def spec_accepted_tokens(scheduler: Scheduler) -> int:
    """The tokens verify steps committed as SGLang's speculation metrics count them (all log intervals'
    total plus the current one's): ``spec_*num_accept_tokens`` from 0.5.12, ``spec_*num_accepted_tokens``
    in 0.5.9 to 0.5.11."""
    for stem in ("accept_tokens", "accepted_tokens"):
        if hasattr(scheduler, f"spec_num_{stem}"):
            return getattr(scheduler, f"spec_total_num_{stem}") + getattr(scheduler, f"spec_num_{stem}")
    raise AttributeError("SGLang's scheduler keeps no accepted-token counter graphpool's tests know")


@dataclasses.dataclass
class Sent:
    """What the scheduler streamed for a request (its ``stream_output``), checked by the tests."""

    finished_reason: Any = None
    output_ids: List[int] = dataclasses.field(default_factory=list)
    logprobs: List[float] = dataclasses.field(default_factory=list)


class SchedulerWorld:
    """SGLang's scheduler (the real methods, on an instance built without its constructor, which binds
    sockets and loads models) driving the EAGLE v1 worker over the stand-in model runners.

    :meth:`step` does what one iteration of SGLang's ``event_loop_normal`` does, through SGLang's own
    methods: merge the last prefill batch into the running batch (``filter_batch`` / ``merge_batch``,
    as ``get_next_batch_to_run``), prefill the requests that arrived (``ScheduleBatch.init_new`` /
    ``prepare_for_extend``) or else ``update_running_batch`` and decode, then ``run_batch`` and
    ``process_batch_result``.
    """

    def __init__(self, cfg: H.HarnessConfig, device: torch.device, log_interval: int = 3, draft_seed: int = 0):
        self.cfg, self.device, self.draft_seed = cfg, device, draft_seed
        self.args = server_args(
            speculative_algorithm="EAGLE", speculative_num_steps=cfg.draft_tokens - 1, speculative_eagle_topk=1,
            speculative_num_draft_tokens=cfg.draft_tokens, page_size=1, disable_overlap_schedule=True,
            attention_backend="torch_native", decode_log_interval=log_interval, device=str(device),
            enable_metrics=False,
            skip_tokenizer_init=True, cuda_graph_bs=list(cfg.batch_sizes))
        rtp = ReqToTokenPool(size=cfg.max_reqs, max_context_len=cfg.max_ctx, device=str(device),
                             enable_memory_saver=False)
        self.target = SchedModelRunner(cfg, device, True, 0, rtp, None, self.args)
        allocator = TokenToKVPoolAllocator(size=cfg.kv_slots - 1, dtype=cfg.dtype, device=str(device),
                                           kvcache=self.target.token_to_kv_pool, need_sort=False)
        self.target.token_to_kv_pool_allocator = allocator
        # Draft seed 0 = the target's weights (STANDALONE speculation with the target's own config):
        # every draft is accepted, so verify steps commit several tokens and requests finish mid-chain.
        self.draft = SchedModelRunner(cfg, device, False, draft_seed, rtp, allocator, self.args)
        self.target.graph_runner = MultiModeCudaGraphRunner(self.target)
        self.worker = make_eagle_worker(self.target, self.draft, self.args)
        self.tree_cache = ChunkCache(CacheInitParams(disable=True, req_to_token_pool=rtp,
                                                     token_to_kv_pool_allocator=allocator, page_size=1))
        self.model_config = SimpleNamespace(
            is_encoder_decoder=False, is_matryoshka=False, is_multimodal=False, is_generation=True,
            use_ngram_embedding=False, think_end_id=None, vocab_size=cfg.vocab, hf_eos_token_id=None,
            context_len=cfg.max_ctx, dtype=cfg.dtype, hidden_size=cfg.hidden, spec_hidden_size=cfg.hidden)
        self.scheduler = self._scheduler()
        self.running = ScheduleBatch.init_new([], rtp, allocator, self.tree_cache, self.model_config, False,
                                              self.worker.speculative_algorithm)
        self.last_batch: Optional[ScheduleBatch] = None
        self.waiting: List[Req] = []
        self.sent: Dict[str, Sent] = {}
        self.decode_log: List[str] = []

    def _scheduler(self) -> Scheduler:
        s = object.__new__(Scheduler)
        s.server_args, s.model_config, s.model_worker = self.args, self.model_config, self.worker
        s.tree_cache, s.req_to_token_pool = self.tree_cache, self.target.req_to_token_pool
        s.token_to_kv_pool_allocator = self.target.token_to_kv_pool_allocator
        s.spec_algorithm, s.is_generation, s.enable_overlap, s.enable_overlap_mlx = (
            self.worker.speculative_algorithm, True, False, False)
        s.attn_tp_rank, s.tp_rank, s.dp_rank, s.device = 0, 0, None, str(self.device)
        s.enable_kv_cache_events = False  # the constructor's, without --kv-events-config (read here up to 0.5.10)
        # the constructor's too up to 0.5.9 (init_metrics sets them from 0.5.10)
        s.enable_metrics = self.args.enable_metrics
        s.enable_metrics_for_all_schedulers = self.args.enable_metrics_for_all_schedulers
        s.init_metrics(0, 0, None)
        s.disaggregation_mode = DisaggregationMode.NULL
        s.enable_hisparse, s.hisparse_coordinator, s.decode_offload_manager = False, None, None
        s.enable_hierarchical_cache, s.is_hybrid_swa, s.is_hybrid_ssm = False, False, False
        s.max_total_num_tokens = self.cfg.kv_slots - 1
        s.new_token_ratio, s.new_token_ratio_decay, s.min_new_token_ratio = 0.5, 0.01, 0.1
        s.num_retracted_reqs = s.num_paused_reqs = 0
        s.forward_ct, s.forward_sleep_time, s.stream_interval = 0, None, 1
        s.profile_by_stage, s.profile_in_progress = False, False
        s.waiting_queue = []
        s.enable_fpm, s.enable_pdmux, s.return_health_check_ipcs = False, False, None
        s.enable_mfu_metrics = False
        s.stream_output = self._stream_output
        s.report_prefill_stats = s.log_prefill_stats = lambda *a, **k: None  # (log_prefill_stats up to 0.5.9)
        s.log_batch_result_stats = lambda *a, **k: None
        s.update_device_timer = lambda *a, **k: None
        s.maybe_send_health_check_signal = lambda *a, **k: None
        s._maybe_clear_mm_inputs = lambda *a, **k: None
        s._profile_batch_predicate = lambda *a, **k: None
        return s

    def set_think_end_id(self, token: Optional[int]) -> None:
        """The model's end-of-thinking token, where each release reads it: the model config (0.5.11 on,
        spec-v1 verify counts reasoning tokens) or the scheduler (0.5.10.x, ``process_batch_result_decode``
        counts them); 0.5.9 counts none."""
        self.model_config.think_end_id = token
        self.scheduler._think_end_id = token

    # ------------------------------------------------------------------------------- requests
    def add_request(self, rid: str, prompt: List[int], max_new_tokens: int, *, ignore_eos: bool = True,
                    stop_token_ids: Optional[List[int]] = None, eos_token_ids: Optional[set] = None,
                    return_logprob: bool = False, top_logprobs_num: int = 0, require_reasoning: bool = False,
                    grammar: Any = None) -> Req:
        """Queue a request (greedy); it is prefilled at the next :meth:`step`."""
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=ignore_eos,
                                stop_token_ids=stop_token_ids)
        params.normalize(None)
        req = Req(rid, "", list(prompt), params, return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                  eos_token_ids=eos_token_ids or {EOS}, vocab_size=self.cfg.vocab, require_reasoning=require_reasoning)
        # Output logprobs only (the stand-in model computes no prompt logprobs): logprobs from the end of the
        # prompt (SGLang's -1 means that from 0.5.10; up to 0.5.9 it asks for the last prompt position's too).
        req.logprob_start_len = len(prompt)
        req.grammar = grammar
        self.waiting.append(req)
        return req

    def _stream_output(self, reqs: List[Req], return_logprob: bool, skip_req: Optional[Req] = None) -> None:
        for req in reqs:
            if req.finished() and req.rid not in self.sent:
                self.sent[req.rid] = Sent(req.finished_reason, list(req.output_ids),
                                          list(req.output_token_logprobs_val) if req.return_logprob else [])

    # ------------------------------------------------------------------------------- one iteration
    def step(self) -> Optional[ScheduleBatch]:
        """One iteration of SGLang's normal event loop; returns the batch that ran (None when idle)."""
        s = self.scheduler
        if self.last_batch is not None and self.last_batch.forward_mode.is_extend():
            self.last_batch.filter_batch()
            if not self.last_batch.is_empty():
                if self.running.is_empty():
                    self.running = self.last_batch
                else:
                    self.running.merge_batch(self.last_batch)
        batch = self._prefill_batch()
        if batch is None and not self.running.is_empty():
            self.running = s.update_running_batch(self.running)
            batch = None if self.running.is_empty() else self.running
        if batch is not None:
            result = s.run_batch(batch)
            s.process_batch_result(batch, result)
        self.last_batch = batch
        return batch

    def _prefill_batch(self) -> Optional[ScheduleBatch]:
        if not self.waiting:
            return None
        reqs, self.waiting = self.waiting, []
        for req in reqs:
            req.init_next_round_input(self.tree_cache)
        batch = ScheduleBatch.init_new(reqs, self.target.req_to_token_pool, self.target.token_to_kv_pool_allocator,
                                       self.tree_cache, self.model_config, False, self.worker.speculative_algorithm)
        batch.prepare_for_extend()
        return batch

    def run_until_idle(self, max_steps: int = 10_000) -> int:
        """Steps until nothing waits or runs; returns how many ran."""
        for n in range(max_steps):
            if self.step() is None and not self.waiting:
                return n
        raise AssertionError(f"still busy after {max_steps} steps")

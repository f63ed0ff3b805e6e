"""The SGLang test harness (:mod:`tests.sglang_harness`) for SGLang's runner API (0.5.14+).

What is real SGLang here, beyond the classic harness: ``ModelRunner._forward_raw`` of 0.5.14+ (it asks
``decode_cuda_graph_runner.can_run_graph`` and calls ``execute``), the forward context the model reads its
attention backend from, a real ``ServerArgs`` published to SGLang's runtime context (the runner reads the
decode batch sizes, ``--cuda-graph-config`` and the speculation settings from there, through SGLang's own
``get_batch_sizes_to_capture``). What is ours: the eager runner (the oracle: attention metadata, then the
model, with no graph), and the single-process stand-ins for the TP group and pipeline stage.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, List, Optional, Tuple

import torch

from tests import sglang_harness as H  # noqa: I001  (puts the test stand-ins on sys.path first)

H.require_api("runner")

from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.layers.logits_processor import LogitsProcessorOutput  # noqa: E402
from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig, PhaseConfig  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402


def publish(cfg: H.HarnessConfig, *, speculative: bool, topk: int = 1, decode_backend: str = "full",
            adaptive: bool = False, adaptive_config: Optional[str] = None) -> ServerArgs:
    """Publish a real ``ServerArgs`` for the stand-in server (unresolved: no model is loaded)."""
    spec = dict(speculative_algorithm="EAGLE", speculative_eagle_topk=topk,
                speculative_num_steps=cfg.draft_tokens - 1 if topk == 1 else 3,
                speculative_num_draft_tokens=cfg.draft_tokens, speculative_adaptive=adaptive,
                speculative_adaptive_config=adaptive_config) if speculative else {}
    args = ServerArgs(model_path="dummy", device="cpu", page_size=1, **spec)  # page size: as SGLang resolves it
    config = CudaGraphConfig(decode=PhaseConfig(backend=decode_backend, bs=list(cfg.batch_sizes)),
                             prefill=PhaseConfig(backend="disabled"))
    context = runtime_context.get_context()
    if hasattr(context, "set_server_args"):  # 0.5.16+: the ServerArgs is published to the runtime context
        if hasattr(args, "override"):  # 0.5.17: its runners still read the batch sizes off the record itself
            args.override("graphpool-test", cuda_graph_config=config)
        elif not hasattr(context, "override"):  # 0.5.16: the record holds the settings, as 0.5.14's
            args.cuda_graph_config = config
        context.set_server_args(args)
        if hasattr(context, "override"):  # 0.5.17+: settings live in the runtime context's config bags
            context.override("graphpool-test", cuda_graph_config=config)
    else:  # 0.5.14: settings live on the (global) ServerArgs
        from sglang.srt.server_args import set_global_server_args_for_scheduler

        args.cuda_graph_config = config
        set_global_server_args_for_scheduler(args)
    _single_process_parallel_context()
    return args


def _single_process_parallel_context() -> None:
    """0.5.14 to 0.5.19's parallel context asks torch.distributed's groups, which a single-process test has
    not created (0.5.23 answers from the published ServerArgs): hold it at one process for the session."""
    if "override" in _SINGLE_PROCESS:
        return
    try:  # a leaf (attn_cp_size) and a width derived from the process groups (moe_ep_size, 0.5.19)
        runtime_context.get_parallel().attn_cp_size
        runtime_context.get_parallel().moe_ep_size
        return
    except (AssertionError, AttributeError, RuntimeError):
        pass
    one = dict(world_size=1, world_rank=0, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, attn_tp_size=1, attn_tp_rank=0,
               attn_cp_size=1, attn_cp_rank=0, attn_dp_size=1, attn_dp_rank=0, moe_ep_size=1, moe_ep_rank=0,
               moe_tp_size=1, moe_tp_rank=0, moe_dp_size=1, moe_dp_rank=0)
    known = getattr(runtime_context, "_PARALLEL_FIELDS", one)  # the fields this SGLang's context overrides
    override = runtime_context.get_parallel().override(**{k: v for k, v in one.items() if k in known})
    override.__enter__()
    _SINGLE_PROCESS["override"] = override  # held: a collected override restores on exit


_SINGLE_PROCESS: dict = {}  # SGLang 0.5.14 / 0.5.17's parallel context, held at one process for the session


class EagerSteps:
    """The eager path ``_forward_raw`` takes when no graph serves a step (the oracle): attention metadata
    for the batch, then the model, under the forward context ``_forward_raw`` opened."""

    def __init__(self, model_runner: Any):
        self.model_runner = model_runner

    def execute(self, forward_batch: ForwardBatch, pp_proxy_tensors: Any = None, **kwargs: Any) -> LogitsProcessorOutput:
        mr = self.model_runner
        mr.attn_backend.init_forward_metadata(forward_batch)
        return mr.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)


class RunnerApiModelRunner(H.HarnessModelRunner):
    """The classic harness runner with 0.5.14+'s surfaces: ``decode_cuda_graph_runner``, an eager runner,
    a real published ``ServerArgs``, and SGLang's own ``_forward_raw``."""

    _forward_raw = ModelRunner._forward_raw

    def __init__(self, cfg: H.HarnessConfig, device: torch.device, speculative: bool, model_seed: int = 0,
                 topk: int = 1, server_args: Optional[ServerArgs] = None):
        super().__init__(cfg, device, speculative, model_seed)
        self.server_args = server_args or publish(cfg, speculative=speculative, topk=topk)
        self.server_args.speculative_eagle_topk = topk
        self.eager_runner = EagerSteps(self)
        self.decode_cuda_graph_runner = None
        self.prefill_cuda_graph_runner = None
        self.lora_manager = None
        self.pp_group = SimpleNamespace(is_last_rank=True)
        # One process, no decode context parallelism: where 0.5.18 to 0.5.20 (ps) and 0.5.21 (its own) read it.
        self.ps = SimpleNamespace(attn_dcp_size=1, attn_dcp_rank=0)
        self.attn_dcp_size, self.attn_dcp_rank = 1, 0
        self.model.shared_experts_config = None  # read by _forward_raw's model-context override

    init_new_workspace = False  # read and restored by SGLang's build_adaptive_runtime_state

    def _get_attention_backend(self, init_new_workspace: bool = False) -> H.TorchPagedAttention:
        """A new attention backend, as SGLang builds one per speculation tier: for the verify width published now
        (its tier's, while SGLang's build_adaptive_runtime_state overrides the published settings)."""
        from graphpool.integrations.sglang.fields import setting

        return H.TorchPagedAttention(self.cfg, self.req_to_token_pool, self.token_to_kv_pool,
                                     draft_tokens=setting(self, "spec", ("speculative_num_draft_tokens",)))

    def _prepare_eager_forward_batch(self, forward_batch: ForwardBatch) -> None:
        """SGLang pads eager batches for DP / attention-TP gathers here: none in a single-process server."""

    def _maybe_execute_deferred_mamba_cow_and_clear(self, forward_batch: ForwardBatch) -> None:
        """No mamba state in the harness model."""

    @property
    def graph_runner(self) -> Any:
        """The classic name, so the shared step helpers read the runner under either API."""
        return self.decode_cuda_graph_runner

    @graph_runner.setter
    def graph_runner(self, runner: Any) -> None:
        self.decode_cuda_graph_runner = runner


# ----------------------------------------------------------------------------------- a prefilled spec-v2 server
def world(*, graphs: bool = True, algorithm: Optional[str] = None, forward: Any = None,
          device: torch.device = torch.device("cpu")) -> Tuple[RunnerApiModelRunner, H.Requests, H.SlotAllocator]:
    """A prefilled harness server (EAGLE, batch sizes 1, 2, 4); ``forward`` wraps the model's forward."""
    cfg = H.HarnessConfig(batch_sizes=(1, 2, 4))
    mr = RunnerApiModelRunner(cfg, device, speculative=True)
    if algorithm is not None:
        mr.spec_algorithm = SpeculativeAlgorithm.from_string(algorithm)
    if forward is not None:
        mr.model.forward = forward(mr.model.forward)
    if graphs:
        from graphpool.integrations.sglang.runner_api import MultiModeDecodeRunner

        mr.decode_cuda_graph_runner = MultiModeDecodeRunner(mr)
    reqs = H.make_requests(cfg, cfg.max_reqs, prompt_len=6, seed=11)
    alloc = H.SlotAllocator(cfg.kv_slots)
    H.prefill(mr, reqs, alloc)
    return mr, reqs, alloc


def plain_step_inputs(mr: Any, reqs: H.Requests, alloc: H.SlotAllocator,
                      rows: List[int]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a spec-v2 plain step starts from: rows, KV lengths (slot reserved at seq_len), bonus tokens."""
    dev = mr.device
    idx = torch.tensor(rows, dtype=torch.int64, device=dev)
    lens = torch.tensor([reqs.kv_len(r) for r in rows], dtype=torch.int64, device=dev)
    mr.req_to_token_pool.req_to_token[idx, lens] = alloc.alloc(len(rows), dev).to(torch.int32)
    bonus = torch.tensor([reqs.tokens[r][-1] for r in rows], dtype=torch.int32, device=dev)
    return idx, lens, bonus


def real_sampling(mr: Any, bs: int, temperatures: Optional[torch.Tensor] = None) -> Any:
    """SGLang's real ModelRunner.sample and Sampler on the harness runner; greedy sampling on the CPU. Returns
    this SGLang's ``SamplingBatchInfo`` for ``bs`` requests (``temperatures`` ``[bs, 1]``, else ones)."""
    from sglang.srt.layers.sampler import Sampler
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    mr.sample = ModelRunner.sample.__get__(mr)
    mr._preprocess_logits = ModelRunner._preprocess_logits.__get__(mr)
    group = SimpleNamespace(device_group=None)
    try:
        with runtime_context.get_parallel().override(tp_group=group, attn_tp_group=group):
            mr.sampler = Sampler()
    except (ValueError, TypeError, AssertionError, RuntimeError):  # 0.5.14: its Sampler asks get_tp_group()
        from unittest import mock

        import sglang.srt.layers.sampler as sampler_module
        with mock.patch.object(sampler_module, "get_tp_group", lambda: group, create=True):
            mr.sampler = Sampler()
    mr.sampling_observer = mr.watermark_state = None
    mr.ngram_embedding_manager = SimpleNamespace(update_after_decode=lambda **kw: None, enabled=False)
    mr.maybe_update_ngram_token_table = lambda *a, **kw: None
    fields = {f.name for f in dataclasses.fields(SamplingBatchInfo)}
    dev = mr.device
    kwargs = dict(temperatures=torch.ones(bs, 1, device=dev) if temperatures is None else temperatures,
                  top_ps=torch.ones(bs, device=dev), top_ks=torch.ones(bs, dtype=torch.int32, device=dev),
                  min_ps=torch.zeros(bs, device=dev), is_all_greedy=True, is_any_greedy=True,
                  need_top_p_sampling=False, need_top_k_sampling=False, need_min_p_sampling=False,
                  vocab_size=mr.cfg.vocab, device=str(dev))
    return SamplingBatchInfo(**{k: v for k, v in kwargs.items() if k in fields})


def spec_v2_batch(mr: Any, idx: torch.Tensor, lens: torch.Tensor, bonus: torch.Tensor,
                  draft_hidden: Optional[torch.Tensor] = None, reqs: Optional[H.Requests] = None, **fields: Any) -> Any:
    """SGLang's real ``ScheduleBatch`` of a spec-v2 decode step as the worker gets it, made by SGLang's own code:
    ``Req`` objects (the tokens known so far as the prompt) bound to their ``req_to_token`` rows by SGLang's
    ``ReqToTokenPool.alloc`` (which keeps the row where this release keeps it: ``Req.kv`` from 0.5.23), the batch
    by ``ScheduleBatch.init_new``; then device and host lengths (host ones as without overlap), an
    ``EagleDraftInput`` carrying the bonus tokens (and the draft's hidden width), SGLang's ``SamplingBatchInfo``;
    ``fields`` set more of its fields."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    rows = idx.tolist()
    requests = bound_requests(rows, [list(reqs.tokens[r]) if reqs else [0] for r in rows])
    dev, n = idx.device, len(rows)
    spec = EagleDraftInput(bonus_tokens=bonus, topk_p=torch.zeros((n, 1), device=dev),
                           topk_index=torch.zeros((n, 1), dtype=torch.int64, device=dev), hidden_states=draft_hidden)
    batch = ScheduleBatch.init_new(requests, mr.req_to_token_pool, None, None, SimpleNamespace(vocab_size=mr.cfg.vocab),
                                   enable_overlap=False, spec_algorithm=mr.spec_algorithm)
    values = dict(spec_info=spec, seq_lens=lens, seq_lens_cpu=lens.cpu().clone(), seq_lens_sum=int(lens.sum()),
                  req_pool_indices=idx, sampling_info=real_sampling(mr, n), forward_mode=ForwardMode.DECODE,
                  device=str(dev))
    for name, value in {**values, **fields}.items():
        setattr(batch, name, value)
    return batch


def bound_requests(rows: List[int], tokens: List[List[int]], max_new_tokens: int = 256) -> List[Any]:
    """SGLang's ``Req`` objects, each prompt the tokens given, bound to ``rows`` of ``req_to_token`` by SGLang's own
    ``ReqToTokenPool.alloc`` (its free rows set to ``rows``: 0.5.14 to 0.5.17 take them from the front, 0.5.23 from
    the back, so the list is ordered for this release)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.sampling.sampling_params import SamplingParams

    requests = [Req(f"r{r}", "", list(t), SamplingParams(max_new_tokens=max_new_tokens)) for r, t in zip(rows, tokens)]
    pool = ReqToTokenPool(size=max(rows, default=0) + 1, max_context_len=1, device="cpu", enable_memory_saver=False)
    pool.free_slots = list(rows)
    if pool.alloc(requests) != rows:  # a release that hands rows out in another order: reorder the free list
        raise AssertionError(f"SGLang's ReqToTokenPool.alloc did not bind rows {rows} in order")
    return requests


def spec_v2_worker(mr: Any, **fields: Any) -> SimpleNamespace:
    """The ``EAGLEWorkerV2`` attributes a plain step and the catch-up read, over the target ``mr``."""
    return SimpleNamespace(target_worker=SimpleNamespace(model_runner=mr), topk=1, **fields)


def server_args_from_cli(*argv: str) -> Optional[ServerArgs]:
    """``ServerArgs`` as SGLang's own CLI parser builds them, or None where this SGLang has no such flag."""
    import argparse
    import contextlib
    import io

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parsed = parser.parse_args(list(argv))
    except SystemExit:
        return None
    return ServerArgs.from_cli_args(parsed)

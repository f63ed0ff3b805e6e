"""What both SGLang adapters share: modes, step inputs, hidden-state policy, the pool, capture batches.

The classic adapter (:mod:`.runner`, SGLang's ``CudaGraphRunner`` API) and the runner-API adapter
(:mod:`.runner_api`, SGLang 0.5.14+ ``DecodeCudaGraphRunner``) differ only in API glue: method names,
where settings live, the attention backend's graph hooks. Everything about *which* graphs exist and
*what* they are captured with lives here, once. This module imports only names that both SGLang
generations have (``forward_batch_info``, ``eagle_info``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from graphpool import GraphPool, Mode, StepBatch, StepInput, UnknownModeError
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

from . import tp

#: Pool mode name of each SGLang forward mode the adapters capture.
MODE_NAMES: Dict[ForwardMode, str] = {ForwardMode.DECODE: "decode", ForwardMode.TARGET_VERIFY: "target_verify"}

GraphId = Tuple[ForwardMode, int]  # (forward mode, padded batch size)

_FORWARD_BATCH_FIELDS = frozenset(f.name for f in dataclasses.fields(ForwardBatch))

log = logging.getLogger(__name__)


def pool_mode(forward_mode: ForwardMode, captured: Dict[ForwardMode, int]) -> str:
    """The pool's mode name of a batch's forward mode; one the runner holds no graphs of raises
    :class:`~graphpool.UnknownModeError` saying so (SGLang asks ``can_run`` first and runs such steps eagerly)."""
    name = MODE_NAMES.get(forward_mode)
    if name is None or forward_mode not in captured:
        raise UnknownModeError(f"graphpool's runner holds graphs for {[m.name for m in captured]}, none for "
                               f"{getattr(forward_mode, 'name', forward_mode)} batches: check can_run() / can_run_graph() "
                               f"first (False for it: SGLang then runs the step eagerly)")
    return name


def forward_mode_of(batch: StepBatch) -> ForwardMode:
    """SGLang's forward mode of a pool step (pool mode names are the lower-case enum names)."""
    return forward_mode_of_name(batch.mode.name)


def forward_mode_of_name(name: str) -> ForwardMode:
    """SGLang's forward mode of a pool mode: its lower-case enum name, a speculation tier's verify mode
    (``target_verify_<tier>``) included."""
    return ForwardMode.TARGET_VERIFY if name.startswith("target_verify") else ForwardMode[name.upper()]


def is_speculative(spec: Any) -> bool:
    """Whether ``spec`` (a ``SpeculativeAlgorithm``) speculates. ``is_speculative()`` appeared in 0.5.11;
    ``not is_none()`` says the same on every version."""
    return not spec.is_none()


def tokens_per_mode(speculative: bool, num_draft_tokens: int) -> Dict[ForwardMode, int]:
    """Tokens per sequence of each captured mode: DECODE always, TARGET_VERIFY with speculation."""
    modes = {ForwardMode.DECODE: 1}
    if speculative:
        modes[ForwardMode.TARGET_VERIFY] = int(num_draft_tokens)
    return modes


def step_inputs(seq_len_fill_value: int, seq_lens_dtype: torch.dtype = torch.int32) -> List[StepInput]:
    """The pool's inputs, with the dtypes of SGLang's own decode buffers (int32 ``seq_lens`` in the
    classic runner, int64 from 0.5.14) so attention backends see what they expect. Padded rows:
    ``seq_lens`` = the backend's fill value, ``out_cache_loc`` = 0, SGLang's dummy KV slot."""
    return [StepInput("input_ids", torch.int64, per="token"),
            StepInput("positions", torch.int64, per="token"),
            StepInput("out_cache_loc", torch.int64, per="token", fill=0),
            StepInput("seq_lens", seq_lens_dtype, per="seq", fill=seq_len_fill_value),
            StepInput("req_pool_indices", torch.int64, per="seq", fill=0)]


def initial_hidden_modes(spec: Any, server_mode: CaptureHiddenMode) -> Dict[ForwardMode, CaptureHiddenMode]:
    """Hidden-state capture mode per forward mode, kept per mode (SGLang keeps one per runner).

    EAGLE's draft model reads the target's hidden states of every token it verifies, and of the token a
    plain-decode step produced: both modes capture FULL for EAGLE. ``server_mode`` is what the server
    returns to users (``--enable-return-hidden-states``).
    """
    eagle = is_speculative(spec) and not spec.is_standalone()
    mode = max(CaptureHiddenMode.FULL if eagle else CaptureHiddenMode.NULL, server_mode)
    return {m: mode for m in tokens_per_mode(is_speculative(spec), 1)}


def requested_hidden_mode(forward_batch: Any) -> CaptureHiddenMode:
    """The hidden states a batch asks for, from the batch and its ``spec_info``."""
    spec_mode = getattr(forward_batch.spec_info, "capture_hidden_mode", None)
    return max(forward_batch.capture_hidden_mode or CaptureHiddenMode.NULL, spec_mode or CaptureHiddenMode.NULL)


def hidden_mode_served(requested: CaptureHiddenMode, captured: CaptureHiddenMode) -> bool:
    """Whether graphs captured with ``captured`` return what ``requested`` needs (SGLang's rule: NULL or equal)."""
    return requested == CaptureHiddenMode.NULL or requested == captured


def graph_memory_pool(device: Any, get_pool: Callable[[], Any], set_pool: Callable[[Any], None]) -> Any:
    """SGLang's global graph memory pool (created here if this runner captures first), so SGLang's own
    graph runners (the EAGLE draft runners) share memory with the pool's graphs. ``None`` off CUDA."""
    if torch.device(device).type != "cuda":
        return None
    if get_pool() is None:
        set_pool(torch.cuda.graph_pool_handle())
    return get_pool()


def build_pool(modes: Dict[ForwardMode, int], inputs: List[StepInput], batch_sizes: List[int], device: Any,
               backend: str, memory_pool: Any) -> GraphPool:
    """One pool for every captured (forward mode, batch size), in ``memory_pool``; a step past the largest
    captured size raises (SGLang's ``can_run`` / ``can_run_graph`` keep such steps off the graphs)."""
    return GraphPool([Mode(MODE_NAMES[m], n) for m, n in modes.items()], inputs, batch_sizes, device=device,
                     backend=backend, on_miss="raise", memory_pool=memory_pool)


def pool_graphs(pool: GraphPool) -> Dict[GraphId, Any]:
    """(forward mode, bs) -> the captured graph (a ``torch.cuda.CUDAGraph`` on the CUDA backend)."""
    return {(mode, bs): pool.graph(name, bs) for mode, name in MODE_NAMES.items()
            for bs in pool.batch_sizes.get(name, ())}


def capture_graphs(runner: Any) -> None:
    """Both runners' ``capture``: every (forward mode, batch size), largest token count first, into the
    shared pool, inside the runner's ``_capture_context()``; ``runner._prepare_capture`` sees
    ``runner._capturing`` set. Sets ``runner.graphs``. The step returns ``runner.output_names``, each with
    one row per token: SGLang's own runners cut every one of them to the real token count."""
    runner._capture_batches.clear()
    runner.output_buffers.clear()
    runner._capturing = True
    try:
        with runner._capture_context():  # under TP > 1 a capture that fails on one rank fails on every rank
            tp.capture_on_every_rank(lambda: runner.pool.capture(
                runner._run_model, prepare=runner._prepare_capture, progress=False,
                outputs=dict.fromkeys(runner.output_names, "token")))
    finally:
        runner._capturing = False
    runner.graphs = pool_graphs(runner.pool)
    log.info("graphpool captured %d graphs for %s at batch sizes %s", len(runner.graphs),
             [m.name for m in runner.tokens_per_mode], runner.capture_bs)


def logits_buffer(model_runner: Any, max_num_token: int, device: Any) -> Optional[torch.Tensor]:
    """One float32 ``[max tokens, vocab]`` buffer that every graph's logits are copied into, as SGLang's own
    runner does (``next_token_logits_buffer``). Without it each graph keeps its own logits in the graph
    memory pool: seen live, 650 MiB of graphs for DECODE + TARGET_VERIFY against SGLang's 190 MiB."""
    vocab = getattr(getattr(model_runner, "model_config", None), "vocab_size", None)
    if "next_token_logits_buffer" not in _FORWARD_BATCH_FIELDS or not vocab:
        return None
    return torch.zeros((max_num_token, vocab), dtype=torch.float, device=device)


def capture_forward_batch(model_runner: Any, attn_backend: Any, batch: StepBatch, *, seq_lens_cpu: torch.Tensor,
                          spec_info: Any, capture_hidden_mode: CaptureHiddenMode,
                          num_token_non_padded: Optional[torch.Tensor], logits: Optional[torch.Tensor] = None,
                          **extra: Any) -> ForwardBatch:
    """The static ForwardBatch a graph of ``batch``'s key is captured with, over the pool's views.

    Fields this SGLang's ForwardBatch does not have (the pools and attention backend moved out of it in
    0.5.14) are dropped, so both adapters build it here. ``extra`` adds generation-specific fields.
    """
    views, bs, mode = batch.inputs, batch.bs, forward_mode_of(batch)
    fields = dict(
        forward_mode=mode, batch_size=bs, input_ids=views["input_ids"], req_pool_indices=views["req_pool_indices"],
        seq_lens=views["seq_lens"], seq_lens_cpu=seq_lens_cpu[:bs], orig_seq_lens=views["seq_lens"],
        req_to_token_pool=model_runner.req_to_token_pool, token_to_kv_pool=model_runner.token_to_kv_pool,
        attn_backend=attn_backend, out_cache_loc=views["out_cache_loc"],
        seq_lens_sum=int(seq_lens_cpu[:bs].sum()), return_logprob=False, positions=views["positions"],
        spec_algorithm=model_runner.spec_algorithm, spec_info=spec_info, capture_hidden_mode=capture_hidden_mode,
        num_token_non_padded=num_token_non_padded, global_forward_mode=mode,
        next_token_logits_buffer=None if logits is None else logits[:batch.num_tokens], **extra)
    return ForwardBatch(**{k: v for k, v in fields.items() if k in _FORWARD_BATCH_FIELDS})


def verify_capture_input(model_runner: Any, custom_mask: torch.Tensor, *, num_steps: int, num_draft_tokens: int,
                         topk: int) -> Any:
    """The EAGLE verify input TARGET_VERIFY graphs are captured with (no draft yet; a static tree mask)."""
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    spec = model_runner.spec_algorithm
    # The tree's index fields are spelt "retrive_*" up to 0.5.10, "retrieve_*" from 0.5.11.
    names = {f.name for f in dataclasses.fields(EagleVerifyInput)}
    prefix = "retrieve" if "retrieve_index" in names else "retrive"
    tree = {f"{prefix}_{part}": None for part in ("index", "next_token", "next_sibling", "cum_len")}
    return EagleVerifyInput(
        draft_token=None, custom_mask=custom_mask, positions=None, **tree, spec_steps=num_steps, topk=topk,
        draft_token_num=num_draft_tokens,
        capture_hidden_mode=CaptureHiddenMode.NULL if spec.is_standalone() else CaptureHiddenMode.FULL,
        seq_lens_sum=None, seq_lens_cpu=None)


@contextlib.contextmanager
def capture_context(device: Any, memory_pool: Any, set_graph_pool_id: Callable[[Any], None],
                    model_capture_mode: Callable[[], Any]) -> Iterator[None]:
    """What SGLang wraps its own capture in, for both runner generations (they import the two helpers from
    different modules). ``graph_capture()`` lets tensor-parallel all-reduce register the graphs' buffers; it
    needs the TP group, which a single-process test harness does not create."""
    from sglang.srt.distributed import parallel_state

    on_cuda = torch.device(device).type == "cuda"
    if on_cuda:  # symmetric-memory all-reduce looks the graph pool up by this id
        set_graph_pool_id(memory_pool)
    with model_capture_mode():
        if on_cuda and parallel_state.model_parallel_is_initialized():
            with parallel_state.graph_capture():
                yield
        else:
            yield

"""The dynamic speculation switch for SGLang's spec-v2 worker (runner API, 0.5.14+), at any ``topk``.

Above ``off_above`` running requests a decode step is a **plain step**: one token per request, the target
in DECODE mode (spec_info ``None``), which :class:`~.runner_api.MultiModeDecodeRunner` routes to a DECODE
graph. A plain step does **no draft work**: no draft tree, no draft extend. The draft model's KV falls
behind instead, and :class:`DraftLag` records from which position, per request. When speculation turns
back on (at ``on_at_or_below``, hysteresis) the lagging requests catch up with ONE draft extend over the
tokens they decoded plainly, fed the target hidden states those plain steps produced, exactly like a
draft prefill of a chunk; speculation then resumes from an in-step draft.

Where the user turns on SGLang's own ``--speculative-adaptive`` (which steps down to 0 draft steps by
batch size, EAGLE/EAGLE3 at topk 1 only), its step 0 becomes a plain step too, instead of SGLang's
1-token TARGET_VERIFY graph plus a draft extend.

The step logic is plain tensors on SGLang objects (:func:`plain_decode_batch`, :class:`DraftLag`) and is
what the CPU harness drives; :func:`install_speculation_switch` wires it into ``EAGLEWorkerV2``.

Spec v2 reserves KV slots ahead (``eagle_prepare_for_decode`` over-allocates for the next verify), so a
plain step allocates nothing: its one slot per request is already in ``req_to_token`` at ``seq_len``.

Under the overlap scheduler (SGLang's default) nothing here waits for the GPU on a plain step: with attention
backends that need no host lengths (FA3, Triton, trtllm_mha) the scheduler passes ``seq_lens_cpu = None``, and
the plain step plans from the device lengths, keys requests by their host row (:func:`~.fields.req_pool_idx`), and leaves the
lag's positions on the device (:class:`DraftLag`); the target's read-done event goes to the runner the
scheduler's barrier reads. A structured-output request's grammar first takes the previous step's tokens (the
scheduler's grammar barrier, 0.5.17+), as SGLang's own verify does before it builds a mask.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from typing import Any, List, Optional, Protocol

import torch

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

from . import tier_plan
from .draft_lag import DraftLag
from .eagle_v1_plain import PLAIN_STEP
from .fields import req_pool_rows
from .runner_api_support import hand_over_read_done, rejection_sampling
from .spec_switch import SpeculationSwitch, _log_flip
from .spec_v2_metrics import process_decode_result
from .patch import plain_step_refusal

log = logging.getLogger(__name__)

__all__ = ["SpeculationSwitch", "DraftLag", "plain_decode_batch", "catch_up_view", "install_speculation_switch",
           "install_step_choice", "uninstall_speculation_switch"]


def plain_decode_batch(model_runner: Any, *, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                       seq_lens_cpu: Optional[torch.Tensor], bonus_tokens: torch.Tensor) -> ForwardBatch:
    """The DECODE ForwardBatch of a spec-v2 plain step.

    Args:
        model_runner: the target ``ModelRunner``.
        req_pool_indices: each request's row in ``req_to_token``.
        seq_lens, seq_lens_cpu: tokens each request has in the KV cache *before* this step; the bonus
            token (the last one verified or decoded) is not among them: it is this step's input.
            ``seq_lens_cpu`` is ``None`` under the overlap scheduler with an attention backend that needs no
            host lengths; the batch then carries none either (``seq_lens_cpu``, ``seq_lens_sum`` ``None``, as
            SGLang's own batches then do).
        bonus_tokens: that token per request.

    Returns:
        A ``ForwardBatch`` in DECODE mode, ``spec_info=None``, hidden states FULL for EAGLE (the draft
        catch-up reads them) and none for a STANDALONE draft (it reads tokens only: the DECODE graphs are
        captured without them), ``seq_lens`` advanced by one, writing K/V at the slot spec v2 reserved at
        ``seq_len``.

    Raises:
        ValueError: the rows disagree, or (with host lengths) ``seq_len`` is past ``req_to_token``'s columns.
            The slot at ``seq_len`` is trusted to be reserved (checking it would cost a device sync per step).
    """
    bs = req_pool_indices.shape[0]
    host_rows = bs if seq_lens_cpu is None else seq_lens_cpu.shape[0]
    if not (seq_lens.shape[0] == host_rows == bonus_tokens.shape[0] == bs):
        raise ValueError(f"plain decode step: {bs} requests but seq_lens {tuple(seq_lens.shape)}, seq_lens_cpu "
                         f"{None if seq_lens_cpu is None else tuple(seq_lens_cpu.shape)}, bonus_tokens "
                         f"{tuple(bonus_tokens.shape)}; pass one row each")
    table = model_runner.req_to_token_pool.req_to_token
    if bs and seq_lens_cpu is not None and int(seq_lens_cpu.max()) >= table.shape[1]:
        raise ValueError(f"plain decode step at position {int(seq_lens_cpu.max())} past req_to_token's "
                         f"{table.shape[1]} columns")
    out_cache_loc = table[req_pool_indices, seq_lens.long()].to(torch.int64)
    spec = model_runner.spec_algorithm
    hidden = CaptureHiddenMode.NULL if spec is not None and spec.is_standalone() else CaptureHiddenMode.FULL
    fields = dict(
        forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=bonus_tokens.to(torch.int64),
        req_pool_indices=req_pool_indices, seq_lens=seq_lens + 1,
        seq_lens_cpu=None if seq_lens_cpu is None else seq_lens_cpu + 1, orig_seq_lens=seq_lens + 1,
        out_cache_loc=out_cache_loc, seq_lens_sum=None if seq_lens_cpu is None else int(seq_lens_cpu.sum()) + bs,
        positions=seq_lens.to(torch.int64), spec_info=None, capture_hidden_mode=hidden, spec_algorithm=spec)
    return ForwardBatch(**fields)


def batch_rows(batch: Any) -> List[int]:
    """Each request's ``req_to_token`` row, from the host (:func:`~.fields.req_pool_idx`): reading the batch's
    device ``req_pool_indices`` would wait for the GPU every step."""
    return req_pool_rows(batch.reqs)


# ----------------------------------------------------------------------------------- EAGLEWorkerV2 wiring
def eagle_v2_plain_decode(worker: Any, batch: Any, lag: DraftLag, on_publish: Any = None,
                          grammar_barrier: Any = None) -> Any:
    """One plain step of a spec-v2 decode ``batch``: the target on a DECODE graph, sampled, no draft work.

    ``on_publish`` and ``grammar_barrier`` are what SGLang's scheduler passed ``forward_batch_generation``:
    the next step's lengths are published with the first, and the second (overlap, 0.5.17+) makes the grammars
    of structured-output requests take the previous step's tokens before this step's mask is built (SGLang's
    verify does the same); without it the mask would follow a grammar one step behind.

    Returns SGLang's ``GenerationBatchResult`` shaped like its own 0-step (trivial verify) result: one
    token per request, ``accept_lens`` 1, the logprobs the batch asks for (SGLang's sampler computes them
    as for plain decoding), and a next ``EagleDraftInput`` whose ``bonus_tokens`` are the new tokens (the
    draft fields are zero stubs of the draft's own widths; the catch-up rebuilds them before the next
    speculative step).
    """
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    target = worker.target_worker.model_runner
    draft_input, bs = batch.spec_info, batch.seq_lens.shape[0]
    rows = batch_rows(batch)
    fb = plain_decode_batch(target, req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens,
                            seq_lens_cpu=batch.seq_lens_cpu, bonus_tokens=draft_input.bonus_tokens)
    fb.sampling_info = batch.sampling_info
    grammar = bool(getattr(batch, "has_grammar", False))
    if fb.sampling_info is not None:  # the sampler masks by these; SGLang's ForwardBatch.init_new sets them so
        fb.sampling_info.grammars = [req.grammar for req in batch.reqs] if grammar else None
    for name in _LOGPROB_FIELDS:  # what the scheduler reads back for requests that asked for logprobs
        setattr(fb, name, getattr(batch, name, getattr(fb, name)))
    out = target.forward(fb)
    hand_over_read_done(worker, target)
    if grammar_barrier is not None and grammar:
        grammar_barrier()  # host work, after the forward's launch: it overlaps the GPU, as in SGLang's verify
    next_ids = target.sample(out.logits_output, fb)
    new_seq_lens = batch.seq_lens + 1
    if on_publish is not None:
        on_publish(new_seq_lens)
    kv_lens = batch.seq_lens if batch.seq_lens_cpu is None else batch.seq_lens_cpu.tolist()
    lag.record(rows, kv_lens, out.logits_output.hidden_states)
    next_draft = EagleDraftInput(
        bonus_tokens=next_ids.to(torch.int32), topk_p=torch.zeros((bs, worker.topk), device=next_ids.device),
        topk_index=torch.zeros((bs, worker.topk), dtype=torch.int64, device=next_ids.device),
        hidden_states=_stub_like(getattr(draft_input, "hidden_states", None), bs))
    if rejection_sampling(target):  # SGLang's draft inputs then carry the draft's distribution too
        next_draft.draft_probs = _stub_like(getattr(draft_input, "draft_probs", None), bs)
    result = dict(
        logits_output=out.logits_output, next_token_ids=next_ids, can_run_cuda_graph=out.can_run_graph,
        speculative_num_draft_tokens=1, next_draft_input=next_draft,
        accept_lens=torch.ones(bs, dtype=torch.int32, device=next_ids.device),
        accept_index=torch.arange(bs, device=next_ids.device)[:, None], new_seq_lens=new_seq_lens)
    fields = {f.name for f in dataclasses.fields(GenerationBatchResult)}  # accept_index is 0.5.2x's only
    out = GenerationBatchResult(**{k: v for k, v in result.items() if k in fields})
    setattr(out, PLAIN_STEP, True)  # kept out of SGLang's speculation metrics (spec_v2_metrics)
    return out


def _stub_like(carried: Optional[torch.Tensor], bs: int) -> Optional[torch.Tensor]:
    """Zeros of the width a draft field came with (EAGLE3's draft hidden states are not the target's width;
    ``draft_probs`` have the draft's vocabulary), for ``bs`` rows; None where the draft input had none."""
    return None if carried is None else carried.new_zeros((bs,) + tuple(carried.shape[1:]))


#: Draft-input fields the catch-up writes back for the rows it caught up.
_DRAFT_FIELDS = ("topk_p", "topk_index", "hidden_states", "draft_probs")


def eagle_v2_catch_up(worker: Any, batch: Any, lag: DraftLag) -> None:
    """Before a speculative step: one draft extend over the tokens lagging requests decoded plainly, fed
    the hidden states their plain steps produced (as a draft prefill of that chunk); the result becomes
    those requests' draft input for this step."""
    if not len(lag):  # the usual speculative step: nothing lags, nothing to read
        return
    rows = batch_rows(batch)
    gaps = lag.take(rows)
    if not gaps:
        return
    idx = [i for i, r in enumerate(rows) if r in gaps]
    # The batch's own lengths (host copy, else one read of the device's per resume) must be where each lag
    # ends; a row that disagrees is not caught up (its draft proposes from stale state: outputs stay exact).
    lens = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens
    held = [int(v) for v in lens[torch.tensor(idx, dtype=torch.int64, device=lens.device)].tolist()]
    for i, n in zip(list(idx), held):
        if gaps[rows[i]].end != n:
            log.warning("graphpool draft catch-up: row %d lags up to %d but holds %d tokens; not caught up",
                        rows[i], gaps[rows[i]].end, n)
            idx.remove(i)
    if not idx:
        return
    chunks = [gaps[rows[i]] for i in idx]
    kept = [chunk.hidden for chunk in chunks]
    hidden = torch.cat(kept) if kept[0] is not None else None  # None: a STANDALONE draft reads tokens only
    view = catch_up_view(batch, idx, [c.start for c in chunks], [c.end for c in chunks])
    log.info("graphpool draft catch-up: %d requests, %d tokens in one draft extend", len(idx),
             sum(c.end - c.start for c in chunks))
    rows_device = torch.tensor(idx, dtype=torch.int64, device=batch.seq_lens.device)
    draft_input = worker.draft_worker._draft_extend_for_prefill(view, hidden, batch.spec_info.bonus_tokens[rows_device])
    for name in _DRAFT_FIELDS:
        full, new = getattr(batch.spec_info, name, None), getattr(draft_input, name, None)
        if new is None:
            continue
        if full is not None:
            full[rows_device] = new.to(full.dtype)
        elif len(idx) == len(rows):  # every row caught up: the field is the catch-up's
            setattr(batch.spec_info, name, new)


def catch_up_view(batch: Any, idx: List[int], starts: List[int], ends: List[int]) -> Any:
    """The batch SGLang's draft prefill (``_draft_extend_for_prefill``, through ``ForwardBatch.init_new``) sees
    for the catch-up: an EXTEND batch of rows ``idx`` only, each over positions ``[starts[i], ends[i])``.

    A shallow copy of ``batch`` with every per-request field SGLang's ``init_new`` and the draft prefill read
    cut to those rows (requests, lengths and their sum, the sampling parameters: the draft's distribution is
    tempered per row under rejection sampling), no logprobs, and nothing of a chunked prefill; the worker's
    batch keeps its own fields.
    """
    import copy

    table = batch.req_to_token_pool.req_to_token
    device = batch.seq_lens.device
    rows = req_pool_rows(batch.reqs[i] for i in idx)
    lens = [e - s for s, e in zip(starts, ends)]
    view = copy.copy(batch)
    view.forward_mode = ForwardMode.EXTEND
    view.reqs = [batch.reqs[i] for i in idx]
    view.req_pool_indices = torch.tensor(rows, dtype=batch.req_pool_indices.dtype, device=device)
    view.input_ids = torch.cat([_committed_tokens(batch.reqs[i], s, e, device) for i, s, e in zip(idx, starts, ends)])
    view.out_cache_loc = torch.cat([table[r, s:e].to(torch.int64) for r, s, e in zip(rows, starts, ends)])
    view.extend_lens, view.prefix_lens, view.extend_num_tokens = lens, list(starts), sum(lens)
    view.extend_logprob_start_lens = list(lens)
    view.seq_lens = torch.tensor(ends, dtype=batch.seq_lens.dtype, device=device)
    view.seq_lens_cpu = torch.tensor(ends, dtype=torch.int64)
    view.orig_seq_lens, view.seq_lens_sum = view.seq_lens, sum(ends)
    view.return_logprob, view.top_logprobs_nums, view.token_ids_logprobs = False, None, None
    view.sampling_info = _sampling_rows(batch.sampling_info, idx, len(batch.reqs))
    for name, value in (("req_pool_indices_cpu", torch.tensor(rows, dtype=torch.int64)),  # 0.5.23
                        ("max_seq_len_host", max(ends)), ("chunked_req", None), ("chunked_req_next_prompt_token", None),
                        ("input_embeds", None), ("extend_input_logprob_token_ids", None),
                        ("decoding_reqs", view.reqs)):  # decoding requests, no prefill chunk among them
        if hasattr(batch, name):
            setattr(view, name, value)
    mm = getattr(batch, "multimodal_inputs", None)
    if isinstance(mm, list) and len(mm) == len(batch.reqs):
        view.multimodal_inputs = [mm[i] for i in idx]
    return view


#: Per-request tensors of SGLang's ``SamplingBatchInfo`` (its own ``filter_batch`` cuts the same ones).
_SAMPLING_ROWS = ("temperatures", "top_ps", "top_ks", "min_ps", "sampling_seed", "logit_bias")


def _sampling_rows(info: Any, idx: List[int], bs: int) -> Any:
    """A shallow copy of ``info`` with its per-request tensors cut to rows ``idx`` (the batch's keeps them all;
    SGLang's ``filter_batch`` would also filter the batch's penalizers in place)."""
    import copy

    if info is None:
        return None
    rows = copy.copy(info)
    for name in _SAMPLING_ROWS:
        value = getattr(info, name, None)
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == bs:
            setattr(rows, name, value[torch.tensor(idx, dtype=torch.int64, device=value.device)])
    return rows


def _committed_tokens(req: Any, start: int, end: int, device: Any) -> torch.Tensor:
    tokens = list(req.origin_input_ids) + list(req.output_ids)
    return torch.tensor(tokens[start:end], dtype=torch.int64, device=device)


_LOGPROB_FIELDS = ("return_logprob", "top_logprobs_nums", "token_ids_logprobs")

_original_forward: Optional[Any] = None


class StepChoice(Protocol):
    """What decides each decode step of the wrapped worker: :class:`SwitchChoice` (the switch, and SGLang's adaptive
    step count) or :class:`~.spec_tiers.TierChoice` (graphpool's speculation tiers)."""

    def speculate(self, worker: Any, batch_size: int) -> bool:
        """Whether this step speculates, on the worker's state as this call leaves it (False: a plain step)."""

    def ran(self, worker: Any, result: Any) -> None:
        """After SGLang's speculative step: ``result`` is its ``GenerationBatchResult``."""

    def processed(self, batch: Any, result: Any) -> None:
        """After the scheduler processed a speculative step's result (its per-request accepted drafts on the host)."""


class SwitchChoice:
    """The speculation switch's choice: plain above its threshold (hysteresis), and at SGLang's adaptive step 0."""

    def __init__(self, switch: SpeculationSwitch):
        self.switch = switch

    def speculate(self, worker: Any, batch_size: int) -> bool:
        worker.activate_step_by_batch(batch_size)  # SGLang's adaptive step count, if on
        flips = self.switch.switches
        speculate = self.switch.speculate(batch_size)
        if self.switch.switches != flips:
            _log_flip(worker, speculate, batch_size, self.switch)
        return speculate and worker.speculative_num_steps != 0

    def ran(self, worker: Any, result: Any) -> None:
        """Nothing to note: SGLang's adaptive controller hears the step's acceptance itself."""

    def processed(self, batch: Any, result: Any) -> None:
        """Nothing to note (see :meth:`ran`)."""


def install_speculation_switch(off_above: Optional[int], on_at_or_below: Optional[int] = None) -> SpeculationSwitch:
    """Make SGLang's spec-v2 EAGLE worker decode plainly above ``off_above`` requests (in this process), and
    route SGLang's adaptive step 0 (``--speculative-adaptive``) to plain steps. ``off_above=None``: only the
    adaptive routing. Prefill batches and speculative steps keep SGLang's path (after a draft catch-up)."""
    switch = SpeculationSwitch(off_above if off_above is not None else 2**62, on_at_or_below)
    install_step_choice(SwitchChoice(switch))
    if off_above is None:
        log.info("graphpool: SGLang's adaptive step 0 as plain steps on DECODE graphs (no speculation switch)")
    else:
        log.info("graphpool: spec v2 plain decode above %d requests, back on at <= %d; adaptive step 0 on DECODE "
                 "graphs", off_above, switch.policy.on_at_or_below)
    return switch


def install_step_choice(choice: StepChoice) -> None:
    """Wrap ``EAGLEWorkerV2.forward_batch_generation`` (in this process): each decode step asks ``choice`` whether it
    speculates; a plain step runs on the target's DECODE graph with no draft work, and the first speculative step of
    a request after plain ones catches its draft up first. Prefill batches and speculative steps keep SGLang's path."""
    global _original_forward
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    lag = DraftLag(keep_hidden=None)  # EAGLE's plain steps give hidden states, a STANDALONE draft's none
    original = _original_forward or EAGLEWorkerV2.forward_batch_generation
    # This SGLang's own parameters after (self, batch): 0.5.14 takes on_publish only, 0.5.2x adds
    # grammar_barrier and pp_proxy_tensors. Calls pass through as they came.
    position = {name: i for i, name in enumerate(list(inspect.signature(original).parameters)[2:])}

    def argument(name: str, args: tuple, kwargs: dict) -> Any:
        if name in kwargs:
            return kwargs[name]
        i = position.get(name)
        return args[i] if i is not None and i < len(args) else None

    warned = []  # the refusal below is logged once

    def plain_steps_refused(worker: Any) -> bool:
        """SGLang's own runner is the target's (install() refused the server): a plain step, or an adaptive
        step 0 routed to one, would replay its verify graphs, so SGLang's path runs every step instead."""
        from .runner_api import MultiModeDecodeRunner

        target = getattr(getattr(worker, "target_worker", None), "model_runner", None)
        runner = getattr(target, "decode_cuda_graph_runner", None)
        if runner is getattr(target, "eager_runner", None):  # --disable-cuda-graph: plain steps run eagerly
            runner = None
        refusal = plain_step_refusal(runner, MultiModeDecodeRunner)
        if refusal and not warned:
            warned.append(refusal)
            log.warning("graphpool switch: %s", refusal)
        return refusal is not None

    @functools.wraps(original)
    def forward_batch_generation(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        on_publish = argument("on_publish", args, kwargs)
        pp_proxy_tensors = argument("pp_proxy_tensors", args, kwargs)
        decode = not (batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle())
        if decode and pp_proxy_tensors is None and batch.spec_info is not None and not plain_steps_refused(self):
            if not choice.speculate(self, batch.seq_lens.shape[0]):
                return eagle_v2_plain_decode(self, batch, lag, on_publish, argument("grammar_barrier", args, kwargs))
            eagle_v2_catch_up(self, batch, lag)
            result = original(self, batch, *args, **kwargs)
            choice.ran(self, result)
            return result
        if not decode and len(lag):  # prefilled afresh (a row reused, a request re-prefilled): no lag
            lag.forget(req_pool_rows(batch.reqs))
        return original(self, batch, *args, **kwargs)

    forward_batch_generation.graphpool_switch = getattr(choice, "switch", choice)  # type: ignore[attr-defined]
    forward_batch_generation.graphpool_choice = choice  # type: ignore[attr-defined]  # for inspection
    forward_batch_generation.graphpool_lag = lag  # type: ignore[attr-defined]
    _original_forward = original
    EAGLEWorkerV2.forward_batch_generation = forward_batch_generation
    tier_plan.note_plain_steps(True)
    _keep_plain_steps_out_of_spec_metrics(choice)
    _say_where_the_switch_does_not_act()


#: SGLang's spec-v2 workers with a ``forward_batch_generation`` of their own, which the switch does not drive
#: (the launcher refuses the switch for them: :func:`~.support.switch_refusals`).
_OWN_WORKERS = (("sglang.srt.speculative.multi_layer_eagle_worker_v2", "MultiLayerEagleWorkerV2", "multi-layer EAGLE"),
                ("sglang.srt.speculative.frozen_kv_mtp_worker_v2", "FrozenKVMTPWorkerV2", "the frozen-KV MTP draft"))
_own_originals: dict = {}  # worker class -> its own forward_batch_generation


def _say_where_the_switch_does_not_act() -> None:
    """Where the switch is installed in a process of its own (not through the launcher, which refuses these
    setups), a worker the switch does not drive logs so once, on its first step, instead of silently
    speculating at every batch size."""
    import importlib

    for module, name, what in _OWN_WORKERS:
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, RuntimeError, OSError):  # absent, or its kernels are not there
            continue
        own = cls.__dict__.get("forward_batch_generation")
        if own is None or cls in _own_originals:
            continue
        _own_originals[cls] = own
        cls.forward_batch_generation = _warn_once(own, f"graphpool switch: {what} runs on SGLang's {name}, which "
                                                       f"the switch does not drive; speculation stays on at every "
                                                       f"batch size")


def _warn_once(method: Any, message: str) -> Any:
    warned = []

    @functools.wraps(method)
    def warning_once(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not warned:
            warned.append(True)
            log.warning(message)
        return method(self, *args, **kwargs)
    return warning_once


_original_process_decode: Optional[Any] = None
_processed: List[StepChoice] = []  # the choice that hears each processed speculative step (the latest installed)


def _keep_plain_steps_out_of_spec_metrics(choice: StepChoice) -> None:
    """Wrap SGLang's ``SchedulerBatchResultProcessor.process_batch_result_decode`` (0.5.14 to 0.5.23): a plain step's
    result leaves the speculation metrics (:mod:`.spec_v2_metrics`); a speculative step's goes to ``choice`` once
    SGLang has processed it."""
    global _original_process_decode
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor

    _processed[:] = [choice]
    if _original_process_decode is not None:
        return
    original = _original_process_decode = SchedulerBatchResultProcessor.process_batch_result_decode

    @functools.wraps(original)
    def process_batch_result_decode(self: Any, batch: Any, result: Any, *args: Any, **kwargs: Any) -> Any:
        out = process_decode_result(lambda *a: original(*a, *args, **kwargs), self, batch, result)
        if _processed and not getattr(result, PLAIN_STEP, False):
            _processed[0].processed(batch, result)
        return out

    SchedulerBatchResultProcessor.process_batch_result_decode = process_batch_result_decode


def uninstall_speculation_switch() -> None:
    """Restore SGLang's ``forward_batch_generation`` methods and ``process_batch_result_decode`` the switch wrapped."""
    global _original_forward, _original_process_decode
    _processed.clear()
    tier_plan.note_plain_steps(False)
    if _original_process_decode is not None:
        from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor

        SchedulerBatchResultProcessor.process_batch_result_decode = _original_process_decode
        _original_process_decode = None
    if _original_forward is not None:
        from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

        EAGLEWorkerV2.forward_batch_generation = _original_forward
        _original_forward = None
    for cls, own in list(_own_originals.items()):
        cls.forward_batch_generation = own
        del _own_originals[cls]

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
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from typing import Any, Optional

import torch

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

from .draft_lag import DraftLag
from .spec_switch import SpeculationSwitch
from .patch import plain_step_refusal

log = logging.getLogger(__name__)

__all__ = ["SpeculationSwitch", "DraftLag", "plain_decode_batch", "install_speculation_switch",
           "uninstall_speculation_switch"]


def plain_decode_batch(model_runner: Any, *, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                       seq_lens_cpu: torch.Tensor, bonus_tokens: torch.Tensor) -> ForwardBatch:
    """The DECODE ForwardBatch of a spec-v2 plain step.

    Args:
        model_runner: the target ``ModelRunner``.
        req_pool_indices: each request's row in ``req_to_token``.
        seq_lens, seq_lens_cpu: tokens each request has in the KV cache *before* this step; the bonus
            token (the last one verified or decoded) is not among them: it is this step's input.
        bonus_tokens: that token per request.

    Returns:
        A ``ForwardBatch`` in DECODE mode, ``spec_info=None``, hidden states FULL for EAGLE (the draft
        catch-up reads them) and none for a STANDALONE draft (it reads tokens only: the DECODE graphs are
        captured without them), ``seq_lens`` advanced by one, writing K/V at the slot spec v2 reserved at
        ``seq_len``.

    Raises:
        ValueError: the rows disagree, or ``seq_len`` is past ``req_to_token``'s columns. The slot at
            ``seq_len`` is trusted to be reserved (checking it would cost a device sync per step).
    """
    bs = req_pool_indices.shape[0]
    if not (seq_lens.shape[0] == seq_lens_cpu.shape[0] == bonus_tokens.shape[0] == bs):
        raise ValueError(f"plain decode step: {bs} requests but seq_lens {tuple(seq_lens.shape)}, seq_lens_cpu "
                         f"{tuple(seq_lens_cpu.shape)}, bonus_tokens {tuple(bonus_tokens.shape)}; pass one row each")
    table = model_runner.req_to_token_pool.req_to_token
    if bs and int(seq_lens_cpu.max()) >= table.shape[1]:
        raise ValueError(f"plain decode step at position {int(seq_lens_cpu.max())} past req_to_token's "
                         f"{table.shape[1]} columns")
    out_cache_loc = table[req_pool_indices, seq_lens.long()].to(torch.int64)
    spec = model_runner.spec_algorithm
    hidden = CaptureHiddenMode.NULL if spec is not None and spec.is_standalone() else CaptureHiddenMode.FULL
    fields = dict(
        forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=bonus_tokens.to(torch.int64),
        req_pool_indices=req_pool_indices, seq_lens=seq_lens + 1, seq_lens_cpu=seq_lens_cpu + 1,
        orig_seq_lens=seq_lens + 1, out_cache_loc=out_cache_loc, seq_lens_sum=int(seq_lens_cpu.sum()) + bs,
        positions=seq_lens.to(torch.int64), spec_info=None, capture_hidden_mode=hidden, spec_algorithm=spec)
    return ForwardBatch(**fields)


# ----------------------------------------------------------------------------------- EAGLEWorkerV2 wiring
def eagle_v2_plain_decode(worker: Any, batch: Any, lag: DraftLag, on_publish: Any = None) -> Any:
    """One plain step of a spec-v2 decode ``batch``: the target on a DECODE graph, sampled, no draft work.

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
    fb = plain_decode_batch(target, req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens,
                            seq_lens_cpu=batch.seq_lens_cpu, bonus_tokens=draft_input.bonus_tokens)
    fb.sampling_info = batch.sampling_info
    for name in _LOGPROB_FIELDS:  # what the scheduler reads back for requests that asked for logprobs
        setattr(fb, name, getattr(batch, name, getattr(fb, name)))
    out = target.forward(fb)
    next_ids = target.sample(out.logits_output, fb)
    new_seq_lens = batch.seq_lens + 1
    if on_publish is not None:
        on_publish(new_seq_lens)
    lag.record([int(r) for r in batch.req_pool_indices.tolist()], batch.seq_lens_cpu.tolist(),
               out.logits_output.hidden_states)
    # The draft's hidden states travel between steps at the *draft's* width (EAGLE3's target returns 3x
    # hidden_size): the stub keeps the width the draft input came with.
    carried = getattr(draft_input, "hidden_states", None)
    next_draft = EagleDraftInput(
        bonus_tokens=next_ids.to(torch.int32), topk_p=torch.zeros((bs, worker.topk), device=next_ids.device),
        topk_index=torch.zeros((bs, worker.topk), dtype=torch.int64, device=next_ids.device),
        hidden_states=None if carried is None else carried.new_zeros((bs, carried.shape[-1])))
    result = dict(
        logits_output=out.logits_output, next_token_ids=next_ids, can_run_cuda_graph=out.can_run_graph,
        speculative_num_draft_tokens=1, next_draft_input=next_draft,
        accept_lens=torch.ones(bs, dtype=torch.int32, device=next_ids.device),
        accept_index=torch.arange(bs, device=next_ids.device)[:, None], new_seq_lens=new_seq_lens)
    fields = {f.name for f in dataclasses.fields(GenerationBatchResult)}  # accept_index is 0.5.2x's only
    return GenerationBatchResult(**{k: v for k, v in result.items() if k in fields})


def eagle_v2_catch_up(worker: Any, batch: Any, lag: DraftLag) -> None:
    """Before a speculative step: one draft extend over the tokens lagging requests decoded plainly, fed
    the hidden states their plain steps produced (as a draft prefill of that chunk); the result becomes
    those requests' draft input for this step."""
    import copy

    rows = [int(r) for r in batch.req_pool_indices.tolist()]
    gaps = lag.take(rows)
    if not gaps:
        return
    table = batch.req_to_token_pool.req_to_token
    idx = [i for i, r in enumerate(rows) if r in gaps]
    starts = [gaps[rows[i]][0] for i in idx]
    ends = [int(batch.seq_lens_cpu[i]) for i in idx]
    view = copy.copy(batch)  # the worker's batch keeps its own fields
    view.forward_mode = ForwardMode.EXTEND
    view.req_pool_indices = batch.req_pool_indices[idx]
    view.input_ids = torch.cat([_committed_tokens(batch.reqs[i], s, e, table.device)
                                for i, s, e in zip(idx, starts, ends)])
    view.out_cache_loc = torch.cat([table[rows[i], s:e].to(torch.int64) for i, s, e in zip(idx, starts, ends)])
    view.extend_lens = [e - s for s, e in zip(starts, ends)]
    view.prefix_lens = starts
    view.seq_lens, view.seq_lens_cpu = batch.seq_lens[idx], batch.seq_lens_cpu[idx]
    kept = [gaps[rows[i]][1] for i in idx]
    hidden = torch.cat(kept) if kept[0] is not None else None  # None: a STANDALONE draft reads tokens only
    draft_input = worker.draft_worker._draft_extend_for_prefill(view, hidden, batch.spec_info.bonus_tokens[idx])
    for name in ("topk_p", "topk_index", "hidden_states"):
        full = getattr(batch.spec_info, name)
        if full is not None and getattr(draft_input, name) is not None:
            full[idx] = getattr(draft_input, name).to(full.dtype)


def _committed_tokens(req: Any, start: int, end: int, device: Any) -> torch.Tensor:
    tokens = list(req.origin_input_ids) + list(req.output_ids)
    return torch.tensor(tokens[start:end], dtype=torch.int64, device=device)


_LOGPROB_FIELDS = ("return_logprob", "top_logprobs_nums", "token_ids_logprobs")

_original_forward: Optional[Any] = None


def install_speculation_switch(off_above: Optional[int], on_at_or_below: Optional[int] = None) -> SpeculationSwitch:
    """Make SGLang's spec-v2 EAGLE worker decode plainly above ``off_above`` requests (in this process), and
    route SGLang's adaptive step 0 (``--speculative-adaptive``) to plain steps. ``off_above=None``: only the
    adaptive routing. Prefill batches and speculative steps keep SGLang's path (after a draft catch-up)."""
    global _original_forward
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    switch = SpeculationSwitch(off_above if off_above is not None else 2**62, on_at_or_below)
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
            self.activate_step_by_batch(batch.seq_lens.shape[0])  # SGLang's adaptive step count, if on
            if not switch.speculate(batch.seq_lens.shape[0]) or self.speculative_num_steps == 0:
                return eagle_v2_plain_decode(self, batch, lag, on_publish)
            eagle_v2_catch_up(self, batch, lag)
        elif not decode and len(lag):  # prefilled afresh (a row reused, a request re-prefilled): no lag
            lag.forget([req.req_pool_idx for req in batch.reqs])
        return original(self, batch, *args, **kwargs)

    forward_batch_generation.graphpool_switch = switch  # type: ignore[attr-defined]  # for inspection
    forward_batch_generation.graphpool_lag = lag  # type: ignore[attr-defined]
    _original_forward = original
    EAGLEWorkerV2.forward_batch_generation = forward_batch_generation
    log.info("graphpool: spec v2 plain decode above %s requests, back on at <= %d; adaptive step 0 on DECODE graphs",
             off_above, switch.policy.on_at_or_below)
    return switch


def uninstall_speculation_switch() -> None:
    """Restore SGLang's ``EAGLEWorkerV2.forward_batch_generation``."""
    global _original_forward
    if _original_forward is not None:
        from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

        EAGLEWorkerV2.forward_batch_generation = _original_forward
        _original_forward = None

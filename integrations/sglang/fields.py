"""Fields of SGLang's objects that moved or were renamed between releases: the one place graphpool reads them.

graphpool reads a few fields of SGLang's own objects (requests, draft inputs, step results, model runners,
published settings). Where a release moved or renamed one, the read goes through a function here, which
knows every layout graphpool serves; the rest of the integration names no release. Each layout is told
apart by what this SGLang's own classes declare (a class that exists, a dataclass field), never by the
version string, so a patch release that keeps a layout is served unchanged.

=========================================  =======================================  ===================================
what                                        where                                    releases
=========================================  =======================================  ===================================
a request's ``req_to_token`` row            ``Req.kv.req_pool_idx`` (``ReqKvInfo``)  0.5.23 (``Req.req_pool_idx`` before)
the read-done event of the overlap          ``ModelRunner.shared_read_done_event``,  0.5.23 (``war_fastpath_*`` in
scheduler's write-after-read barrier        the worker's ``last_shared_read_runner``  0.5.14 to 0.5.17)
model flags (hybrid SWA, mrope, ...)        ``model_config``                         0.5.17 on (``ModelRunner`` before)
speculation and graph settings              the runtime context (``get_spec()``...)  0.5.17 on (``server_args`` before)
the classic EAGLE v1 names                  :class:`Release`                         0.5.9 to 0.5.12.x
=========================================  =======================================  ===================================

``ServerArgs`` settings as SGLang resolved them are read by :func:`~.support.resolved_arg`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterable, List, NamedTuple, Optional, Tuple


# ----------------------------------------------------------------------------------- requests
@functools.lru_cache(maxsize=None)
def _row_in_req_kv() -> bool:
    """Whether this SGLang keeps a request's ``req_to_token`` row in ``Req.kv`` (its ``ReqKvInfo`` declares
    ``req_pool_idx``: 0.5.23). 0.5.17 has a ``ReqKvInfo`` too, without the row (``Req.kv`` is ``None`` until
    the request holds KV)."""
    try:
        from sglang.srt.managers.schedule_batch import ReqKvInfo
    except ImportError:
        return False
    return "req_pool_idx" in {f.name for f in dataclasses.fields(ReqKvInfo)}


def req_pool_idx(req: Any) -> Optional[int]:
    """A request's row in ``req_to_token`` (``None`` while it holds none): ``Req.kv.req_pool_idx`` in 0.5.23,
    ``Req.req_pool_idx`` before."""
    return req.kv.req_pool_idx if _row_in_req_kv() else req.req_pool_idx


def req_pool_rows(reqs: Iterable[Any]) -> List[int]:
    """:func:`req_pool_idx` of each request, as ints (read on the host: the batch's device copy would sync)."""
    return [int(req_pool_idx(req)) for req in reqs]


# ----------------------------------------------------------------------------------- the read-done event
# The overlap scheduler's write-after-read barrier: the model runner's attribute holding the event its last
# step's reads of scheduler-shared buffers ended at, and the worker's property naming the runner whose event
# the scheduler reads. 0.5.23's names first, then 0.5.14 to 0.5.17's.
_READ_DONE = (("shared_read_done_event", "last_shared_read_runner"),
              ("war_fastpath_read_done_event", "war_fastpath_runner"))


def read_done_names(model_runner: Any) -> Optional[Tuple[str, str]]:
    """``(the runner's event attribute, the worker's last-reader property)`` of this SGLang, or ``None`` where
    it has no such barrier (0.5.14's runners without one, stand-ins)."""
    for names in _READ_DONE:
        if hasattr(model_runner, names[0]):
            return names
    return None


# ----------------------------------------------------------------------------------- model flags
def model_flag(model_runner: Any, name: str) -> Any:
    """A model property SGLang kept on ``ModelRunner`` up to 0.5.14 and on ``model_config`` only from 0.5.17
    (``is_hybrid_swa``, ``model_is_mrope``, ``use_ngram_embedding``, ``is_draft_worker``): whichever is set."""
    return getattr(model_runner, name, None) or getattr(getattr(model_runner, "model_config", None), name, None)


# ----------------------------------------------------------------------------------- settings
def published(name: str) -> Any:
    """A published runtime-context namespace (``get_exec()``, ``get_spec()``: 0.5.17 on), or ``None`` (0.5.14, or
    not published yet)."""
    try:
        from sglang.srt import runtime_context
    except ImportError:
        return None
    getter = getattr(runtime_context, f"get_{name}", None)
    try:
        return getter() if getter is not None else None
    except ValueError:  # "config namespace ... not published"
        return None


def setting(model_runner: Any, bag: str, path: Tuple[str, ...], default: Any = None) -> Any:
    """``get_<bag>().<path>`` where published (0.5.17 on; SGLang's adaptive speculation overrides the step count
    there while it builds its runners), else ``server_args.<last part of path>`` (0.5.14)."""
    value = published(bag)
    for part in path:
        value = getattr(value, part, None) if value is not None else None
    if value is None:
        value = getattr(model_runner.server_args, path[-1], None)
    return default if value is None else value


# ----------------------------------------------------------------------------------- classic EAGLE v1 names
class Release(NamedTuple):
    """What the classic switch's plain step does differently per classic SGLang release (0.5.9 to 0.5.12.x), read
    from that release's own classes (:func:`release`)."""

    bonus: str
    """``EagleDraftInput``'s field for each request's next input token: ``bonus_tokens`` (0.5.12.x),
    ``verified_id`` (0.5.9 to 0.5.11)."""
    accepted: str
    """``GenerationBatchResult``'s accepted drafts of a verify step, summed over the batch:
    ``num_correct_drafts`` (0.5.12.x), ``num_accepted_drafts`` (0.5.11), ``num_accepted_tokens`` (0.5.9,
    0.5.10.x; drafts, the bonus token not counted, despite the name)."""
    accepted_per_req: str
    """The same per request: ``num_correct_drafts_per_req_cpu``, ``num_accepted_drafts_per_req_cpu``,
    ``accept_length_per_req_cpu`` (0.5.9, 0.5.10.x: the scheduler splits ``next_token_ids`` by it)."""
    verify_counts_reasoning: bool
    """Spec-v1 verify counts reasoning tokens (0.5.11 on). In 0.5.10.x the scheduler's
    ``process_batch_result_decode`` counts them for spec v1 as for plain decoding; 0.5.9 counts none."""
    standalone_hidden: bool
    """The worker feeds a STANDALONE draft the target's hidden states as it does EAGLE's (captured FULL):
    0.5.9 to 0.5.11. From 0.5.12 it captures none for STANDALONE (``CaptureHiddenMode.NULL``)."""
    report_decode_stats: str
    """The scheduler's per-decode-step stats method: ``report_decode_stats`` (0.5.10 on),
    ``log_decode_stats`` (0.5.9)."""


@functools.lru_cache(maxsize=None)
def release() -> Release:
    """This classic SGLang's :class:`Release` (from its dataclasses' fields and the scheduler's methods).

    Raises:
        RuntimeError: this SGLang names the accepted-draft counts in a way graphpool does not know.
    """
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    draft_fields = {f.name for f in dataclasses.fields(EagleDraftInput)}
    result_fields = {f.name for f in dataclasses.fields(GenerationBatchResult)}
    for accepted, per_req in (("num_correct_drafts", "num_correct_drafts_per_req_cpu"),
                              ("num_accepted_drafts", "num_accepted_drafts_per_req_cpu"),
                              ("num_accepted_tokens", "accept_length_per_req_cpu")):
        if accepted in result_fields and per_req in result_fields:
            break
    else:
        raise RuntimeError(f"SGLang's GenerationBatchResult names no accepted-draft count graphpool knows: "
                           f"{sorted(result_fields)}")
    return Release(
        bonus="bonus_tokens" if "bonus_tokens" in draft_fields else "verified_id",
        standalone_hidden="bonus_tokens" not in draft_fields,  # both changed in 0.5.12
        accepted=accepted, accepted_per_req=per_req,
        verify_counts_reasoning=per_req != "accept_length_per_req_cpu",  # 0.5.11 on (the scheduler's job before)
        report_decode_stats="report_decode_stats" if hasattr(Scheduler, "report_decode_stats") else "log_decode_stats")


def bonus_tokens(draft_input: Any) -> Any:
    """Each request's next input token in a classic ``EagleDraftInput`` (see :attr:`Release.bonus`)."""
    return getattr(draft_input, release().bonus)

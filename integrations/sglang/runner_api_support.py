"""Settings and refusals of the runner-API adapter (SGLang 0.5.14+), read the way each release keeps them.

0.5.14 reads its settings from ``model_runner.server_args``; later releases from the published runtime context
(``get_exec()``, ``get_spec()``): :func:`~.fields.setting` reads either, so one adapter serves the whole 0.5.14
to 0.5.23 range.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Optional

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

from .fields import published, read_done_names, setting
from .support import unsupported_reasons

#: Decode graph backends of ``--cuda-graph-config`` a pool serves: one whole-step graph per key.
SERVED_BACKENDS = ("full", "disabled")

#: Why each other decode backend is refused (the error names the backend and this reason).
REFUSED_BACKENDS = {
    "breakable": "it captures a step as segments with eager Python between graph breaks (and replays them "
                 "eagerly under --debug-cuda-graph); a pool replays one whole-step graph per (mode, batch size)",
    "tc_piecewise": "it compiles the step piecewise with torch.compile per token count; a pool captures "
                    "whole-step graphs of the eager model",
}

#: SGLang environment switches whose graph inputs or metadata paths the adapter does not stage.
_REFUSED_ENV = (("SGLANG_ENABLE_METADATA_GLUE_GRAPH", "the attention-metadata glue graph"),
                ("SGLANG_OPT_DSV41_TARGET_METADATA_EARLY", "early verify metadata (DSpark)"))


def decode_graph_backend(model_runner: Any) -> str:
    """``--cuda-graph-config``'s decode backend (``full`` when unset, as SGLang defaults)."""
    config = setting(model_runner, "exec", ("graph", "cuda_graph_config"))
    backend = getattr(getattr(config, "decode", None), "backend", None)
    return str(backend or "full")


def refusal_reasons(model_runner: Any, record_nolora_graph: bool = False) -> List[str]:
    """Why the runner-API adapter cannot serve ``model_runner`` (empty: it can); each reason says why."""
    reasons = unsupported_reasons(model_runner)
    backend = decode_graph_backend(model_runner)
    if backend not in SERVED_BACKENDS:
        why = REFUSED_BACKENDS.get(backend, "graphpool does not know this backend")
        reasons.append(f"decode graph backend {backend!r} of --cuda-graph-config ({why})")
    if record_nolora_graph:
        reasons.append("LoRA / no-LoRA graph variants")
    for env, what in _REFUSED_ENV:
        if os.environ.get(env, "").lower() in ("1", "true", "yes"):
            reasons.append(f"{what} ({env})")
    if os.environ.get("SGLANG_RAGGED_VERIFY_MODE", "static").lower() not in ("", "static", "0", "false"):
        reasons.append("ragged verify graphs (SGLANG_RAGGED_VERIFY_MODE)")
    return reasons


@dataclass(frozen=True)
class SpecSettings:
    """The speculation shape one runner is built for (SGLang's adaptive speculation builds one per step count)."""

    num_steps: int
    num_draft_tokens: int
    topk: int


def spec_settings(model_runner: Any, num_steps: Optional[int], num_draft_tokens: Optional[int]) -> SpecSettings:
    """The constructor's overrides, else the published (possibly adaptive-overridden) values, else server_args."""
    if num_steps is None:
        num_steps = setting(model_runner, "spec", ("speculative_num_steps",), 0)
    if num_draft_tokens is None:
        num_draft_tokens = setting(model_runner, "spec", ("speculative_num_draft_tokens",), 1)
    topk = setting(model_runner, "spec", ("speculative_eagle_topk",), 1)
    return SpecSettings(int(num_steps or 0), int(num_draft_tokens or 1), int(topk or 1))


def server_hidden_mode(model_runner: Any) -> CaptureHiddenMode:
    """Hidden states the server returns to users (none for a draft worker, as SGLang's runners)."""
    if getattr(model_runner, "is_draft_worker", False):
        return CaptureHiddenMode.NULL
    features = getattr(published("exec"), "features", None)
    mode = getattr(features, "return_hidden_states_mode", None)
    if mode == "last":
        return CaptureHiddenMode.LAST
    enabled = getattr(features, "enable_return_hidden_states", None)
    if enabled is None:
        enabled = getattr(model_runner.server_args, "enable_return_hidden_states", False)
    return CaptureHiddenMode.FULL if mode == "full" or enabled else CaptureHiddenMode.NULL


def disable_padding(model_runner: Any) -> bool:
    """``--disable-cuda-graph-padding``: replay only exact captured batch sizes."""
    return bool(setting(model_runner, "exec", ("graph", "disable_cuda_graph_padding"), False))


def decode_batch_sizes(model_runner: Any, tokens_per_req: int) -> List[int]:
    """The batch sizes SGLang itself would capture (its ``get_batch_sizes_to_capture``: the decode ``bs``
    list of ``--cuda-graph-config`` / ``--cuda-graph-bs``, aligned and capped at the request pool)."""
    from sglang.srt.model_executor.runner.base_cuda_graph_runner import get_batch_sizes_to_capture

    capture_bs, _ = get_batch_sizes_to_capture(model_runner, tokens_per_req)
    if not capture_bs:
        raise ValueError("SGLang chose no decode batch sizes to capture; pass --cuda-graph-bs 1 2 4 8 ...")
    return sorted(int(bs) for bs in capture_bs)


def rejection_sampling(model_runner: Any) -> bool:
    """``--speculative-use-rejection-sampling``: draft inputs then carry ``draft_probs`` between steps."""
    return bool(setting(model_runner, "spec", ("speculative_use_rejection_sampling",), False))


# ----------------------------------------------------------------------------------- the read-done event
# The overlap scheduler's write-after-read barrier: after launching a step it fences its next writes into the
# buffers the step reads (req_to_token, the KV pool's free slots) behind an event the step's last such reader
# published; without one it waits for the whole forward, and scheduling no longer overlaps the GPU.
def read_done_point(attn_backend: Any, forward_mode: Any) -> Optional[str]:
    """Where a graph step's reads of scheduler-shared buffers end, as SGLang's own runner publishes them:
    ``"pre"`` (planned in ``load_batch``, before the replay), ``"post"`` (after the replay), or ``None`` (SGLang
    publishes nothing for this step). 0.5.23 asks the attention backend (``shared_read_ends``; its in-graph
    marker is SGLang's own, so graphpool publishes after the replay there); 0.5.14 to 0.5.17 publish before
    the replay of a DECODE graph."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    declared = getattr(attn_backend, "shared_read_ends", None)
    if callable(declared):
        return {"PRE_REPLAY": "pre", "IN_REPLAY": "post", "POST_REPLAY": "post"}.get(
            getattr(declared(forward_mode), "name", None))
    return "pre" if forward_mode == ForwardMode.DECODE else None


def publish_read_done(model_runner: Any) -> None:
    """Record the read-done event on the current stream and hand it to ``model_runner`` (where this SGLang
    has the barrier at all)."""
    import torch

    names = read_done_names(model_runner)
    if names is not None:
        event = torch.get_device_module(model_runner.device).Event()
        event.record()
        setattr(model_runner, names[0], event)


def hand_over_read_done(worker: Any, target: Any) -> None:
    """A plain step's last shared-buffer reader is the target's DECODE replay, but the scheduler reads the event
    of the worker's last reader of a speculative step (EAGLE: the draft runner, whose draft extend a plain step
    skips): move the target's event there. With none published (an eager step) the scheduler's wait stays
    coarse, which is always safe."""
    names = read_done_names(target)
    if names is None:
        return
    event, last = names
    reader = getattr(worker, last, None)
    if reader is not None and reader is not target and hasattr(reader, event):
        setattr(reader, event, getattr(target, event))
        setattr(target, event, None)

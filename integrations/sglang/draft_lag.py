"""How far each request's draft KV lags behind the target's, for the speculation switches' catch-up.

Both switches (EAGLE v1 in :mod:`.eagle_v1_plain`, spec v2 in :mod:`.spec_switch_v2`) run plain steps
with **no draft work**: the target decodes one token per request on a DECODE graph and the draft model's
KV falls behind. :class:`DraftLag` records, per request, the first position the draft missed and the
target hidden states of the plain steps (EAGLE's draft reads the target's hidden state at each position;
a STANDALONE draft reads tokens only). When speculation resumes, the switch takes a request's lag and
runs ONE draft extend over its plainly decoded tokens, fed those hidden states, like a draft prefill of
that chunk. This module imports only torch, so both SGLang generations share it.

Memory is bounded by ``max_steps``: a request keeps the hidden states of its last ``max_steps`` plain
steps only (one ``hidden_size`` row per step; the plain step's batch output is copied once per step and
held by row views). A request that decoded more plain tokens than that catches up over the last
``max_steps`` positions only: **the draft restarts from the last window**. The draft's KV at the older
positions of that plain phase is left as it was (stale, finite values of the slot's previous use), which
costs that request draft acceptance, never correctness: the target verifies every token. The catch-up's
extend is bounded the same way, at ``max_steps`` tokens per request.

Positions may come as host integers (EAGLE v1; spec v2 where the scheduler keeps ``seq_lens_cpu``) or as the
device tensor of a step's KV lengths (spec v2 under the overlap scheduler, whose ``seq_lens_cpu`` is ``None``
for attention backends that need no host lengths: FA3, Triton, trtllm_mha). A device tensor is never read on
the step path (a read would wait for the GPU and end the overlap): a request's first lagging position stays
on the device and each later plain step adds one, so the lag is read once, when :meth:`take` needs it.
"""
from __future__ import annotations

import collections
import logging
from typing import Any, Deque, Dict, Hashable, Iterable, List, NamedTuple, Optional, Union

import torch

log = logging.getLogger(__name__)

#: Default cap on the plain steps whose hidden states a request keeps (and on its catch-up's length).
DEFAULT_MAX_LAG_STEPS = 256


class LagChunk(NamedTuple):
    """What one request's draft must catch up on: positions ``[start, end)`` of its sequence."""

    start: int
    """First position the catch-up writes (the lag's first position, or ``end - max_steps``)."""
    hidden: Optional[torch.Tensor]
    """``[end - start, hidden]`` target hidden states at those positions; None when none were kept."""
    end: int
    """One past the last plainly decoded position (the request's KV length after its last plain step)."""
    skipped: int
    """Lagging positions before ``start`` that the window left out (their draft KV stays stale)."""


class _Lag:
    __slots__ = ("first", "steps", "hidden")

    def __init__(self, first: Any, max_steps: int):
        self.first = first  # an int, or (a device tensor of KV lengths, row) still to be read
        self.steps = 0      # plain steps recorded since ``first``
        self.hidden: Deque[torch.Tensor] = collections.deque(maxlen=max_steps)

    def known_end(self) -> Optional[int]:
        """One past the last lagging position, where ``first`` is known on the host (else None)."""
        return self.first + self.steps if isinstance(self.first, int) else None


class DraftLag:
    """Per request: from which position the draft's KV lags, and the hidden states to catch it up with.

    Args:
        keep_hidden: ``True``: every :meth:`record` carries the plain step's hidden states (EAGLE);
            ``False``: positions only (a draft that reads tokens only); ``None``: fixed by the first
            :meth:`record` (hidden states given or not), for a switch installed before its worker exists.
        max_steps: the window (module docstring): hidden states kept and positions caught up per request.

    Keys are whatever identifies a request to the caller (a ``Req``, a ``req_to_token`` row). Plain steps
    call :meth:`record`; a speculative step calls :meth:`take` for its requests and runs one draft extend
    over what it returns; requests that finish, leave the batch or are prefilled again are
    :meth:`forget`-ten (or dropped by :meth:`retain`) and never caught up.
    """

    def __init__(self, keep_hidden: Optional[bool] = True, max_steps: int = DEFAULT_MAX_LAG_STEPS):
        if max_steps < 1:
            raise ValueError(f"DraftLag(max_steps={max_steps}): keep at least one step (max_steps >= 1)")
        self.keep_hidden, self.max_steps = keep_hidden, int(max_steps)
        self._lags: Dict[Hashable, _Lag] = {}
        self.catch_ups = 0          # take() calls that returned something (one draft extend each)
        self.caught_up_requests = 0
        self.caught_up_tokens = 0
        self.windowed = 0           # requests whose catch-up the window cut short
        self.restarts = 0           # records that did not continue a request's lag (it restarted there)

    def __len__(self) -> int:
        return len(self._lags)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._lags

    def record(self, keys: List[Hashable], kv_lens: Union[Iterable[int], torch.Tensor],
               hidden: Optional[torch.Tensor] = None) -> None:
        """A plain step wrote the target's KV at position ``kv_lens[i]`` of request ``keys[i]``, not the draft's.

        ``kv_lens``: host integers, or a tensor (on any device; copied, never read here: module docstring).
        ``hidden``: that step's target hidden states, one row per key (copied here, once per call).

        Raises:
            ValueError: hidden states missing where this lag keeps them, or rows that disagree.
        """
        if self.keep_hidden is None:
            self.keep_hidden = hidden is not None
        if self.keep_hidden:
            if hidden is None:
                raise ValueError("DraftLag(keep_hidden=True).record needs the plain step's hidden states")
            if hidden.shape[0] != len(keys):
                raise ValueError(f"DraftLag.record: {len(keys)} requests but hidden states of "
                                 f"{hidden.shape[0]} rows; pass one row per request")
            hidden = hidden.detach().clone()  # the runner's output buffer is rewritten by its next replay
        on_device = isinstance(kv_lens, torch.Tensor)
        if on_device:
            if kv_lens.shape[0] != len(keys):
                raise ValueError(f"DraftLag.record: {len(keys)} requests but kv_lens of {kv_lens.shape[0]} rows; "
                                 f"pass one row per request")
            kv_lens = kv_lens.detach().clone()  # the scheduler may write its seq_lens in place later
        for i, key in enumerate(keys):
            at = (kv_lens, i) if on_device else int(kv_lens[i])
            lag = self._lags.get(key)
            end = None if lag is None else lag.known_end()
            if lag is not None and not on_device and end is not None and end != at:
                # Not the position after its last plain step: the row was reused or the request was
                # re-prefilled unseen. Restart the lag here (older draft KV stays as it is).
                self.restarts += 1
                log.warning("graphpool draft lag: request %s plain step at %d, expected %d; restarting its lag",
                            getattr(key, "rid", key), at, end)
                lag = None
            if lag is None:
                lag = self._lags[key] = _Lag(at, self.max_steps)
            lag.steps += 1
            if self.keep_hidden:
                lag.hidden.append(hidden[i])

    def take(self, keys: Iterable[Hashable]) -> Dict[Hashable, LagChunk]:
        """``key -> LagChunk`` for the lagging ``keys``, in their order; forgets them (one catch-up each).
        Positions recorded on the device are read here, once per recorded step tensor."""
        out: Dict[Hashable, LagChunk] = {}
        read: Dict[int, List[int]] = {}  # id(tensor) -> its values
        for key in keys:
            lag = self._lags.pop(key, None)
            if lag is None:
                continue
            first = lag.first
            if not isinstance(first, int):
                tensor, row = first
                values = read.get(id(tensor))
                if values is None:
                    values = read[id(tensor)] = [int(v) for v in tensor.tolist()]
                first = values[row]
            end = first + lag.steps
            start = max(first, end - self.max_steps)
            hidden = torch.stack(list(lag.hidden)) if self.keep_hidden and lag.hidden else None
            out[key] = LagChunk(start, hidden, end, start - first)
            self.windowed += start > first
            self.caught_up_tokens += end - start
        if out:
            self.catch_ups += 1
            self.caught_up_requests += len(out)
        return out

    def forget(self, keys: Iterable[Hashable]) -> None:
        """Drop these requests' lags (finished, aborted, or prefilled again): never caught up."""
        if not self._lags:
            return
        for key in keys:
            self._lags.pop(key, None)

    def retain(self, keys: Iterable[Hashable]) -> None:
        """Drop every lag whose request is not among ``keys`` (it left the running batch, e.g. retracted)."""
        if self._lags:
            keep = set(keys)
            for key in [k for k in self._lags if k not in keep]:
                del self._lags[key]

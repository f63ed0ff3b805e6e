"""One call of :meth:`~.loop.PoolGenerator.generate`: admitting requests into slots (the eager prefill), running
pool steps, and committing what each step chose: drafts accepted by the step's rule, then one more token; a
request ends at an EOS, a stop string (transformers' own ``StopStringCriteria``) or its ``max_new_tokens``, and
its streamer sees each committed token."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .lookup import NgramIndex
from .options import Options
from .sampling import DRAFTS, EOS_FROM, NEUTRAL, PARAMS


@dataclass
class Request:
    """One prompt's request: its slot, history (for lookup), streamer, tokens so far and why it ended."""

    index: int
    prompt: list[int]
    max_new: int
    slot: int
    history: NgramIndex
    streamer: Any = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None

    @property
    def position(self) -> int:
        """Position of the last token, the next step's first input (its keys are not written yet)."""
        return len(self.prompt) + len(self.tokens) - 1


class GenerationRun:
    """One :meth:`~.loop.PoolGenerator.generate` call's state: its options, stop criteria and random generator;
    admits requests (prefill) and runs steps of its owner's pool, committing what each returns.

    Args:
        owner: the :class:`~.loop.PoolGenerator` (its cache, step function, pool and prefill budget).
        options: the call's resolved options.
        stop: transformers' ``StopStringCriteria`` for the call's stop strings, or ``None``.
        generator: the CPU generator sampled rows draw their uniforms from.
    """

    def __init__(self, owner: Any, options: Options, stop: Any, generator: torch.Generator):
        self.owner, self.options, self.stop, self.generator = owner, options, stop, generator
        self.sampling = list(options.sampling) + list(NEUTRAL[len(options.sampling):])

    def _params(self, requests: list[Request], drafts: list[int]) -> torch.Tensor:
        rows = []
        for r, count in zip(requests, drafts):
            row = list(self.sampling)
            row[EOS_FROM] = len(r.prompt) + self.options.min_new_tokens - 1
            row[DRAFTS] = count
            rows.append(row)
        return torch.tensor(rows, dtype=torch.float32).view(len(requests), len(PARAMS))

    def _uniforms(self, n: int) -> torch.Tensor:
        if not self.options.do_sample:
            return torch.full((n, 2), 0.5)
        return torch.rand(n, 2, generator=self.generator)

    def admit(self, waiting: list[Request]) -> list[Request]:
        """Prefill as many waiting requests as there are free slots (eager batches of at most ``prefill_tokens``
        padded tokens); returns them, each with its first token."""
        owner = self.owner
        admitted = [waiting.pop(0) for _ in range(min(len(waiting), owner.cache.free_slots))]
        chunk: list[Request] = []
        for i, r in enumerate(admitted):
            r.slot = owner.cache.allocate()
            if r.streamer is not None:
                r.streamer.put(torch.tensor(r.prompt))
            chunk.append(r)
            after = admitted[i + 1] if i + 1 < len(admitted) else None
            longest = max(len(c.prompt) for c in chunk + ([after] if after else []))
            if after is None or (len(chunk) + 1) * longest > owner.prefill_tokens:
                out = owner.forward.prefill([c.prompt for c in chunk], [c.slot for c in chunk],
                                            self._params(chunk, [0] * len(chunk)), self._uniforms(len(chunk)))
                for c, (token, _, logprob, _) in zip(chunk, out.tolist()):
                    self._commit(c, [int(token)], [logprob])
                chunk = []
        return admitted

    def step(self, running: list[Request], mode: str, drafts: list[list[int]]) -> tuple:
        """One pool step of ``mode`` for ``running``: (mode, bs, graph_bs, committed, drafted, accepted)."""
        owner, bs = self.owner, len(running)
        width = owner.draft_tokens(mode) + 1
        ids, positions = [], []
        for i, r in enumerate(running):
            d = drafts[i] if drafts else []
            # Short drafts are padded with their last token: verified like the others, never counted.
            ids += [r.tokens[-1]] + d + [d[-1] if d else r.tokens[-1]] * (width - 1 - len(d))
            positions += range(r.position, r.position + width)
        host = torch.tensor(ids + positions + [r.slot for r in running], dtype=torch.int64)
        dev = host.to(owner.cache.device)
        n = len(ids)
        params = self._params(running, [len(d) for d in drafts] if drafts else [0] * bs)
        out = owner.pool.run(mode, input_ids=dev[:n], positions=dev[n:2 * n], slots=dev[2 * n:],
                             sampling=params.to(owner.cache.device),
                             uniforms=self._uniforms(n).to(owner.cache.device))["out"]
        rows = out.cpu().view(bs, width, 4).tolist()
        graph_bs = owner.pool.route(mode, bs)
        committed = accepted = 0
        for r, row, d in zip(running, rows, drafts or [[]] * bs):
            taken = 0
            while taken < len(d) and row[taken][1] > 0:
                taken += 1
            accepted += taken
            tokens = d[:taken] + [int(row[taken][0])]
            logprobs = [row[i][3] for i in range(taken)] + [row[taken][2]]
            committed += self._commit(r, tokens, logprobs)
        return mode, bs, graph_bs, committed, sum(map(len, drafts)), accepted

    def _commit(self, r: Request, tokens: list[int], logprobs: list[float]) -> int:
        """Append ``tokens`` to a request one by one until it ends (EOS, a stop string, or max_new_tokens);
        returns how many were appended."""
        eos, taken = self.options.eos, 0
        for token in tokens:
            r.tokens.append(token)
            r.logprobs.append(logprobs[taken])
            taken += 1
            if token in eos:
                r.finish = "eos"
            elif self.stop is not None and self._stopped(r):
                r.finish = "stop_string"
            elif len(r.tokens) >= r.max_new:
                r.finish = "length"
            if r.finish:
                break
        new = r.tokens[len(r.tokens) - taken:]
        r.history.extend(new)
        if r.streamer is not None:
            r.streamer.put(torch.tensor(new))
            if r.finish:
                r.streamer.end()
        return taken

    def _stopped(self, r: Request) -> bool:
        window = getattr(self.stop, "maximum_token_len", None) or len(r.prompt) + len(r.tokens)
        tail = (r.prompt + r.tokens)[-window:]
        return bool(self.stop(torch.tensor([tail]), None)[0])

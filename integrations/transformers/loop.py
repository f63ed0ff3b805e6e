"""Batched greedy generation with every decode step from a :class:`~graphpool.GraphPool`.

:class:`PoolGenerator` builds a :class:`SlotCache` and a pool of two modes for a transformers model, once:
``decode`` (one token per row) and ``verify`` (the row's last token plus ``num_draft_tokens`` drafts found by
prompt lookup in its own history, :mod:`.lookup`). :meth:`PoolGenerator.generate` then runs requests to
their ends: each loop admits waiting prompts into free slots (an eager, batched prefill through the same
cache: prompts have many lengths, so the prefill is outside the pool), then runs one step of all running
requests from the pool. The step's mode is chosen per step: ``verify`` while a :class:`~graphpool.SpeculationPolicy`
says the batch is small enough, an :class:`~graphpool.AcceptanceGate` says drafts pay, and lookup found a
draft for at least one row; ``decode`` otherwise. Requests end at their own step (an EOS token, or their
``max_new_tokens``), and the batch shrinks (or takes in waiting prompts) as they do. Greedy only: the tokens
are those of ``model.generate(do_sample=False)`` for each prompt alone.

Why ``torch.inference_mode()`` everywhere here: with autograd on, the cache's in-place writes record
the keys' history (the weights require grad), so the KV cache silently joins an autograd graph that
grows every step, keeps every step's activations alive, and makes graph capture record autograd state.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

import graphpool as gp

from .cache import SlotCache
from .lookup import NgramIndex
from .step import DECODE, STEP_OUTPUTS, VERIFY, SlotForward, describe, step_inputs, step_modes

log = logging.getLogger("graphpool.transformers")

InputsFn = Callable[[SlotCache, int], Sequence[gp.StepInput]]


@dataclass(frozen=True)
class StepRecord:
    """One decode step of :meth:`PoolGenerator.generate`.

    Attributes:
        mode: ``"decode"`` or ``"verify"``.
        batch_size: the running requests it carried.
        graph_bs: the padded batch size of the graph that served it; ``None`` for an eager miss (a batch
            larger than every graph of the mode).
        committed: tokens it added to the outputs, over all rows (after cutting at EOS and max tokens).
        drafted: draft tokens it verified (0 for decode).
        accepted: of those, the ones equal to the model's greedy token.
        seconds: host wall time of the step, its wait for the tokens included.
    """

    mode: str
    batch_size: int
    graph_bs: int | None
    committed: int
    drafted: int
    accepted: int
    seconds: float


@dataclass
class GenerationResult:
    """What :meth:`PoolGenerator.generate` returns.

    Attributes:
        tokens: each prompt's new tokens, in prompt order (an EOS that ended one is included, as ``generate``
            includes it).
        finish: ``"eos"`` or ``"length"`` per prompt.
        steps: one :class:`StepRecord` per decode step, in order.
        prefill_s: seconds spent in prefills; ``decode_s``: in decode steps.
    """

    tokens: list[list[int]]
    finish: list[str]
    steps: list[StepRecord] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def num_tokens(self) -> int:
        """New tokens over all prompts."""
        return sum(map(len, self.tokens))

    def steps_of(self, mode: str) -> list[StepRecord]:
        """The steps of one mode (``"decode"`` or ``"verify"``), in order."""
        return [s for s in self.steps if s.mode == mode]

    @property
    def accept_per_verify(self) -> float | None:
        """Mean tokens a verify step committed per sequence (1 + its accepted drafts, before cutting at EOS or
        max tokens); ``None`` without verify steps. Speculation pays when this beats the verify step's cost
        relative to a plain step's."""
        verify = self.steps_of(VERIFY)
        rows = sum(s.batch_size for s in verify)
        return (rows + sum(s.accepted for s in verify)) / rows if rows else None

    @property
    def misses(self) -> int:
        """Steps that ran eagerly (larger than every graph of their mode)."""
        return sum(s.graph_bs is None for s in self.steps)

    def summary(self) -> str:
        """One line: tokens, steps by mode, acceptance, misses, time."""
        accept = self.accept_per_verify
        return (f"{self.num_tokens} tokens in {len(self.steps)} steps ({len(self.steps_of(DECODE))} decode, "
                f"{len(self.steps_of(VERIFY))} verify"
                + (f", {accept:.2f} tokens per sequence per verify step" if accept is not None else "")
                + f", {self.misses} eager misses); prefill {self.prefill_s * 1e3:.1f} ms, "
                  f"decode {self.decode_s * 1e3:.1f} ms")


@dataclass
class _Request:
    index: int
    prompt_len: int
    max_new: int
    slot: int
    history: NgramIndex
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None

    @property
    def position(self) -> int:
        """Position of the last token, the next step's first input (its keys are not written yet)."""
        return self.prompt_len + len(self.tokens) - 1


class PoolGenerator:
    """Greedy batched generation for a transformers causal LM, every decode step from one :class:`GraphPool`.

    Builds the :class:`SlotCache` (``max_batch + 1`` slots of ``max_len`` tokens) and the pool, and captures
    its graphs (CUDA graphs on CUDA, the eager twin on CPU), all at construction; :meth:`generate` reuses them.

    Args:
        model: a supported ``*ForCausalLM`` model (:mod:`.versions`: Llama, Mistral, Qwen2, Qwen3; ``sdpa`` or
            ``eager`` attention), in eval mode, on its device and dtype.
        max_len: tokens per sequence slot: every request's prompt + ``max_new_tokens`` + ``num_draft_tokens``
            must fit.
        max_batch: requests running at once (cache slots; more prompts wait for a free slot). Default: the
            largest batch size.
        batch_sizes: batch sizes of the graphs (larger batches run eagerly: counted as misses).
        num_draft_tokens: drafts per row of a verify step (its graphs carry ``1 + num_draft_tokens`` tokens
            per row); 0: plain decode only.
        verify_batch_sizes: batch sizes of the verify graphs (default: ``batch_sizes``).
        max_ngram: the longest n-gram prompt lookup matches (down to 1).
        grouped_attention: see :class:`SlotForward` (``sdpa`` models: keys read once per key/value head).
        prefill_tokens: the most (padded) tokens one eager prefill batch carries; more admitted prompts are
            prefilled in several batches (at least one prompt each).
        debug: the pool's debug mode (bounds of every input checked, each step waited for).
        inputs: the pool's input declarations, ``inputs(cache, vocab_size)``; default :func:`step_inputs`.
            Change it only knowingly: a wrong fill breaks padded rows (this package's tests pass one to show
            that their oracle catches it).
        progress: report capture progress on stderr.
    """

    def __init__(self, model: torch.nn.Module, *, max_len: int, max_batch: int | None = None,
                 batch_sizes: Sequence[int] = (1, 2, 4, 8), num_draft_tokens: int = 4,
                 verify_batch_sizes: Sequence[int] | None = None, max_ngram: int = 3, grouped_attention: bool = True,
                 prefill_tokens: int = 8192, debug: bool = False, inputs: InputsFn = step_inputs,
                 progress: bool = False):
        if num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0 (0: plain decode only), got {num_draft_tokens}")
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 (requests running at once), got {max_batch}")
        sizes = tuple(sorted(set(batch_sizes)))
        self.model, self.max_len, self.num_draft_tokens, self.max_ngram = model, max_len, num_draft_tokens, max_ngram
        self.prefill_tokens = prefill_tokens
        self.max_batch = sizes[-1] if max_batch is None else max_batch
        device = next(model.parameters()).device
        with torch.inference_mode():
            self.cache = SlotCache(model, self.max_batch + 1, max_len)
            self.forward = SlotForward(model, self.cache, grouped_attention)
            verify = tuple(sorted(set(verify_batch_sizes))) if verify_batch_sizes else None
            self.pool = gp.GraphPool(step_modes(num_draft_tokens, None, verify),
                                     list(inputs(self.cache, model.config.vocab_size)), sizes, device=device,
                                     debug=debug)
            started = time.perf_counter()
            self.pool.capture(self.forward, outputs=STEP_OUTPUTS, progress=progress)
            self.capture_s = time.perf_counter() - started
        log.info("captured %d graphs for %s in %.2f s; %r", len(self.pool.graph_keys), describe(model),
                 self.capture_s, self.cache)

    def close(self) -> None:
        """Free the graphs (the cache stays until the generator is dropped)."""
        self.pool.close()

    # ------------------------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int] = 32,
                 eos_token_id: int | Sequence[int] | None = None, policy: gp.SpeculationPolicy | None = None,
                 gate: gp.AcceptanceGate | None = None) -> GenerationResult:
        """Generate greedily for every prompt; return the new tokens and per-step stats.

        Args:
            prompts: token id lists (any lengths, at least one token each).
            max_new_tokens: per request (one int for all, or one per prompt).
            eos_token_id: tokens that end a request (included in its output); ``None``: the model's
                ``generation_config.eos_token_id``, as ``generate`` does; ``[]``: none.
            policy: chooses speculation per step by batch size (``policy.choose(bs)``); ``None``: plain
                decode only.
            gate: pauses speculation while verify steps commit too few tokens per sequence.

        Raises:
            ValueError: a prompt is empty, holds a token outside the vocabulary, or with its new tokens and
                drafts does not fit ``max_len``; a policy without a verify mode (``num_draft_tokens=0``).
        """
        with torch.inference_mode():
            return self._generate(prompts, max_new_tokens, eos_token_id, policy, gate)

    def _generate(self, prompts, max_new_tokens, eos_token_id, policy, gate) -> GenerationResult:
        requests = self._requests(prompts, max_new_tokens, policy)
        eos = self._eos(eos_token_id)
        result = GenerationResult(tokens=[[] for _ in requests], finish=[""] * len(requests))
        waiting, running = list(requests), []
        try:
            while waiting or running:
                if waiting and self.cache.free_slots:
                    started = time.perf_counter()
                    running = self._running(running + self._admit(waiting, eos))
                    result.prefill_s += time.perf_counter() - started
                    if not running:  # every admitted request ended at its first token
                        continue
                started = time.perf_counter()
                record = self._step(running, eos, policy, gate)
                record = StepRecord(*record, seconds=time.perf_counter() - started)
                result.steps.append(record)
                result.decode_s += record.seconds
                running = self._running(running)
        finally:  # an error or interrupt mid-way must not keep slots from the next call
            for r in requests:
                if r.slot:
                    self.cache.free(r.slot)
                    r.slot = 0
        for r in requests:
            result.tokens[r.index], result.finish[r.index] = r.tokens, r.finish
        return result

    def _requests(self, prompts, max_new_tokens, policy) -> list[_Request]:
        if policy is not None and self.num_draft_tokens == 0:
            raise ValueError("a speculation policy needs the verify mode: build the PoolGenerator with "
                             "num_draft_tokens > 0, or pass policy=None for plain decode")
        counts = _new_token_counts(prompts, max_new_tokens)
        drafts = self.num_draft_tokens if policy is not None else 0
        vocab = self.model.config.vocab_size
        requests = []
        for i, (prompt, count) in enumerate(zip(prompts, counts)):
            prompt = [int(t) for t in prompt]
            if not prompt or not all(0 <= t < vocab for t in prompt):
                raise ValueError(f"prompt {i} must be a non-empty list of token ids in [0, {vocab}), got "
                                 f"{prompt[:8]}{'...' if len(prompt) > 8 else ''}")
            if len(prompt) + count + drafts > self.max_len:
                raise ValueError(f"prompt {i}: {len(prompt)} tokens + max_new_tokens {count} + {drafts} drafts "
                                 f"exceed the cache's max_len {self.max_len}; build the PoolGenerator with a larger "
                                 f"max_len or shorten the request")
            requests.append(_Request(i, len(prompt), count, 0, NgramIndex(prompt, self.max_ngram)))
        return requests

    def _eos(self, eos_token_id) -> frozenset[int]:
        if eos_token_id is None:
            eos_token_id = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if eos_token_id is None:
            return frozenset()
        return frozenset([eos_token_id] if isinstance(eos_token_id, int) else map(int, eos_token_id))

    def _admit(self, waiting: list[_Request], eos: frozenset[int]) -> list[_Request]:
        """Prefill as many waiting requests as there are free slots (eager batches of at most ``prefill_tokens``
        padded tokens); returns them, each with its first token."""
        admitted = [waiting.pop(0) for _ in range(min(len(waiting), self.cache.free_slots))]
        chunk: list[_Request] = []
        for i, r in enumerate(admitted):
            r.slot = self.cache.allocate()
            chunk.append(r)
            after = admitted[i + 1] if i + 1 < len(admitted) else None
            longest = max(c.prompt_len for c in chunk + ([after] if after else []))
            if after is None or (len(chunk) + 1) * longest > self.prefill_tokens:
                first = self.forward.prefill([c.history.tokens for c in chunk], [c.slot for c in chunk])
                for c, token in zip(chunk, first):
                    self._commit(c, [token], eos)
                chunk = []
        return admitted

    def _running(self, requests: list[_Request]) -> list[_Request]:
        """The requests still running; finished ones give their slots back."""
        running = []
        for r in requests:
            if r.finish is None:
                running.append(r)
            else:
                self.cache.free(r.slot)
                r.slot = 0
        return running

    @staticmethod
    def _commit(r: _Request, tokens: list[int], eos: frozenset[int]) -> int:
        """Append ``tokens`` to a request, cut at its first EOS (kept) and at max_new_tokens; returns how many."""
        room = r.max_new - len(r.tokens)
        tokens = tokens[:room]
        for i, t in enumerate(tokens):
            if t in eos:
                tokens = tokens[:i + 1]
                r.finish = "eos"
                break
        r.tokens.extend(tokens)
        r.history.extend(tokens)
        if r.finish is None and len(r.tokens) >= r.max_new:
            r.finish = "length"
        return len(tokens)

    def _choose(self, running: list[_Request], policy, gate) -> tuple[str, list[list[int]]]:
        """The step's mode and, for verify, each row's drafts."""
        if policy is None or policy.choose(len(running)) != policy.spec_mode or (gate is not None and not gate.allow()):
            return DECODE, []
        drafts = [r.history.propose(self.num_draft_tokens) for r in running]
        return (VERIFY, drafts) if any(drafts) else (DECODE, [])

    def _step(self, running: list[_Request], eos: frozenset[int], policy, gate) -> tuple:
        mode, drafts = self._choose(running, policy, gate)
        bs = len(running)
        if mode == DECODE:
            ids = [r.tokens[-1] for r in running]
            positions = [r.position for r in running]
        else:
            width = 1 + self.num_draft_tokens
            ids, positions = [], []
            for r, d in zip(running, drafts):
                # Short drafts are padded with their last token: verified like the others, never counted.
                ids += [r.tokens[-1]] + d + [d[-1] if d else r.tokens[-1]] * (width - 1 - len(d))
                positions += range(r.position, r.position + width)
        host = torch.tensor(ids + positions + [r.slot for r in running], dtype=torch.int64)
        dev = host.to(self.cache.device)
        n = len(ids)
        out = self.pool.run(mode, input_ids=dev[:n], positions=dev[n:2 * n], slots=dev[2 * n:])["next"].tolist()
        graph_bs = self.pool.route(mode, bs)
        if mode == DECODE:
            committed = sum(self._commit(r, [t], eos) for r, t in zip(running, out))
            return mode, bs, graph_bs, committed, 0, 0
        width = 1 + self.num_draft_tokens
        committed = accepted = 0
        for row, (r, d) in enumerate(zip(running, drafts)):
            predicted = out[row * width:(row + 1) * width]
            taken = 0
            while taken < len(d) and d[taken] == predicted[taken]:
                taken += 1
            accepted += taken
            committed += self._commit(r, predicted[:taken + 1], eos)
        if gate is not None:
            gate.record(1 + accepted / bs)
        return mode, bs, graph_bs, committed, sum(map(len, drafts)), accepted

    # ------------------------------------------------------------------------------------ benchmarks
    def sample_inputs(self, mode: str, bs: int, seed: int = 0) -> dict[str, torch.Tensor]:
        """Valid inputs for one step of ``mode`` at ``bs`` rows (random tokens, rows in slots ``1..bs`` at random
        positions): what a replay-latency benchmark feeds :meth:`GraphPool.run`. The keys written land in those
        slots; run it under ``torch.inference_mode()`` on the eager twin."""
        if not 1 <= bs <= self.cache.num_slots - 1:
            raise ValueError(f"bs must be in [1, {self.cache.num_slots - 1}] (the cache's sequence slots), got {bs}")
        width = self.pool.modes[mode].tokens_per_seq
        gen = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, self.max_len - width + 1, (bs, 1), generator=gen)
        device = self.cache.device
        return {"input_ids": torch.randint(0, self.model.config.vocab_size, (bs * width,), generator=gen).to(device),
                "positions": (starts + torch.arange(width)).view(-1).to(device),
                "slots": torch.arange(1, bs + 1).to(device)}


def generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int] = 32,
             eos_token_id: int | Sequence[int] | None = None, policy: gp.SpeculationPolicy | None = None,
             gate: gp.AcceptanceGate | None = None, **generator_args) -> GenerationResult:
    """One call: build a :class:`PoolGenerator` sized for ``prompts`` and run :meth:`PoolGenerator.generate`.

    ``max_len`` defaults to the longest prompt + ``max_new_tokens`` + drafts; ``generator_args`` go to
    :class:`PoolGenerator` (``batch_sizes``, ``num_draft_tokens``, ``debug``, ...). Capturing costs far more
    than one short generation: keep a :class:`PoolGenerator` for repeated calls. No prompts: an empty result,
    as :meth:`PoolGenerator.generate` returns, and nothing is built."""
    counts = _new_token_counts(prompts, max_new_tokens)
    if not counts:  # no prompts: nothing to size a cache for, nor to capture graphs for
        return GenerationResult(tokens=[], finish=[])
    drafts = generator_args.get("num_draft_tokens", 4)
    generator_args.setdefault("max_len", max(len(p) + c for p, c in zip(prompts, counts)) + drafts)
    generator = PoolGenerator(model, **generator_args)
    try:
        return generator.generate(prompts, max_new_tokens, eos_token_id, policy, gate)
    finally:
        generator.close()


def _new_token_counts(prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int]) -> list[int]:
    """``max_new_tokens`` as one count per prompt; raises ValueError for a count < 1 or a list of another length."""
    one = isinstance(max_new_tokens, int)
    counts = [max_new_tokens] * len(prompts) if one else list(max_new_tokens)
    if len(counts) != len(prompts) or min(counts, default=1) < 1 or one and max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1 or one per prompt ({len(prompts)}), got "
                         f"{max_new_tokens!r}")
    return counts


def build_pool(model: torch.nn.Module, batch_sizes: Sequence[int], max_len: int, num_draft_tokens: int,
               **generator_args) -> tuple[gp.GraphPool, Callable[..., dict[str, torch.Tensor]]]:
    """The captured pool for ``model`` without running generation, and a sampler of valid step inputs.

    For replay-latency benchmarks (``graphpool.bench``): ``pool.run(mode, **sampler(mode, bs))`` runs one
    step of ``mode`` (``"decode"``, or ``"verify"`` with ``num_draft_tokens > 0``) at ``bs`` rows.

    Args:
        model: as for :class:`PoolGenerator`.
        batch_sizes: graph batch sizes (the cache gets one slot per row of the largest).
        max_len: tokens per slot.
        num_draft_tokens: drafts per row of a verify step (its graphs carry ``1 + num_draft_tokens`` tokens).
        generator_args: more :class:`PoolGenerator` arguments (``verify_batch_sizes``, ``debug``, ...).

    Returns:
        ``(pool, sampler)``: ``sampler(mode, bs, seed=0)`` is :meth:`PoolGenerator.sample_inputs`. The pool
        keeps the model and cache alive.
    """
    generator = PoolGenerator(model, max_len=max_len, batch_sizes=batch_sizes, num_draft_tokens=num_draft_tokens,
                              **generator_args)
    return generator.pool, generator.sample_inputs

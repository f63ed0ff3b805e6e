"""Batched generation with every decode step from a :class:`~graphpool.GraphPool`: a ``generate()`` replacement.

:class:`PoolGenerator` builds a :class:`SlotCache` and a pool for a transformers model, once: ``decode`` (one
token per row) and ``verify`` (the row's last token plus ``num_draft_tokens`` drafts found by prompt lookup in
its own history, :mod:`.lookup`), or with speculation tiers (``num_draft_tokens=(8, 4, 2)``) one verify mode per
draft length (``verify``, ``verify_4``, ``verify_2``: :mod:`.tiers`). :meth:`PoolGenerator.generate` then runs
requests to their ends: each loop admits waiting prompts into free slots (an eager, batched prefill through the
same cache: prompts have many lengths, so the prefill is outside the pool), then runs one step of all running
requests from the pool. Each step's mode is chosen in one place (:meth:`PoolGenerator._plan`): the verify mode a
:class:`~graphpool.TierSchedule` names for the batch size (a :class:`~graphpool.SpeculationPolicy`: ``verify``
while the batch is small enough; no policy: ``verify`` always) while an :class:`~graphpool.AcceptanceGate` says
drafts pay and lookup found a draft for at least one row; ``decode`` otherwise. The draft length of a step is its
mode's (``tokens_per_seq - 1``), read from the pool, never from a constant.

Tokens are chosen as ``generate()`` chooses them (:mod:`.sampling`), greedy or sampled per the resolved
``GenerationConfig`` (:mod:`.options`); sampled rows keep speculating, exactly. Requests end at their own step
(an EOS, a stop string, or their ``max_new_tokens``), and the batch shrinks (or takes in waiting prompts) as
they do.

Why ``torch.inference_mode()`` everywhere here: with autograd on, the cache's in-place writes record
the keys' history (the weights require grad), so the KV cache silently joins an autograd graph that
grows every step, keeps every step's activations alive, and makes graph capture record autograd state.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, Sequence

import torch

import graphpool as gp

from .cache import SlotCache
from .generation import GenerationRun, Request
from .inputs import prompt_lists, streamers_for
from .lookup import NgramIndex
from .options import Options, per_request, resolve
from .result import GenerationResult, StepRecord
from .sampling import NEUTRAL
from .step import (DECODE, STEP_OUTPUTS, VERIFY, SlotForward, compile_options, describe, step_inputs, step_modes,
                   verify_modes)
from .structure import inspect_model
from .tiers import check_policy, draft_schedule

log = logging.getLogger("graphpool.transformers")

InputsFn = Callable[[SlotCache, int], Sequence[gp.StepInput]]


class PoolGenerator:
    """Batched generation for a transformers causal LM, every decode step from one :class:`GraphPool`.

    Builds the :class:`SlotCache` (``max_batch + 1`` slots of ``max_len`` tokens) and the pool, and captures
    its graphs (CUDA graphs on CUDA, the eager twin on CPU), all at construction; :meth:`generate` reuses them.

    Args:
        model: a decoder-only ``*ForCausalLM`` whose attention runs through transformers' attention interface
            (:mod:`.structure`; ``sdpa`` or ``eager``), in eval mode, on its device and dtype.
        max_len: tokens per sequence slot: every request's prompt + new tokens + drafts must fit.
        max_batch: requests running at once (cache slots; more prompts wait for a free slot). Default: the
            largest batch size.
        batch_sizes: batch sizes of the graphs (larger batches run eagerly: counted as misses).
        num_draft_tokens: drafts per row of a verify step (its graphs carry ``1 + num_draft_tokens`` tokens
            per row); 0: plain decode only. Several (e.g. ``(8, 4, 2)``): speculation tiers, one verify mode per
            draft length, ``verify`` for the longest and ``verify_<k>`` for each shorter one, all in the one pool
            (:meth:`tier_schedule` builds a schedule choosing among them by batch size). With drafts and no
            ``policy``, :meth:`generate` speculates at every step where lookup finds a draft, with the longest.
        verify_batch_sizes: batch sizes of the verify graphs (default: ``batch_sizes``).
        max_ngram: the longest n-gram prompt lookup matches (down to 1).
        grouped_attention: see :class:`SlotForward` (``sdpa`` models: keys read once per key/value head).
        prefill_tokens: the most (padded) tokens one eager prefill batch carries; more admitted prompts are
            prefilled in several batches (at least one prompt each).
        cache_dtype: the keys' and values' dtype (default: the model's; see :class:`SlotCache`).
        tokenizer: for ``stop_strings`` (also accepted per call, as ``generate`` takes it).
        debug: the pool's debug mode (bounds of every input checked, each step waited for).
        inputs: the pool's input declarations, ``inputs(cache, vocab_size)``; default :func:`step_inputs`.
            Change it only knowingly: a wrong fill breaks padded rows (this package's tests pass one to show
            that their oracle catches it).
        progress: report capture progress on stderr.
        compile: compile the model's forward in the decode and verify steps with ``torch.compile`` before the
            pool captures them (``True``: torch's defaults; a dict: its keyword arguments, e.g. ``{"mode":
            "max-autotune-no-cudagraphs"}``). Inductor fuses the forward's small kernels and the graphs replay the
            fused ones; the sampler stays eager inside the graphs. The compiles happen during construction (each
            new step shape, until torch makes the shapes dynamic). Modes that capture CUDA graphs of their own are
            refused: the pool captures.

    Raises:
        UnsupportedModelError: the model or the transformers release cannot be served (why, and the fix).
        ValueError: a bad ``num_draft_tokens`` (negative, or a list with a length below 1 or repeated) or
            ``max_batch``; a ``compile`` mode that captures CUDA graphs itself.
        TypeError: ``compile`` neither a bool nor a mapping of ``torch.compile`` arguments.
    """

    def __init__(self, model: torch.nn.Module, *, max_len: int, max_batch: int | None = None,
                 batch_sizes: Sequence[int] = (1, 2, 4, 8), num_draft_tokens: int | Sequence[int] = 4,
                 verify_batch_sizes: Sequence[int] | None = None, max_ngram: int = 3, grouped_attention: bool = True,
                 prefill_tokens: int = 8192, cache_dtype: torch.dtype | None = None, tokenizer: Any = None,
                 debug: bool = False, inputs: InputsFn = step_inputs, progress: bool = False,
                 compile: bool | Mapping[str, Any] = False):
        #: The verify modes and their draft lengths, longest first (``{}``: plain decode only).
        self.verify_modes = verify_modes(num_draft_tokens)
        compiled = compile_options(compile)
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 (requests running at once), got {max_batch}")
        sizes = tuple(sorted(set(batch_sizes)))
        #: The longest draft length (``verify``'s; 0: plain decode only).
        self.num_draft_tokens = max(self.verify_modes.values(), default=0)
        self.model, self.max_len, self.max_ngram = model, max_len, max_ngram
        self.prefill_tokens, self.tokenizer = prefill_tokens, tokenizer
        self.max_batch = sizes[-1] if max_batch is None else max_batch
        device = next(model.parameters()).device
        layout = inspect_model(model)
        with torch.inference_mode():
            self.cache = SlotCache(model, self.max_batch + 1, max_len, dtype=cache_dtype, layout=layout)
            self.forward = SlotForward(model, self.cache, grouped_attention, compiled)
            verify = tuple(sorted(set(verify_batch_sizes))) if verify_batch_sizes else None
            self.pool = gp.GraphPool(step_modes(num_draft_tokens, None, verify),
                                     list(inputs(self.cache, self.forward.vocab)), sizes, device=device, debug=debug)
            started = time.perf_counter()
            self.pool.capture(self.forward, outputs=STEP_OUTPUTS, progress=progress)
            self.capture_s = time.perf_counter() - started
        log.info("captured %d graphs for %s in %.2f s; %r", len(self.pool.graph_keys), describe(model),
                 self.capture_s, self.cache)

    def close(self) -> None:
        """Free the graphs (the cache stays until the generator is dropped)."""
        self.pool.close()

    def draft_tokens(self, mode: str) -> int:
        """Drafts per row in a step of ``mode`` (its tokens per row, less the row's last token)."""
        return self.pool.modes[mode].tokens_per_seq - 1

    def tier_schedule(self, bounds: Sequence[tuple[int, float] | tuple[int, float, float]], *,
                      min_accept: Mapping[int, float] | None = None, window: int = 4,
                      pause_steps: int = 512) -> gp.TierSchedule:
        """A :class:`~graphpool.TierSchedule` for :meth:`generate`: the draft length of each step by batch size.

        Args:
            bounds: one ``(draft length, off_above)`` or ``(draft length, off_above, on_at_or_below)`` per
                speculative tier, longest draft first, each a length this generator was built with; plain decode
                serves every batch larger than the last ``off_above``.
            min_accept: break-even tokens per sequence per verify step by draft length (optional).
            window, pause_steps: the acceptance measurement of the tiers with ``min_accept``.

        Raises:
            ValueError: a length the generator lacks, lengths not shortening, bounds not rising (the fix named).

        Example::

            gen = PoolGenerator(model, max_len=256, batch_sizes=[1, 2, 4, 8, 16], num_draft_tokens=(8, 4, 2))
            # 8 drafts at <= 2 requests, 4 at <= 8 (back at <= 6), 2 at <= 12, plain decode above
            tiers = gen.tier_schedule([(8, 2), (4, 8, 6), (2, 12)])
            out = gen.generate(prompts, max_new_tokens=64, policy=tiers)
            out.steps_by_mode  # e.g. {"decode": 20, "verify_2": 9, "verify_4": 14, "verify": 11}
        """
        return draft_schedule(self.pool.modes, bounds, min_accept=min_accept, window=window, pause_steps=pause_steps)

    # ------------------------------------------------------------------------------------ generation
    def generate(self, inputs: Any = None, generation_config: Any = None, *, attention_mask: Any = None,
                 max_new_tokens: int | Sequence[int] | None = None, policy: gp.TierSchedule | None = None,
                 gate: gp.AcceptanceGate | None = None, streamer: Any = None, tokenizer: Any = None,
                 generator: torch.Generator | None = None, seed: int | None = None, output_logprobs: bool = False,
                 input_ids: Any = None, **kwargs: Any) -> GenerationResult:
        """Generate for every prompt as ``model.generate`` would for it alone; return the tokens and per-step stats.

        Args:
            inputs: the prompts: a tokenizer's output (``BatchEncoding`` or a dict with ``input_ids`` and
                ``attention_mask``, left or right padded), a ``[B, L]`` tensor, or token id lists
                (:mod:`.inputs`). ``input_ids=`` is accepted too, as ``generate(**encoding)`` passes it.
            generation_config: a ``GenerationConfig`` (default: the model's own, ``model.generation_config``);
                ``kwargs`` override its fields as in ``generate()``. Served: :data:`~.options.SERVED`
                (``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``,
                ``min_new_tokens``, ``max_new_tokens``, ``max_length``, ``eos_token_id`` (an int or a list;
                ``[]``: none), ``pad_token_id``, ``stop_strings``); any other option set is an error naming it.
            attention_mask: for a tensor or lists of ``inputs``.
            max_new_tokens: one int for all requests, or one per prompt (overrides the config's).
            policy: chooses each step's mode by batch size (``policy.choose(bs)``), and hears each verify step's
                acceptance (``policy.record``): a :class:`~graphpool.TierSchedule` over this generator's modes
                (:meth:`tier_schedule`), or a :class:`~graphpool.SpeculationPolicy` (``verify`` or plain).
                ``None``: speculate at every step (with ``num_draft_tokens > 0``), with the longest drafts;
                ``SpeculationPolicy(off_above=0)``: never. Its state carries over from call to call.
            gate: pauses speculation while verify steps commit too few tokens per sequence.
            streamer: transformers' streamer interface (``TextStreamer``, ``TextIteratorStreamer``): one for a
                single prompt, or a list with one (or ``None``) per prompt.
            tokenizer: for ``stop_strings`` (default: the generator's).
            generator: the ``torch.Generator`` (CPU) sampled rows draw from; ``seed``: a new one seeded so.
                Neither: seeded from torch's global generator (``torch.manual_seed`` makes runs repeat).
            output_logprobs: fill :attr:`GenerationResult.logprobs`.

        Raises:
            UnsupportedOptionError: an option not served (named), or an unknown keyword.
            ValueError: a prompt is empty, holds a token outside the vocabulary, or with its new tokens and
                drafts does not fit ``max_len``; a policy without a verify mode (``num_draft_tokens=0``) or naming a
                mode this generator lacks; stop strings without a tokenizer. Nothing has run then: the generator
                stays usable.
            TypeError: a policy that is not a :class:`~graphpool.TierSchedule`.
        """
        if inputs is None:
            inputs = input_ids
        elif input_ids is not None:
            raise ValueError("prompts given twice: as inputs and as input_ids")
        options = resolve(self.model, generation_config, **kwargs)
        with torch.inference_mode():
            prompts = prompt_lists(inputs, attention_mask, options.pad_token_id, options.eos)
            requests = self._requests(prompts, options, max_new_tokens, policy, streamer)
            stop = self._stop_criteria(options, tokenizer)
            if generator is None:
                seed = int(torch.randint(2 ** 62, ())) if seed is None else seed
                generator = torch.Generator().manual_seed(seed)
            return self._generate(requests, options, policy, gate, stop, generator, output_logprobs)

    def _stop_criteria(self, options: Options, tokenizer: Any) -> Any:
        if not options.stop_strings:
            return None
        tokenizer = tokenizer or self.tokenizer
        if tokenizer is None:
            raise ValueError("stop_strings need a tokenizer (as in generate()): pass tokenizer= to generate() or to "
                             "the PoolGenerator")
        from transformers.generation import StopStringCriteria
        return StopStringCriteria(tokenizer, list(options.stop_strings))

    def _requests(self, prompts, options: Options, max_new_tokens, policy, streamer) -> list[Request]:
        if policy is not None:
            check_policy(policy, self.pool.modes)
        counts = per_request(max_new_tokens, len(prompts), "max_new_tokens")
        streamers = streamers_for(streamer, len(prompts))
        drafts = max(self.draft_tokens(mode) for mode in self.pool.modes)  # room for the longest step
        vocab = self.forward.vocab
        requests = []
        for i, (prompt, count, stream) in enumerate(zip(prompts, counts, streamers)):
            count = options.new_tokens(len(prompt)) if count is None else count
            if not all(0 <= t < vocab for t in prompt):
                raise ValueError(f"prompt {i} holds token ids outside [0, {vocab}): {prompt[:8]}"
                                 f"{'...' if len(prompt) > 8 else ''}")
            if count < 1:
                raise ValueError(f"prompt {i}: no new tokens to generate (max_length {options.max_length} <= its "
                                 f"{len(prompt)} tokens); set max_new_tokens")
            if len(prompt) + count + drafts > self.max_len:
                raise ValueError(f"prompt {i}: {len(prompt)} tokens + max_new_tokens {count} + {drafts} drafts "
                                 f"exceed the cache's max_len {self.max_len}; build the PoolGenerator with a larger "
                                 f"max_len or shorten the request")
            requests.append(Request(i, prompt, count, 0, NgramIndex(prompt, self.max_ngram), stream))
        return requests

    def _generate(self, requests: list[Request], options: Options, policy, gate, stop, generator,
                  output_logprobs: bool) -> GenerationResult:
        result = GenerationResult(tokens=[[] for _ in requests], finish=[""] * len(requests),
                                  pad_token_id=options.pad_token_id)
        self.forward.set_eos(list(options.eos))
        run = GenerationRun(self, options, stop, generator)
        waiting, running = list(requests), []
        try:
            while waiting or running:
                if waiting and self.cache.free_slots:
                    started = time.perf_counter()
                    running = self._running(running + run.admit(waiting))
                    result.prefill_s += time.perf_counter() - started
                    if not running:  # every admitted request ended at its first token
                        continue
                started = time.perf_counter()
                record = run.step(running, *self._plan(running, policy, gate))
                record = StepRecord(*record, seconds=time.perf_counter() - started)
                if record.mode != DECODE:
                    committed_per_seq = 1 + record.accepted / record.batch_size
                    if gate is not None:
                        gate.record(committed_per_seq)
                    if policy is not None:
                        policy.record(record.mode, committed_per_seq)  # a tier's min_accept hears its own steps
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
        if output_logprobs:
            result.logprobs = [r.logprobs for r in sorted(requests, key=lambda r: r.index)]
        return result

    def _running(self, requests: list[Request]) -> list[Request]:
        """The requests still running; finished ones give their slots back."""
        running = []
        for r in requests:
            if r.finish is None:
                running.append(r)
            else:
                self.cache.free(r.slot)
                r.slot = 0
        return running

    def _plan(self, running: list[Request], policy, gate) -> tuple[str, list[list[int]]]:
        """The step's mode and, for a verify mode, each row's drafts (up to as many as the mode carries). The one
        place a step's shape is chosen: the policy's tier for the batch size, plain decode where the gate pauses
        speculation or lookup found no draft."""
        if policy is None:
            mode = VERIFY if self.verify_modes else DECODE
        else:
            mode = policy.choose(len(running))
        if mode == DECODE or (gate is not None and not gate.allow()):
            return DECODE, []
        count = self.draft_tokens(mode)
        drafts = [r.history.propose(count) for r in running]
        return (mode, drafts) if any(drafts) else (DECODE, [])


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
        return {"input_ids": torch.randint(0, self.forward.vocab, (bs * width,), generator=gen).to(device),
                "positions": (starts + torch.arange(width)).view(-1).to(device),
                "slots": torch.arange(1, bs + 1).to(device),
                "sampling": torch.tensor([NEUTRAL] * bs, dtype=torch.float32).to(device),
                "uniforms": torch.rand(bs * width, 2, generator=gen).to(device)}

def generate(model: torch.nn.Module, inputs: Any = None, generation_config: Any = None, *,
             max_new_tokens: int | Sequence[int] | None = None, attention_mask: Any = None,
             generator_args: dict | None = None, **kwargs: Any) -> GenerationResult:
    """One call: build a :class:`PoolGenerator` sized for ``inputs`` and run :meth:`PoolGenerator.generate`.

    ``kwargs`` go to :meth:`PoolGenerator.generate` (``policy``, ``streamer``, generation options, ...);
    ``generator_args`` to :class:`PoolGenerator` (``batch_sizes``, ``num_draft_tokens``, ``debug``, ...;
    ``max_len`` defaults to the longest prompt + its new tokens + drafts). No prompts: an empty result, as
    :meth:`PoolGenerator.generate` gives. Capturing costs far more than one short generation: keep a
    :class:`PoolGenerator` for repeated calls."""
    generator_args = dict(generator_args or {})
    gen_kwargs = {k: kwargs[k] for k in ("generator", "seed", "policy", "gate", "streamer", "tokenizer",
                                         "output_logprobs") if k in kwargs}
    options = resolve(model, generation_config, **{k: v for k, v in kwargs.items() if k not in gen_kwargs})
    prompts = prompt_lists(inputs, attention_mask, options.pad_token_id, options.eos) if _has_prompts(inputs) else []
    counts = per_request(max_new_tokens, len(prompts), "max_new_tokens")  # checked with no prompts too
    if not prompts:
        return GenerationResult(tokens=[], finish=[], pad_token_id=options.pad_token_id)
    drafts = max(verify_modes(generator_args.get("num_draft_tokens", 4)).values(), default=0)
    generator_args.setdefault("max_len", max(len(p) + (c or options.new_tokens(len(p)))
                                             for p, c in zip(prompts, counts)) + drafts)
    pool_generator = PoolGenerator(model, **generator_args)
    try:
        return pool_generator.generate(prompts, generation_config, max_new_tokens=max_new_tokens, **kwargs)
    finally:
        pool_generator.close()


def _has_prompts(inputs: Any) -> bool:
    if inputs is None:
        return False
    if isinstance(inputs, torch.Tensor):
        return inputs.numel() > 0
    if hasattr(inputs, "keys"):
        return _has_prompts(inputs["input_ids"]) if "input_ids" in inputs else True
    return len(inputs) > 0


def build_pool(model: torch.nn.Module, batch_sizes: Sequence[int], max_len: int, num_draft_tokens: int | Sequence[int],
               **generator_args) -> tuple[gp.GraphPool, Callable[..., dict[str, torch.Tensor]]]:
    """The captured pool for ``model`` without running generation, and a sampler of valid step inputs.

    For replay-latency benchmarks (``graphpool.bench``): ``pool.run(mode, **sampler(mode, bs))`` runs one
    step of ``mode`` (``"decode"``, or a verify mode with ``num_draft_tokens > 0``) at ``bs`` rows.

    Args:
        model: as for :class:`PoolGenerator`.
        batch_sizes: graph batch sizes (the cache gets one slot per row of the largest).
        max_len: tokens per slot.
        num_draft_tokens: drafts per row of a verify step (its graphs carry ``1 + num_draft_tokens`` tokens), or
            several (one verify mode each, as for :class:`PoolGenerator`).
        generator_args: more :class:`PoolGenerator` arguments (``verify_batch_sizes``, ``debug``, ...).

    Returns:
        ``(pool, sampler)``: ``sampler(mode, bs, seed=0)`` is :meth:`PoolGenerator.sample_inputs`. The pool
        keeps the model and cache alive.
    """
    generator = PoolGenerator(model, max_len=max_len, batch_sizes=batch_sizes, num_draft_tokens=num_draft_tokens,
                              **generator_args)
    return generator.pool, generator.sample_inputs

"""One step of a transformers model over a :class:`SlotCache`: the pool's declarations and the step function.

Every mode's step is the same function: ``tokens_per_seq`` tokens for each of ``bs`` rows, at the positions
the caller passes, in the slot each row owns. Plain decode is ``Mode("decode", 1)``; prompt-lookup
verification is ``Mode("verify", 1 + num_draft_tokens)`` (each row's last committed token, then its drafts), and
with speculation tiers (several draft lengths, :func:`verify_modes`) one ``verify_<k>`` mode per shorter length.
The step returns, for every input token, the choice of :func:`~.sampling.choose` (``"out"``, one row per
token): the next token as ``generate()`` would choose it (greedy or sampled, per row), and whether the draft
after it is accepted.
"""
from __future__ import annotations

import inspect
import numbers
from typing import Any, Mapping, Sequence

import torch

import graphpool as gp

from .attention import register, slot_attention
from .cache import DUMMY_SLOT, SlotCache
from .sampling import DRAFTS, PARAMS, choose, seen_tokens
from .structure import attention_implementation, cache_argument

DECODE, VERIFY = "decode", "verify"

#: The output rule for :func:`~graphpool.GraphPool.capture`: ``out`` has one row per token
#: (``[N, 4]`` float64, the columns of :data:`~.sampling.OUT`).
STEP_OUTPUTS = {"out": "token"}

#: ``torch.compile`` modes that capture CUDA graphs of their own: the pool captures the step itself, and a capture
#: cannot hold another capture.
GRAPHING_MODES = ("reduce-overhead", "max-autotune")


def compile_options(compile: bool | Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``torch.compile`` keyword arguments of a generator's ``compile`` option: ``None`` for ``False``, ``{}``
    (torch's defaults: Inductor, no CUDA graphs of its own) for ``True``, a copy of a mapping otherwise.

    Raises:
        ValueError: a mode that captures CUDA graphs itself (``reduce-overhead``, ``max-autotune``), or Inductor's
            ``triton.cudagraphs`` option on: the pool captures the compiled step (use ``default`` or
            ``max-autotune-no-cudagraphs``).
        TypeError: neither a bool nor a mapping.
    """
    if isinstance(compile, bool):
        return {} if compile else None
    if not isinstance(compile, Mapping):
        raise TypeError(f"compile takes True, False or a dict of torch.compile arguments (e.g. {{'mode': "
                        f"'max-autotune-no-cudagraphs'}}), got {type(compile).__name__}")
    options = dict(compile)
    cudagraphs = (options.get("options") or {}).get("triton.cudagraphs", False)
    if options.get("mode") in GRAPHING_MODES or cudagraphs:
        raise ValueError(f"compile={compile!r}: that torch.compile setting captures CUDA graphs of its own, and the "
                         f"pool captures the compiled step in its graphs; use mode 'default' or "
                         f"'max-autotune-no-cudagraphs'")
    return options


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def draft_lengths(num_draft_tokens: int | Sequence[int]) -> tuple[int, ...]:
    """The verify steps' draft lengths, longest first: ``()`` for 0 (plain decode only), ``(k,)`` for an int ``k``,
    and a list or tuple of lengths (speculation tiers, in any order) sorted.

    Raises:
        ValueError: a negative int; a sequence that is empty or holds a length below 1, a repeated one or a
            non-int (the fix named).
    """
    if _is_int(num_draft_tokens):
        if num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0 (0: plain decode only), got {num_draft_tokens}")
        return (int(num_draft_tokens),) if num_draft_tokens else ()
    lengths = list(num_draft_tokens) if isinstance(num_draft_tokens, (list, tuple, range)) else []
    if not lengths or not all(map(_is_int, lengths)):
        raise ValueError(f"num_draft_tokens takes an int (drafts per verify row; 0: plain decode only) or a "
                         f"non-empty list of them (one verify mode per draft length, e.g. (8, 4, 2)), got "
                         f"{num_draft_tokens!r}")
    if min(lengths) < 1 or len(set(lengths)) != len(lengths):
        raise ValueError(f"num_draft_tokens={tuple(num_draft_tokens)!r}: each speculation tier's draft length must be "
                         f">= 1 and appear once (plain decode is always built: leave 0 out)")
    return tuple(sorted(map(int, lengths), reverse=True))


def verify_modes(num_draft_tokens: int | Sequence[int]) -> dict[str, int]:
    """The verify modes' names and draft lengths, longest first: ``verify`` for the longest, ``verify_<k>`` for
    each shorter length ``k`` (the reference engine's names), e.g. ``(8, 4, 2)`` gives ``{"verify": 8,
    "verify_4": 4, "verify_2": 2}``. ``{}`` for 0."""
    lengths = draft_lengths(num_draft_tokens)
    return {(VERIFY if i == 0 else f"{VERIFY}_{k}"): k for i, k in enumerate(lengths)}


def step_modes(num_draft_tokens: int | Sequence[int], batch_sizes: tuple[int, ...] | None = None,
               verify_batch_sizes: tuple[int, ...] | None = None) -> list[gp.Mode]:
    """The pool's modes: plain decode (1 token per row) and, for each draft length ``k`` of ``num_draft_tokens``
    (an int, or several for speculation tiers; :func:`verify_modes` names them), a verify mode of ``1 + k``
    tokens per row; decode at ``batch_sizes``, the verify modes at ``verify_batch_sizes`` (``None``: the pool's)."""
    modes = [gp.Mode(DECODE, 1, batch_sizes)]
    modes += [gp.Mode(name, 1 + k, verify_batch_sizes) for name, k in verify_modes(num_draft_tokens).items()]
    return modes


def step_inputs(cache: SlotCache, vocab_size: int) -> list[gp.StepInput]:
    """The step's inputs, declared for the pool, with fills that keep padded rows harmless.

    * ``input_ids`` (per token, fill 0, bounds ``[0, vocab_size)``);
    * ``positions`` (per token, fill 0, bounds ``[0, max_len)``): where each token sits in its sequence; the
      mask lets it see keys at positions ``<=`` its own;
    * ``slots`` (per sequence, fill :data:`DUMMY_SLOT`, bounds ``[0, num_slots)``): the row's cache slot;
    * ``sampling`` (per sequence, float32 ``[len(PARAMS)]``, fill 1.0): the row's settings, the columns of
      :data:`~.sampling.PARAMS`; all ones is a harmless setting (temperature 1, keep the top token);
    * ``uniforms`` (per token, float32 ``[2]``, fill 0.5, bounds ``[0, 1)``): the draws of a sampled row.

    Padded rows (and every row during capture) hold the fills: token 0 at position 0 in the dummy slot, so
    they write only the dummy slot and attend to one key there.
    """
    return [gp.StepInput("input_ids", torch.int64, per="token", fill=0, bounds=(0, vocab_size)),
            gp.StepInput("positions", torch.int64, per="token", fill=0, bounds=(0, cache.max_len)),
            gp.StepInput("slots", torch.int64, per="seq", fill=DUMMY_SLOT, bounds=(0, cache.num_slots)),
            gp.StepInput("sampling", torch.float32, per="seq", fill=1.0, trailing=(len(PARAMS),),
                         bounds=(0.0, float("inf"))),
            gp.StepInput("uniforms", torch.float32, per="token", fill=0.5, trailing=(2,), bounds=(0.0, 1.0))]


class SlotForward:
    """The model over a :class:`SlotCache`: :meth:`logits`, :meth:`prefill`, and the pool's step function
    (calling the object).

    Args:
        model: a served ``*ForCausalLM`` model (:mod:`.structure`).
        cache: its slot cache (its ``layout`` is the model's).
        grouped: for ``"sdpa"`` models, attend with :func:`~.attention.grouped_sdpa` (each key read once per
            key/value head, not repeated for its query heads) where attention receives nothing else it would
            compute differently; ``False`` keeps transformers' own ``sdpa``. ``"eager"`` models keep theirs.
        compile: ``torch.compile`` keyword arguments for the model's forward in the decode and verify steps
            (``None``: eager modules); :func:`compile_options` makes them. The sampler stays eager (captured in the
            graphs all the same), and so does the prefill: its shapes change with every batch.
    """

    def __init__(self, model: torch.nn.Module, cache: SlotCache, grouped: bool = True,
                 compile: Mapping[str, Any] | None = None):
        self.model, self.cache = model, cache
        layout = cache.layout
        self.grouped = bool(grouped and layout.implementation == "sdpa" and layout.plain_arguments and layout.groups)
        self.groups = layout.groups if self.grouped else 1
        self.windows = layout.windows
        self.attention = register(slot_attention(layout, self.grouped))
        self._cache_arg = cache_argument(model)
        self._keep_arg = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.vocab = model.get_output_embeddings().weight.shape[0]
        # Compiled without CUDA graphs of its own (compile_options): Inductor fuses the forward's small kernels, and
        # the pool's capture records the fused kernels. A compile happens on a step's first new shape, which the
        # pool's warm-up run before each capture meets first. The sampler stays eager, as under transformers'
        # own compiled generate (the graph removes its launch costs all the same): torch 2.11's Inductor fails to
        # generate the split scan of top-p's cumsum over a real vocabulary (128256, run BQ).
        self._forward = self.logits if compile is None else torch.compile(self.logits, **compile)
        with torch.inference_mode():
            #: The EOS tokens that ``min_new_tokens`` suppresses (set per generation, read by the graphs).
            self.eos = torch.zeros(self.vocab, dtype=torch.bool, device=cache.device)

    def set_eos(self, tokens: list[int]) -> None:
        """Set the EOS tokens (in place: the graphs read this buffer)."""
        with torch.inference_mode():
            self.eos.zero_()
            if tokens:
                self.eos[torch.tensor(tokens, device=self.eos.device)] = True

    def logits(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv_len: int | None = None,
               last_only: bool = False) -> torch.Tensor:
        """Logits ``[B, T, V]`` (``[B, 1, V]`` with ``last_only``) of tokens ``ids`` ``[B, T]`` at ``positions``
        ``[B, T]`` in ``slots`` ``[B]``, writing their keys, values and ids into the cache."""
        cache = self.cache
        cache.bind(slots, positions, kv_len)
        cache.write_tokens(ids)
        mask = cache.attention_mask(positions, kv_len, self.groups, self.windows)
        keep = {"logits_to_keep": 1 if last_only else 0} if self._keep_arg else {}
        with attention_implementation(self.model.config, self.attention):
            out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                             **keep, **{self._cache_arg: cache})
        return out.logits[:, -1:] if last_only else out.logits

    def choose(self, logits: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, sampling: torch.Tensor,
               uniforms: torch.Tensor) -> torch.Tensor:
        """:func:`~.sampling.choose` for every token of ``logits`` ``[B, T, V]`` (the bound rows)."""
        rows, tokens = positions.shape
        n = rows * tokens
        history = self.cache.history()
        history = history[:, None, :].expand(rows, tokens, history.shape[1]).reshape(n, -1)
        params = sampling[:, None, :].expand(rows, tokens, sampling.shape[1]).reshape(n, -1)
        flat = positions.reshape(n)
        drafts = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1).reshape(n)
        column = torch.arange(tokens, device=ids.device).repeat(rows)
        seen = seen_tokens(history, flat, logits.shape[-1])
        return choose(logits.reshape(n, -1), seen, params, flat, self.eos, drafts, column < params[:, DRAFTS],
                      uniforms)

    def __call__(self, batch: gp.StepBatch) -> dict[str, torch.Tensor]:
        """The step function for :meth:`graphpool.GraphPool.capture`: ``{"out": [bs * tokens_per_seq, 4]}``."""
        x, rows, tokens = batch.inputs, batch.bs, batch.mode.tokens_per_seq
        # inference mode inside too: the eager twin and the eager miss path run this function on every step,
        # and the cache's in-place writes must never join an autograd graph (PoolGenerator also wraps its loop).
        with torch.inference_mode():
            ids, positions = x["input_ids"].view(rows, tokens), x["positions"].view(rows, tokens)
            logits = self._forward(ids, positions, x["slots"])
            return {"out": self.choose(logits, ids, positions, x["sampling"], x["uniforms"])}

    def prefill(self, prompts: list[list[int]], slots: list[int], sampling: torch.Tensor,
                uniforms: torch.Tensor) -> torch.Tensor:
        """Run ``prompts`` eagerly into their ``slots`` (one batch) and choose each one's first new token.

        Rows are left-padded to the longest prompt, so that every row's last token is the batch's last column
        (the head runs on that column only); a padding token sits past its prompt's end (positions ``len(p)``
        onwards), where the first decode steps overwrite it before anything reads it (see :mod:`.cache`).

        Returns:
            ``[B, 4]`` float64, the columns of :data:`~.sampling.OUT` for each prompt's last token.
        """
        device = self.cache.device
        longest = max(map(len, prompts))
        ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], dtype=torch.int64, device=device)
        positions = torch.tensor([list(range(len(p), longest)) + list(range(len(p))) for p in prompts],
                                 dtype=torch.int64, device=device)
        slot_ids = torch.tensor(slots, dtype=torch.int64, device=device)
        with torch.inference_mode():
            logits = self.logits(ids, positions, slot_ids, kv_len=longest, last_only=True)
            return self.choose(logits, ids[:, -1:], positions[:, -1:], sampling.to(device), uniforms.to(device))


def describe(model: Any) -> str:
    """A one-line summary of a model for logs: class, layers, hidden size, parameters, dtype."""
    params = sum(p.numel() for p in model.parameters())
    first = next(model.parameters())
    config = model.config.get_text_config()
    return (f"{type(model).__name__} ({config.num_hidden_layers} layers, hidden {config.hidden_size}, "
            f"{params / 1e6:.1f} M parameters, {first.dtype}, {model.config._attn_implementation} attention)")

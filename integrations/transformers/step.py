"""One decode step of a transformers model over a :class:`SlotCache`: the pool's declarations and the step.

Every mode's step is the same function: ``tokens_per_seq`` tokens for each of ``bs`` rows, at the positions
the caller passes, in the slot each row owns. Plain decode is ``Mode("decode", 1)``; prompt-lookup
verification is ``Mode("verify", 1 + num_draft_tokens)`` (each row's last committed token, then its drafts).
The step returns the greedy next token after every input token (``"next"``, one row per token): a verify
row's drafts are accepted while they equal the token predicted before them.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

import graphpool as gp

from .attention import grouped_attention
from .cache import DUMMY_SLOT, SlotCache

DECODE, VERIFY = "decode", "verify"

#: The output rule for :func:`~graphpool.GraphPool.capture`: ``next`` has one row per token.
STEP_OUTPUTS = {"next": "token"}


def step_modes(num_draft_tokens: int, batch_sizes: tuple[int, ...] | None = None,
               verify_batch_sizes: tuple[int, ...] | None = None) -> list[gp.Mode]:
    """The pool's modes: plain decode (1 token per row) and, with ``num_draft_tokens > 0``, verify
    (``1 + num_draft_tokens`` per row), each at its own batch sizes (``None``: the pool's)."""
    modes = [gp.Mode(DECODE, 1, batch_sizes)]
    if num_draft_tokens > 0:
        modes.append(gp.Mode(VERIFY, 1 + num_draft_tokens, verify_batch_sizes))
    return modes


def step_inputs(cache: SlotCache, vocab_size: int) -> list[gp.StepInput]:
    """The step's inputs, declared for the pool, with fills that keep padded rows harmless.

    * ``input_ids`` (per token, fill 0, bounds ``[0, vocab_size)``);
    * ``positions`` (per token, fill 0, bounds ``[0, max_len)``): where each token sits in its sequence; the
      mask lets it see keys at positions ``<=`` its own;
    * ``slots`` (per sequence, fill :data:`DUMMY_SLOT`, bounds ``[0, num_slots)``): the row's cache slot.

    Padded rows (and every row during capture) hold the fills: token 0 at position 0 in the dummy slot, so
    they write only the dummy slot and attend to one key there.
    """
    return [gp.StepInput("input_ids", torch.int64, per="token", fill=0, bounds=(0, vocab_size)),
            gp.StepInput("positions", torch.int64, per="token", fill=0, bounds=(0, cache.max_len)),
            gp.StepInput("slots", torch.int64, per="seq", fill=DUMMY_SLOT, bounds=(0, cache.num_slots))]


class SlotForward:
    """The model's decoder and head over a :class:`SlotCache`: :meth:`hidden`, :meth:`greedy`, :meth:`prefill`,
    and the pool's step function (calling the object).

    Args:
        model: a supported ``*ForCausalLM`` model (see :mod:`.versions`).
        cache: its slot cache.
        grouped: for ``"sdpa"`` models, attend with :func:`~.attention.grouped_sdpa` (each key read once per
            key/value head, not repeated for its query heads); ``False`` keeps transformers' own ``sdpa``.
            ``"eager"`` models always keep theirs.
    """

    def __init__(self, model: torch.nn.Module, cache: SlotCache, grouped: bool = True):
        self.model, self.cache = model, cache
        self.decoder, self.head = model.get_decoder(), model.get_output_embeddings()
        config = model.config
        self.grouped = grouped and config._attn_implementation == "sdpa"
        self.groups = config.num_attention_heads // cache.kv_heads if self.grouped else 1
        # transformers 5.24 renamed the decoder's `past_key_values` argument to `cache` (the old name warns).
        params = inspect.signature(self.decoder.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               kv_len: int | None = None) -> torch.Tensor:
        """Last hidden states ``[B, T, hidden]`` of tokens ``ids`` ``[B, T]`` at ``positions`` ``[B, T]`` in
        ``slots`` ``[B]``, writing their keys and values into the cache."""
        cache = self.cache
        cache.bind(slots, positions, kv_len)
        mask = cache.attention_mask(positions, kv_len, self.groups)
        with grouped_attention(self.model.config, self.grouped):
            out = self.decoder(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                               **{self._cache_arg: cache})
        return out.last_hidden_state

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy next token of each hidden state (``argmax`` of the head's logits, as transformers'
        greedy search takes it: ties go to the lowest token id)."""
        return self.head(hidden).argmax(-1)

    def __call__(self, batch: gp.StepBatch) -> dict[str, torch.Tensor]:
        """The step function for :meth:`graphpool.GraphPool.capture`: ``{"next": [bs * tokens_per_seq]}``."""
        x, rows, tokens = batch.inputs, batch.bs, batch.mode.tokens_per_seq
        # inference mode inside too: the eager twin and the eager miss path run this function on every step,
        # and the cache's in-place writes must never join an autograd graph (PoolGenerator also wraps its loop).
        with torch.inference_mode():
            hidden = self.hidden(x["input_ids"].view(rows, tokens), x["positions"].view(rows, tokens), x["slots"])
            return {"next": self.greedy(hidden).view(-1)}

    def prefill(self, prompts: list[list[int]], slots: list[int]) -> list[int]:
        """Run ``prompts`` eagerly into their ``slots`` (one padded batch) and return each one's first new token.

        Rows are right-padded to the longest prompt; a padded token writes into its own row's slot past the
        prompt's end, where the first decode steps overwrite it before anything reads it (see :mod:`.cache`).
        """
        device = self.cache.device
        longest = max(map(len, prompts))
        ids = torch.tensor([p + [0] * (longest - len(p)) for p in prompts], dtype=torch.int64, device=device)
        positions = torch.arange(longest, device=device).expand(len(prompts), longest)
        slot_ids = torch.tensor(slots, dtype=torch.int64, device=device)
        with torch.inference_mode():
            hidden = self.hidden(ids, positions, slot_ids, kv_len=longest)
            last = torch.tensor([len(p) - 1 for p in prompts], device=device)
            first = self.greedy(hidden[torch.arange(len(prompts), device=device), last])
        return first.tolist()


def describe(model: Any) -> str:
    """A one-line summary of a model for logs: class, layers, hidden size, parameters, dtype."""
    params = sum(p.numel() for p in model.parameters())
    first = next(model.parameters())
    config = model.config
    return (f"{type(model).__name__} ({config.num_hidden_layers} layers, hidden {config.hidden_size}, "
            f"{params / 1e6:.1f} M parameters, {first.dtype}, {config._attn_implementation} attention)")

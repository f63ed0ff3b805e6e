"""Prompts in the shapes ``generate()`` and tokenizers give them, and streamers per request.

Prompts: a tokenizer's output (``BatchEncoding``, or any mapping with ``input_ids`` and optionally
``attention_mask``), a ``[B, L]`` tensor with or without ``attention_mask``, or lists of token ids. A padded
batch gives each row the tokens its mask marks (left or right padding; the pad tokens are not prompt tokens). A
tensor without a mask follows ``generate()``'s rule: where the pad token occurs in it and differs from every EOS
token, the mask is ``input_ids != pad_token_id``.

Streamers: transformers' interface (``put(tensor)``, ``end()``: ``TextStreamer``, ``TextIteratorStreamer``), one
per request. Each gets the prompt first (as ``generate`` puts it; ``skip_prompt=True`` skips it), then the
tokens each step commits, then ``end()`` when the request finishes.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Sequence

import torch


def _rows(value: Any, name: str) -> list[list[int]]:
    if isinstance(value, torch.Tensor):
        if value.dim() == 1:
            value = value[None]
        if value.dim() != 2 or value.dtype.is_floating_point:
            raise ValueError(f"{name} must be a [batch, length] integer tensor, got {tuple(value.shape)} {value.dtype}")
        return value.tolist()
    value = list(value)
    if value and all(isinstance(v, int) or (isinstance(v, torch.Tensor) and v.dim() == 0) for v in value):
        return [[int(v) for v in value]]  # one prompt
    try:
        return [[int(t) for t in row] for row in value]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be token id lists (or a tensor, or a tokenizer's output with input_ids), "
                         f"got an element {str(value[0])[:40]!r}...: {e}") from None


def prompt_lists(inputs: Any, attention_mask: Any = None, pad_token_id: int | None = None,
                 eos: Sequence[int] = ()) -> list[list[int]]:
    """Each prompt's token ids, without padding.

    Raises:
        ValueError: an unknown key in a tokenizer's output, a mask that does not match the ids, a row whose mask
            is not one run of ones (holes), or an empty prompt.
    """
    if isinstance(inputs, Mapping):
        extra = sorted(set(inputs) - {"input_ids", "attention_mask"})
        if extra:
            raise ValueError(f"the tokenizer's output holds {extra} besides input_ids and attention_mask: a "
                             f"decoder-only causal LM takes neither here; drop them (return_token_type_ids=False)")
        if "input_ids" not in inputs:
            raise ValueError("a mapping of prompts needs 'input_ids' (a tokenizer's output)")
        if attention_mask is not None and "attention_mask" in inputs:
            raise ValueError("attention_mask given twice: in the tokenizer's output and as an argument")
        attention_mask = inputs.get("attention_mask", attention_mask)
        inputs = inputs["input_ids"]
    infer = isinstance(inputs, torch.Tensor) and attention_mask is None
    rows = _rows(inputs, "inputs")
    if infer and pad_token_id is not None and pad_token_id not in eos and any(pad_token_id in r for r in rows):
        attention_mask = [[int(t != pad_token_id) for t in r] for r in rows]  # generate()'s rule
    if attention_mask is None:
        prompts = rows
    else:
        masks = _rows(attention_mask, "attention_mask")
        if [len(m) for m in masks] != [len(r) for r in rows]:
            raise ValueError(f"attention_mask's shape ({len(masks)} rows) does not match the prompts' "
                             f"({len(rows)} rows of lengths {[len(r) for r in rows][:4]}...)")
        prompts = [_unpad(r, m, i) for i, (r, m) in enumerate(zip(rows, masks))]
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
    return prompts


def _unpad(row: list[int], mask: list[int], index: int) -> list[int]:
    ones = [j for j, m in enumerate(mask) if m]
    if ones and ones[-1] - ones[0] + 1 != len(ones):
        raise ValueError(f"prompt {index}: its attention_mask is not one run of ones ({mask[:16]}...): only left or "
                         f"right padding is served")
    return row[ones[0]:ones[-1] + 1] if ones else []


def streamers_for(streamer: Any, count: int) -> list[Any]:
    """One streamer (or ``None``) per request: ``streamer`` for a single prompt, or a list of ``count``."""
    if streamer is None:
        return [None] * count
    if isinstance(streamer, (list, tuple)):
        if len(streamer) != count:
            raise ValueError(f"streamer: one per prompt ({count}), got {len(streamer)}")
        found = list(streamer)
    elif count == 1:
        found = [streamer]
    else:
        raise ValueError(f"one streamer for {count} prompts: a streamer takes one sequence (as in generate()); "
                         f"pass a list of {count} streamers (None where not wanted)")
    for s in found:
        if s is not None and not (callable(getattr(s, "put", None)) and callable(getattr(s, "end", None))):
            raise ValueError(f"a streamer needs put() and end() (transformers' BaseStreamer), got {type(s).__name__}")
    return found

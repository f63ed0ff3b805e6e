"""A slot-indexed KV cache for transformers models that keeps every CUDA graph rule.

transformers' ``StaticCache`` cannot back a pool of graphs: it takes its batch size from its first write
(a second batch size fails in ``index_copy_``), and one write counter moves all rows together, so rows at
different positions (prompts of different lengths, per-row acceptance of drafts) cannot be expressed, and
the pool's warm-up and capture runs have moved it before any real token. :class:`SlotCache` instead:

* allocates, once and before capture, one ``[num_slots, kv_heads, max_len, head_dim]`` tensor of keys and
  one of values per layer; a sequence owns one *slot* (a row) for its lifetime;
* reserves slot :data:`DUMMY_SLOT` (0) for padded rows: the pool fills their ``slots`` input with it, so the
  graph's extra rows (and capture, which runs every row at its fill values) write only there;
* writes each token at its own (slot, position), both read from the step's inputs;
* returns, for attention, the keys and values of each row's own slot, read through a 4-D additive mask built
  from the positions (:meth:`SlotCache.attention_mask`): key ``j`` is visible to a query at position ``p``
  when ``j <= p`` (and ``j > p - window`` in a layer with a sliding window). Every row can sit at its own
  position and carry its own drafts;
* keeps each slot's token ids by position too (:attr:`SlotCache.token_ids`), written like the keys: the
  repetition penalty reads a row's history from them.

Why positions past a sequence's end never leak: a step writes the keys of its own tokens before attention
reads them, and reads only positions ``<=`` its own, all written by earlier steps of the same sequence. So
what a rejected draft, a padded prefill token, or a slot's previous owner left beyond the current length is
overwritten before anything reads it.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .structure import ModelLayout, inspect_model

#: The slot padded rows write to; no sequence ever owns it.
DUMMY_SLOT = 0


class SlotLayer(CacheLayerMixin):
    """One decoder layer's keys and values, ``[num_slots, kv_heads, max_len, head_dim]`` each (:class:`SlotCache`)."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: "SlotCache", keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.keys, self.values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._owner = owner
        self._heads = torch.arange(keys.shape[1], device=keys.device).view(1, -1, 1)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the tensors were allocated at construction (a graph must never see them change)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, kv_heads, T, head_dim]`` keys and values at each row's (slot, position); return each row's
        slot, ``[B, kv_heads, kv_len, head_dim]``, for attention."""
        (slot_rows, positions), slots, kv_len = self._owner._bound()
        where = (slot_rows, self._heads, positions)  # [B, 1, 1], [1, kv_heads, 1], [B, 1, T]
        # A cache dtype other than the model's: stored in the cache's, handed to attention in the model's.
        self.keys.index_put_(where, key_states.to(self.keys.dtype))
        self.values.index_put_(where, value_states.to(self.values.dtype))
        keys = self.keys[:, :, :kv_len].index_select(0, slots)
        values = self.values[:, :, :kv_len].index_select(0, slots)
        return keys.to(key_states.dtype), values.to(value_states.dtype)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._owner.max_len, 0

    def get_seq_length(self) -> int:
        raise NotImplementedError(_NO_LENGTH)

    def get_max_length(self) -> int:
        return self._owner.max_len

    def get_max_cache_shape(self) -> int:  # transformers < 5.17's name for get_max_length
        return self._owner.max_len

    def reset(self) -> None:
        self.keys.zero_()
        self.values.zero_()


_NO_LENGTH = ("SlotCache holds many sequences, each at its own position, so it has no single length: pass "
              "position_ids and the 4-D attention_mask from SlotCache.attention_mask to the model (PoolGenerator "
              "does), never let it infer them from the cache")


class SlotCache(Cache):
    """A transformers ``Cache`` of ``num_slots`` sequence slots, each up to ``max_len`` tokens, allocated once.

    Args:
        model: the ``*ForCausalLM`` model it serves, checked and probed by :func:`~.structure.inspect_model`
            (which also gives each layer's key/value heads and head size); its first parameter gives the dtype and
            device unless given.
        num_slots: slots including :data:`DUMMY_SLOT`, so ``num_slots - 1`` sequences at a time.
        max_len: tokens per slot: a sequence's prompt, new tokens and one step's drafts must fit.
        dtype: of keys and values (default: the model's). Another floating dtype works: keys are stored in it and
            handed to attention in the model's (float64 keeps float32 keys exactly; a narrower one rounds them).
        device: where the cache lives (default: the model's).
        layout: the model's :class:`~.structure.ModelLayout` when already inspected (the probe runs otherwise).

    Before each forward, :meth:`bind` says which slot each row uses and at which positions its tokens sit;
    the layers' ``update`` reads those. A step function binds its static inputs, so a captured graph keeps
    reading them.

    .. warning:: allocate it before capture and never rebind its tensors: a captured graph writes and reads
        the addresses it was captured with (graphpool.pool's rules). Do not call it under autograd:
        :class:`PoolGenerator` runs everything under ``torch.inference_mode()``.
    """

    def __init__(self, model: torch.nn.Module, num_slots: int, max_len: int, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, layout: ModelLayout | None = None):
        if num_slots < 2 or max_len < 1:
            raise ValueError(f"SlotCache needs num_slots >= 2 (slot {DUMMY_SLOT} is the dummy slot padded rows write "
                             f"to, plus one per sequence) and max_len >= 1; got num_slots={num_slots}, "
                             f"max_len={max_len}")
        first = next(model.parameters())
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"SlotCache dtype must be a floating-point torch.dtype (keys and values are cast to it "
                            f"and back), got {dtype!r}; an integer cache would need quantization scales this "
                            f"cache does not keep: leave dtype=None for the model's ({first.dtype})")
        self.layout = inspect_model(model) if layout is None else layout
        dtype = first.dtype if dtype is None else dtype
        device = first.device if device is None else torch.device(device)
        self.num_slots, self.max_len = num_slots, max_len
        self.kv_heads, self.head_dim = self.layout.layers[0].kv_heads, self.layout.layers[0].head_dim
        self.dtype, self.device = dtype, torch.device(device)
        mask_dtype = self.layout.dtype  # the mask is added to the attention scores: the model's dtype
        with torch.inference_mode():
            layers = [SlotLayer(self, torch.zeros((num_slots, s.kv_heads, max_len, s.head_dim), dtype=dtype,
                                                  device=device),
                                torch.zeros((num_slots, s.kv_heads, max_len, s.head_dim), dtype=dtype, device=device))
                      for s in self.layout.layers]
            self.token_ids = torch.zeros((num_slots, max_len), dtype=torch.int64, device=device)
            self._key_positions = torch.arange(max_len, device=device)
            self._visible = torch.zeros((), dtype=mask_dtype, device=device)
            self._hidden = torch.full((), torch.finfo(mask_dtype).min, dtype=mask_dtype, device=device)
        super().__init__(layers=layers)
        self._binding: tuple | None = None
        self._free = list(range(num_slots - 1, 0, -1))  # pop() hands out slot 1 first

    @property
    def nbytes(self) -> int:
        """Bytes of all keys and values."""
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers)

    # ------------------------------------------------------------------------------------ slots
    @property
    def free_slots(self) -> int:
        """Slots no sequence owns (the dummy slot not counted)."""
        return len(self._free)

    def allocate(self) -> int:
        """Take a free slot for a new sequence.

        Raises:
            RuntimeError: every slot is taken; free one (a finished sequence's) or build a larger cache.
        """
        if not self._free:
            raise RuntimeError(f"all {self.num_slots - 1} sequence slots of the SlotCache are taken: free() a finished "
                               f"sequence's slot first, or build the cache with a larger num_slots")
        return self._free.pop()

    def free(self, slot: int) -> None:
        """Give back a sequence's slot (its stale keys stay; the next owner overwrites them before reading)."""
        if not 0 < slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not a taken sequence slot (1..{self.num_slots - 1}; the free ones are "
                             f"{sorted(self._free)})")
        self._free.append(slot)

    # ------------------------------------------------------------------------------------ a forward
    def bind(self, slots: torch.Tensor, positions: torch.Tensor, kv_len: int | None = None) -> None:
        """Say where the next forward's tokens go: ``slots`` ``[B]`` (int64, one per row), ``positions``
        ``[B, T]`` (int64, each token's position in its sequence); attention reads the first ``kv_len``
        positions of each slot (default ``max_len``; the eager prefill reads only as far as its longest prompt)."""
        kv_len = self.max_len if kv_len is None else kv_len
        rows, tokens = positions.shape
        self._binding = ((slots.view(rows, 1, 1), positions.view(rows, 1, tokens)), slots, kv_len)

    def write_tokens(self, ids: torch.Tensor) -> None:
        """Record the bound forward's token ids ``[B, T]`` at their (slot, position), as the keys are written."""
        (slots, positions), _, _ = self._bound()
        self.token_ids.index_put_((slots.view(-1, 1), positions.view(slots.shape[0], -1)), ids)

    def history(self) -> torch.Tensor:
        """The bound rows' token ids ``[B, kv_len]`` by position (only positions ``<=`` a token's own are its
        history; later ones are stale, as in the keys)."""
        _, slots, kv_len = self._bound()
        return self.token_ids[:, :kv_len].index_select(0, slots)

    def _bound(self) -> tuple:
        if self._binding is None:
            raise RuntimeError("SlotCache.bind(slots, positions) must run before the model's forward: the cache "
                               "cannot know which slot and position each token belongs to")
        return self._binding

    def attention_mask(self, positions: torch.Tensor, kv_len: int | None = None, groups: int = 1,
                       windows: tuple[int | None, ...] = (None,)) -> torch.Tensor:
        """The additive masks ``[B, len(windows), groups * T, kv_len]`` (the model's dtype), one per window on
        dimension 1: 0 where key ``j <= positions[b, t]`` (and ``j > positions[b, t] - window`` for a window that
        is not ``None``), the dtype's minimum elsewhere. Passed as the model's ``attention_mask``, transformers
        hands it to attention as given, where :func:`~.attention.slot_attention` picks each layer's window.
        ``groups > 1`` repeats the rows for the query heads that share a key/value head (:mod:`.attention`: row
        ``g * T + t`` is token ``t``)."""
        kv_len = self.max_len if kv_len is None else kv_len
        keys = self._key_positions[:kv_len].view(1, 1, 1, kv_len)
        rows = (positions.repeat(1, groups) if groups > 1 else positions)[:, None, :, None]
        masks = []
        for window in windows:
            visible = keys <= rows if window is None else (keys <= rows) & (keys > rows - window)
            masks.append(torch.where(visible, self._visible, self._hidden))
        return masks[0] if len(masks) == 1 else torch.cat(masks, dim=1)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise NotImplementedError(_NO_LENGTH)

    def __repr__(self) -> str:
        return (f"SlotCache(layers={len(self.layers)}, num_slots={self.num_slots}, max_len={self.max_len}, "
                f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, windows={self.layout.windows}, dtype={self.dtype}, "
                f"{self.nbytes / 2**20:.1f} MiB)")

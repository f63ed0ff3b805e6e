"""Which models this integration serves, found from their structure, not their name.

A model is served when it is a decoder-only causal LM whose every layer's attention runs through transformers'
attention interface and writes its keys and values through the ``Cache`` API: then the slot cache
(:mod:`.cache`) and the step's attention (:mod:`.attention`) see every key and every attention call, whatever
the family. :func:`inspect_model` finds out by running the model once, on two tokens, with a recording cache and
a recording attention function (the probe), and reads from what it saw:

* per layer, the key/value heads and head size its cache writes (the slot cache's shapes);
* per layer, the sliding window its attention passes to the attention function (``sliding_window=``, what
  transformers' flash attention reads too): the step builds one mask per window, so windows shorter than the
  cache are served, not refused;
* the extra arguments attention receives (a soft-cap, attention sinks): when there are any, the step hands
  attention to transformers' own implementation instead of its grouped one.

What cannot work is refused with its reason, before the probe where the configuration already says so
(encoder-decoder, recurrent or hybrid layers, chunked attention, flash or flex attention) and from the probe
otherwise (a layer whose attention bypasses the interface or shares another layer's cache, a window the
configuration sets that attention never receives).
"""
from __future__ import annotations

import inspect
import itertools
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from .versions import UnsupportedModelError, check_interfaces, check_version

#: Layer types (``config.layer_types``) whose attention the slot cache serves.
ATTENTION_LAYERS = ("full_attention", "sliding_attention")
#: Configuration fields of recurrent (state-space) layers (and any ``mamba_*`` or ``ssm_*`` field).
RECURRENT_FIELDS = frozenset({"state_size", "conv_kernel", "time_step_rank", "linear_conv_kernel_dim"})
#: ``config._attn_implementation`` values served: both apply a 4-D additive mask as given.
ATTENTION = ("sdpa", "eager")
#: Arguments attention may receive that the grouped attention computes the same way (others: transformers' own).
PLAIN_ATTENTION_ARGS = frozenset({"dropout", "scaling", "sliding_window", "position_ids", "is_causal",
                                  "cache_position", "output_attentions", "head_mask", "use_cache"})


@dataclass(frozen=True)
class LayerShape:
    """What one decoder layer writes into its cache and how it attends."""

    kv_heads: int
    head_dim: int
    query_heads: int
    window: int | None  # the sliding window attention receives (None: the whole sequence)


@dataclass(frozen=True)
class ModelLayout:
    """What :func:`inspect_model` found: per-layer shapes and windows, the attention to delegate to, and the
    attention implementation's name.

    Attributes:
        layers: one :class:`LayerShape` per decoder layer, in ``layer_idx`` order.
        implementation: ``"sdpa"`` or ``"eager"``.
        plain_arguments: attention received only arguments the grouped attention computes the same way.
        eager_functions: for ``"eager"``: each attention module class's own ``eager_attention_forward``.
        dtype: the dtype of the model's attention inputs (queries).
    """

    layers: tuple[LayerShape, ...]
    implementation: str
    plain_arguments: bool
    eager_functions: dict
    dtype: torch.dtype

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The distinct windows, full attention (``None``) first: the step's masks, in this order."""
        found = {layer.window for layer in self.layers}
        return (None,) + tuple(sorted(w for w in found if w is not None))

    @property
    def groups(self) -> int | None:
        """Query heads per key/value head when every layer has the same number, else ``None``."""
        ratios = {layer.query_heads // layer.kv_heads for layer in self.layers}
        return ratios.pop() if len(ratios) == 1 else None


def cache_argument(model: torch.nn.Module) -> str:
    """The name of the model forward's cache argument (``cache`` from transformers 5.24, ``past_key_values`` before)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def check_config(model: Any) -> None:
    """Refusals the configuration alone decides (no forward run).

    Raises:
        UnsupportedModelError: what was found, why it cannot work, and what to do.
    """
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_output_embeddings"):
        raise UnsupportedModelError(f"{name} is not a transformers model (no config): pass a *ForCausalLM model")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{name} is an encoder-decoder model: only decoder-only causal LMs are served (their steps read one "
            f"cache of their own tokens); use model.generate() for it")
    if model.get_output_embeddings() is None:
        raise UnsupportedModelError(f"{name} has no language-model head (get_output_embeddings() is None): pass the "
                                    f"*ForCausalLM model, not its base model")
    recurrent = sorted(k for k in config.to_dict() if k in RECURRENT_FIELDS or k.startswith(("mamba_", "ssm_")))
    if recurrent:
        raise UnsupportedModelError(
            f"{name} has recurrent (state-space) layers (its config sets {recurrent[:4]}): their state is carried from "
            f"token to token, not kept as keys in a Cache, so a slot cache cannot hold it. Served: decoder layers of "
            f"types {list(ATTENTION_LAYERS)} whose attention runs through transformers' attention interface")
    types = getattr(config, "layer_types", None) or ()
    other = sorted(set(types) - set(ATTENTION_LAYERS))
    if other:
        kind = ("chunked attention (each token sees only its chunk, which the slot cache's masks do not express)"
                if other == ["chunked_attention"] else
                "recurrent or hybrid layers (a state carried from token to token, not keys in a Cache)")
        raise UnsupportedModelError(
            f"{name} has layers of type {other} besides attention: {kind}. Served: decoder layers of types "
            f"{list(ATTENTION_LAYERS)} whose attention runs through transformers' attention interface")
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ATTENTION:
        raise UnsupportedModelError(
            f"attention implementation {impl!r} is not supported: only {list(ATTENTION)} apply the 4-D mask that "
            f"puts every row at its own position ({impl!r} would build its own mask and attend to stale cache "
            f"entries); load the model with attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))")
    for param in ("position_ids", "attention_mask"):
        if param not in inspect.signature(model.forward).parameters:
            raise UnsupportedModelError(f"{name}.forward takes no {param!r}: the step passes each token's position "
                                        f"and a 4-D mask; this model cannot be served")


class _ProbeLayer(CacheLayerMixin):
    """One layer of the probe's cache: records the keys written and hands them back, as a fresh cache would."""

    is_sliding = False
    is_compileable = False

    def __init__(self, index: int, seen: list):
        super().__init__()
        self.index, self.seen = index, seen
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        self.seen.append((self.index, tuple(key_states.shape), tuple(value_states.shape)))
        return key_states, value_states

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        return 2, 0

    def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
        raise NotImplementedError(
            "the model asked its cache for one sequence length; a slot cache holds many sequences at their own "
            "positions, so only models that take each token's position from position_ids are served")

    def get_max_cache_shape(self, *args: Any, **kwargs: Any) -> int:  # transformers < 5.17's name
        return -1

    def get_max_length(self, *args: Any, **kwargs: Any) -> int:
        return -1

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        pass

    def reset(self) -> None:
        pass


_PROBE = "graphpool_probe"


def _register_probe(calls: list) -> None:
    """Register (again) the probe's attention function under one name: each call appends to ``calls``."""

    def record(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        calls.append((module, tuple(query.shape), tuple(key.shape), kwargs))
        rows, heads, tokens, _ = query.shape
        return query.new_zeros(rows, tokens, heads, value.shape[-1]), None

    AttentionInterface.register(_PROBE, record)


@contextmanager
def attention_implementation(config: Any, name: str) -> Iterator[None]:
    """Run the enclosed forward with the attention function registered as ``name``, then put the config's back."""
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def inspect_model(model: torch.nn.Module) -> ModelLayout:
    """Check that ``model`` can be served and find its layout (see the module's docstring).

    Raises:
        UnsupportedModelError: the release, an interface it relies on, or the model's structure: what was found,
            why it cannot work, and what to do.
    """
    check_version()
    check_interfaces()
    check_config(model)
    if model.training:
        raise UnsupportedModelError(
            f"{type(model).__name__} is in training mode (dropout on): generation runs the model as generate() does "
            f"in eval mode; call model.eval() first")
    name, config = type(model).__name__, model.config
    num_layers = config.get_text_config().num_hidden_layers
    seen: list = []
    calls: list = []
    _register_probe(calls)
    device = next(model.parameters()).device
    ids = torch.zeros(1, 2, dtype=torch.int64, device=device)
    positions = torch.arange(2, device=device).view(1, 2)
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    mask = torch.zeros(1, 1, 2, 2, dtype=dtype, device=device)
    mask[..., 0, 1] = torch.finfo(dtype).min
    try:
        with torch.inference_mode(), attention_implementation(config, _PROBE):
            model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                  **{cache_argument(model): Cache(layers=[_ProbeLayer(i, seen) for i in range(num_layers)])})
    except Exception as e:  # the model's own error, whatever it is: the reason it cannot be served
        raise UnsupportedModelError(
            f"{name} failed its probe step (two tokens through a recording cache and attention): "
            f"{type(e).__name__}: {e}. Served: decoder-only causal LMs whose attention runs through transformers' "
            f"attention interface and writes through the Cache API") from e
    return _layout(model, num_layers, seen, calls, dtype)


def _layout(model: torch.nn.Module, num_layers: int, seen: list, calls: list, dtype: torch.dtype) -> ModelLayout:
    name, config = type(model).__name__, model.config
    written = [s[0] for s in seen]
    if sorted(written) != list(range(num_layers)):
        missing = sorted(set(range(num_layers)) - set(written))
        repeated = sorted(i for i in set(written) if written.count(i) > 1)
        raise UnsupportedModelError(
            f"{name}: of its {num_layers} layers, {len(set(written))} wrote keys through the Cache API "
            f"(without: {missing[:8]}; more than once: {repeated[:8]}): layers that keep a recurrent state or read "
            f"another layer's keys are not served, only decoder layers that each write their own keys once")
    if len(calls) != num_layers:
        raise UnsupportedModelError(
            f"{name}: {len(calls)} attention calls went through transformers' attention interface for "
            f"{num_layers} layers: attention computed outside the interface would ignore the slot cache's masks; "
            f"not served")
    types = getattr(config, "layer_types", None)
    layers, plain, eager = [], True, {}
    for (index, key_shape, _), (module, query_shape, _, kwargs) in zip(sorted(seen), _in_layer_order(calls)):
        window = kwargs.get("sliding_window")
        configured = types[index] if types and index < len(types) else None
        if configured == "sliding_attention" and window is None:
            raise UnsupportedModelError(
                f"{name}: layer {index} is a sliding-window layer in its configuration, but its attention does not "
                f"receive the window (sliding_window=...), so the step cannot mask it; not served")
        layers.append(LayerShape(kv_heads=key_shape[1], head_dim=key_shape[3], query_heads=query_shape[1],
                                 window=int(window) if window is not None else None))
        plain &= all(k in PLAIN_ATTENTION_ARGS or v is None for k, v in kwargs.items())
        if config._attn_implementation == "eager":
            eager[type(module)] = _eager_function(module)
    return ModelLayout(tuple(layers), config._attn_implementation, plain, eager, dtype)


def _in_layer_order(calls: list) -> list:
    """The attention calls sorted by their module's ``layer_idx`` (call order where a module has none)."""
    keyed = [(getattr(c[0], "layer_idx", i), i, c) for i, c in enumerate(calls)]
    return [c for _, _, c in sorted(keyed, key=lambda k: (k[0], k[1]))]


def _eager_function(module: torch.nn.Module) -> Callable:
    """The attention module's own ``eager_attention_forward`` (each modeling file defines one)."""
    function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if function is None:
        raise UnsupportedModelError(
            f"{type(module).__name__}'s module defines no eager_attention_forward: eager attention cannot be "
            f"delegated to; load the model with attn_implementation='sdpa'")
    return function


_names = itertools.count()


def unique_name(prefix: str) -> str:
    """A name not used before in this process (one registered attention function per generator)."""
    return f"{prefix}_{next(_names)}"

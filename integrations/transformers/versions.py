"""What this integration supports: transformers releases, model families, attention implementations.

Checked at construction (:class:`~graphpool.integrations.transformers.SlotCache`,
:class:`~graphpool.integrations.transformers.PoolGenerator`), not at import, so the package imports (and
its docs read) with any transformers installed; each refusal says what was found, why it cannot work,
and what to do.

* **transformers 5.6.0 to 5.24.x** (tested: 5.6.0, 5.17.0, 5.24.0). 5.x's ``Cache`` is a list of
  per-layer objects whose ``update(key, value, layer_idx)`` returns the keys and values attention reads,
  and a 4-D ``attention_mask`` is passed to attention as given: the two hooks :class:`SlotCache` uses.
  4.x builds masks from the cache's single length; releases after 5.24 are untested.
* **Families**: Llama, Mistral, Qwen2, Qwen3 (``*ForCausalLM``): a decoder (``model.get_decoder()``) whose
  attention calls ``cache.update`` once per layer, then ``lm_head``, with no logit soft-capping. Qwen3
  normalises queries and keys per head, Qwen2 has attention biases: the cache sees the keys after those,
  whatever the layout.
* **Attention**: ``"sdpa"`` and ``"eager"`` (transformers' own), which take the 4-D additive mask. Flash
  attention and flex attention build their own masks from sequence lengths and would ignore it.
* **Windows**: a sliding window shorter than ``max_len`` is refused: the mask is causal over the whole
  cache (Mistral's default window, 4096, is fine for ``max_len <= 4096``).
"""
from __future__ import annotations

import importlib.metadata
import re
from typing import Any

#: The releases this integration runs on, as (major, minor) bounds, both ends included.
OLDEST, NEWEST = (5, 6), (5, 24)
#: The releases its CPU tests ran on (CI: 5.6.0 and 5.17.0, .ci/transformers-range.sh; 5.24.0 too).
TESTED = ("5.6.0", "5.17.0", "5.24.0")
SUPPORTED = f"transformers {OLDEST[0]}.{OLDEST[1]}.0 to {NEWEST[0]}.{NEWEST[1]}.x (tested: {', '.join(TESTED)})"

#: ``config.model_type`` of the families served.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
#: ``config._attn_implementation`` values that honour a 4-D additive mask.
ATTENTION = ("sdpa", "eager")


class UnsupportedModelError(ValueError):
    """A model, transformers release or setting this integration cannot serve; the message says why and the fix."""


def transformers_version() -> str:
    """The installed transformers' version string, or ``"not installed"``."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def check_version(version: str | None = None) -> None:
    """Refuse a transformers release outside :data:`SUPPORTED` (default: the installed one).

    Raises:
        UnsupportedModelError: naming the release found and the supported range.
    """
    version = transformers_version() if version is None else version
    match = re.match(r"(\d+)\.(\d+)", version)
    found = (int(match.group(1)), int(match.group(2))) if match else None
    if found is None or not OLDEST <= found <= NEWEST:
        if found is None:
            why = "not a release number"
        elif found < OLDEST:
            why = "older releases build attention masks from one cache length and lack the per-layer Cache API"
        else:
            why = "it is newer than every release this was tested on"
        raise UnsupportedModelError(
            f"graphpool.integrations.transformers supports {SUPPORTED}; found transformers {version} ({why}): "
            f"install a supported release, e.g. pip install 'transformers=={TESTED[-1]}'")


def check_model(model: Any, max_len: int) -> None:
    """Refuse a model this integration cannot run exactly (release, family, attention, window).

    Args:
        model: a transformers ``*ForCausalLM`` model.
        max_len: the longest sequence (prompt + new tokens + drafts) the cache will hold.

    Raises:
        UnsupportedModelError: what is unsupported, why, and the fix.
    """
    check_version()
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        raise UnsupportedModelError(
            f"model type {kind!r} ({type(model).__name__}) is not served: supported families are {list(FAMILIES)} "
            f"(their *ForCausalLM classes), whose decoder and head this integration drives; use one of them")
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ATTENTION:
        raise UnsupportedModelError(
            f"attention implementation {impl!r} is not supported: only {list(ATTENTION)} apply the 4-D mask that "
            f"puts every row at its own position ({impl!r} would build its own mask and attend to stale cache "
            f"entries); load the model with attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))")
    if model.get_output_embeddings() is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no lm_head: pass the *ForCausalLM model, not its "
                                    f"base model")
    window = _window(config)
    if window is not None and window < max_len:
        raise UnsupportedModelError(
            f"{type(model).__name__} attends within a sliding window of {window} tokens, shorter than max_len "
            f"{max_len}: the slot cache's mask is causal over the whole sequence, so tokens past the window would "
            f"differ; use max_len <= {window}")


def _window(config: Any) -> int | None:
    """The shortest sliding window any layer uses, or ``None``."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None  # Qwen2/Qwen3 keep a window value but use it only where use_sliding_window marks layers
    if types is None and getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)

"""``generate()``'s options, resolved as ``generate()`` resolves them, and refused where not served.

The options come from a ``GenerationConfig`` (the model's own by default, ``generation_config=`` otherwise) with
keyword overrides, merged by transformers' own ``_prepare_generation_config`` (so defaults such as ``top_k=50``
when sampling are ``generate()``'s). Served: :data:`SERVED`. Any other option set to a value that would change
what ``generate()`` does is an error naming it (never ignored); options that change nothing about the tokens
(:data:`NO_EFFECT`) pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .sampling import MIN_P, PENALTY, SAMPLE, TEMPERATURE, TOP_K, TOP_P

#: The GenerationConfig fields served.
SERVED = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "min_new_tokens",
          "max_new_tokens", "max_length", "eos_token_id", "pad_token_id", "stop_strings")
#: Fields that change nothing about the tokens here (metadata, cache and compile choices, the output container,
#: settings of assisted generation that is off).
NO_EFFECT = frozenset({
    "transformers_version", "_from_model_config", "bos_token_id", "decoder_start_token_id", "use_cache",
    "cache_implementation", "cache_config", "compile_config", "disable_compile", "return_dict_in_generate",
    "is_assistant", "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
    "assistant_lookbehind", "target_lookbehind", "max_matching_ngram_size", "low_memory", "prefill_chunk_size",
    "continuous_batching_config", "length_penalty", "early_stopping", "min_length", "output_attentions",
    "output_hidden_states", "output_scores", "output_logits", "num_return_sequences", "num_beams",
    "remove_invalid_values", "renormalize_logits",
})
#: Where a refused option has a counterpart here, the hint.
HINTS = {
    "output_scores": "pass output_logprobs=True for each token's log-probability",
    "output_logits": "pass output_logprobs=True for each token's log-probability",
    "prompt_lookup_num_tokens": "prompt lookup is built in: PoolGenerator(num_draft_tokens=...)",
    "num_return_sequences": "repeat the prompt instead",
}


class UnsupportedOptionError(ValueError):
    """A ``generate()`` option this integration does not implement, set to a value that would matter."""


@dataclass(frozen=True)
class Options:
    """One generation's resolved options.

    Attributes:
        sampling: the first six columns of the step's ``sampling`` input (:data:`~.sampling.PARAMS`).
        min_new_tokens: EOS is suppressed until a request has this many new tokens.
        max_new_tokens: new tokens per request, or ``None`` to use ``max_length``.
        max_length: prompt + new tokens, where ``max_new_tokens`` is ``None``.
        eos: the tokens that end a request.
        pad_token_id: the padding token (``generate``'s fallback: the first EOS).
        stop_strings: strings that end a request (with a tokenizer).
    """

    sampling: tuple[float, ...]
    min_new_tokens: int
    max_new_tokens: int | None
    max_length: int | None
    eos: tuple[int, ...]
    pad_token_id: int | None
    stop_strings: tuple[str, ...]

    @property
    def do_sample(self) -> bool:
        return self.sampling[SAMPLE] > 0

    def new_tokens(self, prompt_len: int) -> int:
        """``generate()``'s count of new tokens for a prompt of ``prompt_len`` tokens."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        return max(0, (self.max_length or 0) - prompt_len)


def _neutral() -> dict[str, Any]:
    from transformers import GenerationConfig
    neutral = GenerationConfig().to_dict()
    neutral.update(GenerationConfig._get_default_generation_params())
    return neutral


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.reshape(-1).tolist()]
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def resolve(model: torch.nn.Module, generation_config: Any = None, **kwargs: Any) -> Options:
    """Resolve ``generation_config`` and keyword overrides as ``model.generate`` does, and check them.

    Raises:
        UnsupportedOptionError: an option this integration does not implement is set (its name, its value, and
            what is served), or a keyword that is no ``generate()`` option.
        ValueError: a served option out of its range.
    """
    from transformers import GenerationConfig
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError(f"generation_config must be a transformers GenerationConfig, got "
                        f"{type(generation_config).__name__}")
    config, rest = model._prepare_generation_config(generation_config, **kwargs)
    rest = {k: v for k, v in rest.items() if v is not None}
    if rest:
        raise UnsupportedOptionError(
            f"unexpected keyword(s) {sorted(rest)}: not generate() options served here. Served: the "
            f"GenerationConfig fields {list(SERVED)}, and generate()'s own inputs, attention_mask, "
            f"generation_config, streamer, tokenizer, plus max_new_tokens per request, generator, seed, policy, "
            f"gate, output_logprobs")
    neutral, values = _neutral(), config.to_dict()
    refused = []
    for name, value in values.items():
        if name in SERVED or name in NO_EFFECT or name not in neutral or value == neutral[name]:
            continue
        refused.append(f"{name}={value!r}" + (f" ({HINTS[name]})" if name in HINTS else ""))
    for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if values.get(name):
            refused.append(f"{name}=True" + (f" ({HINTS[name]})" if name in HINTS else ""))
    for name in ("num_beams", "num_return_sequences"):
        if values.get(name) not in (None, 1):
            refused.append(f"{name}={values[name]!r}" + (f" ({HINTS[name]})" if name in HINTS else ""))
    if values.get("min_length") not in (None, 0):
        refused.append(f"min_length={values['min_length']!r} (use min_new_tokens)")
    if refused:
        raise UnsupportedOptionError(
            f"generate() option(s) not implemented by graphpool.integrations.transformers: {', '.join(refused)}. "
            f"Served: {list(SERVED)} (with a tokenizer for stop_strings); unset these options to run here")
    return _options(config)


def _options(config: Any) -> Options:
    do_sample = bool(config.do_sample)
    temperature = 1.0 if config.temperature is None else float(config.temperature)
    top_k = int(config.top_k or 0)
    top_p = 1.0 if config.top_p is None else float(config.top_p)
    min_p = 0.0 if config.min_p is None else float(config.min_p)
    penalty = 1.0 if config.repetition_penalty is None else float(config.repetition_penalty)
    checks = [(not do_sample or temperature > 0, f"temperature must be > 0 when sampling, got {temperature}"),
              (top_k >= 0, f"top_k must be >= 0 (0: off), got {top_k}"),
              (0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p}"),
              (0 <= min_p <= 1, f"min_p must be in [0, 1], got {min_p}"),
              (penalty > 0, f"repetition_penalty must be > 0, got {penalty}"),
              ((config.min_new_tokens or 0) >= 0, f"min_new_tokens must be >= 0, got {config.min_new_tokens}")]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    sampling = [0.0] * 6
    sampling[SAMPLE], sampling[PENALTY] = float(do_sample), penalty
    if do_sample:  # generate() applies the warpers only when sampling
        sampling[TEMPERATURE], sampling[TOP_K], sampling[TOP_P], sampling[MIN_P] = temperature, top_k, top_p, min_p
    else:
        sampling[TEMPERATURE], sampling[TOP_P] = 1.0, 1.0
    eos = tuple(_as_list(config.eos_token_id))
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)
    stops = config.stop_strings
    stops = () if not stops else ((stops,) if isinstance(stops, str) else tuple(stops))
    return Options(tuple(sampling), int(config.min_new_tokens or 0), config.max_new_tokens, config.max_length, eos,
                   None if pad is None else int(_as_list(pad)[0]), stops)


def per_request(value: int | Sequence[int] | None, count: int, name: str) -> list[int | None]:
    """One value for each of ``count`` requests: an int for all, one per request, or ``None``."""
    if value is None or isinstance(value, int):
        values = [value] * count
        checked = [value]  # an int is checked itself, whether or not there are requests
    else:
        values = checked = list(value)
    if len(values) != count or any(v is not None and (not isinstance(v, int) or v < 1) for v in checked):
        raise ValueError(f"{name} must be an int >= 1 or one per prompt ({count}), got {value!r}")
    return values

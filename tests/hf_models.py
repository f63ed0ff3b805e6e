"""Tiny transformers causal LMs from their configs, random weights: the models of the transformers tests.

Two layouts besides Llama's: Qwen3 (per-head RMS norms on queries and keys), Qwen2 (attention biases),
Mistral (a sliding window, here wider than any test sequence). A small vocabulary makes greedy outputs
repeat themselves soon, so prompt lookup finds drafts.
"""
from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Any

import pytest
import torch

FAMILIES = ("llama", "qwen3", "qwen2", "mistral")

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


def tiny_model(family: str, device: str = "cpu", seed: int = 0, attn: str = "sdpa",
               dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A random-weight ``*ForCausalLM`` of ``family`` (2 layers, hidden 64, vocab 96), in eval mode."""
    import transformers

    config_cls, model_cls, extra = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 512}),
    }[family]
    config = config_cls(**_SIZES, **extra)
    torch.manual_seed(seed)
    model = model_cls._from_config(config, attn_implementation=attn, dtype=dtype)
    return model.to(device).eval()


def reference(model: torch.nn.Module, prompts: list[list[int]], max_new: list[int],
              eos: list[int]) -> list[list[int]]:
    """The oracle: ``model.generate(do_sample=False)`` for each prompt alone, its new tokens."""
    device = next(model.parameters()).device
    out = []
    for prompt, count in zip(prompts, max_new):
        ids = torch.tensor([prompt], device=device)
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=count, min_new_tokens=0,
                             do_sample=False, eos_token_id=eos or None, pad_token_id=0)
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

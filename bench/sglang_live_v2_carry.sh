#!/bin/bash
# Build .sgl17/ in the repository root: what a GPU machine without network (the H200: Python 3.12, torch
# 2.11.0+cu130, Triton 3.6.0, nvcc 13.0) needs to serve SGLang 0.5.17 for bench/sglang_live_v2.sh. Run where pip
# reaches a package index (any OS/arch: wheels are fetched for cp312 manylinux x86-64). About 40 MB; with the
# checkout a call carries under 64 MiB. SGLK_WHEEL / FI_WHEEL / SGLANG_WHEEL may name downloaded wheels of
# sglang-kernel 0.4.5 / flashinfer-python 0.6.15.post1 / sglang 0.5.17 (cp312).
#   whl/                  the pure-Python and cp312 packages SGLang 0.5.17 imports at start-up that the H200's image
#                         lacks, at 0.5.17's pins where it pins (transformers 5.12.1 and tokenizers 0.22.2: the
#                         image's 5.17.0 / 0.23.2 break its imports); installed with --no-deps
#   sglang-slim.tar.xz    sglang 0.5.17 without its Rust server and multimodal cores (imported only when asked
#                         for), the diffusion package and the tests
#   sglk-slim.tar.xz      sglang-kernel 0.4.5 without FA3 (flash_ops, 1.1 GB: it cannot travel, so the live run
#                         uses --attention-backend triton where SGLang's Hopper default is fa3; Triton also needs
#                         no host lengths under the overlap scheduler), FlashMLA, InfLLM, sm100: the sm90 ops
#   flashinfer.tar.xz     flashinfer-python 0.6.15.post1 with its JIT sources: --attention-backend flashinfer
#                         compiles its kernels there with the image's nvcc (once per machine)
#   stubs/                IPython.display, soundfile, xgrammar and deep_gemm stand-ins: names SGLang imports at module level
#                         for notebooks, audio and tool-call grammars; the servers run --grammar-backend none
#   models/               config.json of Llama-3.1-8B (its public configuration) and of an EAGLE3 draft of its
#                         hidden size, served with --load-format dummy (no weights travel, no tokenizer)
set -euo pipefail
D=.sgl17; W=$(mktemp -d)
rm -rf $D && mkdir -p $D/whl $D/stubs/IPython $D/stubs/xgrammar $D/models/llama-3.1-8b $D/models/eagle3-llama-3.1-8b
P=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp)
for n in 39 35 34 31 28 27 26 24 17 5; do P+=(--platform manylinux_2_${n}_x86_64); done
P+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q "${P[@]}" -d $D/whl transformers==5.12.1 tokenizers==0.22.2 apache-tvm-ffi==0.1.11 \
  pydantic==2.14.4 pydantic-core==2.50.5 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 orjson==3.13.0 \
  msgspec==0.23.0 pyzmq==27.3.0 pybase64==1.5.1 dill==0.4.1 gguf==0.19.0 compressed-tensors==0.18.0 \
  partial-json-parser==0.2.1.1.post7 setproctitle==1.3.8 openai==2.6.1 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2 loguru==0.7.3 sniffio==1.3.1 \
  distro==1.9.0 jiter==0.19.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
  rpds-py==2026.9.1 python-multipart==0.0.34
fetch() {  # name==version -> a wheel path (downloaded unless $2 names one)
  [ -n "$2" ] && { echo "$2"; return; }
  python3 -m pip download -q "${P[@]}" -d $W "$1" >/dev/null && ls $W/"$(echo "${1%%==*}" | tr - _)"-*.whl
}
SGL=$(fetch sglang==0.5.17 "${SGLANG_WHEEL:-}"); SGLK=$(fetch sglang-kernel==0.4.5 "${SGLK_WHEEL:-}")
FI=$(fetch flashinfer-python==0.6.15.post1 "${FI_WHEEL:-}")
mkdir $W/s && unzip -q "$SGL" -d $W/s && (cd $W/s && rm -rf sglang/multimodal_gen sglang/test \
  sglang/srt/server/_core*.so sglang/srt/multimodal/_core*.so && tar -cJf - .) > $D/sglang-slim.tar.xz
mkdir $W/k && unzip -q "$SGLK" -d $W/k && (cd $W/k && rm -rf sgl_kernel/flash_ops.abi3.so \
  sgl_kernel/flashmla_ops.abi3.so sgl_kernel/infllm_ops*.so sgl_kernel/sm100 lib include _mscclpp* \
  && tar -cJf - .) > $D/sglk-slim.tar.xz
mkdir $W/f && unzip -q "$FI" -d $W/f && (cd $W/f && tar -cJf - flashinfer flashinfer_python-*.dist-info) \
  > $D/flashinfer.tar.xz
python3 - "$D" <<'PY'
import json, sys

d = sys.argv[1]
# sglang.utils needs IPython.display.{HTML, display} (notebook helpers); only the audio endpoint uses soundfile.
open(f"{d}/stubs/IPython/__init__.py", "w").write('"""Stand-in: the notebook helpers SGLang imports."""\n')
open(f"{d}/stubs/IPython/display.py", "w").write(
    "class HTML:\n    def __init__(self, data=None, *a, **k):\n        self.data = data\n\n\n"
    "def display(*objs, **k):\n    for o in objs:\n        print(getattr(o, 'data', o))\n")
open(f"{d}/stubs/soundfile.py", "w").write(
    '"""Stand-in: only the audio transcription endpoint uses soundfile."""\n\n\n'
    "def _missing(*a, **k):\n    raise RuntimeError('soundfile stand-in: no audio I/O here')\n\n\n"
    "read = write = info = SoundFile = _missing\n")
# deep_gemm: EAGLE v2's draft-graph capture imports the DSA attention backend (for an isinstance list), which
# imports deep_gemm at module level on CUDA; the box has none (run BJ: every EAGLE3 server stopped there).
# Only DeepSeek sparse attention calls into it.
open(f"{d}/stubs/deep_gemm.py", "w").write(
    '"""Stand-in: imported by the DeepSeek sparse-attention backend of SGLang; only it calls in."""\n\n\n'
    "def __getattr__(name):\n    raise RuntimeError(f'deep_gemm stand-in: {name} is not available on this machine')\n")
# xgrammar (a 44 MB wheel) stands in by the names SGLang 0.5.17 imports at module level (tool-call structural
# tags, its grammar backend): its structural tags as open pydantic models (SGLang's request models type fields with
# them), the rest raising on use. The servers run --grammar-backend none.
tags = ["StructuralTag", "AnyTextFormat", "AnyTokensFormat", "ConstStringFormat", "ExcludeTokenFormat", "Format",
        "JSONSchemaFormat", "OptionalFormat", "OrFormat", "QwenXMLParameterFormat", "RegexFormat", "SequenceFormat",
        "TagFormat", "TagsWithSeparatorFormat", "TriggeredTagsFormat", "GrammarFormat", "PlusFormat", "StarFormat",
        "TokenFormat"]
missing = ["GrammarCompiler", "GrammarMatcher", "TokenizerInfo", "CompiledGrammar"]
doc = '"""Stand-in for xgrammar: the names SGLang 0.5.17 imports at module level; grammar work raises."""\n'
models = "".join(f"class {n}(_Open):\n    pass\n\n\n" for n in tags)
head = (doc + "from pydantic import BaseModel, ConfigDict\n\n__version__ = '0.0.0+stand-in'\n\n\n"
        "class _Open(BaseModel):\n    model_config = ConfigDict(extra='allow')\n\n\n")
raising = "".join(f"class {n}:\n    def __init__(self, *a, **k):\n        raise RuntimeError('xgrammar stand-in: no "
                  f"{n} (run with --grammar-backend none)')\n\n\n" for n in missing)
funcs = "".join(f"def {f}(*a, **k):\n    raise RuntimeError('xgrammar stand-in: no {f}')\n\n\n"
                for f in ("get_model_structural_tag", "allocate_token_bitmask", "apply_token_bitmask_inplace"))
open(f"{d}/stubs/xgrammar/__init__.py", "w").write(head + models + raising + funcs)
open(f"{d}/stubs/xgrammar/structural_tag.py", "w").write(doc + "from . import " + ", ".join(tags) + "  # noqa: F401\n")

# Llama-3.1-8B's public configuration (dummy weights: the shapes are what matters).
target = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
          "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
          "hidden_act": "silu", "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
          "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
          "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "bos_token_id": 128000,
          "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16"}
# An EAGLE3 draft of its hidden size: one decoder layer over the target's 3 aux hidden states; the full vocabulary
# (no draft-to-target token map, whose dummy values would be garbage ids).
draft = dict(target, architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, target_hidden_size=4096,
             draft_vocab_size=128256)
json.dump(target, open(f"{d}/models/llama-3.1-8b/config.json", "w"), indent=2)
json.dump(draft, open(f"{d}/models/eagle3-llama-3.1-8b/config.json", "w"), indent=2)
# --speculative-adaptive's step table for the side by side: 3 draft steps up to batch 16, none above (SGLang
# routes a batch to the nearest entry), the same threshold as the switch's --graphpool-spec-off-above 16.
json.dump({"1": {"candidate_steps": [3]}, "32": {"candidate_steps": [0]}}, open(f"{d}/models/adaptive.json", "w"))
PY
rm -rf $W; du -sh $D; echo "$(ls $D/whl | wc -l) wheels"

#!/bin/bash
# Build .sgl/ (~45 MB) in the repository root: what a GPU machine without network needs to run a live
# SGLang 0.5.12.post1 server for bench/sglang_live.sh. Run on a machine with pip access (any OS/arch: wheels
# are fetched for cp312 manylinux x86-64). SGLK_WHEEL / FI_WHEEL may name already-downloaded wheels of
# sglang-kernel 0.4.2.post2 / flashinfer-python 0.6.11.post1.
#   whl/                 SGLang and the pure-Python/cp312 packages it imports at start-up (no deps resolution)
#   sglk-slim.tar.xz     sglang-kernel without FA3, FlashMLA, sm100 and mscclpp (the sm90 ops H200 loads)
#   flashinfer-slim.tar.xz  flashinfer-python without its JIT sources (SGLang imports it at module level)
#   stubs/               IPython.display and soundfile stand-ins (notebook helpers, the audio endpoint)
#   models/              config.json of a 4-layer Llama (tiny-llama) and a 1-layer EAGLE3 draft (tiny-eagle3):
#                        served with --load-format dummy, so no weights travel
#   lib/                 libnuma1 .deb, used where the GPU machine lacks libnuma.so.1
set -euo pipefail
D=.sgl; W=$(mktemp -d)
E="$(git rev-parse --git-common-dir)/info/exclude"; grep -qx '/.sgl/' "$E" 2>/dev/null || echo /.sgl/ >> "$E"
rm -rf $D && mkdir -p $D/whl $D/lib $D/stubs/IPython $D/models/tiny-llama $D/models/tiny-eagle3
P=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp)
for n in 34 28 27 26 24 17 5; do P+=(--platform manylinux_2_${n}_x86_64); done
P+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q "${P[@]}" -d $D/whl sglang==0.5.12.post1 transformers==5.6.0 tokenizers==0.22.2 \
  apache-tvm-ffi==0.1.9 pydantic==2.14.4 pydantic-core==2.50.5 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 \
  orjson==3.13.0 msgspec==0.23.0 pyzmq==27.3.0 pybase64==1.5.1 dill==0.4.1 gguf==0.19.0 compressed-tensors==0.18.0 \
  partial-json-parser==0.2.1.1.post7 setproctitle==1.3.8 openai==2.6.1 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2 loguru==0.7.3 sniffio==1.3.1 \
  distro==1.9.0 jiter==0.19.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
  rpds-py==2026.9.1 python-multipart==0.0.34
SGLK=${SGLK_WHEEL:-}; FI=${FI_WHEEL:-}
[ -n "$SGLK" ] || { python3 -m pip download -q "${P[@]}" -d $W sglang-kernel==0.4.2.post2; SGLK=$(ls $W/sglang_kernel-*.whl); }
[ -n "$FI" ] || { python3 -m pip download -q "${P[@]}" -d $W flashinfer-python==0.6.11.post1; FI=$(ls $W/flashinfer_python-*.whl); }
mkdir $W/k && unzip -q "$SGLK" -d $W/k && (cd $W/k && rm -rf sgl_kernel/flash_ops.abi3.so sgl_kernel/flashmla_ops.abi3.so \
  sgl_kernel/sm100 lib include _mscclpp* && tar -cJf - .) > $D/sglk-slim.tar.xz
mkdir $W/f && unzip -q "$FI" -d $W/f && (cd $W/f && rm -rf flashinfer/data/{cutlass,cccl,csrc,include,spdlog} \
  && tar -cJf - flashinfer flashinfer_python-*.dist-info) > $D/flashinfer-slim.tar.xz
(cd $D/lib && apt-get download libnuma1 >/dev/null 2>&1) || echo "libnuma1 .deb not fetched (only needed where the GPU machine lacks libnuma.so.1)"
echo '# stand-in: sglang.utils only needs IPython.display.{HTML,display} (notebook helpers)' > $D/stubs/IPython/__init__.py
printf 'class HTML:\n    def __init__(self, data=None, *a, **k): self.data = data\ndef display(*objs, **k):\n    for o in objs: print(getattr(o, "data", o))\n' > $D/stubs/IPython/display.py
printf '# stand-in: only the audio transcription endpoint uses soundfile\ndef _missing(*a, **k):\n    raise RuntimeError("soundfile stand-in: no audio I/O here")\nread = write = info = SoundFile = _missing\n' > $D/stubs/soundfile.py
python3 - "$D/models" <<'PY'
import json, sys
base = dict(model_type="llama", hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8,
            head_dim=64, hidden_act="silu", vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
            rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
target = dict(base, architectures=["LlamaForCausalLM"], num_hidden_layers=4)
# EAGLE3 reads 3 distinct target layers; SGLang's default [2, L//2, L-3] gives only 2 for a 4-layer target.
draft = dict(base, architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, target_hidden_size=1024,
             draft_vocab_size=32000, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
json.dump(target, open(sys.argv[1] + "/tiny-llama/config.json", "w"), indent=2)
json.dump(draft, open(sys.argv[1] + "/tiny-eagle3/config.json", "w"), indent=2)
PY
rm -rf $W; du -sh $D; echo "$(ls $D/whl | wc -l) wheels"

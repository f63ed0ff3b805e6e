#!/usr/bin/env bash
# The runner-API adapter (SGLang 0.5.14+) on the GPU machine, with SGLang 0.5.14: the first runner-API release,
# and one that pins torch 2.11.0, the GPU machine's torch (0.5.22 and 0.5.23 pin torch 2.14.1, which cannot
# run there). The GPU tests use SGLang's real Python classes with the harness's model and attention
# (tests/sglang_harness.py), real CUDA graphs, and SGLang's global graph memory pool; no SGLang kernel runs.
#
#   bash bench/sglang_runner_api_gpu.sh make   # CPU machine, project root: wheels into .whl/sglang514 (~55 MB)
#   bash bench/sglang_runner_api_gpu.sh run    # GPU machine, project root, with .whl carried beside the checkout
#
# `run` installs the wheels into a folder on PYTHONPATH (no pip build, no network), then runs the `gpu`-marked
# tests of tests/test_sglang_runner_api.py and tests/test_sglang_spec_switch_v2.py. Logs go to $OUT (or ./out).
set -euo pipefail
WHEELS=.whl/sglang514
case "${1:-run}" in
make)
  P=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp)
  for n in 34 28 27 26 24 17 5; do P+=(--platform "manylinux_2_${n}_x86_64"); done
  P+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  mkdir -p "$WHEELS"
  python3 -m pip download -q "${P[@]}" -d "$WHEELS" sglang==0.5.14 transformers==5.8.1 tokenizers==0.22.2 \
    huggingface-hub==1.33.0 apache-tvm-ffi==0.1.9 pydantic==2.14.4 pydantic-core==2.50.5 fastapi==0.165.0 \
    starlette==1.10.0 uvicorn==0.54.0 orjson==3.13.0 msgspec==0.23.0 pyzmq==27.3.0 pybase64==1.5.1 dill==0.4.1 \
    gguf==0.19.0 compressed-tensors==0.18.0 partial-json-parser==0.2.1.1.post7 setproctitle==1.3.8 openai==2.6.1 \
    annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2 \
    loguru==0.7.3 sniffio==1.3.1 distro==1.9.0 jiter==0.19.0 python-multipart==0.0.34 einops==0.8.2 \
    ipython==9.18.1 pytest-timeout==2.4.0 flashinfer-python==0.6.12 \
    traitlets==5.16.1 decorator==5.3.1 jedi==0.20.1 parso==0.8.7 matplotlib-inline==0.2.2 pexpect==4.9.0 \
    ptyprocess==0.7.0 prompt-toolkit==3.0.53 wcwidth==0.9.4 stack-data==0.6.3 executing==2.3.0 asttokens==3.0.2 \
    pure-eval==0.2.4 ipython-pygments-lexers==1.1.1
  # flashinfer: SGLang's sampler imports it on CUDA; traitlets .. ipython-pygments-lexers: IPython's needs
  # (sglang.utils imports IPython.display), absent from the GPU image
  du -sh "$WHEELS"; ls "$WHEELS" | wc -l
  ;;
run)
  OUT=${OUT:-out}; mkdir -p "$OUT"; SITE=/tmp/site-sglang514
  [ -d "$WHEELS" ] || { echo "no $WHEELS: run 'bash bench/sglang_runner_api_gpu.sh make' on the CPU machine"; exit 2; }
  wheels=$(ls "$WHEELS" | md5sum | cut -c1-12)  # reinstall when the set of wheels changed
  if [ "$(cat "$SITE/.done" 2>/dev/null)" != "$wheels" ]; then
    rm -rf "$SITE"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEELS"/*.whl && echo "$wheels" > "$SITE/.done"
  fi
  export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 GRAPHPOOL_NO_EXTENSION=1
  python3 -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())" \
    2>&1 | tee "$OUT/sglang_runner_api_gpu.log" || true
  python3 bench/find_missing_modules.py tests.sglang_runner_api_harness | tee -a "$OUT/sglang_runner_api_gpu.log"
  python3 -m pytest -m gpu -q -rs -s -p no:cacheprovider tests/test_sglang_runner_api.py \
    tests/test_sglang_spec_switch_v2.py 2>&1 | tee -a "$OUT/sglang_runner_api_gpu.log" | tail -15
  ;;
*) echo "usage: bash bench/sglang_runner_api_gpu.sh make|run"; exit 2 ;;
esac

#!/usr/bin/env bash
# The GPU runs, one entry point, one run per call of the device machine (each fits its 10 minutes):
#   bash bench/gpu.sh RUN [ARGS...]      from the repository root; `bash bench/gpu.sh help` lists the runs
# Logs and results go to $OUT (the device tool's output folder) or ./out; each run prints its table last.
#
# On the GPU machine (no network: what its image lacks travels as a carry, built below):
#   tests [PYTEST ARGS]  the GPU tests: python3 -m pytest -m gpu -q --runslow (default: tests/)
#   decode [ARGS]        the main job's GPU sweep, bench/decode_loop.py --identity-check (docs/benchmarks.md)
#   tiers [ARGS]         speculation tiers on the reference engine (docs/tiers.md): decode_loop --tiers
#                        4x2:8,4x1:4 at C = 1..128 with the float32 identity check; JSON in $OUT/decode_tiers.json
#   hf [ARGS]            transformers: its GPU tests, then bench/hf_decode.py ARGS (docs/transformers.md)
#   live [PYTEST ARGS]   the live tier (tests/test_live_sglang.py) on the GPU: SGLang 0.5.17 from the .sgl17 carry,
#                        its CUDA graphs for the oracle, graphpool's for the target (GRAPHPOOL_LIVE_DEVICE=cuda);
#                        with ARGS, pytest ARGS beside that SGLang (e.g. -m gpu tests/test_sglang_tiers.py)
#                        (a fresh machine needs two calls for the tier: -k 'not standalone', then -k standalone)
#   sglang-live ARGS     live SGLang 0.5.17 servers from the .sgl17 carry: bench/sglang_live_v2.py ARGS
#                        (--phase correctness|flashinfer|throughput); DEADLINE_S (550) bounds the whole call
#   sglang-classic ARGS  live SGLang 0.5.12.post1 servers from the .sgl carry: bench/sglang_live.py ARGS
#   sglang-tests         SGLang 0.5.14's classes with real CUDA graphs: the runner-API GPU tests (.whl/sglang514)
#   tp [ARGS]            TP 2 on two GPUs: the engine's TP GPU tests, then decode_loop --tp 2 ARGS
# On a machine with pip (the carries; keep them out of git: .whl/ and .sgl*/ are in .gitignore):
#   wheels               FlashInfer 0.6.11.post1 + apache-tvm-ffi 0.1.9 into .whl/: carried, tests, decode,
#                        tiers and tp install them (without them the engine runs torch attention)
#   sglang-carry REL     .sgl17/ (REL 0.5.17, for sglang-live) or .sgl/ (REL 0.5.12, for sglang-classic)
#   sglang-tests make    SGLang 0.5.14 and what it imports into .whl/sglang514
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
TMP=$(dirname "$(mktemp -u)")
# pip download for the GPU machine's Python 3.12 on x86-64 Linux, whatever this machine is
PIPDL=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp)
for n in 39 35 34 31 28 27 26 24 17 5; do PIPDL+=(--platform "manylinux_2_${n}_x86_64"); done
PIPDL+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# what SGLang's server imports at start-up that the GPU image lacks (pure Python or cp312), for every carry
SGL_DEPS=(apache-tvm-ffi pydantic==2.14.4 pydantic-core==2.50.5 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0
  orjson==3.13.0 msgspec==0.23.0 pyzmq==27.3.0 pybase64==1.5.1 dill==0.4.1 gguf==0.19.0 compressed-tensors==0.18.0
  partial-json-parser==0.2.1.1.post7 setproctitle==1.3.8 openai==2.6.1 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 opentelemetry-api==1.45.2 loguru==0.7.3 sniffio==1.3.1 distro==1.9.0 jiter==0.19.0
  python-multipart==0.0.34)

say() { echo "$@" | tee -a "$LOG"; }
# stage NAME SECONDS CMD...: CMD with a time limit, its output to the log, then how it ended
stage() {
  local name=$1 limit=$2 t0=$SECONDS rc; shift 2
  say "== $name"
  timeout "$limit" "$@" >> "$LOG" 2>&1; rc=$?
  say "== $name: exit $rc after $((SECONDS - t0)) s$([ $rc -eq 124 ] && echo " (timed out at $limit s)")"
  return $rc
}
machine() {
  { python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
torch.cuda.device_count(), 'x', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
    python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>/dev/null \
      || echo "flashinfer: not importable (bash bench/gpu.sh wheels, carry .whl): the engine runs torch attention"
  } 2>&1 | tee -a "$LOG"
}
# The carried top-level wheels of .whl/ into a folder on PYTHONPATH (once per machine and wheel set).
install_wheels() {
  ls .whl/*.whl > /dev/null 2>&1 || return 0
  local site=$TMP/gp-wheels key; key=$(ls .whl/*.whl | md5sum | cut -c1-12)
  if [ "$(cat "$site/.done" 2>/dev/null)" != "$key" ]; then
    rm -rf "$site" && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
      .whl/*.whl && echo "$key" > "$site/.done"
  fi
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
}
# table REGEX FILE: FILE from its last line matching REGEX to the end (a run's short table)
table() { awk -v m="$1" '$0 ~ m {n = NR} {line[NR] = $0} END {for (i = n; n && i <= NR; i++) print line[i]}' "$2"; }
tests_summary() { grep -E "^(FAILED|ERROR) |[0-9]+ (passed|failed|skipped|errors?)" "$1" | tail -15; }

# SGLang's live servers run from a carry: its wheels and archives installed into a site folder beside graphpool
# laid out as its packaging maps it (kernels/ and integrations/ inside the graphpool package), fresh each call.
sglang_setup() {
  local carry=$1 run=$2 site=$2/site gp=$2/gp
  [ -d "$carry/whl" ] || { echo "no $carry/whl here: build it first (bash bench/gpu.sh sglang-carry ...)"; exit 2; }
  mkdir -p "$run"
  (
    if [ ! -f "$site/.done" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$carry"/whl/*.whl \
        || exit 1
      for t in "$carry"/*.tar.xz; do tar -xJf "$t" -C "$site" || exit 1; done
      cp -r "$carry/stubs/." "$site/" && touch "$site/.done"
    fi
    rm -rf "$gp" && mkdir -p "$gp/graphpool" && cp -r graphpool/. "$gp/graphpool/" \
      && cp -r kernels "$gp/graphpool/kernels" && cp -r integrations "$gp/graphpool/integrations"
    # sglang-kernel's norm and sampling wrappers prefer FlashInfer's JIT ops; take its own precompiled ones
    sed -i 's/^    import flashinfer\.\(norm\|sampling\) as _flashinfer_\(norm\|sampling\)$/    raise ImportError("no flashinfer JIT")/' \
      "$site/sgl_kernel/elementwise.py" "$site/sgl_kernel/sampling.py"
  ) > "$OUT/setup.log" 2>&1 || { echo "setup failed:"; tail -20 "$OUT/setup.log"; exit 1; }
  export PYTHONPATH=$site:$gp HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 GRAPHPOOL_NO_EXTENSION=1
  # the deep_gemm stand-in imports, so SGLang would take DeepGEMM on sm90+: keep its JIT off (no DeepGEMM here)
  export SGLANG_ENABLE_JIT_DEEPGEMM=0
  export TVM_FFI_CACHE_DIR=${TVM_FFI_CACHE_DIR:-$run/tvmffi-cache} FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$run}
  python3 - >> "$OUT/setup.log" 2>&1 <<'PY' || { echo "SGLang does not import:"; tail -5 "$OUT/setup.log"; exit 1; }
import importlib.metadata as md, torch
print("torch", torch.__version__, "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
print({p: md.version(p) for p in ("sglang", "sglang-kernel", "flashinfer-python", "transformers")})
import sgl_kernel, flashinfer, graphpool.integrations.sglang.launch  # noqa: F401
from graphpool.integrations.sglang import versions
if versions.runner_api() == versions.RUNNER:  # what the spec-v2 draft capture imports on CUDA (run BJ stopped there)
    import sglang.srt.layers.attention.dsa_backend, sglang.srt.layers.attention.deepseek_v4_backend  # noqa: F401
print("imports OK; graphpool sees SGLang's", versions.runner_api(), "API")
PY
  echo "[$((SECONDS))s] setup: $(tail -1 "$OUT/setup.log")"
}

# The carry of a live SGLang release, built where pip reaches an index: $1 0.5.17 (.sgl17: Llama-3.1-8B's shape,
# an EAGLE3 draft of it) or 0.5.12 (.sgl: a 4-layer Llama and a 1-layer EAGLE3 draft); dummy weights, no tokenizer.
sglang_carry() {
  local rel=${1:-} d w
  case $rel in 0.5.17) d=.sgl17 ;; 0.5.12) d=.sgl ;; *) echo "usage: bash bench/gpu.sh sglang-carry 0.5.17|0.5.12"; exit 2 ;; esac
  w=$(mktemp -d) && rm -rf $d && mkdir -p $d/whl
  case $rel in
  0.5.17) "${PIPDL[@]}" -d $w sglang==0.5.17 sglang-kernel==0.4.5 flashinfer-python==0.6.15.post1 || exit 1
    "${PIPDL[@]}" -d $d/whl transformers==5.12.1 tokenizers==0.22.2 jsonschema==4.26.0 \
      jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 "${SGL_DEPS[@]/apache-tvm-ffi/apache-tvm-ffi==0.1.11}" || exit 1
    # sglang without its Rust server and multimodal cores, diffusion and tests; flashinfer whole (JIT sources)
    mkdir $w/s && unzip -q $w/sglang-*.whl -d $w/s && (cd $w/s && rm -rf sglang/multimodal_gen sglang/test \
      sglang/srt/server/_core*.so sglang/srt/multimodal/_core*.so && tar -cJf - .) > $d/sglang-slim.tar.xz || exit 1
    mkdir $w/f && unzip -q $w/flashinfer_python-*.whl -d $w/f && (cd $w/f && tar -cJf - .) > $d/flashinfer.tar.xz || exit 1 ;;
  0.5.12) "${PIPDL[@]}" -d $w sglang-kernel==0.4.2.post2 flashinfer-python==0.6.11.post1 || exit 1
    "${PIPDL[@]}" -d $d/whl sglang==0.5.12.post1 transformers==5.6.0 tokenizers==0.22.2 \
      jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
      "${SGL_DEPS[@]/apache-tvm-ffi/apache-tvm-ffi==0.1.9}" || exit 1
    # flashinfer without its JIT sources: this release's SGLang only imports it
    mkdir $w/f && unzip -q $w/flashinfer_python-*.whl -d $w/f && (cd $w/f && rm -rf flashinfer/data/{cutlass,cccl,csrc,include,spdlog} \
      && tar -cJf - .) > $d/flashinfer-slim.tar.xz || exit 1 ;;
  esac
  # sglang-kernel without FA3 (1.1 GB: the servers run Triton or FlashInfer attention), FlashMLA, InfLLM, sm100
  mkdir $w/k && unzip -q $w/sglang_kernel-*.whl -d $w/k && (cd $w/k && rm -rf sgl_kernel/flash_ops.abi3.so \
    sgl_kernel/flashmla_ops.abi3.so sgl_kernel/infllm_ops*.so sgl_kernel/sm100 lib include _mscclpp* && tar -cJf - .) \
    > $d/sglk-slim.tar.xz || exit 1
  python3 bench/live/carry.py "$d" "$rel" && rm -rf $w && du -sh $d && echo "$(ls $d/whl | wc -l) wheels"
}

run=${1:-help}; shift || true
LOG="$OUT/$run.log"
case $run in
tests)
  : > "$LOG"; install_wheels; machine
  stage "GPU tests" ${TEST_LIMIT:-570} python3 -m pytest -m gpu -q -rs --runslow -p no:cacheprovider "${@:-tests}"
  tests_summary "$LOG" ;;
decode|tiers)
  : > "$LOG"; install_wheels; machine
  args=(--identity-check --out "$OUT/decode_loop")
  [ "$run" = tiers ] && args=(--tiers 4x2:8,4x1:4 --concurrency 1,2,4,8,16,32,64,128 --identity-check --out "$OUT/decode_tiers")
  stage "decode_loop ${args[*]} $*" ${LOOP_LIMIT:-570} python3 bench/decode_loop.py "${args[@]}" "$@"
  table "^(output tokens/s|steps by mode) " "$LOG" ;;
hf)
  : > "$LOG"; machine
  # the pool's Python input checks instead of a minute's build of the C++ checker on a bare machine
  export GRAPHPOOL_NO_EXTENSION=${GRAPHPOOL_NO_EXTENSION:-1}
  stage "transformers GPU tests" 150 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_transformers_*.py
  tests_summary "$LOG"
  stage "bench/hf_decode.py $*" ${HF_LIMIT:-400} python3 bench/hf_decode.py --out "$OUT/hf_decode" "$@"
  grep -E "^hf_decode: (graphpool captured|graphed step|hf-static |\(f\) )" "$LOG"; table "tokens/s [(]all rows" "$LOG" ;;
live)
  : > "$LOG"; machine
  sglang_setup "$PWD/.sgl17" "${SGL_RUN_DIR:-$TMP/gp-live.sgl17}"
  export GRAPHPOOL_LIVE_DEVICE=cuda GRAPHPOOL_NO_EXTENSION=1
  [ $# -gt 0 ] || set -- -m live tests/test_live_sglang.py
  stage "live tier on CUDA (SGLang 0.5.17): $*" ${LIVE_LIMIT:-560} python3 -m pytest -q -rs -s -p no:cacheprovider --live \
    --basetemp "$TMP/gp-live-tests" "$@"
  # the servers' logs and counts in one file (the device tool returns few files)
  (cd "$TMP/gp-live-tests" && find . -name '*.log' -o -name '*.json' | tar -czf "$OUT/live-logs.tar.gz" -T -)
  grep -E "^live |^(FAILED|ERROR) |[0-9]+ (passed|failed)" "$LOG" | tail -20 ;;
sglang-live|sglang-classic)
  DEADLINE_S=${DEADLINE_S:-550}
  if [ "$run" = sglang-live ]; then carry=.sgl17 script=bench/sglang_live_v2.py; else carry=.sgl script=bench/sglang_live.py; fi
  rundir=${SGL_RUN_DIR:-$TMP/gp-live$carry}  # outside the checkout: a warm machine keeps it and the JIT caches
  sglang_setup "$PWD/$carry" "$rundir"
  pin=()  # servers on all cores but the last 4, the client on those: the same cores for every server of a call
  N=$(nproc); [ "$N" -ge 8 ] && pin=(--cpus "0-$((N - 5))") && [ "$run" = sglang-live ] && pin+=(--client-cpus "$((N - 4))-$((N - 1))")
  exec python3 $script --out "$OUT" --models "$PWD/$carry/models" --python python3 --server-cwd "$rundir/gp" \
    "${pin[@]}" --deadline-s $((DEADLINE_S - SECONDS)) "$@" ;;
sglang-carry) sglang_carry "$@" ;;
sglang-tests)
  wheels=.whl/sglang514
  if [ "${1:-run}" = make ]; then  # SGLang 0.5.14: the first runner-API release, and one pinning the H200's torch 2.11
    mkdir -p $wheels && "${PIPDL[@]}" -d $wheels sglang==0.5.14 transformers==5.8.1 tokenizers==0.22.2 \
      huggingface-hub==1.33.0 einops==0.8.2 flashinfer-python==0.6.12 pytest-timeout==2.4.0 ipython==9.18.1 \
      traitlets==5.16.1 decorator==5.3.1 jedi==0.20.1 parso==0.8.7 matplotlib-inline==0.2.2 pexpect==4.9.0 \
      ptyprocess==0.7.0 prompt-toolkit==3.0.53 wcwidth==0.9.4 stack-data==0.6.3 executing==2.3.0 asttokens==3.0.2 \
      pure-eval==0.2.4 ipython-pygments-lexers==1.1.1 "${SGL_DEPS[@]/apache-tvm-ffi/apache-tvm-ffi==0.1.9}" \
      && du -sh $wheels; exit
  fi
  [ -d $wheels ] || { echo "no $wheels: run 'bash bench/gpu.sh sglang-tests make' where pip works, carry .whl"; exit 2; }
  : > "$LOG"; machine
  site=$TMP/gp-sglang514
  [ -f "$site/.done" ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    $wheels/*.whl && touch "$site/.done"; }
  export PYTHONPATH=$site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 GRAPHPOOL_NO_EXTENSION=1
  stage "runner-API GPU tests (SGLang 0.5.14)" 500 python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
    tests/test_sglang_runner_api.py tests/test_sglang_spec_switch_v2.py
  tests_summary "$LOG" ;;
tp)
  : > "$LOG"; install_wheels; machine
  # NVLink multicast stays off (NVLS in NCCL, multicast in torch's symmetric memory): never turn it on here.
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 TP=${TP:-2}
  # the C++ checker built once here, or every spawned rank of every test waits on the build lock
  python3 -c "import graphpool.native as n; print('C++ input checker:', n.extension_available())" 2>&1 | tee -a "$LOG"
  stage "engine GPU tests at --tp $TP" 200 python3 -m pytest -m gpu -q -rs -p no:cacheprovider --tp "$TP" tests/test_engine_tp.py
  tests_summary "$LOG"
  stage "decode_loop --tp $TP $*" 300 python3 bench/decode_loop.py --tp "$TP" --out "$OUT/decode_tp$TP" "$@"
  table "^(output tokens/s|steps by mode) " "$LOG" ;;
wheels)
  mkdir -p .whl && "${PIPDL[@]}" -d .whl flashinfer-python==0.6.11.post1 apache-tvm-ffi==0.1.9 && ls .whl/*.whl ;;
help|-h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//' ;;
*) echo "bash bench/gpu.sh: unknown run '$run'; the runs:"; sed -n '6,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2 ;;
esac

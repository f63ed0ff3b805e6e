#!/usr/bin/env bash
# Issue 11 on one H200 in one call (~5 min): FlashInfer's JIT compile (timed, then excluded), the C = 1
# step profile (also with every GEMM through cuBLAS instead of the Triton GEMV at one token),
# the GPU tests of the engine's kernels, FlashInfer attention and the decode loop, and the decode-loop sweeps with
# --attention flashinfer and torch, then flashinfer with --draft-select torch (the speculative step's
# selection and acceptance as torch ops instead of the default fused kernels; quick set of C, with the
# float32 greedy identity check). Everything goes to $OUT (or ./out): run.log (all output),
# profile_step{,_blas}.json, trace_spec.json.gz, decode_{flashinfer,torch,flashinfer_torch_select}.{json,png}
# (10 files; the device tool returns 8: remove the trace and the plots at the end of the call). The summary table
# comes last. Each stage has a time limit, and
# the limits add up to 10 minutes at most; expected total ~5 minutes after the wheels are installed.
#
# FlashInfer and apache-tvm-ffi are not installed on the H200: carry them as wheels in .whl/ and start
# the command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
#     && export PYTHONPATH="$SITE:${PYTHONPATH:-}"
# (any writable $SITE). FlashInfer, Triton and torch keep their JIT caches under $HOME, so a second call on
# the same machine compiles nothing.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG="$OUT/run.log"
: > "$LOG"
source "$(dirname "${BASH_SOURCE[0]}")/stages.sh"  # say, stage

{ python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  python3 -c "import flashinfer, tvm_ffi; print('flashinfer', flashinfer.__version__, 'tvm_ffi', tvm_ffi.__version__)" \
    || echo "flashinfer: NOT importable (carry the wheels, see the header): FlashInfer stages will fail"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } 2>&1 | tee -a "$LOG"

# 1. JIT: FlashInfer's attention module (one fa2 prefill module serves decode, causal and tree-masked
#    calls), the engine's Triton kernels and graphpool's C++ checker; timed once, cached for the rest.
stage "jit warm-up" 75 python3 - <<'EOF'
import time, torch
t = time.perf_counter()
from bench.engine.fi_attention import FlashInferLayouts
table = torch.arange(1, 1 + 4 * 192, device="cuda").view(4, 192)
layouts = FlashInferLayouts(table, 32, 4, 128, torch.bfloat16, kernel="flashinfer")
rows, n = torch.arange(4, device="cuda"), torch.full((4,), 50, device="cuda")
layouts.causal(rows, n - 1, 1); layouts.causal(rows, n - 5, 5)
layouts.tree(rows, n - 1, torch.eye(16, dtype=torch.bool, device="cuda").expand(4, 16, 16).contiguous())
torch.cuda.synchronize()
print(f"FlashInfer JIT compile + first plans: {time.perf_counter() - t:.1f} s (excluded from every measurement below)")
t = time.perf_counter()
from graphpool.native import make_input_checker  # noqa: F401  (builds the C++ checker once per machine)
from bench.engine.harness import build
from bench.engine.config import ModelConfig, SpecConfig
from dataclasses import replace
cfg = replace(ModelConfig.tiny(), num_heads=32, num_kv_heads=4, head_dim=128)  # FlashInfer's module is per head_dim
build(cfg, SpecConfig(), [1], 32, 16, "cuda", torch.bfloat16, attention="flashinfer")
print(f"graphpool checker + engine Triton kernels warm-up: {time.perf_counter() - t:.1f} s (excluded too)")
EOF

# 2. Where the time goes at C = 1 (plain and speculative steps; torch/torch is the code before issue 11).
stage "profile (C = 1)" 70 python3 bench/profile_step.py --out "$OUT/profile_step" --trace "$OUT/trace_spec.json.gz"
# The plain step is GEMM-bound: the same profile with every GEMM through cuBLAS (no Triton GEMV at one token:
# the engine before it). bench/gemv_probe.py times each shape (cuBLASLt = cuBLAS, run AB).
stage "profile (C = 1) --gemv off --skinny off" 40 python3 bench/profile_step.py --configs flashinfer:fused \
  --gemv off --skinny off --out "$OUT/profile_step_blas"

# 3. GPU tests: fused kernels; FlashInfer graph replay == eager FlashInfer == torch (every size, every mode);
#    the decode loop in float32 (token-identical) and bf16 FlashInfer.
stage "gpu tests" 105 bash -c "python3 -m pytest -q -rs -p no:cacheprovider tests/test_engine_fused.py tests/test_engine_gemv.py tests/test_engine_skinny.py; \
  python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_engine_draft_select.py tests/test_engine_tree_kernels.py tests/test_engine_draft_inputs.py; \
  python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_engine_flashinfer.py tests/test_decode_loop.py tests/test_examples.py"

# 4. The decode-loop sweeps (quick set of C: 1, 4, 16, 32, 128), FlashInfer then torch attention, then
#    FlashInfer with the speculative step's selection and acceptance as torch ops (the gain of their kernels).
for att in flashinfer torch; do
  stage "decode_loop --attention $att" 110 python3 bench/decode_loop.py --quick --attention "$att" --identity-check \
    --out "$OUT/decode_$att"
done
stage "decode_loop --attention flashinfer --draft-select torch" 90 python3 bench/decode_loop.py --quick \
  --attention flashinfer --draft-select torch --identity-check --out "$OUT/decode_flashinfer_torch_select"

say ""
say "================================ summary ================================"
grep -E "^FlashInfer JIT compile|^graphpool checker" "$LOG" | tee -a "$LOG.summary"
sed -n '/^per step at C = 1/,/^== /p' "$LOG" | grep -v "^== " | tee -a "$LOG.summary"
echo "-- gpu tests" | tee -a "$LOG.summary"
grep -E "^(FAILED|ERROR) |^[0-9]+ (passed|failed|skipped|errors?|deselected)" "$LOG" | tail -12 | tee -a "$LOG.summary"
for att in flashinfer torch "flashinfer --draft-select torch"; do
  echo "-- decode_loop --attention $att" | tee -a "$LOG.summary"
  awk -v a="$att" '$0 == "== decode_loop --attention "a {on=1; next} /^== / {on=0} on' "$LOG" \
    | sed -n '/^output tokens\/s by concurrency/,$p' | tee -a "$LOG.summary"
done
cat "$LOG.summary" >> "$LOG"; rm -f "$LOG.summary"

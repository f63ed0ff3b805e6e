#!/usr/bin/env bash
# Issue 27 on the H200 in one device call (~6-8 minutes): the transformers integration's GPU tests (float32, real
# CUDA graphs: greedy tokens equal model.generate per prompt), then bench/hf_decode.py (Llama-3.2-1B config, bf16).
# Logs and results go to $OUT (the device tool's output folder) or ./out; the benchmark's table comes last.
#   OUT=out bash bench/hf_gpu.sh
# GRAPHPOOL_NO_EXTENSION=1: the pool's Python input checks instead of building the C++ checker on the bare
# machine (a minute of the call; it saves ~3 us of a ~1 ms step here).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GRAPHPOOL_NO_EXTENSION=${GRAPHPOOL_NO_EXTENSION:-1}
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
torch.cuda.get_device_name())" 2>&1 | tee "$OUT/hf_gpu_tests.log"
timeout 150 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_transformers_loop.py \
    tests/test_transformers_example.py 2>&1 | tee -a "$OUT/hf_gpu_tests.log" |
    grep -E "passed|failed|error|FAILED|Error" | tail -20
timeout 400 python3 bench/hf_decode.py --out "$OUT/hf_decode" ${HF_ARGS:-} > "$OUT/hf_decode.log" 2>&1
echo "== bench/hf_decode.py (exit $?), full log: hf_decode.log"
grep -E "^hf_decode: (graphpool captured|graphed step|hf-static )" "$OUT/hf_decode.log"
sed -n '/tokens\/s (all rows/,$p' "$OUT/hf_decode.log"

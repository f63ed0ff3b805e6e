#!/usr/bin/env bash
# Everything the H200 has to prove, in one call: GPU tests, then the benchmarks. Logs and results go to
# $OUT (the device tool's output folder) or ./out; the short tables come last.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{ python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } | tee "$OUT/gpu_tests.log"
python3 -m pytest -m gpu -q -rs -s --continue-on-collection-errors ${GPU_TESTS:-tests} 2>&1 | tee -a "$OUT/gpu_tests.log" | grep -E "passed|failed|error|graph memory|FAILED|Error" | tail -40
for job in ${BENCH-replay_latency}; do
  python3 bench/$job.py --out "$OUT/$job" ${BENCH_ARGS:-} > "$OUT/$job.log" 2>&1
  echo "== $job (exit $?)"; tail -n ${TAIL:-25} "$OUT/$job.log"
done

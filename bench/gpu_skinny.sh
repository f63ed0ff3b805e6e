#!/usr/bin/env bash
# The skinny GEMM on one H200 in one call (~7 min): the per-shape sweep against cuBLAS at 4 and 16 rows
# (bench/gemv_probe.py --skinny, its best configuration per shape loaded into the engine through
# BENCH_SKINNY_CONFIGS), then the decode loop at C = 1, 4, 16 (plain and spec) with the skinny GEMM off and
# on, each in a process of its own, then the C = 1 step profile with it on. FlashInfer must be importable
# (carry the wheels, see bench/gpu_flashinfer.sh). Everything goes to $OUT (or ./out); the summary comes last.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG="$OUT/run.log"
: > "$LOG"
source "$(dirname "${BASH_SOURCE[0]}")/stages.sh"  # say, stage
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$LOG"

stage "skinny sweep" ${SWEEP_LIMIT:-240} python3 bench/gemv_probe.py --skinny --json "$OUT/skinny_probe.json"
[ -f "$OUT/skinny_probe.json" ] && export BENCH_SKINNY_CONFIGS="$OUT/skinny_probe.json"
for sk in off on; do
  stage "decode_loop --skinny $sk" ${LOOP_LIMIT:-100} python3 bench/decode_loop.py --quick --concurrency 1,4,16 \
    --variants plain,spec --skinny "$sk" --out "$OUT/decode_skinny_$sk"
done
stage "profile (C = 1) --skinny on" ${PROFILE_LIMIT:-70} python3 bench/profile_step.py --configs flashinfer:fused \
  --skinny on --out "$OUT/profile_skinny"
rm -f "$OUT"/*.png

say ""
say "================================ summary ================================"
sed -n '/^shape .*skinny/,/^== decode_loop --skinny off$/p' "$LOG" | grep -v "^==" > "$LOG.summary"
for sk in off on; do
  echo "-- decode_loop --skinny $sk" >> "$LOG.summary"
  awk -v a="$sk" '$0 == "== decode_loop --skinny "a {on=1; next} /^== / {on=0} on' "$LOG" \
    | sed -n '/^output tokens\/s by concurrency/,$p' >> "$LOG.summary"
done
sed -n '/^per step at C = 1/,/^GPU waits/p' "$LOG" >> "$LOG.summary"
cat "$LOG.summary"; cat "$LOG.summary" >> "$LOG"; rm -f "$LOG.summary"

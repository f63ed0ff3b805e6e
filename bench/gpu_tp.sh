#!/usr/bin/env bash
# Issue 12 on a machine with TP GPUs (default 2: nvidia-h200-x2), in one call of about 5 minutes:
#   1. the engine's GPU tests with --tp 2 (tests/test_engine_tp.py: the decode-loop GPU tests on every rank,
#      random steps vs the single-process engine, fp32 greedy at TP 2 token-identical to TP 1, the
#      disagreement check under NCCL; every rank must exit on its own);
#   2. the decode-loop sweep at TP 2 in bf16 (plain, spec, dynamic, dyn-eager): dynamic >= 0.95 x
#      max(plain, spec) at every C, no graph misses;
#   3. graph memory per rank, decode + verify vs verify alone (<= 1.10x), and host us per pool.run per rank.
# Logs and JSON go to $OUT (7 files); PASS/FAIL lines and the short tables come last.
# NVLink multicast stays off (NVLS in NCCL, multicast in torch's symmetric memory): never turn it on here.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
TP=${TP:-2}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
verdicts=()
verdict() { verdicts+=("$1"); echo "$1"; }

{ python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.device_count(), 'x', torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST=$TORCH_SYMM_MEM_DISABLE_MULTICAST"
  # Build the C++ input checker once here, or every spawned rank of every test waits on the build lock.
  python3 -c "import graphpool.native as n; print('C++ input checker:', n.extension_available())" 2>&1 || true
} > "$OUT/tp_env.log" 2>&1
cat "$OUT/tp_env.log"

echo "== 1. engine GPU tests at --tp $TP"
start=$SECONDS
timeout ${TEST_LIMIT:-180} python3 -m pytest -m gpu -q -rs -p no:cacheprovider --tp "$TP" tests/test_engine_tp.py \
  > "$OUT/tp_tests.log" 2>&1
rc=$?
tail -n 4 "$OUT/tp_tests.log"
summary=$(grep -E "[0-9]+ (passed|failed|skipped|error)" "$OUT/tp_tests.log" | tail -n 1)
ok=$( [ $rc -eq 0 ] && ! grep -qE "[0-9]+ skipped" <<< "$summary" && echo PASS || echo FAIL)  # a skip is a miss
verdict "$ok engine GPU tests at TP $TP: ${summary:-no summary} (exit $rc, $((SECONDS - start)) s)"

echo "== 2. decode loop at TP $TP, bf16"
start=$SECONDS
timeout ${LOOP_LIMIT:-110} python3 bench/decode_loop.py --tp "$TP" ${DL_ARGS:-} --out "$OUT/tp_decode_loop" \
  > "$OUT/tp_decode_loop.log" 2>&1
rc=$?
verdict "$( [ $rc -eq 0 ] && echo PASS || echo FAIL) decode loop at TP $TP ran and every rank exited (exit $rc, $((SECONDS - start)) s)"
lines=$(mktemp)
python3 - "$OUT/tp_decode_loop.json" <<'EOF' | tee -a "$OUT/tp_decode_loop.log" > "$lines" || true
import json, sys
try:
    checks = json.load(open(sys.argv[1]))["checks"]
except Exception as exc:
    print(f"FAIL decode loop: no results ({type(exc).__name__}: {exc})"); sys.exit()
for row in checks:
    ok = row.get("dyn_ok") is True and row["misses"] == 0
    print(f"{'PASS' if ok else 'FAIL'} decode loop C={row['concurrency']}: dynamic / max(plain, spec) = "
          f"{row.get('dyn_over_best', float('nan')):.3f} (>= 0.95), graph misses {row['misses']}")
EOF
while IFS= read -r line; do verdict "$line"; done < "$lines"; rm -f "$lines"

echo "== 3. graph memory and host us per rank at TP $TP"
start=$SECONDS
timeout ${GRAPHS_LIMIT:-80} python3 bench/tp_graphs.py --tp "$TP" ${GRAPHS_ARGS:-} --out "$OUT/tp_graphs" > "$OUT/tp_graphs.log" 2>&1
rc=$?
verdict "$( [ $rc -eq 0 ] && echo PASS || echo FAIL) graph memory per rank <= 1.10 x verify alone, no misses (exit $rc, $((SECONDS - start)) s)"

echo "== tables"
sed -n '/^rank 0 (/,$p' "$OUT/tp_graphs.log"
sed -n '/^output tokens\/s by concurrency/,/^targets:/p' "$OUT/tp_decode_loop.log" | grep -v "^targets:"
echo "== verdicts"
printf '%s\n' "${verdicts[@]}"

#!/usr/bin/env bash
# CI, the runner API's range: graphpool's SGLang integration against the real Python classes of every SGLang release
# from 0.5.14 to 0.5.23 (0.5.15 and 0.5.15.post1 included; 0.5.17: the newest release whose torch pin, 2.11, the GPU
# machines have; 0.5.23: the newest).
#
# One environment for all three: .ci/run's first one when it is there (torch 2.13.0 CPU, setup.py's
# sglang-classes extra), else one made here the same way. Each release goes into a folder of its own with the
# packages it pins differently (.ci/sglang-current-requirements.txt; pip --target, without dependencies), put
# first on PYTHONPATH, as .ci/sglang-classic-range.sh does for the classic releases. SGLang's CUDA pins stay
# unmet: the tests drive SGLang's real ModelRunner._forward_raw, DecodeCudaGraphRunner, ScheduleBatch, Req,
# FutureMap, Sampler, EAGLEWorkerV2, ServerArgs and runtime context with stand-ins for the model, attention and
# KV pool (tests/sglang_harness.py); no CUDA kernel of SGLang runs. Classic-API tests skip with their reason.
#
# Time: the releases' tests run side by side, at most three at once (one thread each). 0.5.23 runs every test; the
# others leave out the topk-1 sweep and 0.5.14 both sweeps (about 30 s each here), whose code paths the other tests of
# those releases cover and 0.5.23 sweeps in full.
# Usage: bash .ci/sglang-current.sh   (from the repository root; exits non-zero if any release failed)
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
REQS=.ci/sglang-current-requirements.txt
RANGE=.sgl-current
TESTS="tests/test_sglang_runner_api.py tests/test_sglang_runner_api_contract.py tests/test_sglang_spec_v2_defaults.py
       tests/test_sglang_spec_switch_v2.py tests/test_sglang_draft_lag.py tests/test_sglang_runner.py
       tests/test_sglang_spec_switch.py tests/test_sglang_launch.py tests/test_sglang_refusals.py
       tests/test_sglang_spec_v2_metrics.py tests/test_sglang_tiers.py"
SWEEP=tests/test_sglang_spec_switch_v2.py::test_switch_sweep_1_to_64_and_back_cpu
declare -A LEAVE_OUT=([0.5.14]="--deselect $SWEEP[1] --deselect $SWEEP[4]" [0.5.23]="")
LEAVE_OUT_ELSE="--deselect $SWEEP[1]"
AT_ONCE=3
RELEASES=$(awk '!/^#/ && NF {print $1}' "$REQS" | uniq)

source .ci/sglang-env.sh sglang-current

for release in $RELEASES; do  # the downloads side by side
    target="$RANGE/$release"
    if [ ! -d "$target/sglang" ]; then
        pins=$(awk -v r="$release" '$1 == r {print $2}' "$REQS")
        python -m pip install -qq --no-deps --no-compile --no-warn-conflicts --target "$target" $pins &
    fi
done
wait
echo "ci: runner-API releases installed in $((SECONDS - started)) s"

rc=0
ran=()
for release in $RELEASES; do
    target="$RANGE/$release"
    found=$(PYTHONPATH="$target" python -c "import importlib.metadata as m; print(m.version('sglang'))")
    [ "$found" = "$release" ] || { echo "runner API: $target holds SGLang $found, not $release"; rc=1; continue; }
    while [ "$(jobs -rp | wc -l)" -ge "$AT_ONCE" ]; do wait -n || true; done
    rm -f "$target.rc"  # none left from an earlier run: a job that died before writing it counts as failed
    # The status goes to a file: `wait -n` above may have reaped this job before the loop below looks at it.
    # shellcheck disable=SC2086
    ( status=0
      PYTHONPATH="$target" GRAPHPOOL_REQUIRE_SGLANG=1 OMP_NUM_THREADS=1 python -m pytest -q -ra --durations=15 \
        -p no:cacheprovider $TESTS ${LEAVE_OUT[$release]-$LEAVE_OUT_ELSE} > "$target.log" 2>&1 || status=$?
      echo "$status" > "$target.rc" ) &
    ran+=("$release")
done
wait
for release in "${ran[@]}"; do
    if [ "$(cat "$RANGE/$release.rc" 2>/dev/null)" = 0 ]; then status=passed; else status=FAILED; rc=1; fi
    echo "runner API: SGLang $release $status: $(tail -n 1 "$RANGE/$release.log")"
    [ "$status" = passed ] || cat "$RANGE/$release.log"
done
echo "ci: runner-API range took $((SECONDS - started)) s"
exit "$rc"

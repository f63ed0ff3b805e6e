#!/usr/bin/env bash
# CI, the live tier: real SGLang servers on CPU through graphpool's launcher and runner (tests/test_live_sglang.py), for
# every release of SGLang from 0.5.16 to 0.5.23 (LIVE below; 0.5.14 and 0.5.15 have no CPU EAGLE path). Each release
# takes about 2 to 4 minutes (0.5.23 and 0.5.17 two more: they also serve a real checkpoint, SmolLM2-135M-Instruct,
# which GRAPHPOOL_REQUIRE_SMOLLM2 makes required); what a release serves on CPU is in the test's header.
#
# One environment for all: .ci/run's first one when it is there (torch 2.13.0 CPU, setup.py's sglang-classes extra),
# else one made here the same way. Each release goes into a folder of its own (.sgl-live/<release>, pip --target,
# without dependencies): the release and what it pins differently (.ci/sglang-current-requirements.txt), and what its
# server needs on CPU (.ci/sglang-live-requirements.txt); that folder goes first on PYTHONPATH. The sgl_kernel CPU ops
# and torchvision are stand-ins in the test tree. The releases' tests run one after the other: side by side, on 2
# cores beside CI's other jobs, one server's HTTP side sometimes got a wave's requests to its scheduler so far apart
# that it never ran more than 4 at once, and the switch's or the tiers' checks failed (in 2 CI runs of 6, on 0.5.17).
# Alone, a server has a core for its scheduler and one for its HTTP side (CI runs the other jobs at nice 10).
# Usage: bash .ci/sglang-live.sh [RELEASE ...]   (from the repository root; exits non-zero if a release failed)
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
LIVE=${*:-"0.5.23 0.5.22 0.5.21 0.5.20 0.5.19 0.5.18 0.5.17 0.5.16"}
RANGE=.sgl-live

source .ci/sglang-env.sh sglang-live

pins() {  # <release>: its lines of both requirement files
    awk -v r="$1" '!/^#/ && NF && ($1 == r || $1 == "all") {print $2}' .ci/sglang-current-requirements.txt \
        .ci/sglang-live-requirements.txt
}
for release in $LIVE; do  # the downloads side by side
    target="$RANGE/$release"
    if [ ! -d "$target/sglang" ]; then
        # shellcheck disable=SC2046
        python -m pip install -qq --no-deps --no-compile --no-warn-conflicts --target "$target" $(pins "$release") &
    fi
done
wait
echo "ci: live-tier releases installed in $((SECONDS - started)) s"

rc=0
for release in $LIVE; do  # one release after the other (see the header)
    target="$RANGE/$release"
    found=$(PYTHONPATH="$target" python -c "import importlib.metadata as m; print(m.version('sglang'))")
    [ "$found" = "$release" ] || { echo "live tier: $target holds SGLang $found, not $release"; rc=1; continue; }
    t0=$SECONDS
    if PYTHONPATH="$target" OMP_NUM_THREADS=1 GRAPHPOOL_REQUIRE_SMOLLM2=1 python -m pytest -q -rs -s --durations=15 -p no:cacheprovider --live \
        -m live --basetemp "$RANGE/tmp-$release" tests/test_live_sglang.py > "$target.log" 2>&1; then
        status=passed
    else
        status=FAILED rc=1
    fi
    echo "live tier: SGLang $release $status in $((SECONDS - t0)) s: $(tail -n 1 "$target.log")"
    grep -E "^live |^SKIPPED" "$target.log" || true
    if [ "$status" != passed ]; then
        cat "$target.log"
        for log in "$RANGE/tmp-$release"/*/*.log; do  # each server's own log, its end
            [ -f "$log" ] && { echo "----- $log (last 40 lines)"; tail -n 40 "$log"; }
        done
    fi
done
echo "ci: live tier took $((SECONDS - started)) s"
exit "$rc"

#!/usr/bin/env bash
# CI, the classic API's range: graphpool's runner, install(), launcher and switch against the real classes of each
# classic SGLang release besides CI's main one (0.5.12.post1), 0.5.13.post1 included (classic runner class, new
# attention hooks, no EAGLE v1 worker: its switch tests skip, the switch's refusal is tested).
#
# Each release goes into a folder of its own (pip --target, without dependencies: the active environment,
# .ci/run's, has them), put first on PYTHONPATH so it shadows the environment's SGLang. Run from .ci/run
# with its venv active. Usage: bash .ci/sglang-classic-range.sh   (exits non-zero if any release failed)
set -euo pipefail
cd "$(dirname "$0")/.."
RANGE=.sgl-range
# The speculation switch's tests too: its plain step follows each classic release's EAGLE v1 worker.
# Not tests/test_sglang_launch_cli.py: its subprocesses drop PYTHONPATH (or hide SGLang), so they never see the
# release folder; they test CI's SGLang, 0.5.12.post1, which .ci/run's own pytest call runs them against.
TESTS="tests/test_sglang_runner.py tests/test_sglang_launch.py
       tests/test_sglang_scheduler_switch.py tests/test_sglang_spec_switch.py tests/test_sglang_draft_lag.py
       tests/test_sglang_refusals.py"
# The spawned scheduler process (7 s: a fresh interpreter importing SGLang) runs on the oldest release only (and on
# 0.5.12.post1 in .ci/run's pytest call): what it checks there, the runner and the switch installed, every release's
# in-process tests check (test_install_swaps_..., test_keep_sglang_runner_..., the switch's tests); the spawn,
# pickling and entry point around them are graphpool's own, the same on every release.
SPAWNED=tests/test_sglang_launch.py::test_scheduler_entry_installs_graphpool_inside_a_spawned_process
declare -A LEAVE_OUT=([0.5.10.post1]="--deselect $SPAWNED" [0.5.11]="--deselect $SPAWNED")
rc=0
for version in 0.5.9 0.5.10.post1 0.5.11 0.5.13.post1; do
    target="$RANGE/$version"
    [ -d "$target/sglang" ] || python -m pip install -qq --no-deps --no-compile --target "$target" "sglang==$version"
    found=$(PYTHONPATH="$target" python -c "import importlib.metadata as m; print(m.version('sglang'))")
    [ "$found" = "$version" ] || { echo "range: $target holds SGLang $found, not $version"; rc=1; continue; }
    echo "range: SGLang $version"
    # shellcheck disable=SC2086
    PYTHONPATH="$target" GRAPHPOOL_REQUIRE_SGLANG=1 python -m pytest -q --durations=15 -p no:cacheprovider $TESTS \
        ${LEAVE_OUT[$version]:-} || rc=1
done
exit "$rc"

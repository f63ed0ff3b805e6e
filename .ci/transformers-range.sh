#!/usr/bin/env bash
# CI, the transformers releases besides CI's main one (5.6.0, the oldest supported and SGLang 0.5.12.post1's pin,
# in .ci/run's venv): graphpool.integrations.transformers' CPU tests against each release's real classes.
#   newest (5.25.0): every tiny-model test, long versions included (22 families, generate()'s options, the
#                    statistical test of sampling and speculation, the loop, speculation tiers, the parts, the
#                    example, the compiled step, the benchmark's smoke run);
#   between (5.17.0): the 22 families, greedy in plain and prompt-lookup modes.
# The real checkpoint's tests run once, in the main venv (they are the heaviest).
#
# Each release goes into a folder of its own (pip --target, without dependencies, with those it needs beyond the
# active environment's: .ci/run's has the rest), put first on PYTHONPATH so it shadows the environment's
# transformers. transformers 5.25's `kernels` requirement stays out on purpose: run from the checkout, the
# repository's kernels/ folder would shadow it, and transformers imports it only where it is installed.
# Run from .ci/run with its venv active. Usage: bash .ci/transformers-range.sh [release ...] (default: 5.17.0
# 5.25.0; a release named here gets the newest's tests; exits non-zero if any release failed)
set -euo pipefail
cd "$(dirname "$0")/.."
RANGE=.tf-range
NEWEST=5.25.0
ALL="tests/test_transformers_families.py tests/test_transformers_options.py tests/test_transformers_sampling.py
     tests/test_transformers_loop.py tests/test_transformers_tiers.py tests/test_transformers_parts.py
     tests/test_transformers_example.py tests/test_transformers_compile.py
     tests/test_hf_decode_cli.py"
BETWEEN="tests/test_transformers_families.py"
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(5.17.0 "$NEWEST")
rc=0
for version in "${versions[@]}"; do
    target="$RANGE/$version"
    # 5.17 and later need tokenizers 0.23 (5.6.0, the environment's, pins 0.22); 5.25 needs huggingface_hub 2.x
    # (over httpx2 and httpcore2).
    extra=("tokenizers>=0.23.1,<0.24")
    case "$version" in
        5.[0-9].*|5.1[0-9].*|5.2[0-4].*) ;;
        *) extra+=("huggingface_hub>=2.4,<3" "httpx2>=2,<3" "httpcore2" "truststore") ;;
    esac
    [ -d "$target/transformers" ] || python -m pip install -qq --no-deps --no-compile --target "$target" \
        "transformers==$version" "${extra[@]}"
    found=$(PYTHONPATH="$target" python -c "import importlib.metadata as m; print(m.version('transformers'))")
    [ "$found" = "$version" ] || { echo "transformers range: $target holds $found, not $version"; rc=1; continue; }
    tests=$ALL
    [ "$version" = 5.17.0 ] && tests=$BETWEEN
    echo "transformers range: $version"
    PYTHONPATH="$target" python -m pytest -q --durations=15 -p no:cacheprovider --runslow $tests || rc=1
done
exit "$rc"

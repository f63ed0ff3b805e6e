#!/usr/bin/env bash
# CI, the transformers releases besides CI's main one (5.6.0, SGLang 0.5.12.post1's pin, in .ci/run's venv):
# graphpool.integrations.transformers' CPU tests against each release's real classes.
#
# Each release goes into a folder of its own (pip --target, without dependencies, with the tokenizers it needs:
# the active environment, .ci/run's, has the rest), put first on PYTHONPATH so it shadows the environment's
# transformers. Run from .ci/run with its venv active. About 15 s per release once the folders exist.
# Usage: bash .ci/transformers-range.sh [release ...]   (default: 5.17.0, the H200's, and 5.24.0, the newest
# supported; exits non-zero if any release failed)
set -euo pipefail
cd "$(dirname "$0")/.."
RANGE=.tf-range
TESTS="tests/test_transformers_loop.py tests/test_transformers_parts.py tests/test_transformers_example.py
       tests/test_hf_decode_cli.py"
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(5.17.0 5.24.0)
rc=0
for version in "${versions[@]}"; do
    target="$RANGE/$version"
    # transformers 5.17 and later need tokenizers 0.23 (5.6.0, the environment's, pins 0.22).
    [ -d "$target/transformers" ] || python -m pip install -qq --no-deps --no-compile --target "$target" \
        "transformers==$version" "tokenizers>=0.23.1,<0.24"
    found=$(PYTHONPATH="$target" python -c "import importlib.metadata as m; print(m.version('transformers'))")
    [ "$found" = "$version" ] || { echo "transformers range: $target holds $found, not $version"; rc=1; continue; }
    echo "transformers range: $version"
    PYTHONPATH="$target" python -m pytest -q -p no:cacheprovider $TESTS || rc=1
done
exit "$rc"

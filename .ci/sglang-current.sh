#!/usr/bin/env bash
# CI, second environment: graphpool's SGLang integration against current SGLang (0.5.23, the runner API of
# 0.5.14+), in its own venv beside the first one (which has SGLang 0.5.12.post1, the classic API).
#
# SGLang 0.5.23 pins torch 2.14.1, which has no CPU build here: SGLang is installed with --no-deps and its
# light Python dependencies without SGLang's pins, on the same CPU torch 2.13.0 as the first environment.
# The tests use SGLang's real Python classes (ModelRunner._forward_raw, DecodeCudaGraphRunner, ForwardBatch,
# EAGLEWorkerV2, ServerArgs and the runtime context) with stand-ins for the model, attention and KV pool
# (tests/sglang_harness.py); no CUDA kernel of SGLang runs. Classic-API tests skip here with their reason.
# Usage: bash .ci/sglang-current.sh   (from the repository root; exits with pytest's status)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-sglang-current

python3 -m venv "$VENV"
source "$VENV/bin/activate"
python -m pip install -qq --upgrade pip
python -m pip install -qq torch==2.13.0           # the pinned CPU build first, as in .ci/run
python -m pip install -qq triton==3.6.0 numpy pytest pytest-timeout
python -m pip install -qq --no-deps -e .
python -m pip install -qq --no-warn-conflicts --no-deps sglang==0.5.23
python -m pip install -qq --no-warn-conflicts -r .ci/sglang-current-requirements.txt  # SGLang's pins unmet on purpose
python -c "import sglang, torch; print('second environment: sglang', sglang.__version__, 'torch', torch.__version__)"

set +e
python -m pytest -q -ra tests/test_sglang_runner_api.py tests/test_sglang_runner_api_contract.py tests/test_sglang_spec_switch_v2.py \
    tests/test_sglang_draft_lag.py tests/test_sglang_runner.py tests/test_sglang_spec_switch.py tests/test_sglang_launch.py \
    tests/test_sglang_refusals.py
rc=$?
set -e
[ "$rc" -eq 5 ] && { echo "pytest collected no tests in the SGLang 0.5.23 environment"; exit 1; }
exit "$rc"

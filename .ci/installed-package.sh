#!/usr/bin/env bash
# CI: graphpool as a user installs it, not as the checkout runs it. A fresh venv, a non-editable
# `pip install ".[bench]"`, then, from a folder outside the checkout (so nothing of it is on the path):
# the installed subpackages import, and the installed benchmark (`graphpool-bench`, `python -m graphpool.bench`)
# runs its CPU smoke run and a user module's own step, and writes its outputs.
# Usage: bash .ci/installed-package.sh   (from the repository root; exits non-zero on the first failure)
set -euo pipefail
cd "$(dirname "$0")/.."
checkout=$PWD
VENV=$checkout/.venv-installed
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -qq --upgrade pip
"$VENV/bin/python" -m pip install -qq torch==2.13.0    # the CPU build, as in .ci/run
"$VENV/bin/python" -m pip install -qq ".[bench]"        # not editable: what `pip install graphpool` would give
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
export PATH="$VENV/bin:$PATH"
python - <<'PY'
import sys, graphpool, graphpool.kernels, graphpool.integrations, graphpool.integrations.sglang, graphpool.bench
where = graphpool.__file__
assert where.startswith(sys.prefix), f"graphpool imported from {where}, not from the venv's install ({sys.prefix})"
print("installed:", where)
PY
graphpool-bench --device cpu --iters 2 --warmup 0 --batch-sizes 1,2 --out smoke
cat > my_step.py <<'PY'
"""A user's own step: one matrix product over a per-token input."""
import torch
import graphpool as gp
from graphpool.bench import BenchStep


def make(device, max_tokens):
    weight = torch.randn(8, 8, device=device)
    return BenchStep(inputs=[gp.StepInput("x", torch.float32, "token", trailing=(8,))],
                     step_fn=lambda batch: {"y": batch.inputs["x"] @ weight},
                     sample=lambda mode, bs: {"x": torch.randn(bs * mode.tokens_per_seq, 8, device=device)},
                     outputs="token", check="y")
PY
python -m graphpool.bench --device cpu --iters 2 --warmup 0 --batch-sizes 1,2 --modes decode:1,verify:4 \
    --step my_step:make --out mine
for run in smoke mine; do
  for name in replay_latency.json replay_latency.csv replay_latency.png; do
    [ -s "$run/$name" ] || { echo "installed-package: $run/$name was not written"; exit 1; }
  done
done
python - <<'PY'
import json
rows = json.load(open("mine/replay_latency.json"))["rows"]
assert {(r["mode"], r["bs"]) for r in rows} == {(m, b) for m in ("decode", "verify") for b in (1, 2)}, rows
assert all(r["token_match"] == 1.0 for r in rows)
print("installed-package: graphpool-bench ran the smoke run and the user's step; outputs written")
PY

#!/usr/bin/env bash
# graphpool's first command (README.md): install what this Python lacks, then run the main job,
# bench/decode_loop.py, on its embedded default. Arguments after the script go to decode_loop.py
# (e.g. `bash quickstart.sh --quick`); `--setup-only` stops after the set-up (.ci/run uses it).
#
# Installs only what is missing, so it is safe to run again, and it downloads nothing on a machine that
# already has torch, Triton, pytest, NumPy, matplotlib and ninja (graphpool then runs from this checkout).
# Python: $PYTHON, else python3 (a virtual environment's, when one is active).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PY=${PYTHON:-python3}

# Versions. A CPU machine gets CI's: torch's CPU build and Triton (whose interpreter runs the staging
# kernel in the tests). A CUDA machine gets the torch that SGLang 0.5.12.post1 pins; its wheel brings
# Triton 3.6.0 (torch 2.13's CUDA wheel would bring Triton 3.7.1).
TORCH_CPU=torch==2.13.0
TRITON_CPU=triton==3.6.0
TORCH_CUDA=torch==2.11.0
# PyTorch's CPU wheel index, the one place this project names it: plain `pip install torch` picks a
# multi-GB CUDA build. Set TORCH_CPU_INDEX= (empty) to use pip's own index, where that already serves the
# CPU build (as on CI's machines).
TORCH_CPU_INDEX=${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}

setup_only=0
if [ "${1:-}" = "--setup-only" ]; then setup_only=1; shift; fi

has() { "$PY" -c "import $1" >/dev/null 2>&1; }
# One request to a package index (its torch page), 5 s at most: true when it answers.
index_reachable() {
  "$PY" - "$1" >/dev/null 2>&1 <<'PYCODE'
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5).close()
PYCODE
}
pip_install() {
  echo "quickstart: pip install $*"
  if ! "$PY" -c 'import sys, sysconfig, os
in_venv = sys.prefix != sys.base_prefix
managed = os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))
sys.exit(1 if managed and not in_venv else 0)'; then
    echo "quickstart: $PY belongs to the operating system, which refuses pip installs: make a virtual" \
         "environment first (python3 -m venv .venv && . .venv/bin/activate), then run this again" >&2
    exit 2
  fi
  "$PY" -m pip install -qq "$@"
}

"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || {
  echo "quickstart: graphpool needs Python >= 3.10; $PY is $("$PY" -V 2>&1)" >&2; exit 2; }

started=$SECONDS
if has torch; then
  echo "quickstart: torch $("$PY" -c 'import torch; print(torch.__version__)') is installed: keeping it"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "quickstart: NVIDIA GPU found: installing $TORCH_CUDA (CUDA build, a few GB)"
  pip_install "$TORCH_CUDA"
else
  # Ask the CPU index once, with a short timeout: where it cannot be reached, pip would retry every request
  # for minutes (dozens of warnings) before failing or falling back on its own sources without a word.
  if [ -n "$TORCH_CPU_INDEX" ] && ! index_reachable "$TORCH_CPU_INDEX"; then
    echo "quickstart: PyTorch's CPU index ($TORCH_CPU_INDEX) cannot be reached: falling back on pip's own" \
         "configured sources (where they serve only CUDA builds, this installs a CUDA build)"
    TORCH_CPU_INDEX=
  fi
  source_said="pip's own configured sources"
  echo "quickstart: no NVIDIA GPU: installing the CPU build of $TORCH_CPU from ${TORCH_CPU_INDEX:-$source_said}"
  pip_install ${TORCH_CPU_INDEX:+--index-url "$TORCH_CPU_INDEX"} "$TORCH_CPU"
fi
if ! has triton; then
  if "$PY" -c 'import torch, sys; sys.exit(torch.version.cuda is None)' 2>/dev/null; then
    echo "quickstart: this CUDA build of torch came without Triton: installing it"
    pip_install "triton"
  else
    pip_install "$TRITON_CPU"
  fi
fi
missing=$(for module in pytest pytest_timeout numpy matplotlib ninja; do has "$module" || echo "$module"; done | xargs)
if [ -n "$missing" ]; then
  echo "quickstart: missing $missing: installing graphpool (editable) with its dev extra"
  pip_install -e ".[dev]"
elif ! (cd / && "$PY" -c "import graphpool" >/dev/null 2>&1); then
  # Everything else is there (a prepared GPU box, maybe without network): link this checkout into the
  # environment without downloading anything. If even that fails, graphpool still runs from here.
  echo "quickstart: pytest, pytest-timeout, numpy, matplotlib and ninja are installed; installing graphpool itself" \
       "(editable, nothing downloaded)"
  if ! log=$("$PY" -m pip install -qq --no-deps --no-build-isolation -e . 2>&1); then
    reason=$(printf '%s\n' "$log" | grep -iE "error|invalid|denied|not found" | tail -n 2 | xargs)
    echo "quickstart: pip could not install graphpool: ${reason:-$(printf '%s\n' "$log" | tail -n 1)}"
    # Link the package folder itself into the environment (an editable install minus pip's metadata), so
    # `import graphpool` works from anywhere (examples/, your scripts); only graphpool/ becomes importable.
    site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    if [ ! -e "$site/graphpool" ] && ln -s "$PWD/graphpool" "$site/graphpool" 2>/dev/null; then
      echo "quickstart: linked this checkout's graphpool/ into $site instead: import graphpool works from anywhere"
    else
      echo "quickstart: graphpool runs from this checkout (tests, bench/); for examples/ and your own scripts set" \
           "PYTHONPATH=$PWD"
    fi
  fi
else
  echo "quickstart: graphpool and everything it needs are installed"
fi
echo "quickstart: set-up done in $((SECONDS - started)) s"
[ "$setup_only" = 1 ] && exit 0

exec "$PY" bench/decode_loop.py "$@"

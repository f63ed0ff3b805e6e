#!/bin/bash
# Live SGLang benchmark on the GPU machine: lays out SGLang (from the .sgl/ carry, see
# integrations/sglang/README.md) and graphpool, then runs bench/sglang_live.py (five servers, one table).
# From the repository root:   [DEADLINE_S=540] bash bench/sglang_live.sh [extra bench/sglang_live.py args]
# Writes $OUT/setup.log plus what sglang_live.py writes (server logs, sglang_live.json, summary.txt).
set -u
T0=$(date +%s); DEADLINE_S=${DEADLINE_S:-540}
OUT=${OUT:-out/sglang_live}; mkdir -p "$OUT"; S=$PWD/.sgl
RUN=${SGL_RUN_DIR:-$S/run}; SITE=$RUN/site; GP=$RUN/gp  # installed packages and graphpool's layout, beside the carry
[ -d "$S/whl" ] || { echo "no .sgl/whl here: build .sgl/ first (integrations/sglang/README.md, 'Run it live')"; exit 2; }
mkdir -p "$RUN"
{
if [ ! -f "$SITE/.done" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$S"/whl/*.whl || exit 1
  tar -xJf "$S/sglk-slim.tar.xz" -C "$SITE" && tar -xJf "$S/flashinfer-slim.tar.xz" -C "$SITE" && cp -r "$S/stubs/." "$SITE/"
  touch "$SITE/.done"
fi
# graphpool laid out as pyproject.toml maps it: kernels/ and integrations/ inside the graphpool package
rm -rf "$GP" && mkdir -p "$GP/graphpool" && cp -r graphpool/. "$GP/graphpool/" \
  && cp -r kernels "$GP/graphpool/kernels" && cp -r integrations "$GP/graphpool/integrations"
if ! ldconfig -p | grep -q 'libnuma.so.1 '; then
  dpkg -x "$S"/lib/libnuma1_*.deb "$RUN/numa"; export LD_LIBRARY_PATH=$RUN/numa/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
fi
# The slim sglang-kernel: its rmsnorm/sampling wrappers prefer flashinfer's JIT ops, whose CUDA sources the
# slim flashinfer lacks; make them take sglang-kernel's own precompiled ops (idempotent).
sed -i 's/^    import flashinfer\.\(norm\|sampling\) as _flashinfer_\(norm\|sampling\)$/    raise ImportError("slim: no flashinfer JIT")/' \
  "$SITE/sgl_kernel/elementwise.py" "$SITE/sgl_kernel/sampling.py"
} > "$OUT/setup.log" 2>&1 || { echo "setup failed:"; tail -20 "$OUT/setup.log"; exit 1; }
export PYTHONPATH=$SITE:$GP PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 GRAPHPOOL_NO_EXTENSION=1
export TVM_FFI_CACHE_DIR=${TVM_FFI_CACHE_DIR:-$RUN/tvmffi-cache}
python3 - >> "$OUT/setup.log" 2>&1 <<'PY'
import importlib.metadata as md, torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "gpu", torch.cuda.get_device_name(0))
print({p: md.version(p) for p in ("sglang", "sglang-kernel", "flashinfer-python", "transformers")})
import sgl_kernel, flashinfer, graphpool.integrations.sglang.launch  # noqa: F401
print("imports OK")
PY
echo "[$(( $(date +%s) - T0 ))s] setup: $(tail -1 "$OUT/setup.log")"
# Servers run from the laid-out copy, so only the installed names (graphpool, graphpool.*) are importable.
exec python3 bench/sglang_live.py --out "$OUT" --models "$S/models" --python python3 --server-cwd "$GP" \
  --deadline-s $(( DEADLINE_S - ($(date +%s) - T0) )) "$@"

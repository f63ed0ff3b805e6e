#!/bin/bash
# Live SGLang 0.5.17 (runner API) on the H200, one phase per call: lays out SGLang from the .sgl17/ carry
# (bench/sglang_live_v2_carry.sh) and graphpool, then runs bench/sglang_live_v2.py. From the repository root:
#   [DEADLINE_S=550] bash bench/sglang_live_v2.sh --phase correctness|flashinfer|throughput [more args]
# Installs into $SGL_RUN_DIR (default gp-live17 in the system's temporary folder: outside the checkout, so a warm
# machine keeps it, and the JIT caches beside it, from one call to the next). Writes $OUT/setup.log plus what
# sglang_live_v2.py writes.
set -u
T0=$(date +%s); DEADLINE_S=${DEADLINE_S:-550}
OUT=${OUT:-out/sglang_live_v2}; mkdir -p "$OUT"; S=$PWD/.sgl17
RUN=${SGL_RUN_DIR:-$(dirname "$(mktemp -u)")/gp-live17}; SITE=$RUN/site; GP=$RUN/gp
[ -d "$S/whl" ] || { echo "no .sgl17/whl here: build it first (bash bench/sglang_live_v2_carry.sh)"; exit 2; }
mkdir -p "$RUN"
{
if [ ! -f "$SITE/.done" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$S"/whl/*.whl || exit 1
  for t in sglang-slim sglk-slim flashinfer; do tar -xJf "$S/$t.tar.xz" -C "$SITE" || exit 1; done
  cp -r "$S/stubs/." "$SITE/" && touch "$SITE/.done"
fi
# graphpool laid out as setup.py maps it: kernels/ and integrations/ inside the graphpool package (fresh each call)
rm -rf "$GP" && mkdir -p "$GP/graphpool" && cp -r graphpool/. "$GP/graphpool/" \
  && cp -r kernels "$GP/graphpool/kernels" && cp -r integrations "$GP/graphpool/integrations"
# sglang-kernel's rmsnorm/sampling wrappers prefer FlashInfer's JIT ops; take its own precompiled ops (idempotent)
JIT='^    import flashinfer\.\(norm\|sampling\) as _flashinfer_\(norm\|sampling\)$'
sed -i "s/$JIT/    raise ImportError(\"no flashinfer JIT\")/" \
  "$SITE/sgl_kernel/elementwise.py" "$SITE/sgl_kernel/sampling.py"
} > "$OUT/setup.log" 2>&1 || { echo "setup failed:"; tail -20 "$OUT/setup.log"; exit 1; }
export PYTHONPATH=$SITE:$GP PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 GRAPHPOOL_NO_EXTENSION=1
export TVM_FFI_CACHE_DIR=${TVM_FFI_CACHE_DIR:-$RUN/tvmffi-cache}
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$RUN}
python3 - >> "$OUT/setup.log" 2>&1 <<'PY'
import importlib.metadata as md, torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "gpu",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
print({p: md.version(p) for p in ("sglang", "sglang-kernel", "flashinfer-python", "transformers", "tokenizers")})
import sgl_kernel, flashinfer, sglang.srt.server_args, graphpool.integrations.sglang.launch  # noqa: F401
# what EAGLE v2's draft-graph capture imports on CUDA (run BJ stopped there, 70 s into each server's start)
import sglang.srt.layers.attention.dsa_backend, sglang.srt.layers.attention.deepseek_v4_backend  # noqa: F401
from graphpool.integrations.sglang import versions
print("imports OK; graphpool sees SGLang's", versions.runner_api(), "API")
PY
echo "[$(( $(date +%s) - T0 ))s] setup: $(tail -1 "$OUT/setup.log")"
# Servers on all cores but the last 4 (the H200's 16: 0-11), this client on those 4: the same cores for every
# server of a phase. No pinning on a machine of fewer than 8 cores.
N=$(nproc); PIN=()
[ "$N" -ge 8 ] && PIN=(--cpus "0-$((N - 5))" --client-cpus "$((N - 4))-$((N - 1))")
exec python3 bench/sglang_live_v2.py --out "$OUT" --models "$S/models" --python python3 \
  --server-cwd "$GP" "${PIN[@]}" --deadline-s $(( DEADLINE_S - ($(date +%s) - T0) )) "$@"

#!/usr/bin/env bash
# The one GPU benchmark run (bench/gpu.py says what it measures). From the repo root, on the GPU machine:
#
#     bash bench/gpu.sh            # carry .whl/ (pydantic and its needs: the trainer section imports it)
#
# Installs the carried wheels (if any) into /tmp/site and primebuild itself into /tmp/site-primebuild, runs bench/gpu.py under a time limit, and leaves
# gpu_results.json, gpu_bench.log and gpu_nvidia_smi.txt in $OUT (the current folder when OUT is unset).
# Extra arguments go to bench/gpu.py (e.g. --sections gemm,trainer).
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir="${OUT:-$PWD}"
mkdir -p "$out_dir"
py="${PYTHON:-python3}"

if compgen -G ".whl/*.whl" >/dev/null; then
  if "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "warning: installing .whl/*.whl failed; the trainer section will fail without pydantic" >&2
  fi
fi

# primebuild itself, as pip installs it (no build isolation: no network)
if ! "$py" -c "import primebuild" 2>/dev/null; then
  "$py" -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/site-primebuild . \
    && export PYTHONPATH="/tmp/site-primebuild${PYTHONPATH:+:$PYTHONPATH}" \
    || echo "warning: installing primebuild failed; bench/gpu.py will not import it" >&2
fi

export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
  --format=csv >"$out_dir/gpu_nvidia_smi.txt" 2>&1 || true

# SIGINT first: bench/gpu.py then saves what it measured; the JSON is also rewritten after every section.
timeout --signal=INT --kill-after=20 "${GPU_BENCH_TIMEOUT_S:-300}" \
  "$py" bench/gpu.py --out "$out_dir/gpu_results.json" "$@" 2>&1 | tee "$out_dir/gpu_bench.log"
rc=${PIPESTATUS[0]}
echo "bench/gpu.py exit code $rc (124: time limit); results in $out_dir/gpu_results.json"
exit "$rc"

#!/usr/bin/env bash
# `make gpu-check`: pdpush's GPU path on a machine with one NVIDIA GPU, in a few minutes.
#
# That machine has python3 with torch (CUDA), transformers, numpy, msgpack, typer, xxhash, rich and
# prometheus-client, and no network: the rest comes from the wheels `make gpu-wheels` put in
# $GPU_WHEELS (carry that folder along). Writes $OUT/gpu-check.json (OUT defaults to bench-out).
# Extra arguments go to `python -m pdpush_tools.bench.gpu_check` (--device cpu --small: a dry run anywhere).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${GPU_WHEELS:-gpu-wheels}
SITE=${GPU_SITE:-/tmp/pdpush-gpu-site}
OUT=${OUT:-bench-out}
LIMIT_S=${GPU_CHECK_LIMIT_S:-480}

if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "gpu-check: no wheels in $WHEELS: run 'make gpu-wheels' where pip can download, and bring the folder" >&2
    exit 2
fi
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export UCX_WARN_UNUSED_ENV_VARS=n
mkdir -p "$OUT"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
rc=0
timeout --signal=TERM --kill-after=20 "$LIMIT_S" "$PYTHON" -m pdpush_tools.bench.gpu_check --json "$OUT/gpu-check.json" "$@" || rc=$?
if [ "$rc" = 124 ]; then
    echo "gpu-check: stopped after ${LIMIT_S}s" >&2
fi
test -f "$OUT/gpu-check.json" && cat "$OUT/gpu-check.json"
exit "$rc"

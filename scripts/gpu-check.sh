#!/usr/bin/env bash
# `make gpu-check`: the GPU suite and the GPU benchmark, on a CUDA machine, from a copy of
# the repository alone (no network, no install: the interpreter's torch with CUDA, numpy,
# msgpack, xxhash, prometheus-client, pytest and hypothesis are all lmtier's GPU path and
# its tests import). Writes $OUT/gpu-check.json and prints a table.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu-check: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine" >&2
    exit 2
fi
"$PY" -c "import numpy, msgpack, xxhash, prometheus_client, pytest, hypothesis" \
    || { echo "gpu-check: a module the GPU path needs is missing (above)" >&2; exit 2; }

status=0
LMTIER_GPU_CHECK=1 "$PY" -m pytest -q -p no:cacheprovider tests/gpu --junitxml="$OUT/gpu-tests.xml" || status=$?
"$PY" benchmarks/bench_gpu.py --json-out "$OUT/gpu-bench.json" --tests "$OUT/gpu-tests.xml" \
    --report "$OUT/gpu-check.json" --profile "$OUT" || status=$?
exit $status

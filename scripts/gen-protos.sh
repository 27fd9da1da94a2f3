#!/usr/bin/env bash
# Regenerate the Python code of the wire contract (protos/lmtier/v1/*.proto) into
# lmtier/v1/. The generated files are committed; tests/test_protos.py fails when they are
# stale against the .proto files. Needs grpcio-tools (in the dev environment).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-.}
"$PY" -m grpc_tools.protoc -I protos --python_out="$OUT" --pyi_out="$OUT" --grpc_python_out="$OUT" protos/lmtier/v1/*.proto

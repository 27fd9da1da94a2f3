#!/usr/bin/env bash
# Regenerate the Python code of the wire contract (protos/lmtier/v1/*.proto) into
# lmtier/v1/. The generated files are committed; tests/test_protos.py fails when they are
# stale against the .proto files.
#
# The compiler is pinned, in a small venv of its own (.venv-protoc, made once): the
# generated code sets the oldest protobuf and grpcio it runs on, and lmtier runs inside
# engines' environments, so it comes from the oldest grpcio-tools that compiles the
# contract and whose floors the engines allow. grpcio-tools 1.63.2 writes protobuf 5.26.1
# gencode (no runtime version check: it loads on protobuf 5.26.1 up to 7.x) and a service
# module that asks for grpcio >= 1.63.2 (vLLM's own floor, through OpenTelemetry's gRPC
# exporter, is 1.63.2; SGLang's 1.81.1). pyproject.toml's extras declare exactly these.
set -euo pipefail
cd "$(dirname "$0")/.."
GRPCIO_TOOLS=1.63.2
PYTHON=${PYTHON:-python3}
TOOLS=${TOOLS:-.venv-protoc}
OUT=${1:-.}

if ! "$TOOLS/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('grpcio-tools') != '$GRPCIO_TOOLS')" 2>/dev/null; then
    rm -rf "$TOOLS"
    "$PYTHON" -m venv "$TOOLS"
    "$TOOLS/bin/python" -m pip install --quiet --disable-pip-version-check "grpcio-tools==$GRPCIO_TOOLS" >&2
fi
"$TOOLS/bin/python" -m grpc_tools.protoc -I protos --python_out="$OUT" --pyi_out="$OUT" --grpc_python_out="$OUT" protos/lmtier/v1/*.proto

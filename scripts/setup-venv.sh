#!/usr/bin/env bash
# Create or reuse .venv with the pinned requirements, and install lmtier into it.
# Idempotent: a venv whose requirements and project metadata have not changed is reused
# as it is, so a second run costs a second.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.lmtier-stamp"
want=$(cat requirements/dev.txt pyproject.toml | sha256sum | cut -d' ' -f1)

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" && -x "$VENV/bin/python" ]]; then
    exit 0
fi

echo "setting up $VENV (requirements changed or venv missing)" >&2
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# torch first, pinned: it is the CPU wheel here, and nothing later may replace it.
"$VENV/bin/python" -m pip install --quiet "$(grep '^torch==' requirements/dev.txt)"
"$VENV/bin/python" -m pip install --quiet -r requirements/dev.txt
"$VENV/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e .
echo "$want" > "$STAMP"

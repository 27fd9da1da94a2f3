#!/usr/bin/env bash
# Create or reuse .venv-peer: the project's pinned environment (requirements/lock.txt, made
# by scripts/setup-venv.sh with VENV=.venv-peer) plus LMCache 0.5.6, for the optional peer
# benchmark (benchmarks/bench_peer.py). A separate venv: LMCache's own requirements
# (numpy<=2.2.6, protobuf<7, cupy-cuda13x, cuda-python, ...) must never touch .venv.
# LMCache goes in with --no-deps, then only the few modules it imports on a CPU machine
# (requirements/peer-lmcache.txt, also --no-deps): nothing here can replace the CPU torch.
# Idempotent: a stamp of its inputs; a second run costs a second.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-peer
STAMP="$VENV/.peer-stamp"
want=$(cat requirements/lock.txt requirements/peer-lmcache.txt pyproject.toml setup.py \
    scripts/setup-venv.sh scripts/setup-peer-venv.sh | sha256sum | cut -d' ' -f1)

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" && -x "$VENV/bin/python" ]]; then
    exit 0
fi

echo "setting up $VENV (first run, or its pinned requirements changed): a few minutes" >&2
# torch==2.13.0 first (CPU wheel), the lock with --no-deps, lmtier -e, the "vllm" alias.
VENV="$VENV" ./scripts/setup-venv.sh
pip=("$VENV/bin/python" -m pip --quiet --disable-pip-version-check)
"${pip[@]}" install --no-deps -r requirements/peer-lmcache.txt  # lmcache==0.5.6 and the few it imports
# Check the pieces the benchmark runs import (LMCache logs a lot: shown only on failure).
if ! log=$("$VENV/bin/python" - 2>&1 <<'PY'

import importlib.metadata as md

assert md.version("torch").startswith("2.13.0"), md.version("torch")
assert md.version("lmcache") == "0.5.6", md.version("lmcache")
import lmcache.integration.vllm.lmcache_mp_connector  # noqa: F401  the vLLM side
import lmcache.v1.distributed.l2_adapters.fs_l2_adapter  # noqa: F401  its disk backend
import lmcache.v1.multiprocess.http_server  # noqa: F401  the server process
import lmtier  # noqa: F401
import vllm  # noqa: F401
PY
); then
    echo "$log" | tail -20 >&2
    echo "$VENV: LMCache's server or vLLM connector does not import (above)" >&2
    exit 1
fi
echo "$want" > "$STAMP"

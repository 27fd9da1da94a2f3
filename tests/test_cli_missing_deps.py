"""The command line on a machine without an optional dependency (an installed wheel without
torch, vLLM or grpcio): a command that needs one fails with one line naming it and the
install command; the others run. Each case is a real ``python -m lmtier`` whose imports of
the hidden modules fail, as they do where those are not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmtier.tiers.base import open_tier

from conftest import make_prompt

# A sitecustomize that Python runs at start: the modules named in LMTIER_TEST_HIDE (and
# their submodules) raise ModuleNotFoundError on import, as where they are not installed.
HIDER = """
import os
import sys

HIDDEN = set(os.environ.get("LMTIER_TEST_HIDE", "").split(","))


class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Hide())
"""


@pytest.fixture
def without(tmp_path):
    """``without("torch", "vllm")(*argv)``: ``python -m lmtier ARGV`` (or ``-c CODE`` for
    ``argv[0] == "-c"``) in ``tmp_path/work`` with those modules unimportable."""
    hider = tmp_path / "hider"
    hider.mkdir()
    (hider / "sitecustomize.py").write_text(HIDER)
    work = tmp_path / "work"
    work.mkdir()

    def make(*hidden: str):
        def run(*argv: str) -> subprocess.CompletedProcess:
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join([str(hider), *filter(None, [os.environ.get("PYTHONPATH")])]),
                "LMTIER_TEST_HIDE": ",".join(hidden),
                "LMTIER_CONFIG": "",
            }
            cmd = [sys.executable, *argv] if argv[0] == "-c" else [sys.executable, "-m", "lmtier", *argv]
            return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=work)

        return run

    return make


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_the_hider_hides(without):
    """The premise of every case below: the hidden module cannot be imported at all."""
    proc = without("torch")("-c", "import torch")
    assert proc.returncode != 0 and "No module named 'torch'" in proc.stderr


def test_lmtier_demo_without_torch_says_what_to_install_in_one_line(without, tmp_path):
    run = without("torch")
    assert one_line_error(run("demo")) == (
        "lmtier demo: error: 'torch' is not installed; install it with: pip install 'lmtier[vllm]' (without a GPU: "
        "python3 scripts/vllm_cpu_env.py VENV in lmtier's checkout makes a vLLM CPU environment; docs/install.md)"
    )
    assert not any((tmp_path / "work").iterdir())  # refused before it made anything (./lmtier-demo)
    assert one_line_error(run("demo", "--store-only")) == (
        "lmtier demo: error: 'torch' is not installed; install it with: pip install 'lmtier[torch]'"
    )


def test_lmtier_demo_without_vllm_says_what_to_install_in_one_line(without):
    assert one_line_error(without("vllm")("demo")) == (
        "lmtier demo: error: 'vllm' is not installed; install it with: pip install 'lmtier[vllm]' (without a GPU: "
        "python3 scripts/vllm_cpu_env.py VENV in lmtier's checkout makes a vLLM CPU environment; docs/install.md)"
    )


def test_server_commands_without_grpcio_say_what_to_install_in_one_line(without, tmp_path):
    run = without("grpc")
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(list(range(64))))
    assert one_line_error(run("serve", "--port", "0")) == (
        "lmtier serve: error: 'grpc' is not installed; install it with: pip install 'lmtier[server]'"
    )
    for argv in (
        ["stats", "--server", "grpc://127.0.0.1:1"],
        ["match", "--server", "grpc://127.0.0.1:1", "--model", "llama-3-8b", "--tokens-file", str(tokens)],
    ):
        assert one_line_error(run(*argv)) == (
            f"lmtier {argv[0]}: error: 'grpc' is not installed; install it with: pip install 'lmtier[grpc]'"
        )


def test_commands_that_need_neither_torch_nor_vllm_run_without_them(without, tmp_path):
    root = tmp_path / "disk"
    tier = open_tier(f"file://{root}?size=64MiB")
    tier.put(make_prompt(3, seed=5).chunks())
    tier.close()
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(list(range(600))))
    run = without("torch", "vllm")
    for argv in (
        ["size", "--model", "llama-3-8b", "--tokens", "8k"],
        ["keys", "--model", "llama-3-8b", "--tokens-file", str(tokens)],
        ["stats", "--disk", str(root)],
        ["inspect", str(root), "--verify", "--quiet"],
    ):
        proc = run(*argv)
        assert proc.returncode == 0, (argv, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert "3 chunks, 0 corrupt" in run("inspect", str(root), "--verify", "--quiet").stdout
    assert Path(root).is_dir()


def test_a_missing_module_no_check_foresaw_is_still_one_line(without, tmp_path):
    """A module a dependency imports (here the standard library's sqlite3, which a Python
    built without it lacks): no extra brings it, but it is named in one line all the same."""
    (tmp_path / "disk" / "segments").mkdir(parents=True)
    assert one_line_error(without("sqlite3")("inspect", str(tmp_path / "disk"))) == (
        "lmtier inspect: error: 'sqlite3', which this command needs, is not installed"
    )

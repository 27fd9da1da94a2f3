"""The tests' engines forked from one process that imported vLLM (lmtier/testing/enginefork.py):
the same answers as a fresh process's, bit for bit; a failure and a timeout are reported as
a fresh process's are; an engine whose caller went away is killed; the server survives a
bad request; a caller whose environment the server's imports did not see starts fresh."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from lmtier.testing import enginefork
from lmtier.testing.engine import run_engine
from lmtier.testing.tinymodel import build

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(build(tmp_path_factory.mktemp("forks"), layers=2))


def prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(5, 500, n)] for n in (300, 90)]


def test_a_forked_engine_answers_as_a_fresh_process_bit_for_bit(model, tmp_path, monkeypatch):
    monkeypatch.setenv(enginefork.FLAG, "1")

    def spec(name: str) -> dict:  # a disk of its own each
        return {
            "model": model,
            "lmtier": {"tiers": [f"file://{tmp_path / name}?size=64MiB"], "chunk_tokens": 64},
            "phases": [
                {"name": "first", "prompts": prompts(1)},
                {"flush": True},
                {"name": "again", "prompts": prompts(1)},
            ],
        }

    assert enginefork.wanted(None) and not enginefork.wanted(dict(os.environ))
    forked = run_engine(spec("forked"), tmp_path, "forked", timeout=600)
    assert list((tmp_path / "forked").iterdir())  # its connector saved to its disk, as a fresh one's does
    fresh = run_engine(spec("fresh"), tmp_path, "fresh", timeout=600, env=dict(os.environ))  # an environment: fresh
    for phase in ("first", "again"):
        for a, b in zip(forked["results"][phase], fresh["results"][phase], strict=True):
            assert (a["tokens"], a["logprobs"], a["cached"]) == (b["tokens"], b["logprobs"], b["cached"])
    # the second pass found what the first saved: both loaded from lmtier
    assert [o["cached"] for o in forked["results"]["again"]] == [256, 64]
    assert all("lmtier: " in run["log"] and "engine identity" in run["log"] for run in (forked, fresh))
    assert forked["connector"] == fresh["connector"]  # the same lmtier


def children(pid: int) -> list[str]:
    return subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()


def gone(pid: int) -> bool:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
            return True
        time.sleep(0.1)
    return False


def test_failures_timeouts_and_callers_that_vanish_cost_the_engine_never_the_server(model, tmp_path, monkeypatch):
    monkeypatch.setenv(enginefork.FLAG, "1")
    with pytest.raises(RuntimeError, match="engine gone failed") as failed:
        run_engine({"model": str(tmp_path / "no-model"), "phases": []}, tmp_path, "gone", timeout=600)
    assert "no-model" in str(failed.value)  # the end of its stderr, as a fresh process's
    server = enginefork._Server._current
    assert server is not None and server.proc.poll() is None

    waits = {"model": model, "phases": [{"wait": str(tmp_path / "never")}]}
    with pytest.raises(subprocess.TimeoutExpired):
        run_engine(waits, tmp_path, "slow", timeout=5)
    assert children(server.proc.pid) == []  # killed and reaped before the error came back

    # A caller that goes away without a word (a test's own timeout, an interrupt): its
    # engine goes with its connection. A request that is not JSON costs only itself.
    (tmp_path / "waits.json").write_text(json.dumps(waits))
    with socket.socket(socket.AF_UNIX) as junk:
        junk.connect(server.path)
        junk.sendall(b"not json\n")
        assert junk.recv(100) == b""
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(server.path)
    request = {"argv": [str(tmp_path / "waits.json"), str(tmp_path / "w.out")], "log": str(tmp_path / "w.log"),
               "cwd": os.getcwd(), "env": dict(os.environ)}  # fmt: skip
    conn.sendall(json.dumps(request).encode() + b"\n")
    pid = json.loads(conn.makefile().readline())["pid"]
    assert str(pid) in children(server.proc.pid)
    conn.close()
    assert gone(pid)
    assert enginefork._Server._current is server and server.proc.poll() is None

    # An environment variable read at import that differs from the server's: a fresh process.
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert enginefork.run(["a", "b"], tmp_path / "x.log", 5) is None

"""The tests' engines forked from one process that imported vLLM (lmtier/testing/enginefork.py):
the same engine as a fresh process, bit for bit; a failure and a timeout are reported as
a fresh process's are, and nothing is left running."""

from __future__ import annotations

import os
import subprocess
import time

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


def test_a_failing_engine_reports_its_log_and_a_slow_one_is_killed(model, tmp_path, monkeypatch):
    monkeypatch.setenv(enginefork.FLAG, "1")
    with pytest.raises(RuntimeError, match="engine gone failed") as failed:
        run_engine({"model": str(tmp_path / "no-model"), "phases": []}, tmp_path, "gone", timeout=600)
    assert "no-model" in str(failed.value)  # the end of its stderr, as a fresh process's

    never = tmp_path / "never"
    spec = {"model": model, "phases": [{"wait": str(never)}]}
    with pytest.raises(subprocess.TimeoutExpired):
        run_engine(spec, tmp_path, "slow", timeout=5)
    server = enginefork._Server.get()
    forks = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
    deadline = time.monotonic() + 30
    while forks and time.monotonic() < deadline:  # the killed engine, reaped by the server
        time.sleep(0.1)
        forks = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
    assert forks == []

"""``--help`` of every command line lmtier ships: it prints a usage, exits 0 and does
nothing else (``lmtier bench`` outside a checkout; the tiny-model builder, whose
``--help`` once built a model in a directory of that name)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from lmtier.cli import build_parser, main


def subcommands() -> list[str]:
    """Every subcommand the parser knows: one added later is checked too."""
    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(action.choices)


def test_the_parser_knows_the_commands_the_readme_lists():
    assert {"serve", "stats", "inspect", "size", "keys", "match", "bench", "demo"} <= set(subcommands())


@pytest.mark.parametrize("command", subcommands())
def test_every_subcommand_prints_its_help(command, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "lmtier", command, "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: "), proc.stdout
    assert not any(tmp_path.iterdir())  # help runs nothing


def test_lmtier_bench_help_outside_a_checkout(tmp_path, monkeypatch, capsys):
    """An installed wheel has no benchmark runner to forward ``--help`` to: its own help,
    saying where the runner is, instead of an error."""
    import lmtier.cli.demo

    monkeypatch.setattr(lmtier.cli.demo, "_BENCH_RUNNERS", (tmp_path / "benchmarks" / "run.py",))
    for flag in ("--help", "-h"):
        assert main(["bench", flag]) == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: lmtier bench") and "benchmarks/run.py" in out
    assert main(["bench", "--short"]) == 2  # anything else still says where the runner lives
    assert "source checkout" in capsys.readouterr().err


def test_tinymodel_help_prints_usage_and_builds_nothing(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "lmtier.testing.tinymodel", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: ") and "DIR" in proc.stdout and "--layers" in proc.stdout
    assert not any(tmp_path.iterdir())  # no directory named --help


def test_tinymodel_builds_in_its_directory_with_the_options_given(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "lmtier.testing.tinymodel", "model", "--layers", "2", "--kv-heads", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (2, 1)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    bad = subprocess.run(
        [sys.executable, "-m", "lmtier.testing.tinymodel", "other", "--layers", "two"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert bad.returncode == 2 and "invalid int value" in bad.stderr
    assert not (tmp_path / "other").exists()

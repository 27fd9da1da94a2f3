"""Operations: ``lmtier serve`` from a config file and the environment, its effective
settings and ``/metrics`` read back, and every other CLI command, good and bad arguments."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from lmtier import metrics
from lmtier.cli import main
from lmtier.testing.cache_server import ServerProcess
from lmtier.testing.redis_server import free_port
from lmtier.tiers.base import open_tier

from conftest import disk_frames, flip_byte, make_namespace, make_prompt

ROOT = Path(__file__).resolve().parent.parent


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def sample(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


@pytest.fixture(scope="module")
def configured_server(tmp_path_factory):
    """``lmtier serve --config FILE`` with LMTIER_SERVER_* overrides, a metrics port and a
    token from a token file named in the config."""
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "tokens").write_text("s3cret=alice\n")
    config = tmp / "lmtier.yaml"
    config.write_text(
        "server:\n"
        "  tiers: ['cpu://?size=32MiB&slot=64KiB', 'file://" + str(tmp / "disk") + "?size=64MiB']\n"
        "  workers: 3\n"
        "  max_keys: 100\n"
        "  max_chunk_bytes: 8MiB\n"
        f"  token_file: {tmp / 'tokens'}\n"
    )
    metrics_port = free_port()
    server = ServerProcess(
        tmp,
        "--config",
        str(config),
        env={"LMTIER_SERVER_MAX_KEYS": "77", "LMTIER_SERVER_METRICS_PORT": str(metrics_port)},
    )
    server.metrics_port = metrics_port
    yield server
    server.stop()


def test_serve_runs_from_a_config_file_with_environment_overrides(configured_server, capsys):
    url = f"grpc://{configured_server.address}"
    assert main(["stats", "--server", url, "--token", "s3cret", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    config = out["config"]
    assert config["workers"] == 3  # from the file
    assert config["max_keys"] == 77  # the environment wins over the file
    assert config["max_chunk_bytes"] == 8 << 20
    assert config["port"] == int(configured_server.address.rsplit(":", 1)[1])  # the flag wins
    assert config["tokens"] == ["alice"]  # tenants only, never the secrets
    assert "s3cret" not in json.dumps(out)
    assert [t["name"] for t in out["tiers"]] == ["cpu", "disk"]
    assert out["tiers"][0]["capacity_bytes"] == 32 << 20

    assert main(["stats", "--server", url, "--token", "s3cret"]) == 0
    text = capsys.readouterr().out
    assert "hit ratio" in text and "cpu" in text and "disk" in text
    # a wrong token: one line, non-zero (after the warning that --token is readable by all)
    assert main(["stats", "--server", url, "--token", "wrong"]) == 2
    warning, error = capsys.readouterr().err.splitlines()
    assert "/proc/PID/cmdline" in warning and "LMTIER_TOKEN" in warning
    assert "UNAUTHENTICATED" in error


def test_metrics_count_hits_misses_and_bytes_after_a_workload(configured_server):
    tier = open_tier(f"grpc://{configured_server.address}?token=s3cret&shm=off")
    ns = make_namespace()
    prompt = make_prompt(6, seed=41, namespace=ns)
    before = scrape(configured_server.metrics_port)
    try:
        tier.put(prompt.chunks())
        got = tier.get(prompt.keys)
        assert all(c is not None for c in got)
        for c in got:
            c.release()
        other = make_prompt(3, seed=42, namespace=ns)
        assert tier.get(other.keys) == [None] * 3
    finally:
        tier.close()
    after = scrape(configured_server.metrics_port)
    for name, labels in [
        ("lmtier_tier_ops_total", {"tier": "cpu", "op": "get", "result": "hit"}),
        ("lmtier_tier_ops_total", {"op": "get", "result": "miss"}),
        ("lmtier_tier_bytes_total", {"tier": "cpu", "op": "get"}),
        ("lmtier_tier_bytes_total", {"tier": "cpu", "op": "put"}),
        ("lmtier_tier_op_seconds_count", {"tier": "cpu", "op": "get"}),
        ("lmtier_server_bytes_total", {"direction": "put"}),
        ("lmtier_server_rpcs_total", {"method": "DataGet", "code": "OK"}),  # the bulk data channel's loads
        ("lmtier_server_bytes_total", {"direction": "get", "transport": "data"}),
    ]:
        assert sample(after, name, **labels) > sample(before, name, **labels), (name, labels)
    assert sample(after, "lmtier_tier_capacity_bytes", tier="cpu") == 32 << 20
    assert sample(after, "lmtier_tier_breaker_open", tier="disk") == 0


def test_the_in_engine_exporter_serves_lmtier_metrics():
    port = free_port()
    assert metrics.export(port, host="127.0.0.1")
    assert metrics.export(port, host="127.0.0.1")  # idempotent
    metrics.ENGINE_TOKENS.labels("test", "requested").inc(16)
    text = scrape(port)
    assert sample(text, "lmtier_engine_tokens_total", engine="test", result="requested") >= 16
    # a port already taken is a warning, not a failure
    assert metrics.export(port, host="127.0.0.1") is True
    busy = free_port()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", busy))
        s.listen()
        assert metrics.export(busy, host="127.0.0.1") is False


# ------------------------------------------------------------------------------------------
# Disk tiers: stats and inspect
# ------------------------------------------------------------------------------------------
@pytest.fixture
def disk(tmp_path):
    root = tmp_path / "disk"
    tier = open_tier(f"file://{root}?size=64MiB")
    prompt = make_prompt(5, seed=43)
    tier.put(prompt.chunks())
    tier.close()
    return root, prompt


def test_stats_reads_a_disk_tier(disk, capsys):
    root, prompt = disk
    assert main(["stats", "--disk", str(root), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chunks"] == 5 and out["used_bytes"] > 5 * len(prompt.chunk_bytes(0))
    assert main(["stats", "--disk", str(root)]) == 0
    assert "5 chunks" in capsys.readouterr().out


def test_inspect_lists_verifies_and_deletes_corrupt_chunks(disk, capsys):
    root, prompt = disk
    assert main(["inspect", str(root), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["chunks"] == 5 and listed["corrupt"] == 0
    assert {c["key"] for c in listed["chunks_list"]} == {k.hex() for k in prompt.keys}
    assert all(c["tokens"] == 16 for c in listed["chunks_list"])

    assert main(["inspect", str(root), "--verify", "--quiet"]) == 0
    assert "5 chunks, 0 corrupt" in capsys.readouterr().out

    path, offset, length = disk_frames(root)[prompt.keys[2]]
    flip_byte(path, offset + length - 10, 0xFF)
    assert main(["inspect", str(root), "--verify", "--quiet", "--json"]) == 1  # found, kept
    report = json.loads(capsys.readouterr().out)
    assert report["corrupt"] == 1
    assert [c["key"] for c in report["chunks_list"] if not c["ok"]] == [prompt.keys[2].hex()]

    assert main(["inspect", str(root), "--verify", "--quiet", "--delete-corrupt"]) == 0
    assert "1 deleted" in capsys.readouterr().out
    assert prompt.keys[2] not in disk_frames(root)
    tier = open_tier(f"file://{root}?size=64MiB")
    assert tier.contains(prompt.keys) == 2  # the index agrees: the third chunk is gone
    tier.close()


# ------------------------------------------------------------------------------------------
# bench, and bad arguments everywhere
# ------------------------------------------------------------------------------------------
def bench(argv: list[str]) -> int:
    """``python benchmarks/run.py ARGV``, in this process (the runner is not in the wheel)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import run as runner
    finally:
        sys.path.pop(0)
    return runner.main(argv)


def test_bench_runs_a_benchmark_and_writes_its_report(tmp_path, capsys):
    assert bench(["--short", "--only", "cpu", "--out", str(tmp_path), "--quiet", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert set(results["benchmarks"]) == {"cpu"}
    assert json.loads((tmp_path / "results.json").read_text()) == results
    (target,) = results["targets"]
    assert target["reference"] == "np.copyto" and target["ratio"] > 0
    assert "| cpu |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "throughput.png").stat().st_size > 1000


def test_bench_without_the_engine_or_matplotlib_runs_what_it_can_and_says_what_it_skipped(
    tmp_path, capsys, monkeypatch
):
    """A venv with the dev extra only: no vLLM, no matplotlib. Each missing part is one
    line naming what to install; what can run, runs."""
    import importlib.util
    import sys

    hidden = {"vllm", "matplotlib"}
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in hidden else find_spec(name, *a))
    for name in [m for m in sys.modules if m.split(".")[0] in hidden]:
        monkeypatch.delitem(sys.modules, name)
    for name in hidden:
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    assert bench(["--short", "--only", "cpu", "--only", "vllm", "--out", str(tmp_path), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "| cpu |" in out
    assert "skipped: vllm: needs vllm, matplotlib (install the vllm extra and matplotlib)" in out
    assert "skipped: plots: need matplotlib" in out
    assert bench(["--short", "--only", "vllm", "--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no benchmark can run here: vllm: needs vllm" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["bogus"],
        ["serve", "--port", "many"],
        ["serve", "--config", "/nonexistent/lmtier.yaml", "--port", "0"],
        ["stats"],
        ["stats", "--server", "http://x:1"],
        ["stats", "--server", "grpc://127.0.0.1:1", "--timeout", "0.5"],
        ["stats", "--disk", "/nonexistent"],
        ["inspect", "/nonexistent"],
        ["inspect"],
        ["size", "--model", "llama-3-8b"],
        ["keys", "--model", "llama-3-8b", "--tokens-file", "/nonexistent"],
        ["demo", "--docs", "many"],
    ],
)
def test_bad_arguments_give_one_line_and_a_non_zero_exit(argv):
    proc = subprocess.run(
        [sys.executable, "-m", "lmtier", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "LMTIER_CONFIG": ""},
        cwd=ROOT,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("lmtier") and "error" in lines[0]


def test_lmtier_bench_is_deprecated_and_forwards_to_the_runner(tmp_path):
    """``lmtier bench`` of earlier releases: one line saying where the runner is now, then
    the runner itself, with the same arguments."""
    proc = subprocess.run(
        [sys.executable, "-m", "lmtier", "bench", "--short", "--only", "nosuch", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    deprecated, error = proc.stderr.strip().splitlines()
    assert "deprecated" in deprecated and "benchmarks/run.py" in deprecated
    known = "cpu, disk, redis, grpc, s3, netns, server_load, trace, cluster_ops, vllm_tiers, vllm_pd, vllm"
    assert error == f"benchmarks: error: unknown benchmark(s) nosuch; known: {known}"


def test_lmtier_bench_outside_a_checkout_says_where_the_runner_lives(tmp_path, monkeypatch, capsys):
    import lmtier.cli.demo

    monkeypatch.setattr(lmtier.cli.demo, "_BENCH_RUNNERS", (tmp_path / "benchmarks" / "run.py",))  # an installed wheel
    assert main(["bench", "--short"]) == 2
    assert "source checkout" in capsys.readouterr().err


def test_paper_cuts_of_a_first_session(tmp_path):
    """`lmtier keys --config` names the model as an engine started on that directory does;
    `lmtier ... | head` ends quietly; one context is "1 full context"."""
    import subprocess
    import sys

    from lmtier.testing.tinymodel import build

    model = build(tmp_path / "tiny")
    run = subprocess.run(
        [sys.executable, "-m", "lmtier", "keys", "--config", str(model / "config.json"), "--tokens-file", "-",
         "--block-size", "64", "--json"],
        input=json.dumps(list(range(300))), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["namespace"]["model"] == str(model)
    assert "an engine started with that model path uses it" in run.stderr
    many = tmp_path / "tokens.json"
    many.write_text(json.dumps(list(range(500_000))))  # ~2,000 lines of keys: more than a pipe holds
    piped = subprocess.run(
        f"{sys.executable} -m lmtier keys --model llama-3-8b --tokens-file {many} | head -n 1",
        shell=True, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert piped.returncode == 0 and piped.stdout.strip() and "Error" not in piped.stderr, piped.stderr
    one = subprocess.run(
        [sys.executable, "-m", "lmtier", "size", "--model", "llama-3-8b", "--tokens", "8k", "--cpu", "1.1GiB"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "= 1 full context of" in one.stdout, one.stdout


def test_lmtier_stats_counts_callers_reads_and_distinct_chunks_exactly(tmp_path, capsys):
    """A scripted workload against a server with memory and disk: 4 chunks stored (in
    both tiers), 4 read back, 2 asked for that are not there. Its readiness probes, the
    write-through's reads and the second copy on disk are not the caller's."""
    server = ServerProcess(
        tmp_path, "--tier", "cpu://?size=16MiB&slot=64KiB", "--tier", f"file://{tmp_path / 'disk'}?size=64MiB"
    )
    client = open_tier(f"grpc://{server.address}?shm=off")
    try:
        stored, absent = make_prompt(4, seed=3), make_prompt(2, seed=4)
        client.put(stored.chunks())
        assert client.contains(stored.keys) == 4
        got = client.get(stored.keys)
        assert len(got) == 4
        for c in got:
            c.release()
        assert client.get(absent.keys) == [None, None]
        assert main(["stats", "--server", f"grpc://{server.address}", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        memory, disk = out["tiers"]
        assert (memory["counters"]["hits"], memory["counters"]["misses"]) == (4, 2)
        assert (disk["counters"]["hits"], disk["counters"]["misses"]) == (0, 2)
        assert out["chunks"] == 4 and out["hit_ratio"] == pytest.approx(4 / 6)
    finally:
        client.close()
        server.stop()


def test_lmtier_stats_passes_a_token_with_url_characters_as_it_is(tmp_path, capsys):
    token = "a+b/c&d"  # '+' would read as a space, '&' would start another option
    server = ServerProcess(tmp_path, "--tier", "cpu://?size=16MiB&slot=64KiB", "--token", f"{token}=team")
    try:
        assert main(["stats", "--server", f"grpc://{server.address}", "--token", token, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["config"]["tokens"] == ["team"]
    finally:
        server.stop()

"""The README's main job and the benchmark run end to end (small sizes; no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lmtier.testing.netns import unavailable

ROOT = Path(__file__).resolve().parents[1]
# Every benchmark of benchmarks/run.py; the cross-host one where this machine makes network
# namespaces (the suite lists it as skipped, with the reason, where it cannot).
ALL = (
    "cpu",
    "disk",
    "redis",
    "s3",
    "grpc",
    "netns",
    "server_load",
    "trace",
    "cluster_ops",
    "vllm_tiers",
    "vllm_pd",
    "vllm",
)
NETNS = unavailable()
HERE = tuple(b for b in ALL if b != "netns" or NETNS is None)


def test_demo_runs_and_checks_its_own_results():
    run = subprocess.run(
        [sys.executable, "-m", "lmtier", "demo", "--store-only"], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "[A] stored 4352 of 4396 tokens" in run.stdout
    assert "byte-identical to A's KV: True" in run.stdout
    assert "[B] found 4096 of 4396 tokens cached" in run.stdout
    assert "get returns 512 tokens" in run.stdout
    assert "another model, same prompt: 0 tokens found" in run.stdout
    assert "demo passed" in run.stdout


def test_console_script_is_installed():
    lmtier = Path(sys.executable).parent / "lmtier"
    run = subprocess.run(
        [str(lmtier), "size", "--model", "llama-3-8b", "--tokens", "8Ki", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["total_bytes"] == 1024**3


def suite_test(test):
    """A test of the benchmark run. The first one pays for the whole run (minutes on a slow
    2-core machine, more than pytest's default 300 s): the tests that use it get the run's
    own bound. The run starts vLLM engines (its vLLM benchmarks): ``make check`` leaves it out."""
    return pytest.mark.engine(pytest.mark.timeout(1600)(test))


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """``lmtier bench --short``, as CI runs it: every benchmark, the table and the plots."""
    out = tmp_path_factory.mktemp("bench")
    run = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--short", "--quiet", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text()), run.stdout


def report_of(suite, name: str) -> tuple[dict, str]:
    out, summary, _ = suite
    return summary["benchmarks"][name], (out / f"{name}.txt").read_text()


@suite_test
def test_the_suite_writes_json_a_table_of_every_target_and_plots(suite):
    out, summary, stdout = suite
    assert summary["mode"] == "short" and set(summary["benchmarks"]) == set(HERE)
    if NETNS is not None:
        assert "netns" in summary["skipped"] and NETNS in summary["skipped"]["netns"]
    benches = [t["benchmark"] for t in summary["targets"]]
    counts = {"cpu": 1, "disk": 2, "redis": 6, "s3": 2, "grpc": 4, "netns": 4, "server_load": 2, "trace": 9, "vllm": 6,
              "vllm_tiers": 3, "vllm_pd": 2, "cluster_ops": 2}  # fmt: skip
    counts = {b: n for b, n in counts.items() if b in HERE}
    assert {b: benches.count(b) for b in set(benches)} == counts
    for t in summary["targets"]:
        if t["benchmark"] == "cluster_ops":  # seconds until the hits are back: 0 when they never left
            assert t["lmtier"] >= 0 and t["reference_value"] > 0 and t["ratio"] >= 0
        else:
            assert t["lmtier"] > 0 and t["reference_value"] > 0 and t["ratio"] > 0
        assert isinstance(t["met"], bool) and t["target"]
    table = (out / "results.md").read_text()
    assert table.count("\n| ") >= len(summary["targets"])
    assert "| grpc | gRPC tier over TCP, PUT 0.5 MiB (GB/s) |" in table
    assert "| grpc | gRPC tier over TCP, PUT 0.5 MiB (GB/s) |" in stdout  # printed too
    for png in ("throughput.png", "ttft.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@suite_test
def test_cpu_benchmark_reports_both_sides_and_their_ratio(suite):
    report, stdout = report_of(suite, "cpu")
    results = report["results"]
    assert set(results) == {"reference_copyto", "cpu_tier", "reference_strided", "embedded_api"}
    for name in ("cpu_tier", "embedded_api"):
        r = results[name]
        assert r["gb_per_s"] > 0
        assert r["ratio_to_reference"] == r["gb_per_s"] / results[r["reference"]]["gb_per_s"]
    assert "| cpu_tier |" in stdout  # the table follows the JSON


@suite_test
def test_disk_benchmark_measures_dd_and_the_tier_in_the_same_run(suite):
    report, stdout = report_of(suite, "disk")
    for direction in ("write", "read"):
        r = report["throughput"][direction]
        assert r["dd_gb_per_s"] > 0 and r["lmtier_gb_per_s"] > 0
        assert r["ratio_of_bests"] == pytest.approx(r["lmtier_gb_per_s"] / r["dd_gb_per_s"])
    assert report["rebuild"]["chunks"] == 500
    assert "| read |" in stdout


@suite_test
def test_redis_benchmark_measures_redis_benchmark_lmtier_and_redis_py_on_one_server(suite):
    report, stdout = report_of(suite, "redis")
    assert [(r["chunk_mib"], r["op"]) for r in report["rows"]] == [(1, "set"), (1, "get"), (1, "set+get")]
    for r in report["rows"]:
        assert r["redis_benchmark_gbps"] > 0 and r["lmtier_gbps"] > 0 and r["redis_py_gbps"] > 0
        assert r["lmtier_over_redis_py"] == pytest.approx(r["lmtier_gbps"] / r["redis_py_gbps"])
        assert r["connections"] >= 1
    assert "| 1 MiB | GET |" in stdout and "| 1 MiB | SET+GET |" in stdout


@suite_test
def test_the_object_store_benchmark_measures_awscrt_alone_and_the_tier_on_one_server(suite):
    report, stdout = report_of(suite, "s3")
    (row,) = report["rows"]
    for op in ("put", "get"):
        r = row[op]
        assert r["lmtier_gbps"] > 0 and r["awscrt_gbps"] > 0 and r["rounds"] == 1
        assert r["ratio_min"] <= r["ratio_median"] <= r["ratio_max"]
    assert "| 0.5 MiB | GET |" in stdout


@suite_test
def test_grpc_benchmark_measures_echo_memcpy_redis_and_both_transports_in_one_run(suite):
    report, stdout = report_of(suite, "grpc")
    ops = [r["op"] for r in report["rows"]]
    assert ops == ["put", "get", "load", "put+get"]
    for r in report["rows"]:
        assert min(r[f"{name}_gbps"] for name in ("echo", "tcp", "memcpy", "copyhash", "shm", "redis")) > 0
        assert r["tcp_over_echo"] == pytest.approx(r["tcp_gbps"] / r["echo_gbps"])
        assert r["shm_over_memcpy"] == pytest.approx(r["shm_gbps"] / r["memcpy_gbps"])
        assert r["shm_over_copyhash"] == pytest.approx(r["shm_gbps"] / r["copyhash_gbps"])
    assert "| 0.5 MiB | LOAD |" in stdout


@suite_test
@pytest.mark.skipif(NETNS is not None, reason=f"no network namespaces here: {NETNS}")
def test_the_cross_host_benchmark_measures_raw_tcp_echo_and_the_tier_on_one_link(suite):
    report, stdout = report_of(suite, "netns")
    assert [(r["chunk_mib"], r["op"]) for r in report["rows"]] == [(0.5, "load"), (0.5, "put")]
    for r in report["rows"]:
        assert min(r["tcp_gbps"], r["echo_gbps"], r["tier_gbps"]) > 0
        assert r["tier_over_tcp"] == pytest.approx(r["tier_gbps"] / r["tcp_gbps"])
        assert r["tier_counts"]["errors"] == 0 and r["tier_counts"]["directory_reads"] == 0
    assert "| 0.5 MiB | LOAD |" in stdout


@suite_test
def test_the_load_benchmark_times_every_clients_loads_on_one_server(suite):
    report, stdout = report_of(suite, "server_load")
    (run,) = report["runs"]
    assert run["tenants"] == 1 and run["clients"] == 8 and run["failed_calls"] == 0
    assert len(run["load_latency"]) == 8
    for c in run["load_latency"]:
        assert c["loads"] > 0 and 0 < c["p50_ms"] <= c["p99_ms"]
    assert "| client | data plane |" in stdout


@pytest.mark.engine
def test_the_vllm_demo_runs_two_engines_and_checks_its_own_answers(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmtier",
            "demo",
            "--docs",
            "2",
            "--doc-tokens",
            "1024",
            "--questions",
            "2",
            "--out",
            str(tmp_path / "out"),
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "| B, new instance (lmtier disk hit)" in run.stdout
    assert "demo passed" in run.stdout
    assert (tmp_path / "out" / "ttft.png").stat().st_size > 1000
    report = json.loads((tmp_path / "out" / "ttft.json").read_text())
    assert report["tokens_per_timed_request"] == [1]  # a first token, not a whole answer
    assert report["connector"]["reference"] is None  # the reference ran without lmtier
    assert report["connector"]["A"] and report["connector"]["B"]
    assert 0 <= report["noise"] < 10 and isinstance(report["flagged"], list)


def test_the_demos_table_flags_rows_that_disagree_beyond_the_noise(capsys):
    """The demo's rows from its own rounds: two full-prefill rows of 703 ms and 7,070 ms for
    the same work, or a row whose rounds disagree beyond the measured noise, are flagged."""
    from lmtier.demo.vllm import A_FIRST, B_HIT, NO_CACHE, measured_noise, print_ttft_table

    def outs(*seconds: float) -> list[dict]:
        return [{"seconds": s, "cached": 0, "prompt_len": 100, "tokens": [1]} for s in seconds]

    full = [outs(0.70, 0.72, 0.71), outs(0.71, 0.70, 0.73)]
    noise = measured_noise(full)
    assert 0 < noise < 0.05
    steady = {NO_CACHE: full, A_FIRST: [outs(0.75, 0.74)], B_HIT: [outs(0.05, 0.05), outs(0.051, 0.05)]}
    assert print_ttft_table(steady, noise)[1] == []
    unsteady = {NO_CACHE: full, A_FIRST: [outs(7.07, 7.0)], B_HIT: [outs(0.05, 0.05), outs(0.5, 0.5)]}
    medians, flagged = print_ttft_table(unsteady, noise)
    assert flagged == [A_FIRST, B_HIT] and round(medians[A_FIRST], 3) == 7.035
    assert f"| {B_HIT} (unsteady) |" in capsys.readouterr().out


@suite_test
def test_ttft_benchmark_measures_every_configuration(suite):
    report, _ = report_of(suite, "vllm")
    (row,) = report["rows"]
    for key in ("no_cache", "vllm_prefix_hit", "lmtier_store", "lmtier_no_store", "lmtier_cpu_hit", "lmtier_disk_hit"):
        assert row[key] > 0
    assert row["disk_floor"] > row["vllm_prefix_hit"]
    assert row["cached_tokens"]["lmtier_disk_hit"] == 256  # one full chunk of the 448-token document
    assert row["answers"]["problems"] == [] and row["answers"]["requests"] > 0
    assert report["no_reuse_throughput"]["ratio"] > 0


@suite_test
def test_every_tier_is_timed_inside_the_engine_against_vllms_own_hit(suite):
    report, stdout = report_of(suite, "vllm_tiers")
    assert [r["tier"] for r in report["rows"]] == ["memory", "server"]  # short mode's
    for r in report["rows"]:
        assert r["cached_tokens"] == report["prefix_cached_tokens"] > 0  # every tier served the whole hit
        assert r["ratio"] == pytest.approx(r["ttft"] / report["vllm_prefix_hit"])
    assert report["disk_floor"] > report["vllm_prefix_hit"]
    assert report["memory_floor"] == pytest.approx(report["vllm_prefix_hit"] + report["memcpy_seconds"])
    assert "| lmtier server |" in stdout and "| lmtier memory |" in stdout and "(memory floor)" in stdout


@suite_test
def test_the_pd_benchmark_times_producer_and_decode_instance_against_their_references(suite):
    report, stdout = report_of(suite, "vllm_pd")
    (row,) = report["rows"]
    assert row["tokens"] == 512 and row["decode_cached_tokens"] == 448  # whole chunks before the last block
    assert row["hold_ratio"] == pytest.approx(row["producer_hold"] / row["producer_no_store"])
    assert row["decode_ratio"] == pytest.approx(row["decode_lmtier"] / row["vllm_prefix_hit"])
    assert row["answer_problems"] == [] and row["answers_exact"] == 1
    assert "| 512 |" in stdout


@suite_test
def test_cluster_ops_benchmark_reports_each_event_with_nothing_wrong(suite):
    report, stdout = report_of(suite, "cluster_ops")
    assert [e["event"] for e in report["events"]] == ["failover"]
    for e in report["events"]:
        assert set(e["clients"]) == {"lmtier-0", "lmtier-1"}
        assert all(f["wrong"] == 0 and f["loads"] > 0 for f in e["clients"].values())
    assert report["replica_reads"]["replicas"]["wrong"] == 0
    assert "| failover | lmtier-0 |" in stdout and "replicas / masters" in stdout


def test_the_results_page_is_a_full_run_copied_unedited():
    """docs/results/results.md is a full `make bench` run's page, as today's runner makes it
    of the committed reports, with the plots it made; the benchmarks page shows the plots
    and links the page, and every row of the README's headline table is a row of it."""
    results = ROOT / "docs" / "results"
    summary = json.loads((results / "results.json").read_text())
    assert summary["mode"] == "full" and set(summary["benchmarks"]) == set(ALL)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import run as runner
    finally:
        sys.path.pop(0)
    # The page's rows are what today's runner makes of the committed reports: a page left
    # behind by a change to a benchmark or its targets fails here.
    assert runner.targets(summary["benchmarks"]) == summary["targets"]
    page = (results / "results.md").read_text()
    assert page == runner.markdown(summary, results), "docs/results/results.md is not the runner's page of results.json"
    table = page.split("\n\n")[2].splitlines()
    assert len(table) == 2 + len(summary["targets"])
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text()
    assert "](results/results.md)" in benchmarks
    for png in ("throughput.png", "ttft.png"):
        assert (results / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"](results/{png})" in benchmarks and f"]({png})" in page

    # The README's headline: | what | reference | ratio |, each a row of the full run's table.
    def cells(line: str) -> tuple[str, ...]:
        return tuple(c.strip() for c in line.strip("|").split("|"))

    full = {(r[1], r[3], r[5]) for r in map(cells, table[2:])}
    readme = (ROOT / "README.md").read_text()
    headline = readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    rows = [cells(line) for line in headline.splitlines() if line.startswith("|")]
    assert rows[0] == ("what", "reference", "ratio") and len(rows) > 2
    assert not [r for r in rows[2:] if r not in full], "README's headline rows must be rows of docs/results/results.md"


def test_a_benchmark_rerun_keeps_the_other_reports_of_the_earlier_run_and_says_so(tmp_path):
    """``--only NAME --keep``: one benchmark again, the others' reports as the earlier run
    left them, the page saying which ran when; a run of the other mode is not mixed in."""

    def bench(*args):
        return subprocess.run(
            [sys.executable, "benchmarks/run.py", "--short", "--quiet", "--out", str(tmp_path), *args],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
        )

    assert bench("--only", "cpu").returncode == 0
    first = json.loads((tmp_path / "results.json").read_text())
    again = bench("--only", "trace", "--keep")
    assert again.returncode == 0, again.stderr[-2000:]
    summary = json.loads((tmp_path / "results.json").read_text())
    assert set(summary["benchmarks"]) == {"cpu", "trace"}
    assert summary["benchmarks"]["cpu"] == first["benchmarks"]["cpu"]  # kept as it was
    assert summary["ran"]["cpu"] == first["ran"]["cpu"] != summary["ran"]["trace"]
    assert {t["benchmark"] for t in summary["targets"]} == {"cpu", "trace"}
    page = (tmp_path / "results.md").read_text()
    assert f"cpu ran {first['ran']['cpu']}" in page and f"trace ran {summary['ran']['trace']}" in page
    other_mode = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--quiet", "--out", str(tmp_path), "--only", "cpu", "--keep"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert other_mode.returncode == 2 and "short run, not a full one" in other_mode.stderr

"""The trace-replay benchmark: its references are right on cases small enough to check by
hand, and its quick mode, on a slice of the Mooncake trace and on the synthetic
workloads, keeps the orderings that must hold (no timing is asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lmtier.store.admission import SavePolicy

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"  # CI has ../shared beside the checkout
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_trace as bt  # noqa: E402


def req(*chunks: bytes) -> tuple[list[bytes], int]:
    """A request over the named chunks (each a key), every chunk full."""
    return list(chunks), len(chunks) * bt.CHUNK_TOKENS


A, B, C, D = (bytes([i]) * 16 for i in range(4))


def test_belady_skips_what_is_never_used_again_where_lru_does_not():
    requests = [req(A), req(B), req(A)]
    assert bt.belady(requests, capacity=1) == 1  # B bypassed: A is still there
    assert bt.lru(requests, capacity=1) == 0  # B evicted A
    assert bt.lru(requests, capacity=1, oracle=True) == 1


def test_a_hit_is_the_leading_run_only():
    requests = [req(A, B), req(C, B)]  # B's key here stands for another prefix's chunk
    assert bt.belady(requests, capacity=10) == bt.lru(requests, capacity=10) == 0


def test_belady_keeps_a_prefix_usable_by_evicting_deeper_chunks_first():
    requests = [req(A, B), req(C), req(A, B)]  # A and B are next used at the same time
    assert bt.belady(requests, capacity=2) == 2


def test_the_store_replays_always_as_today_and_reuse_as_write_back():
    always = bt.SimStore(SavePolicy("always"), memory=2, lower=4)
    reuse = bt.SimStore(SavePolicy("reuse", keys=64, min_reuse=1.0), memory=2, lower=4)
    for store in (always, reuse):
        store.request(*req(A, B))  # stored in memory
        store.request(*req(A, B))  # both read from memory: proven
        store.request(*req(C, D))  # A and B evicted, C and D never read
        store.request(*req(A, B))  # both back from the lower tier
    assert always.counts["lower_written"] == 4  # everything, at save time
    assert reuse.counts["lower_written"] == 2  # what was read in memory, at eviction
    assert always.counts["hits"] == reuse.counts["hits"] == 4


@pytest.fixture(scope="module")
def report():
    trace = TRACES / "mooncake_synthetic_trace.jsonl"
    assert trace.exists(), f"the trace must be at {trace}"
    return bt.run(trace, quick=True)


def rows(report, **match):
    return [r for r in report["rows"] if all(r[k] == v for k, v in match.items())]


def test_quick_mode_covers_every_workload_setup_capacity_and_policy(report):
    assert set(report["workloads"]) == {"trace", "no_reuse", "system_prompts", "conversations"}
    assert report["workloads"]["trace"]["requests"] == 1000
    policies = {"belady", "lru", "lru+oracle admission", "always", "min_tokens=4096", "reuse"}
    for workload in report["workloads"]:
        for setup in ("memory", "memory+lower"):
            found = rows(report, workload=workload, setup=setup)
            assert len(found) == len(bt.SIZES) * len(policies)
            assert {r["policy"] for r in found} == policies


def test_belady_is_the_ceiling_of_every_policy(report):
    for ceiling in rows(report, policy="belady"):
        same = rows(report, workload=ceiling["workload"], setup=ceiling["setup"],
                    memory_pct=ceiling["memory_pct"], lower_pct=ceiling["lower_pct"])  # fmt: skip
        assert all(r["hit_ratio"] <= ceiling["hit_ratio"] + 1e-12 for r in same)
        assert ceiling["hit_ratio"] <= report["workloads"][ceiling["workload"]]["max_hit_ratio"] + 1e-12


def test_always_in_memory_alone_is_plain_lru_and_reuse_changes_nothing_there(report):
    for lru in rows(report, setup="memory", policy="lru"):
        where = {"workload": lru["workload"], "setup": "memory", "memory_pct": lru["memory_pct"]}
        (always,) = rows(report, policy="always", **where)
        (reuse,) = rows(report, policy="reuse", **where)
        assert always["hit_ratio"] == lru["hit_ratio"] == reuse["hit_ratio"]
        assert always["lower_written_gib"] == 0


def test_nothing_hits_without_reuse_and_reuse_cuts_its_lower_tier_writes(report):
    assert all(r["hit_ratio"] == 0 and r["x_belady"] is None for r in rows(report, workload="no_reuse"))
    for workload in ("no_reuse", "system_prompts"):
        for always in rows(report, workload=workload, setup="memory+lower", policy="always"):
            (reuse,) = rows(report, workload=workload, setup="memory+lower", policy="reuse",
                            lower_pct=always["lower_pct"])  # fmt: skip
            assert reuse["lower_written_gib"] < 0.6 * always["lower_written_gib"]
            assert reuse["hit_ratio"] >= always["hit_ratio"]


def test_reuse_writes_no_more_than_always_to_the_lower_tier_on_any_workload(report):
    for always in rows(report, setup="memory+lower", policy="always"):
        (reuse,) = rows(report, workload=always["workload"], setup="memory+lower", policy="reuse",
                        lower_pct=always["lower_pct"])  # fmt: skip
        assert reuse["lower_written_gib"] <= always["lower_written_gib"]
        assert reuse["memory_written_gib"] == always["memory_written_gib"]


def test_the_script_prints_json_and_a_table(tmp_path, capsys):
    out = tmp_path / "trace.json"
    assert bt.main(["--quick", "--trace", str(TRACES / "mooncake_synthetic_trace.jsonl"),
                    "--json-out", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["benchmark"] == "trace_replay" and saved["default_policy"] == "reuse"
    assert "| setup | memory | lower | policy | hit ratio | x Belady |" in printed
    assert "| memory+lower | 10% | 50% | reuse |" in printed

"""Eight client processes against one bounded server for half a minute
(benchmarks/load_server.py; the results page runs it for a minute)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from load_server import run_load, table


def test_eight_clients_for_half_a_minute_fail_nothing_and_the_server_stays_in_its_bounds(tmp_path, capsys):
    result = run_load(clients=8, duration=30, workdir=tmp_path)
    with capsys.disabled():
        print("\n" + table(result) + "\n" + json.dumps(result))
    assert result["server_alive"] and result["client_crashes"] == 0
    assert result["failed_calls"] == 0, result["failures"]
    counts = result["counts"]
    assert min(counts[k] for k in ("put", "get", "lookup", "delete", "rejected")) > 0
    assert counts["hits"] > 0
    assert result["gb_moved"] * 1024 > 2 * (64 + 128)  # more than the server can hold: it evicts
    assert result["rss_peak_mib"] <= result["rss_bound_mib"]
    assert result["disk_peak_mib"] <= result["disk_bound_mib"]
    assert result["disk_files_match"] and result["disk_files_mib"] <= result["disk_bound_mib"]

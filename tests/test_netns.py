"""The grpc:// tier between two hosts: the server and the client in two network namespaces
joined by a veth pair shaped by ``tc`` (``lmtier.testing.netns``), through the cross-host
benchmark's own script, short (loads on the server's bulk data channel). Where the machine
cannot make namespaces (no root, no iproute2), the test says why it did not run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lmtier.testing.netns import HostPair, unavailable

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_netns.py"
REASON = unavailable()
needs_namespaces = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}")


@needs_namespaces
def test_chunks_cross_a_shaped_link_between_two_namespaces_verified(tmp_path):
    out = tmp_path / "netns.json"
    argv = [sys.executable, str(BENCH), "--sizes-mib", "0.5", "--total-mib", "8", "--rounds", "1", "--batch", "8",
            "--rate", "2gbit", "--json-out", str(out)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=BENCH.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {r["op"] for r in report["rows"]} == {"load", "put"}
    for row in report["rows"]:
        assert row["tcp_gbps"] > 0 and row["echo_gbps"] > 0 and row["tier_gbps"] > 0
        counts = row["tier_counts"]
        assert counts["errors"] == 0 and counts["corrupt"] == 0
        assert counts["directory_reads"] == 0 and counts["shm_fallbacks"] == 0  # nothing same-host across the link
        assert counts["data_loads"] > 0 and counts["data_fallbacks"] == 0  # loads on the bulk data channel


@needs_namespaces
def test_a_host_pair_is_two_hosts_and_leaves_nothing_behind():
    with HostPair(rate=None) as net:
        seen = net.call("client", ["ip", "-brief", "addr"], timeout=30, capture_output=True, text=True).stdout
        assert net.client_ip in seen and net.server_ip not in seen
        ping = ["python3", "-c", f"import socket; socket.create_connection(('{net.server_ip}', 9), 2)"]
        refused = net.call("client", ping, timeout=30, capture_output=True, text=True)
        assert "ConnectionRefused" in refused.stderr  # the server's host answers: the link is up
        net.down()
        cut = net.call("client", ping, timeout=30, capture_output=True, text=True)
        assert "ConnectionRefused" not in cut.stderr and cut.returncode  # no answer: the link is cut
        names = list(net.ns.values())
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)

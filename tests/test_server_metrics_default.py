"""A cache server's figures are where users look without asking: ``lmtier serve --port P``
serves /metrics on P + 2 (after the data channel's P + 1) unless told otherwise; never by
default where tenants share the server and no metrics token guards the sum of their traffic."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from lmtier.testing.cache_server import ServerProcess
from lmtier.testing.redis_server import free_port

from conftest import eventually


def metrics(port: int) -> str | None:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except (urllib.error.URLError, ConnectionError):
        return None


def test_metrics_are_served_by_default_beside_the_grpc_port(tmp_path):
    server = ServerProcess(tmp_path, "--tier", "cpu://?size=16MiB")
    try:
        text = metrics(server.port + 2)
        assert text is not None and "lmtier_server_" in text
        said = f":{server.port + 2}/metrics"  # logged as the port opens: maybe just after it answers
        assert eventually(lambda: "metrics on http://" in server.log() and said in server.log(), 10)
    finally:
        server.stop()


@pytest.mark.parametrize("how", ["--no-metrics", "tenants"])
def test_no_metrics_when_turned_off_or_when_tenants_share_the_server_unguarded(tmp_path, how):
    args = ["--no-metrics"] if how == "--no-metrics" else ["--token", "a" * 32 + "=alice", "--token", "b" * 32 + "=bob"]
    server = ServerProcess(tmp_path, "--tier", "cpu://?size=16MiB", *args)
    try:
        assert metrics(server.port + 2) is None and "metrics on" not in server.log()
    finally:
        server.stop()


def test_a_taken_default_port_costs_only_the_metrics(tmp_path):
    """The default port taken by another process: the server runs, says so, and serves."""
    import socket

    port = free_port()
    blocker = socket.create_server(("0.0.0.0", port + 2))
    try:
        server = ServerProcess(tmp_path, "--tier", "cpu://?size=16MiB", port=port)
        try:
            assert "no /metrics on" in server.log() and server.health() is not None
        finally:
            server.stop()
    finally:
        blocker.close()

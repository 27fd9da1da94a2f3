"""The cache server's metrics port against whoever can reach it (now that it is on by
default), and the same-host directory reads it counts: real servers, raw sockets."""

from __future__ import annotations

import socket
import struct
import threading
import urllib.request

import grpc
import pytest

from lmtier.server import metricsport
from lmtier.server.metricsport import MetricsHTTPServer
from lmtier.testing.cache_server import ServerProcess
from lmtier.testing.redis_server import free_port
from lmtier.tiers.base import open_tier
from lmtier.v1 import cache_pb2

from conftest import eventually, make_prompt
from grpc_servers import SERVICE, start


def ready(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as answer:
        return answer.status


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b"" or closed(sock)  # an answer to a request cut short, then the end
    except (ConnectionResetError, BrokenPipeError):
        return True


def test_clients_trickling_their_requests_are_cut_off_and_the_probes_answer(monkeypatch):
    """Slowloris: every slot held by a client sending a byte a second (each read within the
    per-read timeout) once kept /healthz and /readyz dark for as long as it liked, and the
    kubelet restarts a pod whose liveness probe fails. A request has a deadline in all."""
    monkeypatch.setattr(MetricsHTTPServer, "MAX_CONNECTIONS", 4)
    monkeypatch.setattr(metricsport, "REQUEST_DEADLINE_S", 1.5)
    srv, _ = start(tiers=("cpu://?size=4MiB",), metrics_port=0)
    stop = threading.Event()
    tricklers = [socket.create_connection(("127.0.0.1", srv.metrics_port), timeout=10) for _ in range(4)]

    def trickle(sock: socket.socket) -> None:
        try:
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")
            while not stop.wait(0.3):
                sock.sendall(b"X")
        except OSError:
            return

    threads = [threading.Thread(target=trickle, args=(s,), daemon=True) for s in tricklers]
    try:
        for t in threads:
            t.start()
        assert all(closed(s) for s in tricklers)  # while they were still trickling
        assert eventually(lambda: ready(srv.metrics_port) == 200)
    finally:
        stop.set()
        for s in tricklers:
            s.close()
        srv.stop(0)


def test_a_request_with_more_header_bytes_than_a_probe_sends_is_cut_off():
    """64 connections of 100 headers of 64 KiB each once pinned 400 MB of the server: it read
    up to 100 header lines of any length before it refused them. Now a request's headers
    stop at 16 KiB: lines of 8 KB, sent one at a time, meet a closed connection long before
    the fiftieth."""
    srv, _ = start(tiers=("cpu://?size=4MiB",), metrics_port=0)
    try:
        sock = socket.create_connection(("127.0.0.1", srv.metrics_port), timeout=10)
        lines = 0
        try:
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")
            with pytest.raises(OSError):  # the server closed: a send fails (reset, broken pipe)
                while lines < 100:
                    sock.sendall(b"X-Pad: " + b"p" * 8000 + b"\r\n")
                    lines += 1
                    threading.Event().wait(0.02)
            assert lines < 50
        finally:
            sock.close()
        assert ready(srv.metrics_port) == 200
    finally:
        srv.stop(0)


def test_connections_reset_by_their_clients_print_no_tracebacks(tmp_path):
    """Each reset once printed a traceback to stderr, past the logging's levels (1.4 KB each)."""
    server = ServerProcess(tmp_path, "--tier", "cpu://?size=4MiB")
    try:
        for i in range(50):
            sock = socket.create_connection(("127.0.0.1", server.port + 2), timeout=5)
            if i % 2:
                sock.sendall(b"GET /metr")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # a reset
        assert ready(server.port + 2) == 200
        assert "Traceback" not in server.log()
    finally:
        server.stop()


def test_the_default_port_taken_with_a_metrics_token_set_stops_the_start(tmp_path):
    """Whoever holds the default port would be sent the token by every scrape: the server
    refuses to start, as it does for a port asked for."""
    port = free_port()
    squatter = socket.create_server(("127.0.0.1", port + 2))
    try:
        server = ServerProcess(tmp_path, "--tier", "cpu://?size=4MiB", port=port, start=False,
                               env={"LMTIER_SERVER_METRICS_TOKEN": "m" * 32})  # fmt: skip
        with pytest.raises(RuntimeError, match=r"cannot serve metrics on .*the default port"):
            server.start(timeout=30)
    finally:
        squatter.close()


def test_a_report_of_reads_counts_each_chunk_held_once(tmp_path):
    """A client's reports are its own counts, but a report of one key 4,096 times, or of
    keys the server does not hold, counts what it held, once each."""
    srv, port = start(tiers=("cpu://?size=4MiB",), shm_dir=str(tmp_path))
    tier = open_tier(f"grpc://127.0.0.1:{port}?shm=off")
    prompt = make_prompt(2, seed=5)
    tier.put(prompt.chunks())
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    report = channel.unary_unary(
        SERVICE + "Directory", cache_pb2.DirectoryRequest.SerializeToString, cache_pb2.DirectoryResponse.FromString
    )
    try:
        report(cache_pb2.DirectoryRequest(read=[prompt.keys[0]] * 4096), timeout=10)
        report(cache_pb2.DirectoryRequest(read=[bytes(16)] * 100 + [prompt.keys[1]]), timeout=10)
        memory = srv.store.stats()["tiers"][0]
        assert memory["directory_reads"] == 2 and memory["hits"] == 2
    finally:
        channel.close()
        tier.close()
        srv.stop(0)

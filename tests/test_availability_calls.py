"""Availability is part of isolation: what one tenant of a shared ``lmtier serve`` can take
from the others in calls, workers and connections (calls that send only their headers,
stalled calls, idle reflection streams, silent Releases and health checks, floods of idle
connections to the gRPC and metrics ports, a call rate), driven by raw gRPC clients written
from the ``.proto`` (not lmtier's own client), with the other tenant's calls measured beside
the attack; and every attack at once, from benchmarks/hostile_tenant.py.

Memory and shared memory are in test_availability_memory.py; identities, tokens and secrets
in test_availability_identity.py. test_security_*.py keep the attacks on isolation.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lmtier.errors import ConfigError
from lmtier.server.auth import tenant_tag
from lmtier.v1 import cache_pb2

from conftest import eventually, make_prompt
from raw_client import SERVICE, S, call, connection, puts, two_tenant_server

ROOT = Path(__file__).resolve().parent.parent


class Stalled:
    """Calls to ``method`` that send their headers and then nothing: a request stream that
    waits (the raw shape of a client that opened a call and went quiet)."""

    def __init__(self, channel: grpc.Channel, method: str, n: int, token: str | None = None) -> None:
        self.gate = threading.Event()
        fn = channel.stream_unary(SERVICE + method, None, lambda raw: raw)
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.futures = [fn.future(self._wait(), metadata=metadata, timeout=60) for _ in range(n)]

    def _wait(self):
        self.gate.wait(60)
        yield from ()

    def codes(self, seconds: float = 30) -> list:
        """The status each call ended with (waiting up to ``seconds`` in all)."""
        deadline = time.monotonic() + seconds
        out = []
        for f in self.futures:
            try:
                f.result(timeout=max(0.1, deadline - time.monotonic()))
                out.append(S.OK)
            except grpc.FutureTimeoutError:
                out.append(None)
            except grpc.RpcError as e:
                out.append(e.code())
        return out

    def release(self) -> None:
        self.gate.set()


@contextmanager
def attacked(channels: int, **settings):
    """A two-tenant server, ``channels`` connections to it, and a list the test puts its
    ``Stalled`` calls in: all released, closed and stopped at the end, whatever happened."""
    srv, address = two_tenant_server(**settings)
    conns = [connection(address) for _ in range(channels)]
    stalls: list[Stalled] = []
    try:
        yield srv, conns, stalls
    finally:
        for s in stalls:
            s.release()
        for c in conns:
            c.close()
        srv.stop(0)


def lookups(channel: grpc.Channel, keys: list[bytes], token: str, n: int) -> list[float]:
    """``n`` Lookups, each with a 5 s deadline: their latencies (an error fails the test)."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call(channel, "Lookup", cache_pb2.LookupRequest(keys=keys), token=token, timeout=5)
        times.append(time.perf_counter() - start)
    return times


def test_calls_without_credentials_hold_no_worker():
    """Forty calls that send only their headers, with no token or a wrong one, on several
    connections (the server has 16 workers): each is refused when its headers arrive, and
    the other tenant's calls and the health check go on being served (they once timed
    out: every worker waited for a request that never came)."""
    prompt = make_prompt(2, seed=400)
    with attacked(4, workers=16) as (_, channels, stalls):
        health = health_pb2_grpc.HealthStub(channels[3])
        assert call(channels[3], "Put", puts(prompt), token="alice-secret").stored == 2
        before = lookups(channels[3], prompt.keys, "alice-secret", 20)
        stalls += [Stalled(channels[i % 3], "Lookup", 10, token=None if i % 2 else "guessed") for i in range(4)]
        during = lookups(channels[3], prompt.keys, "alice-secret", 20)
        assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == 1  # SERVING
        for attack in stalls:
            assert set(attack.codes(10)) == {S.UNAUTHENTICATED}
        print(f"alice's Lookup, median: {statistics.median(before) * 1e3:.2f} ms alone, "
              f"{statistics.median(during) * 1e3:.2f} ms beside 40 header-only calls")  # fmt: skip


def test_a_flood_of_idle_connections_takes_no_descriptor_the_server_needs(tmp_path):
    """Raw TCP connections that never speak HTTP/2 (21,000 of them once left the server no
    descriptor for its probes): past ``max_connections`` they are closed as they arrive,
    those within it when their handshake time is up, and meanwhile an engine's open
    connection is served, readiness holds, and a new client gets in once they are gone."""
    import socket

    prompt = make_prompt(2, seed=401)
    srv, address = two_tenant_server(max_connections=8, handshake_timeout=1.0, metrics_port=0)
    engine = connection(address)
    flood: list[socket.socket] = []
    try:
        assert call(engine, "Put", puts(prompt), token="alice-secret").stored == 2
        host, port = address.rsplit(":", 1)
        for _ in range(40):
            flood.append(socket.create_connection((host, int(port)), timeout=5))
        assert lookups(engine, prompt.keys, "alice-secret", 10)  # the engine's connection: served
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/readyz", timeout=5) as ready:
            assert ready.status == 200
        closed = 0
        for sock in flood:  # every one of them is closed by the server: over the limit or timed out
            sock.settimeout(10)
            try:
                while sock.recv(4096):  # the server's HTTP/2 preface, then end of stream
                    pass
                closed += 1
            except ConnectionResetError:
                closed += 1
        assert closed == len(flood)
        newcomer = connection(address)
        try:
            lookup = call(newcomer, "Lookup", cache_pb2.LookupRequest(keys=prompt.keys), token="alice-secret")
            assert lookup.hits == 2
        finally:
            newcomer.close()
    finally:
        for sock in flood:
            sock.close()
        engine.close()
        srv.stop(0)


def test_idle_connections_to_the_metrics_port_are_bounded_and_closed(monkeypatch):
    """Connections to the metrics port that never send a request once each held a thread and
    a descriptor for good (a thousand: 600 threads): at most MAX_CONNECTIONS are served at
    once, the rest closed as they arrive, each closed after TIMEOUT_S, and the probes
    answer again once they are gone."""
    import socket

    from lmtier.server.app import MetricsHTTPServer

    monkeypatch.setattr(MetricsHTTPServer, "MAX_CONNECTIONS", 8)
    monkeypatch.setattr(MetricsHTTPServer, "TIMEOUT_S", 1.0)
    srv, _ = two_tenant_server(metrics_port=0)
    threads = threading.active_count()
    flood = [socket.create_connection(("127.0.0.1", srv.metrics_port), timeout=5) for _ in range(60)]
    try:
        time.sleep(0.5)
        assert threading.active_count() <= threads + 8
        for sock in flood:  # every one is closed by the server: at once, or after its second
            sock.settimeout(10)
            try:
                assert sock.recv(1) == b""
            except ConnectionResetError:
                pass
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/readyz", timeout=5) as ready:
            assert ready.status == 200
    finally:
        for sock in flood:
            sock.close()
        srv.stop(0)


def test_one_tenant_stalling_its_calls_holds_only_its_share_and_not_for_long():
    """Bob opens sixteen calls with his token and sends nothing more (Lookups and Puts):
    he holds at most his share of the 8 workers (the rest are refused at once), Alice is
    served throughout, and his stalled calls are cancelled after stall_timeout."""
    bob = tenant_tag("bob")
    prompt = make_prompt(2, seed=401)
    with attacked(3, workers=8, stall_timeout=1.0) as (srv, channels, stalls):
        assert call(channels[2], "Put", puts(prompt), token="alice-secret").stored == 2
        stalls += [Stalled(channels[0], "Lookup", 8, "bob-secret"), Stalled(channels[1], "Put", 8, "bob-secret")]
        assert eventually(lambda: srv.service.calls_in_flight(bob) >= 1, 5)
        assert srv.service.calls_in_flight(bob) <= 4  # half the workers where two tenants share them
        lookups(channels[2], prompt.keys, "alice-secret", 10)
        codes = [c for s in stalls for c in s.codes(20)]
        assert None not in codes and S.CANCELLED in codes and S.RESOURCE_EXHAUSTED in codes
        assert set(codes) <= {S.CANCELLED, S.RESOURCE_EXHAUSTED}
        assert eventually(lambda: srv.service.calls_in_flight(bob) == 0, 5)
        assert lookups(channels[2], prompt.keys, "alice-secret", 1)


def test_idle_reflection_streams_hold_no_worker_without_a_token_and_not_for_long_with_one():
    """gRPC reflection once stood beside the gate: 32 streams that never sent a message, with
    no token, held every worker (each tenant's calls timed out for as long as the client
    liked). Now those are refused as their headers arrive, and a tenant's own idle streams
    count against its calls and are cancelled after stall_timeout."""
    bob = tenant_tag("bob")
    path = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    prompt = make_prompt(2, seed=402)
    gate = threading.Event()

    def silent():
        gate.wait(60)
        yield from ()

    with attacked(5, workers=8, stall_timeout=1.0) as (srv, channels, _):
        try:
            assert call(channels[4], "Put", puts(prompt), token="alice-secret").stored == 2
            streams = []
            for i in range(32):  # no token, on four connections
                streams.append(channels[i % 4].stream_stream(path, None, None)(silent(), timeout=60))
            for i in range(8):  # Bob's, with his token
                fn = channels[i % 4].stream_stream(path, None, None)
                streams.append(fn(silent(), timeout=60, metadata=(("authorization", "Bearer bob-secret"),)))
            assert srv.service.calls_in_flight(bob) <= 4
            assert lookups(channels[4], prompt.keys, "alice-secret", 10)  # served throughout
            assert eventually(lambda: all(s.done() for s in streams), 20)
            codes = [s.code() for s in streams]
            assert set(codes[:32]) == {S.UNAUTHENTICATED}
            assert set(codes[32:]) <= {S.CANCELLED, S.RESOURCE_EXHAUSTED} and S.CANCELLED in codes[32:]
            assert srv.service.calls_in_flight(bob) == 0
        finally:
            gate.set()


def test_a_tenant_limit_at_or_above_the_workers_is_refused_where_tenants_share_them():
    with pytest.raises(ConfigError, match="below workers"):
        two_tenant_server(workers=8, max_calls_per_tenant=8)


def test_a_tenant_past_its_call_rate_is_refused_and_the_other_is_served():
    srv, address = two_tenant_server(max_call_rate_per_tenant=5)
    channel = grpc.insecure_channel(address)
    lookup = cache_pb2.LookupRequest(keys=make_prompt(1, seed=409).keys)
    try:
        codes = []
        for _ in range(20):  # far more than 5 in a second
            try:
                call(channel, "Lookup", lookup, token="bob-secret")
                codes.append(S.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
        assert codes.count(S.OK) >= 5 and S.RESOURCE_EXHAUSTED in codes
        assert call(channel, "Lookup", lookup, token="alice-secret").hits == 0  # Alice has her own bucket
    finally:
        channel.close()
        srv.stop(0)


def test_silent_releases_and_health_calls_hold_no_more_than_their_few_workers():
    """Release (never refused for the limit: it frees memory) and the health service
    (answered without credentials) once held every worker with calls that sent their
    headers and nothing more; now they are counted, bounded and cancelled on stalling."""
    srv, address = two_tenant_server(workers=8, stall_timeout=1.0)
    channels = [connection(address) for _ in range(3)]
    prompt = make_prompt(2, seed=410)
    try:
        assert call(channels[2], "Put", puts(prompt), token="alice-secret").stored == 2
        releases = Stalled(channels[0], "Release", 12, "bob-secret")
        health = [channels[1].stream_unary("/grpc.health.v1.Health/Check", None, lambda raw: raw)]
        gate = threading.Event()

        def wait():
            gate.wait(30)
            yield from ()

        checks = [health[0].future(wait(), timeout=30) for _ in range(12)]
        lookups(channels[2], prompt.keys, "alice-secret", 10)  # served beside them
        assert S.RESOURCE_EXHAUSTED in releases.codes(20)
        codes = []
        for f in checks:
            try:
                f.result(timeout=20)
            except grpc.RpcError as e:
                codes.append(e.code())
        assert set(codes) <= {S.RESOURCE_EXHAUSTED, S.CANCELLED} and S.RESOURCE_EXHAUSTED in codes
        gate.set()
    finally:
        for c in channels:
            c.close()
        srv.stop(0)


# -- every attack at once ------------------------------------------------------------------------
def test_a_well_behaved_tenant_beside_every_attack_at_once_loses_no_call_and_no_chunk(tmp_path):
    """benchmarks/hostile_tenant.py, short: a real ``lmtier serve``, Alice at a steady
    rate, then the attacker process running every attack above at once. Her calls all
    succeed and she keeps all 64 chunks (the p99 ratio is the benchmark's to report)."""
    out = tmp_path / "hostile.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hostile_tenant.py"), "--phase", "4",
                          "--json-out", str(out)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["server_alive"] and result["stored"] == 64
    for phase in ("alone", "beside"):
        assert result[phase]["failed"] == 0 and result[phase]["hits_min"] == 64, (phase, result[phase])
        assert result[phase]["calls"] > 100
    print(run.stdout[-1200:])

"""Availability is part of isolation: what one tenant of a shared ``lmtier serve`` can take
from the others, driven by raw gRPC clients written from the ``.proto`` (not lmtier's own
client), with the other tenant's calls measured beside the attack.

Longer than 400 lines: one catalogue of the attacks on availability (calls, memory, shared
memory, secrets) with the raw-client helpers they share, kept together as test_security
keeps its own catalogue of attacks on isolation.
"""

from __future__ import annotations

import json
import logging
import os
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
import msgpack
import pytest
import xxhash
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_security import SERVICE, call, connection, puts, two_tenant_server

from lmtier.config import ServerConfig, parse_token, read_token_file
from lmtier.errors import ConfigError
from lmtier.kv import codec
from lmtier.server import create_server
from lmtier.server.auth import certificate_identity, tenant_tag
from lmtier.server.leases import Leases
from lmtier.testing.certs import make_certificates
from lmtier.transport import shm
from lmtier.transport.pieces import Region, pack, piece
from lmtier.v1 import cache_pb2

from conftest import eventually, make_prompt

S = grpc.StatusCode
ROOT = Path(__file__).resolve().parent.parent


def empty_frame(key: bytes, like) -> bytes:
    """A frame of 0 tokens with a valid header and checksums (and no payload)."""
    fields = {"v": codec.FRAME_VERSION, "ns": like.namespace, "key": key, "layout": like.layout.to_dict(),
              "tokens": 0, "codec": codec.CODEC, "raw_len": 0}  # fmt: skip
    header = msgpack.packb(fields, use_bin_type=True)
    return codec._preamble(header, 0, xxhash.xxh3_64(b"").intdigest()) + header


def test_a_put_that_fails_part_way_strands_no_memory():
    """Fifteen chunks and then one of 0 tokens, four times: the call is refused and the
    memory tier's 64 slots stay the tenants' (the fault once kept 60 of them reserved for
    good, and another tenant then stored 4 of 40 chunks)."""
    srv, address = two_tenant_server(tiers=("cpu://?size=512KiB&slot=8KiB",))
    channel = grpc.insecure_channel(address)
    try:
        for attempt in range(4):
            prompt = make_prompt(15, seed=100 + attempt)
            bad = make_prompt(1, seed=200 + attempt)
            frame = empty_frame(bad.keys[0], bad.chunks()[0])
            stream = [*puts(prompt), pack(piece(bad.keys[0], len(frame), data=[frame]))]
            try:
                call(channel, "Put", stream, token="bob-secret")
                raise AssertionError("a chunk of 0 tokens was taken")
            except grpc.RpcError as refused:
                assert refused.code() == S.INVALID_ARGUMENT and "0 tokens" in refused.details()
        victim = make_prompt(40, seed=300)
        stored = call(channel, "Put", puts(victim), token="alice-secret").stored
        assert stored == 40
        lookup = call(channel, "Lookup", cache_pb2.LookupRequest(keys=victim.keys), token="alice-secret")
        assert lookup.hits == 40
    finally:
        channel.close()
        srv.stop(0)


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


def test_mutual_tls_tenants_without_a_common_name_are_their_alternative_names(tmp_path):
    """Certificates with no common name (SAN-only, as SPIFFE/SPIRE and cert-manager issue
    them) are each their own tenant, by URI or DNS name, never all the empty name (two
    such clients once read, listed and deleted each other's chunks)."""
    paths = make_certificates(
        tmp_path,
        ["carol"],
        {"spiffe-a": "URI:spiffe://example.org/ns/a/sa/engine", "spiffe-b": "URI:spiffe://example.org/ns/b/sa/engine",
         "dns-c": "DNS:engine-c.example", "nothing": "IP:127.0.0.9"},
    )  # fmt: skip
    config = ServerConfig(port=0, tiers=("cpu://?size=16MiB&slot=64KiB",), tls_cert=paths["server.crt"],
                          tls_key=paths["server.key"], tls_client_ca=paths["ca.crt"], shm_dir="")  # fmt: skip
    srv, port = create_server(config)
    ca = Path(paths["ca.crt"]).read_bytes()

    def channel(name: str) -> grpc.Channel:
        key, cert = (Path(paths[f"client-{name}.{ext}"]).read_bytes() for ext in ("key", "crt"))
        credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        return grpc.secure_channel(f"localhost:{port}", credentials)

    prompt = make_prompt(2, seed=402)
    channels = {name: channel(name) for name in ("carol", "spiffe-a", "spiffe-b", "dns-c", "nothing")}
    try:
        assert call(channels["spiffe-a"], "Put", puts(prompt)).stored == 2
        lookup = cache_pb2.LookupRequest(keys=prompt.keys)
        assert call(channels["spiffe-a"], "Lookup", lookup).hits == 2
        for other in ("spiffe-b", "dns-c", "carol"):  # other identities see nothing of it
            assert call(channels[other], "Lookup", lookup).hits == 0, other
            assert call(channels[other], "Delete", cache_pb2.DeleteRequest(keys=prompt.keys)) is not None
        assert call(channels["spiffe-a"], "Lookup", lookup).hits == 2
        assert len(srv.service.tenant_keys(tenant_tag("uri:spiffe://example.org/ns/a/sa/engine"))) == 2
        with pytest.raises(grpc.RpcError) as refused:
            call(channels["nothing"], "Lookup", lookup)
        assert refused.value.code() == S.UNAUTHENTICATED and "names no identity" in refused.value.details()
    finally:
        for c in channels.values():
            c.close()
        srv.stop(0)


def test_a_common_name_cannot_pass_for_an_alternative_name():
    assert certificate_identity({"x509_common_name": [b"uri:spiffe://x"], "peer_uri": [b"spiffe://y"]}, "auto") == (
        "uri:spiffe://y"
    )
    assert certificate_identity({"x509_common_name": [b""]}, "auto") is None
    assert certificate_identity({"x509_common_name": [b"carol"], "peer_dns": [b"e.example"]}, "dns") == "dns:e.example"


def test_stats_shows_a_tenant_its_own_chunks_and_only_an_operator_the_whole_server():
    """Where tenants share the server, Stats once gave every caller every tenant's name and
    the tiers' live counters (one tenant could watch another's reads and writes)."""
    srv, address = two_tenant_server(operators=("alice",))
    channel = grpc.insecure_channel(address)
    try:
        call(channel, "Put", puts(make_prompt(2, seed=403)), token="alice-secret")
        call(channel, "Put", puts(make_prompt(3, seed=404)), token="bob-secret")
        bob = call(channel, "Stats", cache_pb2.StatsRequest(), token="bob-secret")
        assert bob.tenant_chunks == 3
        assert all(t.capacity_bytes > 0 and t.used_bytes == 0 and not t.counters for t in bob.tiers)
        assert "alice" not in bob.config_json and "bob" not in bob.config_json
        alice = call(channel, "Stats", cache_pb2.StatsRequest(), token="alice-secret")
        assert alice.tenant_chunks == 2 and alice.tiers[0].counters["stored"] == 5
        assert "alice" in alice.config_json and "bob" in alice.config_json
    finally:
        channel.close()
        srv.stop(0)


# -- the shared-memory plane ----------------------------------------------------------------------
def test_metrics_ask_for_their_token_and_probes_do_not(caplog):
    """/metrics sums every tenant's traffic: with ``metrics_token`` set, it answers only a
    scrape that brings the token; /healthz and /readyz stay open for the kubelet; and a
    shared server whose metrics anyone may reach says so when it starts."""

    def get(port: int, path: str, token: str | None = None) -> int:
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                return answer.status
        except urllib.error.HTTPError as refused:
            return refused.code

    srv, _ = two_tenant_server(metrics_port=0, metrics_token="scrape-0123456789abcdef")
    try:
        assert get(srv.metrics_port, "/metrics") == 401
        assert get(srv.metrics_port, "/metrics", "alice-secret") == 401  # a tenant's token is not it
        assert get(srv.metrics_port, "/metrics", "scrape-0123456789abcdef") == 200
        assert get(srv.metrics_port, "/readyz") == 200 and get(srv.metrics_port, "/healthz") == 200
    finally:
        srv.stop(0)
    with caplog.at_level(logging.WARNING, logger="lmtier.server.app"):
        srv, _ = two_tenant_server(metrics_port=0, metrics_host="0.0.0.0")
        srv.stop(0)
    assert any("sums every tenant's traffic" in r.getMessage() for r in caplog.records)


def test_puts_that_announce_large_chunks_and_stall_hold_a_bounded_part_of_memory():
    """Bob opens Puts that each announce a chunk of the largest size, send its first piece
    and stall (sixteen of them once held 1.4 GB): the chunks half-received at once are
    bounded (four of the largest; two per tenant where tenants share the server), the
    rest are refused at once, and Alice's chunks in pieces still get through."""
    big = 4 << 20
    srv, address = two_tenant_server(max_chunk_bytes=big, workers=16)
    gate = threading.Event()
    bob, alice = connection(address), connection(address)
    put = bob.stream_unary(SERVICE + "Put", None, cache_pb2.PutResponse.FromString)

    def stalled(n: int):
        key = n.to_bytes(16, "little")
        yield pack(piece(key, big, 0, data=[b"\0" * (1 << 20)]))
        gate.wait(30)

    try:
        calls = [put.future(stalled(n), metadata=(("authorization", "Bearer bob-secret"),), timeout=30)
                 for n in range(6)]  # fmt: skip
        assert eventually(lambda: srv.service.receiving.held == 2 * big and sum(c.done() for c in calls) == 4, 10)
        refused = [c.exception() for c in calls if c.done()]
        assert {e.code() for e in refused} == {S.RESOURCE_EXHAUSTED}
        assert "no room to receive" in refused[0].details()
        # Alice: one chunk of 1 MiB sent in pieces of 256 KiB, rebuilt in her part of the budget
        prompt = make_prompt(1, seed=410)
        frame = codec.encode(prompt.chunks()[0])
        step = 1024
        pieces = [pack(piece(prompt.keys[0] if o == 0 else b"", len(frame) if o == 0 else 0, o,
                             data=[frame[o : o + step]])) for o in range(0, len(frame), step)]  # fmt: skip
        assert call(alice, "Put", pieces, token="alice-secret").stored == 1
    finally:
        gate.set()
        bob.close()
        alice.close()
        srv.stop(0)
    assert srv.service.receiving.held == 0


def test_a_fifo_named_like_a_segment_blocks_no_sweep(tmp_path):
    """Any local user can make a FIFO in the segment directory: opening it once blocked the
    server's sweep thread for good (readiness then never changed, no lease was reaped)."""
    name = "lmtier-" + "ab" * 16
    os.mkfifo(tmp_path / name)
    done: list = []
    t = threading.Thread(
        target=lambda: done.append((shm.sweep(str(tmp_path), min_age=0), shm.alive(str(tmp_path), name)))
    )
    t.start()
    t.join(10)
    assert done == [(0, False)]  # not swept (not a segment), not taken for a live client
    assert (tmp_path / name).exists()


def test_a_killed_servers_slab_is_reclaimed_when_a_server_starts(tmp_path):
    stale = tmp_path / ("lmtier-" + "cd" * 16)
    stale.write_bytes(b"\0" * 4096)  # a slab no live process holds a lock on
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    config = ServerConfig(port=0, tiers=("cpu://?size=1MiB&slot=64KiB",), shm_dir=str(tmp_path))
    srv, _ = create_server(config)
    try:
        assert not stale.exists()
    finally:
        srv.stop(0)


def test_a_client_cannot_name_the_servers_own_segment(tmp_path):
    """In single-tenant (sidecar) mode a Get whose landing region, and so its lease's owner,
    is the server's own slab once got leases that never expired."""
    config = ServerConfig(port=0, tiers=("cpu://?size=1MiB&slot=64KiB",), shm_dir=str(tmp_path))
    srv, port = create_server(config)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    prompt = make_prompt(1, seed=405)
    try:
        call(channel, "Put", puts(prompt))
        own = srv.service.shared.shared_name
        assert os.stat(tmp_path / own).st_mode & 0o777 == 0o400  # clients map it read-only; none may cut it
        request = cache_pb2.GetRequest(keys=prompt.keys, landing=[cache_pb2.SharedRegion(segment=own, offset=0,
                                                                                          length=1 << 16)])  # fmt: skip
        with pytest.raises(grpc.RpcError) as refused:
            call(channel, "Get", request)
        assert refused.value.code() == S.INVALID_ARGUMENT and "own segment" in refused.value.details()
        assert srv.service.leases.held == 0
        # nor name two segments in one Get: its lease belongs to one client's segment
        two = [cache_pb2.SharedRegion(segment=f"lmtier-{c * 32}", offset=0, length=1 << 16) for c in "ab"]
        with pytest.raises(grpc.RpcError) as refused:
            call(channel, "Get", cache_pb2.GetRequest(keys=prompt.keys * 2, landing=two))
        assert refused.value.code() == S.INVALID_ARGUMENT and "more than one segment" in refused.value.details()
    finally:
        channel.close()
        srv.stop(0)


def test_a_lease_ends_after_its_time_whatever_its_owner(monkeypatch):
    leases = Leases(1 << 20, "/nonexistent", ttl=0.0)
    monkeypatch.setattr("lmtier.server.leases.alive", lambda directory, name: True)  # an owner that never dies
    chunk = make_prompt(1, seed=406).chunks()[0]
    lease = leases.open(b"t" * 16, "lmtier-" + "ef" * 16)
    assert leases.hold(lease, chunk)
    leases.finish(lease)
    time.sleep(0.01)
    leases.reap()
    assert leases.held == 0


# -- a fair share of the memory tier ---------------------------------------------------------------
@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_one_tenants_ordinary_puts_leave_the_other_its_share_of_a_tier(tier, tmp_path):
    """Bob stores five times what the tier holds, in ordinary valid Puts: Alice's chunks,
    within her share, stay (one LRU once evicted them all within seconds, from memory and
    from disk), and Bob over his share evicts his own oldest chunks."""
    url = {"memory": "cpu://?size=512KiB&slot=8KiB",  # 64 slots
           "disk": f"file://{tmp_path}/disk?size=768KiB"}[tier]  # 64 frames of 12 KiB  # fmt: skip
    srv, address = two_tenant_server(tiers=(url,))
    channel = grpc.insecure_channel(address)
    try:
        alice = make_prompt(20, seed=407)
        assert call(channel, "Put", puts(alice), token="alice-secret").stored == 20
        for i in range(10):
            call(channel, "Put", puts(make_prompt(32, seed=500 + i)), token="bob-secret")
        lookup = cache_pb2.LookupRequest(keys=alice.keys)
        assert call(channel, "Lookup", lookup, token="alice-secret").hits == 20
        latest = make_prompt(32, seed=509)
        assert call(channel, "Lookup", cache_pb2.LookupRequest(keys=latest.keys), token="bob-secret").hits == 32
        # Alice may grow to her share of the 64 slots (32), evicting Bob's, not beyond it
        more = make_prompt(40, seed=408)
        call(channel, "Put", puts(more), token="alice-secret")
        stats = call(channel, "Stats", cache_pb2.StatsRequest(), token="alice-secret")
        assert 30 <= stats.tenant_chunks <= 33
    finally:
        channel.close()
        srv.stop(0)


# -- secrets ----------------------------------------------------------------------------------------
def test_tokens_keep_their_equals_signs_and_lose_their_spaces():
    assert parse_token("c2VjcmV0==") == ("c2VjcmV0==", "default")  # base64 padding: all secret
    assert parse_token("c2VjcmV0===alice") == ("c2VjcmV0==", "alice")  # the tenant follows the last "="
    assert parse_token("  s3cret-s3cret-1 = bob \r") == ("s3cret-s3cret-1", "bob")
    for bad in ("two words=bob", "secret=two words", "=bob", "   "):
        with pytest.raises(ConfigError):
            parse_token(bad)


def test_a_loose_token_file_and_a_short_token_are_warned_about(tmp_path, caplog):
    path = tmp_path / "tokens"
    path.write_text("# tenants\n  short=alice  \n\nlong-enough-secret-0123=bob\r\n")
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="lmtier"):
        tokens = read_token_file(path)
        srv, _ = create_server(ServerConfig(port=0, tiers=("cpu://?size=1MiB&slot=64KiB",), tokens=tuple(tokens),
                                            shm_dir=""))  # fmt: skip
        srv.stop(0)
    assert tokens == [("short", "alice"), ("long-enough-secret-0123", "bob")]
    text = caplog.text
    assert "can be read by other users" in text and "tenant alice has a token of 5 characters" in text
    assert "tenant bob" not in text
    path.write_text("a b c\n")
    with pytest.raises(ConfigError, match="line 1"):
        read_token_file(path)


def test_a_bracketed_ipv6_host_is_its_address():
    assert ServerConfig(host="[::]", tiers=("cpu://?size=1MiB",)).host == "::"


def test_the_events_tenant_digest_is_salted_per_deployment_and_full_length(monkeypatch):
    from lmtier.connectors.vllm.events import tenant_digest, tier_labels

    monkeypatch.delenv("LMTIER_EVENTS_SALT", raising=False)
    tenant_digest.cache_clear()
    one = tenant_digest("secret-token-0123456789", "cache:50051")
    assert len(one) == 64 and one != tenant_digest("secret-token-0123456789", "other:50051")
    monkeypatch.setenv("LMTIER_EVENTS_SALT", "deployment-secret")
    tenant_digest.cache_clear()
    assert tenant_digest("secret-token-0123456789", "cache:50051") != one
    # the same from every instance of the fleet, however the URL is written
    assert tier_labels("grpc://CACHE?token=secret-token-0123456789") == tier_labels(
        "grpc://cache:50051?token=secret-token-0123456789"
    )
    tenant_digest.cache_clear()


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


def test_a_layout_past_any_model_is_refused():
    from lmtier.errors import LayoutError
    from lmtier.kv.layout import KVLayout

    with pytest.raises(LayoutError, match="past any model"):
        KVLayout(131_072, 1, 1, dtype="uint8")


def test_one_secret_for_two_tenants_is_refused():
    with pytest.raises(ConfigError, match="tenants alice and bob"):
        ServerConfig(tiers=("cpu://?size=1MiB",), tokens=(("same-secret-0123456789", "alice"),
                                                         ("same-secret-0123456789", "bob")))  # fmt: skip
    ServerConfig(tiers=("cpu://?size=1MiB",), tokens=(("same-secret-0123456789", "alice"),) * 2)  # a repeat is fine


def test_a_client_shrinking_its_segment_mid_call_gets_an_error_and_the_server_lives(tmp_path):
    """Single-tenant (sidecar) mode: the client owns its segment and may shrink it while the
    server reads a Put from it or writes a Get into it. Under a mapping that is a SIGBUS that
    kills the server; read and written through the descriptor it is a clear error (and the
    server is fine). The race is driven hard: a thread flips the file's size all along."""
    from lmtier.testing.cache_server import ServerProcess

    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    # a disk tier first: every chunk got is written into the client's landing region
    server = ServerProcess(tmp_path, "--tier", f"file://{tmp_path / 'disk'}?size=64MiB", "--shm-dir", str(shm_dir))
    segment = shm.Segment(str(shm_dir), 64 * 65536, 65536)
    prompt = make_prompt(32, seed=77)
    frames = [codec.encode(c) for c in prompt.chunks()]
    channel = grpc.insecure_channel(server.address)
    flipping = threading.Event()

    def flip() -> None:
        while not flipping.is_set():
            os.truncate(segment.path, 0)
            os.truncate(segment.path, segment.size)

    try:
        # the deterministic case first: a region past the end of a segment shrunk to nothing
        os.truncate(segment.path, 0)
        region = cache_pb2.SharedRegion(segment=segment.name, offset=0, length=len(frames[0]))
        whole = Region(segment.name, 0, len(frames[0]))
        with pytest.raises(grpc.RpcError) as refused:
            call(channel, "Put", [pack(piece(prompt.keys[0], len(frames[0]), region=whole))])
        assert refused.value.code() == S.FAILED_PRECONDITION and "outside" in refused.value.details()
        for offset in (1 << 62, 1 << 63, (1 << 64) - 1):  # past any file offset: no OverflowError
            far = Region(segment.name, offset, len(frames[0]))
            with pytest.raises(grpc.RpcError) as refused:
                call(channel, "Put", [pack(piece(prompt.keys[0], len(frames[0]), region=far))])
            assert refused.value.code() == S.INVALID_ARGUMENT and "outside" in refused.value.details()
        call(channel, "Put", puts(prompt))  # stored, to be served into landing regions
        request = cache_pb2.GetRequest(keys=prompt.keys[:1], landing=[region])
        with pytest.raises(grpc.RpcError) as refused:
            list(call(channel, "Get", request))
        assert refused.value.code() == S.INVALID_ARGUMENT and "outside" in refused.value.details()
        os.truncate(segment.path, segment.size)

        thread = threading.Thread(target=flip, daemon=True)
        thread.start()
        codes: set = set()
        landing = [cache_pb2.SharedRegion(segment=segment.name, offset=i * 65536, length=65536) for i in range(32)]
        fd = os.open(segment.path, os.O_RDWR)  # never through our own mapping: it would SIGBUS here
        for _ in range(150):
            for i, frame in enumerate(frames[:8]):
                os.pwrite(fd, frame, (32 + i) * 65536)
            put = [pack(*[piece(k, len(f), region=Region(segment.name, (32 + i) * 65536, len(f)))
                          for i, (k, f) in enumerate(zip(prompt.keys[:8], frames[:8], strict=True))])]  # fmt: skip
            for method, request in (("Put", put), ("Get", cache_pb2.GetRequest(keys=prompt.keys, landing=landing))):
                try:
                    call(channel, method, request, timeout=30)
                    codes.add(S.OK)
                except grpc.RpcError as e:
                    codes.add(e.code())
                except Exception as e:  # a malformed frame read back under the flipping: not the server's
                    codes.add(type(e).__name__)
            if server.proc.poll() is not None:
                break
        flipping.set()
        thread.join()
        os.close(fd)
        assert server.proc.poll() is None, server.log()[-3000:]
        assert codes <= {S.OK, S.FAILED_PRECONDITION, S.INVALID_ARGUMENT, S.DATA_LOSS}, codes
        assert server.serving()
        lookup = call(channel, "Lookup", cache_pb2.LookupRequest(keys=prompt.keys))
        assert lookup.hits == 32  # every chunk the server stored is still served
    finally:
        flipping.set()
        channel.close()
        segment.close()
        server.stop()

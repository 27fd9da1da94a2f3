"""The cache server's bulk data channel (lmtier/server/data/channel.py, lmtier/tiers/grpc/data.py):
loads and saves of other hosts without gRPC's per-message costs, against real servers on
port 0.

As a user: the grpc tier loads and saves through it when it has no shared memory (saves
on the same host too), byte for byte, keeps its connection, replaces one the server
closed, verifies every frame as it arrives (a damaged chunk is a miss and is deleted),
speaks TLS where gRPC does, and goes through gRPC where the server runs none, where its
port cannot be reached (for a minute) or where a ticket is refused (for a second). As an
attacker: a ticket is one tenant's, opens one connection, once, and expires; a request
ends at call_timeout however slowly its client reads, and a client that stops reading is
cut off, its chunks let go. Limits: tests/test_data_channel_limits.py; what a client
sends (saves, malformed requests, fuzzed bytes): tests/test_data_channel_input.py.
"""

from __future__ import annotations

import socket
import time

import grpc
import pytest

from lmtier import metrics
from lmtier.config import ServerConfig
from lmtier.kv import codec
from lmtier.kv.chunk import release_all
from lmtier.kv.layout import KVLayout
from lmtier.server import create_server
from lmtier.server.auth import tenant_tag
from lmtier.server.calls import Abort
from lmtier.server.data import channel as server_data
from lmtier.testing.certs import make_certificates
from lmtier.tiers.base import open_tier
from lmtier.transport.datachannel import END, ERROR, FRAME, HELLO, ITEM, REQUEST, Closed, encode_request, recv_exact
from lmtier.v1 import cache_pb2

from conftest import eventually, make_namespace, make_prompt

TOKENS = (("alice-secret", "alice"), ("bob-secret", "bob"))


# -- a raw client of the channel ---------------------------------------------------------------
def connect(port: int, ticket: bytes, hello: bytes = HELLO) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    send(sock, hello + ticket)
    return sock


def answer(sock: socket.socket) -> tuple[list[bytes], str | None]:
    """The chunk bytes of one request's frames (each verified), and the error the server
    ended with ("closed" where it closed without one; None after END)."""
    frames: list[bytes] = []
    while True:
        try:
            kind, length = ITEM.unpack(recv_exact(sock, ITEM.size))
        except (Closed, ConnectionError):
            return frames, "closed"
        if kind == FRAME:
            frames.append(codec.decode(recv_exact(sock, length)).tobytes())
        elif kind == END:
            assert length == len(frames)
            return frames, None
        else:
            assert kind == ERROR
            return frames, recv_exact(sock, length).decode()


def data_get(port: int, ticket: bytes, keys) -> list[bytes]:
    """One load over a new connection; the chunk bytes of the leading run held."""
    with connect(port, ticket) as sock:
        send(sock, encode_request(keys))
        frames, error = answer(sock)
    assert error is None, error
    return frames


def tenant_of(token: str) -> bytes:
    """The tenant tag of the caller with ``token`` (TOKENS'; any other is the default tenant)."""
    return tenant_tag(dict(TOKENS).get(token, "default"))


def ticket(srv, token: str = "") -> bytes:
    """A ticket as OpenData gives it to the caller with ``token`` (in process: the same
    code the call runs once the caller's tenant is known)."""
    return srv.service.data.issue(tenant_of(token))


def send(sock: socket.socket, data: bytes) -> None:
    """What a client sends. A server that closed the connection first (a bad ticket, a
    handshake that failed) may answer the bytes with a reset: ``answer`` then reads what
    it said, if anything, and reports the close."""
    try:
        sock.sendall(data)
    except ConnectionError:
        pass


def start(**settings):
    settings.setdefault("tiers", ("cpu://?size=64MiB&slot=64KiB",))
    settings.setdefault("shm_dir", "")
    srv, port = create_server(ServerConfig(port=0, **settings))
    return srv, port


@pytest.fixture
def server():
    srv, port = start()
    srv.url = f"grpc://127.0.0.1:{port}?shm=off"
    yield srv
    srv.stop(0)


@pytest.fixture
def tenants():
    srv, port = start(tokens=TOKENS)
    srv.url = f"grpc://127.0.0.1:{port}?shm=off"
    yield srv
    srv.stop(0)


def data_bytes() -> float:
    labels = {"direction": "get", "transport": "data"}
    return metrics.SERVER_REGISTRY.get_sample_value("lmtier_server_bytes_total", labels) or 0


def leases(srv) -> int:
    return sum(entry.leases for entry in srv.store.tiers[0]._index.values())


# -- as a user ---------------------------------------------------------------------------------
def test_loads_without_shared_memory_go_through_the_data_channel_byte_for_byte(server):
    tier = open_tier(server.url)
    prompt = make_prompt(12, seed=1)
    try:
        tier.put(prompt.chunks())
        before = data_bytes()
        for _ in range(3):  # one connection, kept between loads
            got = tier.get([*prompt.keys, b"\x01" * 16, prompt.keys[0]])
            assert [c.tobytes() for c in got[:12]] == [prompt.chunk_bytes(i) for i in range(12)]
            assert got[12:] == [None, None]  # the leading run ends at the first miss
            assert all(c.verify() for c in got[:12])
            release_all(got)
        assert tier.counts["data_loads"] == 3 and tier.counts["data_fallbacks"] == 0
        assert data_bytes() - before >= 3 * 12 * prompt.namespace.layout.chunk_bytes(16)
        assert server.service.data.places.total == 1
        assert leases(server) == 0
    finally:
        tier.close()
    assert eventually(lambda: server.service.data.places.total == 0)  # closed with the tier


def test_a_damaged_chunk_is_a_miss_and_is_deleted(server):
    tier = open_tier(server.url)
    prompt = make_prompt(4, seed=2)
    try:
        tier.put(prompt.chunks())
        cpu = server.store.tiers[0]
        entry = cpu._index[tenant_tag("default") + prompt.keys[1]]
        cpu.slab.array[entry.slots[0] * cpu.slot_bytes + 100] ^= 0x40
        got = tier.get(prompt.keys)
        assert got[0].tobytes() == prompt.chunk_bytes(0)
        assert got[1] is None  # found out as it arrived: a miss, before the engine sees a byte
        release_all(got)
        assert tier.counts["data_loads"] == 1
        assert tier.contains(prompt.keys) == 1 and tier.counts["corrupt"] == 1
    finally:
        tier.close()


def test_a_server_without_a_data_channel_is_loaded_through_grpc():
    srv, port = start(data_channel=False)
    tier = open_tier(f"grpc://127.0.0.1:{port}?shm=off")
    prompt = make_prompt(3, seed=3)
    try:
        assert srv.service.data is None
        tier.put(prompt.chunks())
        for _ in range(2):  # asked once: not again for a while
            got = tier.get(prompt.keys)
            assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(3)]
            release_all(got)
        assert tier.counts["data_loads"] == 0 and tier.counts["data_fallbacks"] == 1
        assert tier.counts["errors"] == 0
    finally:
        tier.close()
        srv.stop(0)


def test_a_kept_connection_the_server_closed_is_replaced_without_a_miss(server, monkeypatch):
    monkeypatch.setattr(server_data, "IDLE_S", 0.3)
    tier = open_tier(server.url)
    prompt = make_prompt(3, seed=4)
    try:
        tier.put(prompt.chunks())
        release_all(tier.get(prompt.keys))  # opens a connection with the short idle time
        assert eventually(lambda: server.service.data.places.total == 0)  # the server closed it
        got = tier.get(prompt.keys)
        assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(3)]
        release_all(got)
        assert tier.counts["data_loads"] == 2 and tier.counts["data_fallbacks"] == 0
    finally:
        tier.close()


def test_tls_carries_the_channel_where_grpc_has_it(tmp_path):
    certs = make_certificates(tmp_path, clients=("carol",))
    srv, port = start(tls_cert=certs["server.crt"], tls_key=certs["server.key"], tls_client_ca=certs["ca.crt"])
    client = f"tls_ca={certs['ca.crt']}&tls_cert={certs['client-carol.crt']}&tls_key={certs['client-carol.key']}"
    tier = open_tier(f"grpcs://localhost:{port}?{client}&shm=off")
    prompt = make_prompt(3, seed=5)
    try:
        assert srv.service.data.tls
        tier.put(prompt.chunks())
        got = tier.get(prompt.keys)
        assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(3)]
        release_all(got)
        assert tier.counts["data_loads"] == 1
        # in plaintext, even with carol's own ticket: no handshake, nothing read
        with connect(srv.service.data.port, ticket_of(srv, "carol")) as sock:
            send(sock, encode_request(prompt.keys))
            assert answer(sock) == ([], "closed")
    finally:
        tier.close()
        srv.stop(0)


def ticket_of(srv, tenant: str) -> bytes:
    return srv.service.data.issue(tenant_tag(tenant))


# -- as an attacker -----------------------------------------------------------------------------
def test_a_ticket_is_its_tenants_good_once_and_expires(tenants):
    alice = open_tier(tenants.url + "&token=alice-secret")
    prompt = make_prompt(3, seed=6)
    port = tenants.service.data.port
    try:
        alice.put(prompt.chunks())
        assert data_get(port, ticket(tenants, "bob-secret"), prompt.keys) == []  # bob's: nothing of alice's
        good = ticket(tenants, "alice-secret")
        assert data_get(port, good, prompt.keys) == [prompt.chunk_bytes(i) for i in range(3)]
        for forged in (good, bytes(32), good[:-1] + bytes([good[-1] ^ 1])):  # used, zero, one bit off
            with connect(port, forged) as sock:
                send(sock, encode_request(prompt.keys))
                assert answer(sock) == ([], "closed")
        with connect(port, ticket(tenants, "alice-secret"), hello=b"LMTDATA0") as sock:
            send(sock, encode_request(prompt.keys))
            assert answer(sock) == ([], "closed")
        tenants.service.data.tickets.ttl = 0.05
        late = ticket(tenants, "alice-secret")
        time.sleep(0.2)
        with connect(port, late) as sock:
            send(sock, encode_request(prompt.keys))
            assert answer(sock) == ([], "closed")
    finally:
        alice.close()


def test_open_data_answers_only_a_caller_with_credentials(tenants):
    channel = grpc.insecure_channel(tenants.url.split("//")[1].split("?")[0])
    fn = channel.unary_unary(
        "/lmtier.v1.CacheService/OpenData",
        cache_pb2.OpenDataRequest.SerializeToString,
        cache_pb2.OpenDataResponse.FromString,
    )
    try:
        with pytest.raises(grpc.RpcError) as refused:
            fn(cache_pb2.OpenDataRequest(), timeout=10, metadata=(("authorization", "Bearer nope"),))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        got = fn(cache_pb2.OpenDataRequest(), timeout=10, metadata=(("authorization", "Bearer bob-secret"),))
        assert len(got.ticket) == 32 and got.port == tenants.service.data.port and not got.tls
    finally:
        channel.close()


def test_an_unreachable_data_port_is_not_tried_again_for_a_while(server, monkeypatch):
    from lmtier.testing.redis_server import free_port

    tier = open_tier(server.url)
    prompt = make_prompt(3, seed=20)
    try:
        monkeypatch.setattr(server.service.data, "port", free_port())  # what a closed firewall looks like
        tier.put(prompt.chunks())
        for _ in range(3):
            got = tier.get(prompt.keys)
            assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(3)]
            release_all(got)
        assert tier.counts["data_fallbacks"] == 1 and tier.counts["data_loads"] == 0  # once a minute
    finally:
        tier.close()


def test_a_refused_ticket_sends_one_load_through_grpc_and_the_next_through_the_channel(server, monkeypatch):
    tier = open_tier(server.url)
    prompt = make_prompt(3, seed=21)
    real = server.service.data.issue
    refusals = iter([Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")])

    def issue(tag, lane=None):
        for refusal in refusals:
            raise refusal
        return real(tag, lane)

    try:
        monkeypatch.setattr(server.service.data, "issue", issue)
        tier.put(prompt.chunks())  # refused: through gRPC
        assert tier.counts["data_fallbacks"] == 1 and tier.counts["data_saves"] == 0
        time.sleep(1.2)  # a refusal pauses the channel for a second, not a minute
        release_all(tier.get(prompt.keys))
        assert tier.counts["data_loads"] == 1
    finally:
        tier.close()


def test_a_request_whose_keys_trickle_in_ends_at_call_timeout():
    srv, _ = start(stall_timeout=1.0, call_timeout=2.0)
    try:
        sock = connect(srv.service.data.port, ticket(srv))
        sock.sendall(REQUEST.pack(b"GET1", 100, 1700))  # a key's length byte every half second
        started, ended = time.monotonic(), None
        while time.monotonic() - started < 20:
            try:
                sock.sendall(b"\x10")
            except OSError:
                ended = time.monotonic() - started
                break
            time.sleep(0.5)
            if srv.service.data.places.total == 0:
                ended = time.monotonic() - started
                break
        assert ended is not None and ended < 10
        assert eventually(lambda: srv.service.data.places.total == 0)
        sock.close()
    finally:
        srv.stop(0)


def test_a_request_ends_at_call_timeout_however_slowly_its_client_reads():
    layout = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16")
    prompt = make_prompt(24, seed=22, namespace=make_namespace(layout, chunk_tokens=64))  # 2 MiB chunks
    srv, port = start(tiers=("cpu://?size=128MiB&slot=2MiB",), stall_timeout=1.0, call_timeout=2.0)
    tier = open_tier(f"grpc://127.0.0.1:{port}?shm=off")
    try:
        tier.put(prompt.chunks())
        tier.close()
        sock = connect(srv.service.data.port, ticket(srv))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sock.sendall(encode_request(prompt.keys))
        started, ended = time.monotonic(), None
        # 64 KiB every 0.1 s: never a stall, and 48 MiB would take over a minute. The server's
        # side must end at call_timeout; what the kernel still buffers may reach this reader later.
        while time.monotonic() - started < 30:
            if not sock.recv(65536) or srv.service.data.places.total == 0:
                ended = time.monotonic() - started
                break
            time.sleep(0.1)
        assert ended is not None and ended < 15
        assert eventually(lambda: srv.service.data.places.total == 0 and leases(srv) == 0)
        sock.close()
    finally:
        srv.stop(0)


def test_a_client_that_stops_reading_is_cut_off_and_its_chunks_let_go():
    layout = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16")
    prompt = make_prompt(24, seed=8, namespace=make_namespace(layout, chunk_tokens=64))  # 2 MiB chunks
    srv, port = start(tiers=("cpu://?size=128MiB&slot=2MiB",), stall_timeout=1.0)
    tier = open_tier(f"grpc://127.0.0.1:{port}?shm=off")
    try:
        tier.put(prompt.chunks())
        before = srv.service.data.places.total  # the tier's own connection, kept
        sock = connect(srv.service.data.port, ticket(srv))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(encode_request(prompt.keys))  # 48 MiB asked for, none of it read
        assert eventually(lambda: leases(srv) > 0, 10)
        assert eventually(lambda: srv.service.data.places.total == before and leases(srv) == 0, 30)
        sock.close()
        got = tier.get(prompt.keys[:2])  # and the server serves the next client
        assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(2)]
        release_all(got)
    finally:
        tier.close()
        srv.stop(0)

"""What a client sends on the cache server's bulk data channel (lmtier/server/data/channel.py,
data/saves.py): saves, landed in the memory tier's slots or taken the usual way, scoped to
the ticket's tenant; a damaged, oversized or cut-off save stores the whole chunks before it
and nothing of itself; malformed requests and fuzzed bytes end the connection with a clear
error and leave the server serving, with no lease, slot or receive buffer left taken.
Real servers on port 0 (the helpers are tests/test_data_channel.py's)."""

from __future__ import annotations

import socket
import struct
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_data_channel import answer, connect, data_get, leases, start, ticket

from lmtier import metrics
from lmtier.kv import codec
from lmtier.kv.chunk import release_all
from lmtier.server.auth import tenant_tag
from lmtier.tiers.base import open_tier
from lmtier.transport.datachannel import END, ERROR, FRAME, HELLO, ITEM, REQUEST, Closed, recv_exact

from conftest import FUZZ_EXAMPLES, eventually, make_prompt

TOKENS = (("alice-secret", "alice"), ("bob-secret", "bob"))


@pytest.fixture
def server():
    srv, port = start()
    srv.url = f"grpc://127.0.0.1:{port}?shm=off"
    yield srv
    srv.stop(0)


@pytest.fixture
def tenants():
    srv, _ = start(tokens=TOKENS)
    yield srv
    srv.stop(0)


# -- saves --------------------------------------------------------------------------------------
def frames_of(prompt, start: int = 0, stop: int | None = None) -> list[bytes]:
    return [codec.encode(c) for c in prompt.chunks(start, stop)]


def save(port: int, ticket: bytes, frames: list[bytes], n: int | None = None, close_after: int | None = None):
    """One save over a new connection: (chunks stored, the error the server ended with)."""
    with connect(port, ticket) as sock:
        sock.sendall(REQUEST.pack(b"PUT1", len(frames) if n is None else n, 0))
        for frame in frames:
            sock.sendall(ITEM.pack(FRAME, len(frame)) + frame)
        if close_after is not None:
            sock.sendall(ITEM.pack(FRAME, close_after + 100) + bytes(close_after))
            return None, None
        kind, length = ITEM.unpack(recv_exact(sock, ITEM.size))
        if kind == END:
            return length, None
        assert kind == ERROR
        return None, recv_exact(sock, length).decode()


def held_bytes(srv, tenant: str, keys) -> list[bytes]:
    got = srv.store.get([tenant_tag(tenant) + k for k in keys])
    out = [c.tobytes() for c in got if c is not None]
    release_all(got)
    return out


def test_saves_without_shared_memory_land_in_the_memory_tier_through_the_data_channel(server):
    tier = open_tier(server.url)
    prompt = make_prompt(20, seed=11)
    try:
        before = (
            metrics.SERVER_REGISTRY.get_sample_value(
                "lmtier_server_bytes_total", {"direction": "put", "transport": "data"}
            )
            or 0
        )
        tier.put(prompt.chunks())
        tier.put(prompt.chunks(0, 5))  # held already: stored again is a touch
        assert tier.counts["data_saves"] == 2 and tier.counts["data_fallbacks"] == 0
        assert held_bytes(server, "default", prompt.keys) == [prompt.chunk_bytes(i) for i in range(20)]
        after = metrics.SERVER_REGISTRY.get_sample_value(
            "lmtier_server_bytes_total", {"direction": "put", "transport": "data"}
        )
        assert after - before >= 25 * prompt.namespace.layout.chunk_bytes(16)
        assert server.service.receiving.held == 0  # landed in place: no receive buffer taken
        got = tier.get(prompt.keys)
        assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(20)]
        release_all(got)
        assert leases(server) == 0
    finally:
        tier.close()


def test_on_the_same_host_saves_take_the_data_channel_and_loads_the_published_directory(tmp_path):
    srv, port = start(shm_dir=str(tmp_path))
    tier = open_tier(f"grpc://127.0.0.1:{port}?shm=on&shm_dir={tmp_path}")
    prompt = make_prompt(8, seed=19)
    try:
        tier.put(prompt.chunks())
        assert tier.counts["data_saves"] == 1
        got = tier.get(prompt.keys)
        assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(8)]
        release_all(got)
        assert tier.counts["directory_reads"] == 8 and tier.counts["data_loads"] == 0
    finally:
        tier.close()
        srv.stop(0)


def test_saves_on_a_server_without_a_memory_tier_go_the_usual_way(tmp_path):
    srv, port = start(tiers=(f"file://{tmp_path}/disk?size=64MiB",))
    tier = open_tier(f"grpc://127.0.0.1:{port}?shm=off")
    prompt = make_prompt(6, seed=12)
    try:
        assert srv.service.data.landing is None
        tier.put(prompt.chunks())
        assert tier.counts["data_saves"] == 1
        got = tier.get(prompt.keys)
        assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(6)]
        release_all(got)
        assert srv.service.receiving.held == 0
    finally:
        tier.close()
        srv.stop(0)


@pytest.mark.parametrize("usual", [False, True], ids=["landed", "usual way"])
def test_a_damaged_save_is_data_loss_and_the_chunks_before_it_are_kept(tmp_path, usual):
    tiers = (f"file://{tmp_path}/disk?size=64MiB",) if usual else ("cpu://?size=64MiB&slot=64KiB",)
    srv, _ = start(tiers=tiers)
    prompt = make_prompt(4, seed=13)
    frames = frames_of(prompt)
    bad = bytearray(frames[2])
    bad[-10] ^= 0x01  # a payload byte
    try:
        stored, error = save(srv.service.data.port, ticket(srv), [frames[0], frames[1], bytes(bad), frames[3]])
        assert stored is None and "payload checksum" in error
        assert held_bytes(srv, "default", prompt.keys) == [prompt.chunk_bytes(i) for i in range(2)]
        if not usual:
            assert leases(srv) == 0
        assert srv.service.receiving.held == 0
    finally:
        srv.stop(0)


def test_a_save_cut_off_mid_frame_keeps_the_whole_chunks_and_nothing_of_the_half_one(server):
    prompt = make_prompt(4, seed=14)
    stored, _ = save(server.service.data.port, ticket(server), frames_of(prompt, 0, 3), n=4, close_after=5000)
    assert stored is None
    assert eventually(
        lambda: held_bytes(server, "default", prompt.keys[:3]) == [prompt.chunk_bytes(i) for i in range(3)]
    )
    assert held_bytes(server, "default", prompt.keys[3:]) == []
    assert eventually(lambda: server.service.data.places.total == 0) and leases(server) == 0


def test_a_save_announced_and_sent_slowly_ends_at_call_timeout_and_holds_its_part_of_the_budget():
    # a stall timeout well over the steps before the slow sends begin (a loaded machine can
    # take a second between them: the holds must still be there when the budget is checked)
    srv, _ = start(tokens=TOKENS, stall_timeout=5.0, call_timeout=8.0, max_chunk_bytes=1 << 20)
    port = srv.service.data.port
    frame = frames_of(make_prompt(1, seed=23))[0]
    big = len(frame) + (700 << 10)  # a frame that announces more than it will ever send
    socks = []
    try:
        for _ in range(2):  # alice's part of the budget: two frames of the largest, half of four
            sock = connect(port, ticket(srv, "alice-secret"))
            sock.sendall(REQUEST.pack(b"PUT1", 1, 0) + ITEM.pack(FRAME, big) + frame[:4096])
            socks.append(sock)
        assert eventually(lambda: srv.service.receiving.held == 2 * big)
        stored, error = save(port, ticket(srv, "alice-secret"), [bytes(big)])
        assert stored is None and "receiving too many chunks" in error  # past her part: refused
        assert save(port, ticket(srv, "bob-secret"), frames_of(make_prompt(2, seed=24))) == (2, None)
        for _ in range(20):  # a byte every half second: no stall, but the request's time runs out
            for sock in socks:
                try:
                    sock.sendall(b"\x00")
                except OSError:
                    pass
            time.sleep(0.5)
        assert eventually(lambda: srv.service.receiving.held == 0, 10)
        assert leases(srv) == 0
        error = answer(socks[0])[1]  # its refusal, where the reset did not overtake it
        assert error == "closed" or "call_timeout" in error
    finally:
        for sock in socks:
            sock.close()
        srv.stop(0)


def test_saves_are_scoped_to_the_tickets_tenant(tenants):
    prompt, other = make_prompt(3, seed=15), make_prompt(3, seed=16)
    port = tenants.service.data.port
    assert save(port, ticket(tenants, "alice-secret"), frames_of(prompt)) == (3, None)
    theirs = [codec.encode(c.view_as(k)) for c, k in zip(other.chunks(), prompt.keys, strict=True)]
    assert save(port, ticket(tenants, "bob-secret"), theirs) == (3, None)  # bob's, under alice's keys
    assert held_bytes(tenants, "alice", prompt.keys) == [prompt.chunk_bytes(i) for i in range(3)]
    assert held_bytes(tenants, "bob", prompt.keys) == [other.chunk_bytes(i) for i in range(3)]


def test_save_limits_and_malformed_frames_are_refused_with_a_clear_error():
    srv, _ = start(max_chunk_bytes=64 * 1024)
    prompt = make_prompt(1, seed=17)
    good = frames_of(prompt)[0]
    port = srv.service.data.port
    try:
        cases = {
            "exceeds the limit": [bytes(70 * 1024)],
            "a malformed frame": [b"\x00" * len(good)],
            "the chunk key": [codec.encode(prompt.chunks()[0].view_as(b"\x05" * 20))],
        }
        for says, frames in cases.items():
            stored, error = save(port, ticket(srv), frames)
            assert stored is None and says in error, (says, error)
        with connect(port, ticket(srv)) as sock:  # an item that is not a frame
            sock.sendall(REQUEST.pack(b"PUT1", 1, 0) + ITEM.pack(END, 0))
            assert "expected a frame" in answer(sock)[1]
        assert held_bytes(srv, "default", prompt.keys) == []
        assert save(port, ticket(srv), [good]) == (1, None)  # and the next save is served
        assert srv.service.receiving.held == 0 and leases(srv) == 0
    finally:
        srv.stop(0)


MALFORMED = {
    "unknown op": (REQUEST.pack(b"DEL1", 1, 17) + bytes([16]) + bytes(16), "unknown request"),
    "no keys": (REQUEST.pack(b"GET1", 0, 0), "0 keys"),
    "too many keys": (REQUEST.pack(b"GET1", 5000, 5000 * 17), "at most 4096 keys"),
    "a body longer than its keys": (REQUEST.pack(b"GET1", 1, 40) + bytes(40), "1 keys in 40 bytes"),
    "a key past the body": (REQUEST.pack(b"GET1", 1, 10) + bytes([16]) + bytes(9), "runs past"),
    "fewer keys than said": (REQUEST.pack(b"GET1", 2, 17) + bytes([16]) + bytes(16), "names 1 keys, not the 2"),
    "a key of 17 bytes": (REQUEST.pack(b"GET1", 1, 18) + bytes([17]) + bytes(17), "key"),
    "a save with a body": (REQUEST.pack(b"PUT1", 1, 17) + bytes(17), "a save of 1 frames"),
    "a save of no frames": (REQUEST.pack(b"PUT1", 0, 0), "a save of 0 frames"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_requests_end_the_connection_with_a_clear_error(server, case):
    request, says = MALFORMED[case]
    prompt = make_prompt(2, seed=9)
    tier = open_tier(server.url)
    try:
        tier.put(prompt.chunks())
        before = server.service.data.places.total
        with connect(server.service.data.port, ticket(server)) as sock:
            sock.sendall(request)
            frames, error = answer(sock)
        assert frames == [] and error is not None and says in error
        assert data_get(server.service.data.port, ticket(server), prompt.keys) == [
            prompt.chunk_bytes(i) for i in range(2)
        ]
        assert eventually(lambda: server.service.data.places.total == before) and leases(server) == 0
    finally:
        tier.close()


@pytest.fixture(scope="module")
def fuzzed():
    srv, port = start()
    tier = open_tier(f"grpc://127.0.0.1:{port}?shm=off")
    prompt = make_prompt(3, seed=10)
    tier.put(prompt.chunks())
    tier.close()
    yield srv, prompt
    srv.stop(0)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(
    before=st.binary(max_size=64),
    after=st.one_of(
        st.binary(max_size=200),
        st.builds(
            lambda op, n, length, body: struct.pack("<4sII", op, n, length) + body,
            st.sampled_from([b"GET1", b"PUT1"]),
            st.integers(0, 2**32 - 1),
            st.integers(0, 2**32 - 1),
            st.binary(max_size=120),
        ),
        st.builds(  # a save of one frame, damaged anywhere or cut short
            lambda frame, at, cut: (
                REQUEST.pack(b"PUT1", 1, 0)
                + ITEM.pack(FRAME, len(frame))
                + (frame[:at] + bytes([frame[at] ^ 0x10]) + frame[at + 1 :])[:cut]
            ),
            st.just(codec.encode(make_prompt(1, seed=18).chunks()[0])),
            st.integers(0, 8000),
            st.integers(0, 9000),
        ),
    ),
    with_ticket=st.booleans(),
)
def test_fuzzed_bytes_on_the_channel_get_an_error_or_a_close_and_the_server_serves_on(
    fuzzed, before, after, with_ticket
):
    srv, prompt = fuzzed
    port = srv.service.data.port
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        try:
            sock.sendall((HELLO + ticket(srv) if with_ticket else before) + after)
            sock.shutdown(socket.SHUT_WR)  # nothing more: the server must not wait for it
        except OSError:  # the server refused and closed already
            pass
        while True:
            try:
                kind, length = ITEM.unpack(recv_exact(sock, ITEM.size))
            except (Closed, ConnectionError):
                break
            assert kind in (FRAME, END, ERROR)
            if kind in (FRAME, ERROR):
                recv_exact(sock, length)
    finally:
        sock.close()
    assert data_get(port, ticket(srv), prompt.keys) == [prompt.chunk_bytes(i) for i in range(3)]
    assert eventually(lambda: srv.service.data.places.total == 0, 10) and leases(srv) == 0
    assert srv.service.receiving.held == 0

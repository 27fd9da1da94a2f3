"""Availability is part of isolation: what one tenant of a shared ``lmtier serve`` can take
from the others in memory (receive buffers held by Puts that fail or stall, a tier's space
under one tenant's ordinary Puts, leases) and through the shared-memory plane (FIFOs and
stale slabs in the segment directory, a client naming the server's own segment or shrinking
its own mid-call), driven by raw gRPC clients written from the ``.proto``.

Calls, workers and connections are in test_availability_calls.py; identities, tokens and
secrets in test_availability_identity.py.
"""

from __future__ import annotations

import os
import threading
import time

import grpc
import msgpack
import pytest
import xxhash

from lmtier.config import ServerConfig
from lmtier.kv import codec
from lmtier.server import create_server
from lmtier.server.leases import Leases
from lmtier.transport import shm
from lmtier.transport.pieces import Region, pack, piece
from lmtier.v1 import cache_pb2

from conftest import eventually, make_prompt
from raw_client import SERVICE, S, call, connection, puts, two_tenant_server


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


# -- the shared-memory plane ----------------------------------------------------------------------
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


# -- bounds on what a client declares ------------------------------------------------------------
def test_a_layout_past_any_model_is_refused():
    from lmtier.errors import LayoutError
    from lmtier.kv.layout import KVLayout

    with pytest.raises(LayoutError, match="past any model"):
        KVLayout(131_072, 1, 1, dtype="uint8")


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

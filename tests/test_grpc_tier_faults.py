"""The grpc:// tier against real cache servers on port 0, when things go wrong: bad input
(a clear status, nothing left behind), chunks damaged on the server, failures (typed errors
from the tier, misses from the store), and the server's readiness, health and metrics
following its tiers.

The contract, tenants and TLS are in test_grpc_tier_contract.py; shared memory and leases
in test_grpc_tier_shm.py.
"""

from __future__ import annotations

import shutil
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from lmtier.errors import RetryableError, TierError
from lmtier.kv import codec
from lmtier.kv.chunk import release_all
from lmtier.testing.redis_server import free_port
from lmtier.tiers.base import open_tier
from lmtier.transport import shm
from lmtier.transport.pieces import Region, pack, piece
from lmtier.v1 import cache_pb2

from conftest import SMALL, eventually, make_namespace, make_prompt
from grpc_servers import (
    code_of,
    flip_a_stored_byte,
    misses_through_a_store,
    raw,
    read_back,
    start,
    tenants_server,
)


@pytest.fixture(scope="module")
def server():
    srv = tenants_server()
    yield srv
    srv.stop(0)


# -- bad input -------------------------------------------------------------------------------------
def one(*args, **kw) -> bytes:
    """A Pieces message holding one piece."""
    return pack(piece(*args, **kw))


def frame_of(chunk) -> bytes:
    return codec.encode(chunk)


def test_malformed_requests_get_a_clear_status_and_leave_nothing_behind(server):
    prompt = make_prompt(3, seed=46)
    k0, k1 = prompt.keys[0], prompt.keys[1]
    good = frame_of(prompt.chunks()[0])
    damaged = bytearray(good)
    damaged[-10] ^= 0xFF
    other_key = frame_of(prompt.chunks()[1])
    half = len(good) // 2
    cases = {
        "key of the wrong length": (
            lambda: raw(server.address, "Lookup", cache_pb2.LookupRequest(keys=[b"short"]), cache_pb2.LookupResponse),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        "too many keys": (
            lambda: raw(server.address, "Lookup", cache_pb2.LookupRequest(keys=[k0] * 5000), cache_pb2.LookupResponse),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        "not a Pieces message": (
            lambda: raw(server.address, "Put", [b"\x0a\xff\xff"]),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        "not a frame": (
            lambda: raw(server.address, "Put", [one(k0, 100, data=[b"x" * 100])]),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        "damaged payload": (
            lambda: raw(server.address, "Put", [one(k0, len(good), data=[bytes(damaged)])]),
            grpc.StatusCode.DATA_LOSS,
        ),
        "frame under another key": (
            lambda: raw(server.address, "Put", [one(k0, len(other_key), data=[other_key])]),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        "oversized frame": (
            lambda: raw(server.address, "Put", [one(k0, 1 << 40, data=[good[:half]])]),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
        "stream stops half way": (
            lambda: raw(server.address, "Put", [one(k0, len(good), data=[good[:half]])]),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        "pieces out of order": (
            lambda: raw(
                server.address,
                "Put",
                [one(k0, len(good), data=[good[:half]]), one(b"", 0, half + 1, data=[good[half:]])],
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        "any segment, on a server with several tenants": (  # names are checked too: test_security_limits
            lambda: raw(server.address, "Put", [one(k0, 64, region=Region("../etc/passwd", 0, 64))]),
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
        "a segment that is not on this host": (
            lambda: raw(server.address, "Put", [one(k0, 64, region=Region("lmtier-" + "0" * 32, 0, 64))]),
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
        "more landing regions than keys": (
            lambda: raw(
                server.address,
                "Get",
                cache_pb2.GetRequest(keys=[k0], landing=[cache_pb2.SharedRegion(segment="x", length=1)] * 2),
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    }
    pool = server.service.buffers
    for name, (call, want) in cases.items():
        assert code_of(call) == want, name
        assert raw(server.address, "Lookup", cache_pb2.LookupRequest(keys=[k0, k1]), cache_pb2.LookupResponse).hits == 0
        assert pool.outstanding == 0, f"{name}: a receive buffer was not returned"
    # A chunk that completed before the bad one is kept; the stream stops at the bad one.
    damaged_next = bytearray(other_key)
    damaged_next[-10] ^= 0xFF
    response = code_of(
        lambda: raw(
            server.address,
            "Put",
            [one(k0, len(good), data=[good]), one(k1, len(good), data=[bytes(damaged_next)])],
        )
    )
    assert response == grpc.StatusCode.DATA_LOSS
    assert raw(server.address, "Lookup", cache_pb2.LookupRequest(keys=[k0, k1]), cache_pb2.LookupResponse).hits == 1
    raw(server.address, "Delete", cache_pb2.DeleteRequest(keys=[k0]), cache_pb2.DeleteResponse)


def test_a_chunk_in_many_pieces_arrives_whole(server):
    ns = make_namespace(chunk_tokens=256)  # 64 KiB chunks in 16 KiB pieces
    prompt = make_prompt(3, seed=47, namespace=ns)
    tier = open_tier(server.url + "?token=alice-secret&shm=off&piece=16KiB")
    try:
        tier.put(prompt.chunks())
        assert read_back(tier, prompt.keys) == [prompt.chunk_bytes(i) for i in range(3)]
    finally:
        tier.close()


@pytest.mark.parametrize("shm", ["off", "on", "off&data=false"])
def test_a_chunk_damaged_on_the_server_is_a_miss_and_is_deleted(server, shm):
    tier = open_tier(server.url + f"?token=alice-secret&shm={shm}")
    prompt = make_prompt(4, seed=48)
    tier.put(prompt.chunks())
    flip_a_stored_byte(server, "alice", prompt.keys[1])
    got = tier.get(prompt.keys)
    assert got[0].tobytes() == prompt.chunk_bytes(0)
    # found out by the reader, before the engine sees a byte: as the frame arrived (a
    # miss), or as the chunk is read
    assert got[1] is None or not got[1].verify()
    release_all(got)
    assert tier.contains(prompt.keys) == 1  # and the server's copy is gone
    assert tier.counts["corrupt"] == 1
    tier.delete(prompt.keys)
    tier.close()


# -- failures ------------------------------------------------------------------------------------
def test_a_dead_server_is_a_retryable_error_from_the_tier_and_misses_through_the_store():
    tier = open_tier(f"grpc://127.0.0.1:{free_port()}?timeout=2&retries=1&shm=off")
    prompt = make_prompt(2, seed=55)
    for call in (lambda: tier.contains(prompt.keys), lambda: tier.get(prompt.keys), lambda: tier.put(prompt.chunks())):
        with pytest.raises(RetryableError):
            call()
    assert tier.counts["errors"] == 3  # one try each: the tier retries nothing itself
    assert misses_through_a_store(tier, prompt)


def fake_server(**methods):
    """A CacheService that answers only ``methods`` (raw bytes in and out), on port 0."""
    from concurrent.futures import ThreadPoolExecutor

    kinds = {"Get": grpc.unary_stream_rpc_method_handler, "Release": grpc.unary_unary_rpc_method_handler}
    handlers = {name: kinds[name](fn) for name, fn in methods.items()}
    server = grpc.server(ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("lmtier.v1.CacheService", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_a_get_that_breaks_half_way_returns_all_it_had_received_before_raising(tmp_path):
    """Four chunks asked for: one read in the server's memory (leased), one landed in our
    slot, one as bytes, half of the fourth; then the server goes away. The tier raises, and
    the lease is released to the server, the slot and the receive buffer come back."""
    prompt = make_prompt(4, seed=56)
    chunks, frames = prompt.chunks(), [codec.encode(c) for c in prompt.chunks()]
    memory = shm.Segment(str(tmp_path), 1 << 20, 64 << 10)  # the fake server's own memory
    memory.view(0)[: chunks[0].nbytes] = prompt.chunk_bytes(0)
    clients = shm.SegmentFiles(str(tmp_path))
    released: list[int] = []

    def get(request: bytes, context):
        asked = cache_pb2.GetRequest.FromString(request)
        head = bytes(codec.encode_parts(chunks[0])[0])
        yield pack(piece(asked.keys[0], len(frames[0]), region=Region(memory.name, 0, chunks[0].nbytes), head=head,
                         lease=7))  # fmt: skip
        slot = asked.landing[1]
        clients.write(slot.segment, slot.offset, [frames[1]])
        yield pack(piece(asked.keys[1], len(frames[1]), region=Region(slot.segment, slot.offset, len(frames[1]))))
        yield pack(piece(asked.keys[2], len(frames[2]), data=[frames[2]]))
        yield pack(piece(asked.keys[3], len(frames[3]), data=[frames[3][:100]]))
        context.abort(grpc.StatusCode.UNAVAILABLE, "the server went away")

    def release(request: bytes, context) -> bytes:
        released.append(cache_pb2.ReleaseRequest.FromString(request).lease)
        return b""

    server, port = fake_server(Get=get, Release=release)
    tier = open_tier(f"grpc://127.0.0.1:{port}?shm=on&shm_dir={tmp_path}&shm_size=16MiB&retries=0")
    try:
        with pytest.raises(RetryableError, match="UNAVAILABLE"):
            tier.get(prompt.keys)
        assert eventually(lambda: released == [7])  # the server's lease, through Release
        segment = tier.memory.segment()
        assert segment.num_slots == 4 and segment.free_slots == 1  # the landed chunk's slot is back
        assert tier._buffers.outstanding == 0  # and the half frame's receive buffer
    finally:
        tier.close()
        server.stop(0)
        memory.close()


# -- health, reflection, readiness, metrics ----------------------------------------------------------
def test_readiness_probes_evict_nothing_from_full_tiers(tmp_path):
    """A server at capacity in memory and on disk probes its tiers every few milliseconds:
    each probe proves its tier answers, and none evicts a chunk (a server used to lose one
    chunk to every probe once full) or leaves a file behind."""
    disk = tmp_path / "disk"
    chunk = SMALL.chunk_bytes(16)
    srv, port = start(tiers=(f"cpu://?size={4 * chunk}&slot={chunk}", f"file://{disk}?size={16 * chunk}&segment=64KiB"))
    tier = open_tier(f"grpc://127.0.0.1:{port}?shm=off")
    try:
        cpu, files = srv.store.tiers
        for seed in range(8):  # more than either tier holds
            tier.put(make_prompt(4, seed=seed).chunks())
            srv.store.flush()
        evictions = cpu.stats()["evictions"], files.stats()["evictions"]
        assert min(evictions) > 0, "both tiers must be full for this to prove anything"
        held = (list(cpu._index), files.keys())
        for _ in range(20):
            assert srv.probe()
        assert (list(cpu._index), files.keys()) == held
        assert (cpu.stats()["evictions"], files.stats()["evictions"]) == evictions
        assert list((disk / "tmp").iterdir()) == []
    finally:
        tier.close()
        srv.stop(0)


def test_a_probe_fails_for_a_closed_memory_tier_and_an_unwritable_disk(tmp_path):
    from lmtier.tiers.cpu import CpuTier
    from lmtier.tiers.disk import DiskTier

    memory = CpuTier(size=1 << 20, slot=64 << 10)
    memory.probe(b"k" * 16)
    memory.close()
    with pytest.raises(TierError, match="closed"):
        memory.probe(b"k" * 16)
    files = DiskTier(tmp_path / "disk", size=1 << 20)
    try:
        files.probe(b"k" * 16)
        shutil.rmtree(tmp_path / "disk" / "tmp")
        (tmp_path / "disk" / "tmp").write_bytes(b"not a directory")
        with pytest.raises(OSError):
            files.probe(b"k" * 16)
    finally:
        files.close()


def test_health_reflection_metrics_and_readiness_follow_the_tiers(tmp_path):
    disk = tmp_path / "disk"
    srv, port = start(
        tiers=("cpu://?size=16MiB&slot=64KiB", f"file://{disk}?size=64MiB"), metrics_port=0, probe_interval=0.1
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            assert check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
            service = health_pb2.HealthCheckRequest(service="lmtier.v1.CacheService")
            assert check(service).status == health_pb2.HealthCheckResponse.SERVING
            answers = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
            names = {s.name for a in answers for s in a.list_services_response.service}
            assert {"lmtier.v1.CacheService", "grpc.health.v1.Health"} <= names

        base = f"http://127.0.0.1:{srv.metrics_port}"
        tier = open_tier(f"grpc://127.0.0.1:{port}")
        tier.put(make_prompt(2, seed=51).chunks())
        tier.close()
        body = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
        assert 'lmtier_server_rpcs_total{code="OK",method="Put"}' in body
        assert "lmtier_server_ready 1.0" in body
        assert urllib.request.urlopen(base + "/readyz", timeout=10).status == 200

        shutil.rmtree(disk)  # the disk tier stops working (a file where its directory was,
        disk.write_bytes(b"not a directory")  # so it cannot start again): the server must say so
        deadline = time.monotonic() + 30
        while srv.ready and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not srv.ready
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(base + "/readyz", timeout=10)
        assert info.value.code == 503
        assert urllib.request.urlopen(base + "/healthz", timeout=10).status == 200  # alive, not ready
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        srv.stop(0)


def test_the_health_service_is_the_standard_one_as_grpcs_own_client_sees_it(server):
    """lmtier answers grpc.health.v1 itself (the server extra needs only grpcio and
    protobuf): grpcio-health-checking's own client and messages are the judge."""
    with grpc.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.RpcError) as unknown:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        watch = stub.Watch(health_pb2.HealthCheckRequest(service="lmtier.v1.CacheService"), timeout=5)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        gone = stub.Watch(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert next(gone).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        gone.cancel()
        raw = channel.unary_unary("/grpc.health.v1.Health/Check")  # bytes that are no request
        with pytest.raises(grpc.RpcError) as bad:
            raw(b"\x0f\xff\xff", timeout=5)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT

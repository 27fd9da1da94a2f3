"""The grpc:// tier against real cache servers on port 0: both transports, tenants, TLS,
bad input, failures (typed errors from the tier, misses from the store), readiness, and a
client that dies mid-transfer.

Longer than 400 lines: one server fixture and its vocabulary serve every scenario here;
the transports share the contract suite, the rest are stories of one server each.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from lmtier import metrics
from lmtier.config import ServerConfig
from lmtier.errors import RetryableError, TierError
from lmtier.kv import codec
from lmtier.kv.chunk import release_all
from lmtier.server import create_server
from lmtier.server.auth import tenant_tag
from lmtier.store.tiered import TieredStore
from lmtier.testing.certs import make_certificates
from lmtier.testing.redis_server import free_port
from lmtier.tiers.base import open_tier
from lmtier.transport import shm
from lmtier.transport.pieces import Region, pack, piece
from lmtier.v1 import cache_pb2

from conftest import SMALL, eventually, make_namespace, make_prompt
from tier_contract import EvictingTierContract

SERVICE = "/lmtier.v1.CacheService/"


def start(tmp_path=None, **overrides):
    config = ServerConfig(port=0, tiers=overrides.pop("tiers", ("cpu://?size=64MiB&slot=64KiB",)), **overrides)
    server, port = create_server(config)
    return server, port


def flip_a_stored_byte(server, tenant: str, key: bytes) -> None:
    cpu = server.store.tiers[0]
    entry = cpu._index[tenant_tag(tenant) + key]
    cpu._slab[entry.slots[0] * cpu.slot_bytes + 100] ^= 0x40


def shm_bytes(direction: str) -> float:
    labels = {"direction": direction, "transport": "shm"}
    return metrics.SERVER_REGISTRY.get_sample_value("lmtier_server_bytes_total", labels) or 0


def grpc_bytes(direction: str) -> float:
    labels = {"direction": direction, "transport": "grpc"}
    return metrics.SERVER_REGISTRY.get_sample_value("lmtier_server_bytes_total", labels) or 0


def tier_errors(tier) -> float:
    """The store's count of a tier's failed calls (every operation)."""
    return sum(
        s.value
        for m in metrics.TIER_ERRORS.collect()
        for s in m.samples
        if s.name.endswith("_total") and s.labels["tier"] == tier.name
    )


def misses_through_a_store(tier, prompt) -> bool:
    """What the engine sees of ``tier`` inside a store: no exception, misses, errors counted."""
    before = tier_errors(tier)
    with TieredStore([tier]) as store:  # closing the store closes the tier
        store.put(prompt.chunks())
        missed = store.lookup(prompt.keys) == 0 and store.get(prompt.keys) == []
    return missed and tier_errors(tier) > before


def read_back(tier, keys) -> list[bytes]:
    """The bytes of the chunks ``tier`` holds for ``keys``, released after reading."""
    got = tier.get(keys)
    try:
        return [c.tobytes() for c in got]
    finally:
        release_all(got)


class TestGrpcTier(EvictingTierContract):
    """The shared contract over TCP (the server's bulk data channel): each tier gets its own
    server, bounded like the tier."""

    shm = "off"
    data = "true"

    @pytest.fixture(autouse=True)
    def _servers(self):
        self.servers = {}
        yield
        for server in self.servers.values():
            server.stop(0)

    def make_tier(self, capacity_chunks, chunk_bytes):
        server, port = start(tiers=(f"cpu://?size={capacity_chunks * chunk_bytes}&slot={chunk_bytes}",))
        tier = open_tier(f"grpc://127.0.0.1:{port}?shm={self.shm}&data={self.data}")
        self.servers[id(tier)] = server
        return tier

    def corrupt(self, tier, key):
        flip_a_stored_byte(self.servers[id(tier)], "default", key)


class TestGrpcTierPlainGrpc(TestGrpcTier):
    """The same contract with frame bytes in gRPC messages (a server without a data channel)."""

    data = "false"

    @pytest.fixture(autouse=True)
    def _through_grpc(self, _servers):
        before = grpc_bytes("put") + grpc_bytes("get")
        yield
        assert grpc_bytes("put") + grpc_bytes("get") > before, "no frame went through gRPC messages"


class TestGrpcTierSharedMemory(TestGrpcTier):
    """The same contract with frame bytes moving through the client's shared memory (saves
    too: no data channel)."""

    shm = "on"
    data = "false"

    @pytest.fixture(autouse=True)
    def _through_shared_memory(self, _servers):
        before = shm_bytes("put") + shm_bytes("get")
        yield
        assert shm_bytes("put") + shm_bytes("get") > before, "no frame went through shared memory"


@pytest.fixture(scope="module")
def server():
    srv, port = start(tokens=(("alice-secret", "alice"), ("bob-secret", "bob")))
    srv.url = f"grpc://127.0.0.1:{port}"
    srv.address = f"127.0.0.1:{port}"
    yield srv
    srv.stop(0)


def raw(address: str, method: str, request, response_type=None, token: str | None = "alice-secret", stream=False):
    """One call on a bare channel; returns the response (or raises the RpcError)."""
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(address) as channel:
        if method == "Put":
            call = channel.stream_unary(SERVICE + "Put", None, cache_pb2.PutResponse.FromString)
            return call(iter(request), metadata=metadata, timeout=10)
        if method == "Get":
            call = channel.unary_stream(SERVICE + "Get", cache_pb2.GetRequest.SerializeToString, None)
            return list(call(request, metadata=metadata, timeout=10))
        call = channel.unary_unary(SERVICE + method, type(request).SerializeToString, response_type.FromString)
        return call(request, metadata=metadata, timeout=10)


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code()


# -- tenants ----------------------------------------------------------------------------------
def test_no_token_or_a_wrong_token_is_unauthenticated(server):
    lookup = cache_pb2.LookupRequest(keys=[make_prompt(1).keys[0]])
    for token in (None, "nope", "alice-secret-but-longer"):
        assert code_of(lambda t=token: raw(server.address, "Lookup", lookup, cache_pb2.LookupResponse, t)) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
    assert code_of(lambda: raw(server.address, "Get", cache_pb2.GetRequest(keys=lookup.keys), token=None)) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    # The tier raises a refusal as an error not worth retrying; the store the engine
    # calls turns it into misses and a count, not an exception.
    tier = open_tier(server.url + "?token=wrong&retries=0")
    prompt = make_prompt(2, seed=41)
    with pytest.raises(TierError) as info:
        tier.contains(prompt.keys)
    assert not isinstance(info.value, RetryableError) and "UNAUTHENTICATED" in str(info.value)
    assert misses_through_a_store(tier, prompt)


def test_a_tenant_cannot_read_list_delete_or_probe_another_tenants_chunks(server, monkeypatch):
    alice = open_tier(server.url + "?token=alice-secret")
    monkeypatch.setenv("LMTIER_TOKEN", "bob-secret")  # the token may come from the environment
    bob = open_tier(server.url)
    try:
        prompt = make_prompt(4, seed=42)
        alice.put(prompt.chunks())
        assert alice.contains(prompt.keys) == 4
        assert bob.contains(prompt.keys) == 0  # probe
        assert bob.get(prompt.keys) == [None] * 4  # read
        assert not set(bob.keys()) & set(prompt.keys)  # list
        assert set(prompt.keys) <= set(alice.keys())
        bob.delete(prompt.keys)  # delete
        assert alice.contains(prompt.keys) == 4
        assert bob.stats()["chunks"] == 0 and alice.stats()["chunks"] >= 4
        # Bob storing other bytes under the same keys gets his own copies; Alice's stay.
        other = make_prompt(4, seed=43)
        bob.put([c.view_as(k) for c, k in zip(other.chunks(), prompt.keys, strict=True)])
        for tier, owner in ((alice, prompt), (bob, other)):
            assert read_back(tier, prompt.keys) == [owner.chunk_bytes(i) for i in range(4)]
    finally:
        alice.close()
        bob.close()


# -- TLS ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("certs"), clients=("carol", "dave"))


def test_tls_serves_clients_that_trust_its_ca_and_refuses_plaintext(certs):
    srv, port = start(tls_cert=certs["server.crt"], tls_key=certs["server.key"])
    try:
        prompt = make_prompt(3, seed=44)
        good = open_tier(f"grpcs://localhost:{port}?tls_ca={certs['ca.crt']}")
        good.put(prompt.chunks())
        assert good.contains(prompt.keys) == 3
        plain = open_tier(f"grpc://127.0.0.1:{port}?retries=0")
        assert misses_through_a_store(plain, prompt)  # cannot talk to a TLS server: misses
        good.close()
    finally:
        srv.stop(0)


def test_mutual_tls_maps_the_client_certificate_to_its_tenant(certs):
    srv, port = start(tls_cert=certs["server.crt"], tls_key=certs["server.key"], tls_client_ca=certs["ca.crt"])
    base = f"grpcs://localhost:{port}?tls_ca={certs['ca.crt']}"
    carol = open_tier(f"{base}&tls_cert={certs['client-carol.crt']}&tls_key={certs['client-carol.key']}")
    dave = open_tier(f"{base}&tls_cert={certs['client-dave.crt']}&tls_key={certs['client-dave.key']}")
    anonymous = open_tier(base + "&retries=0")
    try:
        prompt = make_prompt(3, seed=45)
        carol.put(prompt.chunks())
        assert carol.contains(prompt.keys) == 3
        assert dave.contains(prompt.keys) == 0
        with pytest.raises(TierError):
            anonymous.contains(prompt.keys)  # no certificate: refused ...
        assert misses_through_a_store(anonymous, make_prompt(3, seed=145))  # ... which the engine sees as misses
        assert len(srv.service.tenant_keys(tenant_tag("carol"))) == 3
    finally:
        for tier in (carol, dave, anonymous):
            tier.close()
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
        "any segment, on a server with several tenants": (  # names are checked too: test_security
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


# -- shared memory -------------------------------------------------------------------------------
def test_a_server_that_cannot_see_the_segment_falls_back_to_plain_grpc(tmp_path):
    elsewhere = tmp_path / "another-hosts-shm"
    elsewhere.mkdir()
    srv, port = start(shm_dir=str(elsewhere))
    tier = open_tier(f"grpc://127.0.0.1:{port}?shm=on")
    try:
        prompt = make_prompt(4, seed=49)
        tier.put(prompt.chunks())
        assert read_back(tier, prompt.keys) == [prompt.chunk_bytes(i) for i in range(4)]
        stats = tier.stats()
        assert stats["shm_fallbacks"] == 1 and stats["shm"] is None and stats["errors"] == 0
    finally:
        tier.close()
        srv.stop(0)


_DYING_CLIENT = """
import os, sys, time
sys.path.insert(0, {tests!r})
from conftest import make_prompt
from lmtier.kv import codec
from lmtier.transport.shm import Segment
from lmtier.transport.pieces import Region, pack, piece
import grpc
segment = Segment({shm_dir!r}, 1 << 20, 256 << 10)
chunk = make_prompt(1, seed=50).chunks()[0]
frame = codec.encode(chunk)
n = codec.encode_into(chunk, segment.view(0))

def pieces():
    yield pack(piece(chunk.key, n, region=Region(segment.name, 0, n)))  # one whole chunk
    yield pack(piece(b"\\x01" * 16, len(frame), data=[frame[:100]]))  # half of the next
    print(segment.name, flush=True)
    time.sleep(600)  # killed here

channel = grpc.insecure_channel({address!r})
channel.stream_unary("/lmtier.v1.CacheService/Put", None, None)(pieces())
"""


def test_a_client_killed_mid_transfer_leaves_nothing_behind(tmp_path):
    srv, port = start(shm_dir=str(tmp_path))
    script = _DYING_CLIENT.format(tests=os.path.dirname(__file__), shm_dir=str(tmp_path), address=f"127.0.0.1:{port}")
    client = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        name = client.stdout.readline().strip()
        assert name.startswith("lmtier-")
        deadline = time.monotonic() + 30
        while srv.service.buffers.outstanding == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # the half-built frame is in a receive buffer now
        client.send_signal(signal.SIGKILL)
        client.wait(timeout=10)
        deadline = time.monotonic() + 30
        while srv.service.buffers.outstanding and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.service.buffers.outstanding == 0  # the unfinished frame's buffer came back
        # the whole chunk, read into memory and checked, is kept; nothing of the half one
        chunk = make_prompt(1, seed=50).chunks()[0]
        assert srv.service.tenant_keys(tenant_tag("default")) == [tenant_tag("default") + chunk.key]
        assert (tmp_path / name).exists()
        assert shm.sweep(str(tmp_path), min_age=0) == 1  # nobody holds the dead client's segment
        assert not (tmp_path / name).exists()
    finally:
        client.kill()
        srv.stop(0)


def test_a_swept_segment_is_closed_at_once(tmp_path):
    """The server keeps a client's segment open while it sends chunks; once the segment is
    swept (its client died), pruning closes it, instead of keeping its memory until 64
    newer segments push it out."""
    segment = shm.Segment(str(tmp_path), 1 << 20, 64 << 10)
    maps = shm.SegmentFiles(str(tmp_path))
    maps.read_into(segment.name, 0, 4096, bytearray(4096))
    assert maps.prune() == 0 and len(maps) == 1  # still there: kept
    os.unlink(segment.path)  # what sweep does to a dead client's segment
    assert maps.prune() == 1 and len(maps) == 0
    segment.close()


def test_sweep_leaves_the_segments_of_live_clients_alone(tmp_path):
    segment = shm.Segment(str(tmp_path), 1 << 20, 64 << 10)
    try:
        assert shm.sweep(str(tmp_path), min_age=0) == 0
        assert os.path.exists(segment.path)
    finally:
        segment.close()
    assert not os.path.exists(segment.path)


def test_a_growing_segment_reserves_its_memory_as_its_slots_are_taken(tmp_path, monkeypatch):
    """A client's segment reserves its first step at once and the next ones as slots run
    low, on a thread of its own: every slot handed out lies in reserved memory."""
    monkeypatch.setattr(shm.segment, "GROW_STEP", 256 << 10)  # 4 slots a step
    segment = shm.Segment(str(tmp_path), 1 << 20, 64 << 10, grow=True)
    try:
        assert os.stat(segment.path).st_blocks * 512 == 256 << 10  # one step, of a 1 MiB segment
        taken = []
        for _ in range(40):  # the grower catches up in the background
            slot = segment.acquire()
            if slot is not None:
                taken.append(slot)
                assert os.stat(segment.path).st_blocks * 512 >= (slot + 1) * (64 << 10)
            if len(taken) == 16:
                break
            time.sleep(0.05)
        assert sorted(taken) == list(range(16))
        assert segment.acquire() is None  # all 16 in use
    finally:
        segment.close()
    assert not os.path.exists(segment.path)


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


def test_stats_and_list_are_per_tenant(server):
    alice = open_tier(server.url + "?token=alice-secret")
    try:
        prompt = make_prompt(3, seed=52)
        alice.put(prompt.chunks())
        listing = raw(server.address, "List", cache_pb2.ListRequest(limit=2), cache_pb2.ListResponse)
        assert len(listing.keys) == 2 and listing.truncated
        stats = alice.stats()
        assert stats["server_tiers"][0]["name"] == "cpu"
        assert stats["chunks"] == len(alice.keys())
        assert json.dumps(stats)  # plain data, for `lmtier stats` and logs
    finally:
        alice.delete(prompt.keys)
        alice.close()


def test_the_layout_travels_with_the_chunk(server):
    """A chunk of another layout comes back with that layout (the engine checks it)."""
    ns = make_namespace(layout=SMALL.with_dtype("bfloat16"))
    prompt = make_prompt(2, seed=53, namespace=ns)
    tier = open_tier(server.url + "?token=alice-secret")
    tier.put(prompt.chunks())
    got = tier.get(prompt.keys)
    assert [c.layout for c in got] == [ns.layout, ns.layout]
    release_all(got)
    tier.close()


def test_a_single_tenant_server_lends_its_memory_until_the_client_lets_go(tmp_path):
    srv, port = start(tiers=("cpu://?size=16MiB&slot=64KiB",), shm_dir=str(tmp_path))
    tier = open_tier(f"grpc://127.0.0.1:{port}?shm=on&shm_dir={tmp_path}&directory=off")
    try:
        assert srv.zero_copy and srv.service.shared is not None
        prompt = make_prompt(4, seed=54)
        tier.put(prompt.chunks())
        got = tier.get(prompt.keys)
        assert srv.service.leases.held == 4 * prompt.chunks()[0].nbytes  # read in place, held for us
        assert not got[0].data.flags.writeable  # a read-only view of the server's memory
        assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(4)]
        release_all(got[:3])
        assert srv.service.leases.held > 0  # one chunk is still out
        release_all(got[3:])
        assert eventually(lambda: srv.service.leases.held == 0)  # Release reached the server

        got = tier.get(prompt.keys)  # a client that dies holding chunks: reaped once it is gone
        assert srv.service.leases.held > 0
        tier.memory.close()  # its segment's lock goes with it, as when the process dies
        srv.service.leases.reap()
        assert srv.service.leases.held == 0
        release_all(got)
    finally:
        tier.close()
        srv.stop(0)


def test_a_write_follows_the_releases_sent_before_it(tmp_path, monkeypatch):
    """Chunks let go, then a write: the server sees the release first (a slow one made
    slower here), so it may evict them in recency order, never around chunks it would
    still count as lent (whose successors would be stranded)."""
    srv, port = start(tiers=("cpu://?size=16MiB&slot=64KiB",), shm_dir=str(tmp_path))
    tier = open_tier(f"grpc://127.0.0.1:{port}?shm=on&shm_dir={tmp_path}&directory=off")
    release, put, lent_at_put = srv.service.leases.release, srv.store.put, []

    def slow_release(*args):
        time.sleep(0.1)
        release(*args)

    def put_seen(chunks):
        lent_at_put.append(srv.service.leases.held)
        return put(chunks)

    monkeypatch.setattr(srv.service.leases, "release", slow_release)
    monkeypatch.setattr(srv.store, "put", put_seen)
    try:
        first, second = make_prompt(4, seed=55), make_prompt(2, seed=56)
        tier.put(first.chunks())
        got = tier.get(first.keys)
        assert srv.service.leases.held > 0
        release_all(got)
        tier.put(second.chunks())
        assert lent_at_put == [0, 0]
    finally:
        tier.close()
        srv.stop(0)


def test_a_server_with_several_tenants_never_lends_its_memory(server):
    assert not server.zero_copy and server.service.shared is None

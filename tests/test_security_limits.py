"""Security, in tests: limits on the calls of one client (calls per tenant, streams per
connection, message, frame and key sizes: refused, or made to wait, while other tenants
are served), and disk and shared-memory paths that input cannot steer (a segment name in a
request reaches no file outside the segment directory; no key names a file).

Credentials and tenant isolation are in test_security_access.py."""

from __future__ import annotations

import os
import threading

import grpc
import pytest

from lmtier import metrics
from lmtier.config import ServerConfig
from lmtier.errors import RetryableError
from lmtier.kv import codec
from lmtier.kv.chunk import release_all
from lmtier.server import create_server
from lmtier.server.auth import tenant_tag
from lmtier.store.tiered import TieredStore
from lmtier.tiers.base import open_tier
from lmtier.transport.pieces import Region, pack, piece
from lmtier.v1 import cache_pb2

from conftest import eventually
from raw_client import PROMPT, SERVICE, S, call, code_of, connection, two_tenant_server


# -- limits on one client's calls ----------------------------------------------------------------
class HeldPuts:
    """Put streams that stay open (their request iterators wait) until ``release``."""

    def __init__(self, channel: grpc.Channel, token: str, n: int) -> None:
        self.gate = threading.Event()
        fn = channel.stream_unary(SERVICE + "Put", None, cache_pb2.PutResponse.FromString)
        self.futures = [
            fn.future(self._wait(), metadata=(("authorization", f"Bearer {token}"),), timeout=60) for _ in range(n)
        ]

    def _wait(self):
        self.gate.wait(60)
        yield from ()

    def release(self) -> list:
        self.gate.set()
        return [f.result(timeout=60) for f in self.futures]


def test_a_tenant_past_its_call_limit_is_refused_and_others_are_served(monkeypatch):
    srv, address = two_tenant_server(workers=8, max_calls_per_tenant=2)
    alice = tenant_tag("alice")
    channels = [connection(address) for _ in range(3)]  # one client, many connections
    lookup = cache_pb2.LookupRequest(keys=PROMPT.keys)
    try:
        held = [HeldPuts(channels[0], "alice-secret", 1), HeldPuts(channels[1], "alice-secret", 1)]
        assert eventually(lambda: srv.service.calls_in_flight(alice) == 2)
        with pytest.raises(grpc.RpcError) as refused:
            call(channels[2], "Lookup", lookup, token="alice-secret")
        assert refused.value.code() == S.RESOURCE_EXHAUSTED and "max_calls_per_tenant" in refused.value.details()
        assert call(channels[2], "Lookup", lookup, token="bob-secret").hits == 0  # Bob is served
        # The tier raises a refusal as retryable; the store the engine calls retries it
        # with backoff, then misses, never an error.
        monkeypatch.setenv("LMTIER_TOKEN", "alice-secret")
        tier = open_tier(f"grpc://{address}?retries=1&shm=off")
        with pytest.raises(RetryableError, match="RESOURCE_EXHAUSTED"):
            tier.contains(PROMPT.keys)
        store = TieredStore([tier])
        retried = metrics.TIER_OPS.labels(tier.name, "contains", "retried")
        before = retried._value.get()
        assert store.lookup(PROMPT.keys) == 0
        assert retried._value.get() == before + 1
        for h in held:
            assert [r.stored for r in h.release()] == [0]
        assert eventually(lambda: srv.service.calls_in_flight(alice) == 0)
        store.put(PROMPT.chunks())
        assert store.lookup(PROMPT.keys) == 3  # served again once the calls ended
        store.close()
    finally:
        for c in channels:
            c.close()
        srv.stop(0)


def test_streams_past_a_connections_limit_wait_their_turn(monkeypatch):
    srv, address = two_tenant_server(workers=8, max_calls_per_tenant=6, max_streams_per_connection=2)
    alice = tenant_tag("alice")
    one, other = connection(address), connection(address)
    try:
        held = HeldPuts(one, "alice-secret", 3)
        assert eventually(lambda: srv.service.calls_in_flight(alice) == 2)
        # A call on another connection gets through; the third stream is still queued.
        assert call(other, "Lookup", cache_pb2.LookupRequest(keys=PROMPT.keys), token="alice-secret").hits == 0
        assert srv.service.calls_in_flight(alice) == 2
        assert not held.futures[2].done()
        assert [r.stored for r in held.release()] == [0, 0, 0]  # then all three are served
    finally:
        one.close()
        other.close()
        srv.stop(0)


def test_message_frame_and_key_limits_refuse_what_is_over_them():
    srv, address = two_tenant_server(workers=8, max_message_bytes=1 << 20, max_chunk_bytes=256 << 10, max_keys=8)
    channel = connection(address)
    key, frame = PROMPT.keys[0], codec.encode(PROMPT.chunks()[0])
    keys = [PROMPT.keys[0]] * 9
    try:
        # Half a frame, then a message over the limit: the call fails, the half frame's buffer
        # goes back to the pool. (Whole frames that arrived before the failure may be stored,
        # each verified: gRPC can end a failed call's stream as if it were complete.)
        half = len(frame) // 2
        big = [pack(piece(key, len(frame), data=[frame[:half]])), b"\x0a" + b"\x00" * (1536 << 10)]
        assert code_of(lambda: call(channel, "Put", big, "alice-secret")) == S.RESOURCE_EXHAUSTED  # a message
        huge = [pack(piece(key, 300 << 10, data=[frame]))]
        assert code_of(lambda: call(channel, "Put", huge, "alice-secret")) == S.RESOURCE_EXHAUSTED  # a frame
        for method, request in (("Lookup", cache_pb2.LookupRequest), ("Get", cache_pb2.GetRequest)):
            over = request(keys=keys)  # a Get's stream is as long as its keys: bounded by max_keys
            assert code_of(lambda m=method, r=over: call(channel, m, r, "alice-secret")) == S.INVALID_ARGUMENT
        assert call(channel, "Lookup", cache_pb2.LookupRequest(keys=keys[:8]), "alice-secret").hits == 0
        assert srv.service.buffers.outstanding == 0
    finally:
        channel.close()
        srv.stop(0)


# -- paths that input cannot steer ---------------------------------------------------------------
def test_shared_memory_names_from_a_request_never_reach_outside_the_directory(tmp_path):
    shm_dir, outside = tmp_path / "shm", tmp_path / "outside"
    shm_dir.mkdir()
    outside.write_bytes(b"\x00" * 65536)
    decoy = "lmtier-" + "a" * 32
    (shm_dir / decoy).symlink_to(outside)  # a name of the right shape, pointing away
    linked = "lmtier-" + "b" * 32
    os.link(outside, shm_dir / linked)  # a second name for a file that lives elsewhere
    good = "lmtier-" + "c" * 32
    (shm_dir / good).write_bytes(b"\x00" * 65536)  # a real segment, to show the path works
    # One tenant (a server with several maps no client memory), its memory tier private:
    # the server writes what a Get serves into the regions the client names.
    tokens = (("alice-secret", "alice"),)
    config = ServerConfig(port=0, tiers=("cpu://?size=16MiB&slot=64KiB",), shm_dir=str(shm_dir), tokens=tokens)
    srv, port = create_server(config, TieredStore([open_tier("cpu://?size=16MiB&slot=64KiB")]))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    key, frame = PROMPT.keys[0], codec.encode(PROMPT.chunks()[0])
    assert call(channel, "Put", [pack(piece(key, len(frame), data=[frame]))], "alice-secret").stored == 1

    def get(name: str):
        landing = cache_pb2.SharedRegion(segment=name, length=65536)
        return call(channel, "Get", cache_pb2.GetRequest(keys=[key], landing=[landing]), "alice-secret")

    try:
        assert len(get(good)) == 1 and (shm_dir / good).read_bytes()[: len(frame)] == frame
        names = [decoy, linked, "../outside", str(outside), "..", "lmtier-" + "a" * 31 + "/", "lmtier-" + "A" * 32]
        for name in names:
            assert code_of(lambda n=name: get(n)) in (S.INVALID_ARGUMENT, S.FAILED_PRECONDITION), name
            put = [pack(piece(key, len(frame), region=Region(name, 0, len(frame))))]
            refused = code_of(lambda p=put: call(channel, "Put", p, "alice-secret"))
            assert refused in (S.INVALID_ARGUMENT, S.FAILED_PRECONDITION), name
        assert outside.read_bytes() == b"\x00" * 65536  # nothing was written through any name
    finally:
        channel.close()
        srv.stop(0)


def test_disk_file_names_never_come_from_keys(tmp_path):
    """Keys are bytes inside segment files and the index; no key, however odd, names or
    reaches a file, in the tier's directory or outside it."""
    tier = open_tier(f"file://{tmp_path / 'disk'}?size=16MiB")
    odd = [b"../../../../etc/passwd\x00" + b"\xff" * 9, b"/" * 32, b"\x00" * 16, b"..\\..\\" + b"." * 10]
    chunks = [c.view_as(k) for c, k in zip(PROMPT.chunks() + PROMPT.chunks()[:1], odd, strict=True)]
    tier.put(chunks)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert all(p.resolve().is_relative_to((tmp_path / "disk").resolve()) for p in files)
    assert not any(k.hex() in p.name or "passwd" in p.name for p in files for k in odd)
    got = tier.get(odd)
    assert [c.tobytes() for c in got] == [PROMPT.chunk_bytes(i) for i in (0, 1, 2, 0)]
    release_all(got)
    tier.close()

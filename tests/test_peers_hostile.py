"""The peer path against its attackers: a tenant that wants the peers' token, a peer that
wants more than reads of chunks (the holder's statistics, its shared memory, its instance's
leases), a member that lies, trickles or announces a gigabyte, an index with poisoned
entries, a request whose parameters name a peer that lacks the prefix. Real cache servers
on port 0 and a real redis-server; the lying member is a gRPC server and a raw socket of
this file's own (mocks only for fault injection)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from concurrent import futures

import grpc
import pytest
from test_peers import OTHER, READER, WRITER, client, peers, sidecar, stored, writer

from lmtier.kv import codec
from lmtier.kv.chunk import release_all
from lmtier.kv.keys import tenant_tag
from lmtier.kv.layout import KVLayout
from lmtier.tiers.base import TierContext, open_tier
from lmtier.tiers.peers.index import DEFAULT_PREFIX, IndexReader, drain_key, entry
from lmtier.transport.datachannel import END, FRAME, HELLO, ITEM, REQUEST, TICKET_BYTES, decode_keys, recv_exact
from lmtier.v1 import cache_pb2

from conftest import eventually, make_namespace, make_prompt

SERVICE = "lmtier.v1.CacheService"


@pytest.fixture
def index(redis_server):
    client(redis_server).flushall()
    return redis_server.url


def _call(srv, method: str, request, token: str):
    channel = grpc.insecure_channel(srv.address)
    try:
        rpc = channel.unary_unary(f"/{SERVICE}/{method}", type(request).SerializeToString, lambda b: b)
        return rpc(request, timeout=5, metadata=[("authorization", f"Bearer {token}")])
    finally:
        channel.close()


def test_no_tenant_learns_the_peers_token_or_the_index_password_from_stats(index):
    url = index.replace("redis://", "redis://:index-password-0123@")
    holder = sidecar(peer_index=url, advertise="127.0.0.1:1")
    try:
        for token in (OTHER[0], WRITER[0]):
            raw = _call(holder, "Stats", cache_pb2.StatsRequest(), token)
            config = json.loads(cache_pb2.StatsResponse.FromString(raw).config_json)
            text = json.dumps(config)
            assert READER[0] not in text and "index-password-0123" not in text
            assert config["peer_tokens"] == []  # a tenant's view: not even the peers' tenants
    finally:
        holder.stop(0)


def test_a_peers_token_calls_the_reads_of_chunks_and_nothing_else(index):
    """Not Stats (uncached on a one-tenant sidecar: a peer would spend the holder's time),
    not the same-host calls (the directory, leases: the instance's own), not landing
    regions in a Get (a peer on the same node would have the holder write into segments)."""
    holder = sidecar()
    prompt = make_prompt(2, seed=30)
    try:
        stored(holder, prompt.chunks())
        for method, request in (
            ("Stats", cache_pb2.StatsRequest()),
            ("List", cache_pb2.ListRequest()),
            ("Match", cache_pb2.MatchRequest()),
            ("Directory", cache_pb2.DirectoryRequest()),
            ("Release", cache_pb2.ReleaseRequest(lease=1)),
            ("Put", cache_pb2.Pieces()),
            ("Delete", cache_pb2.DeleteRequest(keys=prompt.keys)),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                _call(holder, method, request, READER[0])
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, method
        landing = cache_pb2.GetRequest(keys=prompt.keys[:1])
        landing.landing.add(segment="lmtier-0123456789abcdef", offset=0, length=1 << 16)
        channel = grpc.insecure_channel(holder.address)
        get = channel.unary_stream(f"/{SERVICE}/Get", cache_pb2.GetRequest.SerializeToString, lambda b: b)
        with pytest.raises(grpc.RpcError) as refused:
            list(get(landing, timeout=5, metadata=[("authorization", f"Bearer {READER[0]}")]))
        channel.close()
        assert refused.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION)
        # what a peer may do, it does
        reader = open_tier(f"grpc://{holder.address}?shm=off&token={READER[0]}")
        got = reader.get(prompt.keys)
        assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(2)]
        release_all(got)
        reader.close()
    finally:
        holder.stop(0)


class LyingMember:
    """A member that answers every lookup with a hit and every load on its data channel
    with ``behaviour(sock, keys)``."""

    def __init__(self, behaviour) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.behaviour = behaviour
        threading.Thread(target=self._accept, daemon=True).start()
        handlers = {
            "Lookup": grpc.unary_unary_rpc_method_handler(
                lambda raw, ctx: cache_pb2.LookupResponse(
                    hits=len(cache_pb2.LookupRequest.FromString(raw).keys)
                ).SerializeToString()
            ),
            "OpenData": grpc.unary_unary_rpc_method_handler(
                lambda raw, ctx: cache_pb2.OpenDataResponse(
                    ticket=os.urandom(TICKET_BYTES), port=self.listener.getsockname()[1]
                ).SerializeToString()
            ),
        }
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(sock,), daemon=True).start()

    def _one(self, sock: socket.socket) -> None:
        try:
            recv_exact(sock, len(HELLO) + TICKET_BYTES)
            _, n, length = REQUEST.unpack(recv_exact(sock, REQUEST.size))
            self.behaviour(sock, decode_keys(recv_exact(sock, length), n))
        except OSError:
            pass
        finally:
            sock.close()

    def stop(self) -> None:
        self.listener.close()
        self.server.stop(0)


def _trickle(sock, keys):
    sock.sendall(ITEM.pack(FRAME, 60000))
    for _ in range(40):  # a byte every half second, for 20 s
        sock.sendall(b"x")
        time.sleep(0.5)


def _gigabyte(sock, keys):
    sock.sendall(ITEM.pack(FRAME, 1 << 30) + b"x" * 1024)
    time.sleep(20)


FOREIGN = make_prompt(2, seed=9, namespace=make_namespace(layout=KVLayout(32, 8, 128, "bfloat16"), chunk_tokens=16))


def _foreign(sock, keys):  # well-formed chunks of another model, under the keys asked for
    for i, key in enumerate(keys):
        frame = codec.encode(FOREIGN.chunks()[i % 2].view_as(key))
        sock.sendall(ITEM.pack(FRAME, len(frame)) + frame)
    sock.sendall(ITEM.pack(END, len(keys)))


@pytest.mark.parametrize("behaviour", [_trickle, _gigabyte, _foreign], ids=["trickle", "gigabyte", "foreign"])
def test_a_member_that_lies_or_trickles_costs_a_miss_within_the_deadline(behaviour):
    prompt = make_prompt(2, seed=31)
    member = LyingMember(behaviour)
    context = TierContext(chunk_bytes=len(prompt.chunk_bytes(0)))
    tier = open_tier(peers(f"members={member.address}"), context)  # timeout=2
    try:
        assert tier.direct(prompt.keys, member.address)
        started = time.monotonic()
        got = tier.get(prompt.keys)
        assert got == [None, None]
        assert time.monotonic() - started < 8  # the deadline (2 s), not the member's 20 s
    finally:
        tier.close()
        member.stop()


class GrpcLiar:
    """A member with no data channel (``OpenData`` unimplemented: loads go over gRPC) whose
    ``Lookup`` claims ``hits`` chunks and whose ``Get`` streams a frame of ``frame_size``."""

    def __init__(self, hits: int, frame_size: int = 0) -> None:
        from lmtier.transport.pieces import pack, piece

        def get(raw, ctx):
            keys = cache_pb2.GetRequest.FromString(raw).keys
            for _ in range(512):  # up to 512 MiB of it, a MiB a message
                yield pack(piece(keys[0], frame_size, 0, data=[b"x" * (1 << 20)]))
                time.sleep(0.001)

        handlers = {
            "Lookup": grpc.unary_unary_rpc_method_handler(
                lambda raw, ctx: cache_pb2.LookupResponse(hits=hits).SerializeToString()
            ),
            "Get": grpc.unary_stream_rpc_method_handler(get),
        }
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0)


def test_a_member_that_claims_more_chunks_than_were_asked_finds_none():
    from lmtier.store.tiered import TieredStore

    prompt = make_prompt(2, seed=36)
    member = GrpcLiar(hits=1000)
    store = TieredStore.open(["cpu://?size=16MiB", peers(f"members={member.address}")])
    try:
        peer_tier = store.tiers[1]
        assert peer_tier.direct(prompt.keys, member.address)
        assert peer_tier.contains(prompt.keys) == 0  # a protocol error: that member is not asked for a while
        assert peer_tier.counts["errors"] == 1
        assert store.lookup(prompt.keys) == 0
    finally:
        store.close()
        member.stop()


def test_a_member_that_announces_a_gigabyte_over_grpc_is_refused_at_its_first_piece():
    import resource

    prompt = make_prompt(2, seed=37)
    member = GrpcLiar(hits=2, frame_size=1 << 30)
    context = TierContext(chunk_bytes=len(prompt.chunk_bytes(0)))
    tier = open_tier(peers(f"members={member.address}"), context)
    try:
        assert tier.direct(prompt.keys, member.address)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert tier.get(prompt.keys) == [None, None]
        grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        assert grown_mib < 64  # a frame of a chunk and its header at most, never the member's 512 MiB
    finally:
        tier.close()
        member.stop()


def test_a_chunk_of_another_layout_from_a_peer_is_a_miss_and_lands_nowhere(index):
    from lmtier.store.tiered import TieredStore

    holder = sidecar(index)
    ours = make_prompt(2, seed=38)
    small = make_namespace(layout=KVLayout(1, 1, 64, "float16"), chunk_tokens=16)
    theirs = make_prompt(2, seed=40, namespace=small).chunks()  # smaller chunks of another model, under our keys
    try:
        stored(holder, [c.view_as(k) for c, k in zip(theirs, ours.keys, strict=True)])
        context = TierContext(chunk_bytes=len(ours.chunk_bytes(0)), layouts=(ours.namespace.layout,))
        store = TieredStore.open(["cpu://?size=16MiB", peers(f"index={index}&members={holder.address}")], context)
        assert eventually(lambda: store.lookup(ours.keys) == 2, 10)  # offered
        assert all(c is None for c in store.tiers[1].get(ours.keys))  # refused
        assert store.tiers[1].counts["corrupt"] == 1 and store.tiers[1].counts["hits"] == 0
        got = store.get(ours.keys)
        assert got == [] or all(c is None for c in got)
        store.flush()
        assert store.tiers[0].contains(ours.keys) == 0  # nothing of it in this instance's memory
        store.close()
    finally:
        holder.stop(0)


def test_a_router_cannot_direct_a_load_to_a_drained_sidecar(index):
    holder = sidecar(index)
    prompt = make_prompt(2, seed=39)
    try:
        stored(holder, prompt.chunks())
        tier = open_tier(peers(f"index={index}&members={holder.address}&refresh=0.1"))
        assert eventually(lambda: tier.contains(prompt.keys) == 2, 10)
        holder.peer_index.writer.drain()
        time.sleep(0.2)
        assert tier.direct(prompt.keys, holder.address)  # a member: taken as a hint
        assert tier.contains(prompt.keys) == 0 and tier.get(prompt.keys) == [None, None]  # drained: not asked
        tier.close()
    finally:
        holder.stop(0)


def test_a_sidecar_refuses_one_secret_for_its_engine_and_its_peers_and_an_index_with_no_peers():
    from lmtier.config.schema import ServerConfig
    from lmtier.errors import ConfigError

    with pytest.raises(ConfigError, match="both in tokens and in peer_tokens"):
        ServerConfig(tokens=(("same-secret-0123456789", "a"),), peer_tokens=(("same-secret-0123456789", "b"),))
    with pytest.raises(ConfigError, match="peer_index needs peer_tokens"):
        ServerConfig(tokens=(WRITER,), peer_index="redis://127.0.0.1:1", advertise="127.0.0.1:2")


def test_a_poisoned_index_costs_a_miss_and_reads_no_more_than_addresses(index, redis_server):
    redis_client = client(redis_server)
    prompt = make_prompt(2, seed=32)
    tag = tenant_tag("fleet")
    redis_client.set(entry(DEFAULT_PREFIX, tag, prompt.keys[0]), b"a" * (64 << 20))  # 64 MiB "address"
    redis_client.set(entry(DEFAULT_PREFIX, tag, prompt.keys[1]), "127.0.0.1:9")
    reader = IndexReader(index, DEFAULT_PREFIX, tag, timeout=2)
    first, second = reader.holders(prompt.keys)
    assert len(first) <= 256 and second == "127.0.0.1:9"
    # a drain mark is one key per sidecar, its value never read (a huge one costs nothing)
    redis_client.set(drain_key(DEFAULT_PREFIX, "127.0.0.1:7"), b"d" * (64 << 20))
    assert reader.drained({"127.0.0.1:7", "127.0.0.1:8"}) == {"127.0.0.1:7"}
    reader.close()
    tier = open_tier(peers(f"members=127.0.0.1:9&index={index}"))
    assert tier.contains(prompt.keys) == 0  # the first key's holder is no member: no run at all
    tier.close()


def test_a_request_that_named_a_peer_without_the_prefix_costs_later_requests_nothing(index):
    holder, empty = sidecar(index), sidecar()
    prompt = make_prompt(3, seed=33)
    try:
        stored(holder, prompt.chunks())
        tier = open_tier(peers(f"members={holder.address},{empty.address}&index={index}"))
        assert eventually(lambda: tier.contains(prompt.keys) == 3, 10)
        assert tier.direct(prompt.keys, empty.address)  # a client's parameters: a member, but empty
        assert tier.contains(prompt.keys) == 0  # this request's miss
        assert tier.contains(prompt.keys) == 3  # the next request asks the index again
        tier.close()
    finally:
        holder.stop(0)
        empty.stop(0)


def test_only_the_chunks_of_tenants_with_peers_are_announced(index, redis_server):
    holder = sidecar(index)
    fleet, other = make_prompt(2, seed=34), make_prompt(2, seed=35)
    try:
        stored(holder, fleet.chunks())
        theirs = writer(holder, OTHER[0])  # a tenant with no peers' token
        theirs.put(other.chunks())
        theirs.close()
        redis_client = client(redis_server)
        assert eventually(lambda: redis_client.exists(*(entry(DEFAULT_PREFIX, tenant_tag("fleet"), k)
                                                        for k in fleet.keys)) == 2, 10)  # fmt: skip
        time.sleep(0.5)  # the publisher's rounds after both puts
        assert not redis_client.exists(*(entry(DEFAULT_PREFIX, tenant_tag("other"), k) for k in other.keys))
    finally:
        holder.stop(0)


def test_an_index_that_stops_answering_is_not_asked_again_at_once():
    """A Redis that accepts and never answers: one lookup waits its timeout, the next ones
    (for ``cooldown`` seconds) do not wait at all."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        tier = open_tier(peers(f"members=127.0.0.1:9&index=redis://127.0.0.1:{silent.getsockname()[1]}&cooldown=60"))
        keys = make_prompt(2, seed=36).keys
        assert tier.contains(keys) == 0 and tier.counts["errors"] == 1
        started = time.monotonic()
        assert tier.contains(keys) == 0 and tier.counts["errors"] == 1  # not asked: no second wait
        assert time.monotonic() - started < 1
        tier.close()


def test_what_is_dialled_is_the_members_own_spelling_and_a_departed_members_hint_is_not_used(index):
    holder = sidecar()
    prompt = make_prompt(2, seed=37)
    try:
        stored(holder, prompt.chunks())
        port = holder.address.rsplit(":", 1)[1]
        tier = open_tier(peers(f"members={holder.address}"))
        for spelling in (f"127.0.0.1.:{port}", f"..:{port}", f"...:{port}"):
            tier.direct(prompt.keys, spelling)
            tier.contains(prompt.keys)
        assert set(tier.stats()["connected"]) <= {holder.address}  # no client for another spelling
        assert tier.direct(prompt.keys, holder.address) and tier.contains(prompt.keys) == 2
        tier.members._static, tier.members._known = [], set()  # the member left (fault injection)
        assert tier.contains(prompt.keys) == 0  # its hint is not dialled
        tier.close()
    finally:
        holder.stop(0)


def test_peers_found_by_dns_join_and_leave_as_a_headless_services_pods_do(index, monkeypatch):
    """``dns=``: the peers are what the name resolves to, resolved again every ``refresh``
    seconds; a pod that joins is read from, one that left is not dialled, and a name that
    stops resolving for a moment keeps the last answer. The resolver is the platform's:
    its answers are injected here (the name's pods are real cache servers)."""
    from lmtier.tiers.peers import members as members_module

    holder = sidecar()
    prompt = make_prompt(2, seed=38)
    real = socket.getaddrinfo
    pods: list[str] = []

    def resolve(host, port, *args, **kwargs):
        if host != "peers.fleet.svc":
            return real(host, port, *args, **kwargs)
        if pods == ["fail"]:
            raise socket.gaierror("temporary failure")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in pods]

    try:
        stored(holder, prompt.chunks())
        monkeypatch.setattr(members_module.socket, "getaddrinfo", resolve)
        port = holder.address.rsplit(":", 1)[1]
        tier = open_tier(peers(f"dns=peers.fleet.svc:{port}&refresh=0.1"))
        assert not tier.direct(prompt.keys, holder.address)  # no pod yet
        pods[:] = ["127.0.0.1"]  # the holder's pod joins
        assert eventually(lambda: tier.direct(prompt.keys, holder.address), 5)
        assert tier.contains(prompt.keys) == 2
        pods[:] = ["fail"]  # DNS fails for a moment: the fleet is not emptied
        time.sleep(0.3)
        assert tier.direct(prompt.keys, holder.address)
        pods[:] = []  # the pod left
        assert eventually(lambda: not tier.members.admits(holder.address), 5)
        assert tier.contains(prompt.keys) == 0  # its hints are not dialled
        tier.close()
    finally:
        holder.stop(0)

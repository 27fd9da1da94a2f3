"""Peer reads (lmtier/tiers/peers, lmtier/server/peers.py): an instance loads what another
instance's sidecar holds, found through the fleet's index in a real redis-server or named
by a router, read-only, verified, bounded in time, members only. Real cache servers on
port 0 stand for the sidecars; the engine-level proof is tests/test_vllm_router.py."""

from __future__ import annotations

import socket
import time

import pytest

from lmtier.config.schema import ServerConfig
from lmtier.errors import ConfigError, TierError
from lmtier.kv.chunk import release_all
from lmtier.server import create_server
from lmtier.server.auth import tenant_tag
from lmtier.store.tiered import TieredStore
from lmtier.tiers.base import open_tier
from lmtier.tiers.peers.index import DEFAULT_PREFIX, entry

from conftest import eventually, make_prompt

WRITER = ("fleet-writer-secret-0123", "fleet")
READER = ("fleet-peer-secret-456789", "fleet")
OTHER = ("other-writer-secret-0123", "other")


def sidecar(redis_url: str = "", **settings):
    """A sidecar: the fleet's writer token, its peers' read-only token, its chunks announced
    in the fleet's index under its own address."""
    settings.setdefault("tiers", ("cpu://?size=64MiB&slot=64KiB",))
    settings.setdefault("shm_dir", "")
    settings.setdefault("tokens", (WRITER, OTHER))
    settings.setdefault("peer_tokens", (READER,))
    port = _free_port()
    if redis_url:
        settings.update(peer_index=redis_url, advertise=f"127.0.0.1:{port}")
    srv, port = create_server(ServerConfig(port=port, **settings))
    srv.address = f"127.0.0.1:{port}"
    return srv


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def writer(srv, token=WRITER[0]):
    return open_tier(f"grpc://{srv.address}?shm=off&token={token}")


def stored(srv, chunks) -> None:
    """``chunks`` written to ``srv`` as its engine writes them (the writer's token)."""
    w = writer(srv)
    w.put(chunks)
    w.close()


def peers(query: str, token: str = READER[0]) -> str:
    return f"peers://?{query}&token={token}&tenant=fleet&timeout=2"


def client(redis_server):
    import redis

    return redis.Redis.from_url(redis_server.url)


@pytest.fixture
def index(redis_server):
    client(redis_server).flushall()
    return redis_server.url


def test_a_chunk_one_sidecar_holds_is_found_through_the_index_and_loaded_byte_for_byte(index):
    holder, other = sidecar(index), sidecar(index)
    prompt = make_prompt(6, seed=1)
    try:
        stored(holder, prompt.chunks())
        tier = open_tier(peers(f"index={index}&members={holder.address},{other.address}&advertise={other.address}"))
        assert eventually(lambda: tier.contains(prompt.keys) == 6, 10)
        got = tier.get(prompt.keys)
        assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(6)]
        release_all(got)
        assert tier.counts["hits"] == 6
        tier.close()
    finally:
        holder.stop(0)
        other.stop(0)


def test_a_load_right_after_its_lookup_goes_straight_to_the_holder(index, redis_server):
    """The lookup asks the index; the load that follows it within FOUND_S does not ask
    again (one index round trip per hit, not two), and a lookup always asks afresh."""
    holder = sidecar(index)
    prompt = make_prompt(4, seed=12)
    redis_client = client(redis_server)

    def index_reads() -> int:
        return int(redis_client.info("commandstats").get("cmdstat_getrange", {}).get("calls", 0))

    try:
        stored(holder, prompt.chunks())
        tier = open_tier(peers(f"index={index}"))
        assert eventually(lambda: tier.contains(prompt.keys) == 4, 10)
        before = index_reads()
        got = tier.get(prompt.keys)
        assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(4)]
        release_all(got)
        assert index_reads() == before  # the load used the lookup's answer
        assert tier.contains(prompt.keys) == 4
        assert index_reads() == before + 4  # a lookup asks the index for every key
        tier.close()
    finally:
        holder.stop(0)


def test_what_a_peer_loads_lands_in_its_own_tiers_and_it_never_writes_to_the_holder(index, tmp_path):
    holder = sidecar(index)
    prompt = make_prompt(4, seed=2)
    try:
        stored(holder, prompt.chunks())
        store = TieredStore.open(["cpu://?size=16MiB", peers(f"index={index}")])
        assert eventually(lambda: store.lookup(prompt.keys) == 4, 10)
        release_all(store.get(prompt.keys))
        assert eventually(lambda: store.tiers[0].contains(prompt.keys) == 4, 10)  # promoted into its own memory
        store.put(make_prompt(2, seed=3).chunks())  # its own saves never reach the peer
        store.close()
        assert holder.service.store.tiers[0].stats()["chunks"] == 4
    finally:
        holder.stop(0)


def test_a_peers_token_reads_and_is_refused_every_write(index):
    holder = sidecar(index)
    prompt = make_prompt(2, seed=4)
    try:
        stored(holder, prompt.chunks())
        reader = open_tier(f"grpc://{holder.address}?shm=off&token={READER[0]}")
        assert reader.contains(prompt.keys) == 2
        release_all(reader.get(prompt.keys))
        for call in (lambda: reader._rpc(lambda: reader._channel().delete(_delete(prompt.keys), timeout=5,
                                                                          metadata=reader._metadata)),):  # fmt: skip
            with pytest.raises(Exception, match=r"reads (chunks )?only"):
                call()
        with pytest.raises(TierError, match=r"reads (chunks )?only"):  # through the data channel, then gRPC
            reader.put(make_prompt(2, seed=5).chunks())
        assert holder.service.store.tiers[0].stats()["chunks"] == 2
        assert writer(holder).contains(prompt.keys) == 2  # nothing deleted
        reader.close()
    finally:
        holder.stop(0)


def _delete(keys):
    from lmtier.v1 import cache_pb2

    return cache_pb2.DeleteRequest(keys=keys)


def test_another_tenants_chunks_are_not_found_or_read_through_a_peer(index):
    holder = sidecar(index)
    prompt = make_prompt(3, seed=6)
    try:
        w = writer(holder, OTHER[0])  # the other tenant's chunks
        w.put(prompt.chunks())
        w.close()
        time.sleep(0.6)  # announced by now (every 0.2 s)
        tier = open_tier(peers(f"index={index}"))  # the fleet's peer
        assert tier.contains(prompt.keys) == 0
        directed = open_tier(peers(f"members={holder.address}"))
        assert directed.direct(prompt.keys, holder.address)
        assert directed.contains(prompt.keys) == 0 and directed.get(prompt.keys) == [None] * 3
        tier.close()
        directed.close()
    finally:
        holder.stop(0)


def test_a_router_may_direct_a_load_only_to_a_member(index):
    holder = sidecar()
    prompt = make_prompt(3, seed=7)
    try:
        stored(holder, prompt.chunks())
        tier = open_tier(peers(f"members={holder.address}"))
        assert tier.contains(prompt.keys) == 0  # no index, not directed: no broadcast
        assert not tier.direct(prompt.keys, "10.1.2.3:50051")  # not a member: never dialled
        assert not tier.direct(prompt.keys, "metadata.google.internal:80")
        assert tier.counts["refused"] == 2 and tier.contains(prompt.keys) == 0
        # a router that names the engine (its host, the engine's port) means the sidecar beside it
        assert tier.direct(prompt.keys, "127.0.0.1:8000") and tier.contains(prompt.keys) == 3
        assert tier.direct(prompt.keys, holder.address)
        assert tier.contains(prompt.keys) == 3
        got = tier.get(prompt.keys)
        assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(3)]
        release_all(got)
        tier.close()
        # with the index alone (no membership), a request may name no peer at all: its
        # parameters are its sender's, and the peer token must not go where they say
        open_index = open_tier(peers(f"index={index}"))
        assert not open_index.direct(prompt.keys, holder.address)
        assert open_index.contains(prompt.keys) == 0 and open_index.counts["refused"] == 1
        open_index.close()
    finally:
        holder.stop(0)


def test_a_peer_that_is_gone_or_stalls_costs_a_miss_in_bounded_time(index):
    holder = sidecar(index)
    prompt = make_prompt(3, seed=8)
    stored(holder, prompt.chunks())
    tier = open_tier(peers(f"index={index}"))
    assert eventually(lambda: tier.contains(prompt.keys) == 3, 10)
    address = holder.address
    holder.stop(0)  # gone (it drains first: readers skip it)
    started = time.monotonic()
    assert tier.contains(prompt.keys) == 0 and tier.get(prompt.keys) == [None] * 3
    assert time.monotonic() - started < 10
    tier.close()
    # a listener that accepts and never answers: the deadline ends the lookup
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        stalled = f"127.0.0.1:{silent.getsockname()[1]}"
        tier = open_tier(peers(f"members={stalled}"))
        tier.direct(prompt.keys, stalled)
        started = time.monotonic()
        assert tier.contains(prompt.keys) == 0
        assert time.monotonic() - started < 10
        assert tier.contains(prompt.keys) == 0 and tier.counts["errors"] == 1  # not asked again at once
        tier.close()
    assert address


def test_a_drained_sidecar_is_not_chosen_and_a_stale_entry_is_a_miss(index, redis_server):
    holder = sidecar(index)
    prompt = make_prompt(2, seed=9)
    try:
        stored(holder, prompt.chunks())
        tier = open_tier(peers(f"index={index}&refresh=0.1"))
        assert eventually(lambda: tier.contains(prompt.keys) == 2, 10)
        holder.peer_index.writer.drain()
        time.sleep(0.2)
        assert tier.contains(prompt.keys) == 0  # drained: skipped
        holder.peer_index.writer.drain(undo=True)
        time.sleep(0.2)
        assert tier.contains(prompt.keys) == 2
        redis_client = client(redis_server)
        assert len([k for k in redis_client.keys("lmtier:peers:*") if not k.endswith(b"drained")]) == 2
        redis_client.set(entry(DEFAULT_PREFIX, tenant_tag("fleet"), prompt.keys[0]), "127.0.0.1:1")  # gone
        assert tier.contains(prompt.keys) == 0
        tier.close()
    finally:
        holder.stop(0)


def test_evicted_chunks_are_withdrawn_from_the_index(index, redis_server):
    holder = sidecar(index, tiers=("cpu://?size=1MiB&slot=64KiB",))
    try:
        w = writer(holder)
        first = make_prompt(4, seed=10)
        w.put(first.chunks())
        redis_client = client(redis_server)
        assert eventually(lambda: len(redis_client.keys("lmtier:peers:*")) == 4, 10)
        for seed in range(11, 40):  # far more than 1 MiB: the first prompt is evicted
            w.put(make_prompt(4, seed=seed).chunks())
        w.close()
        held = holder.service.store.tiers[0].stats()["chunks"]
        assert eventually(
            lambda: len([k for k in redis_client.keys("lmtier:peers:*") if b"drained" not in k]) == held, 10
        )
    finally:
        holder.stop(0)


def test_a_peers_tier_url_is_checked():
    for bad in ("peers://", "peers://host:1?members=a:1", "peers://?members=nohost", "peers://?members=a:1&bogus=1"):
        with pytest.raises(ConfigError):
            open_tier(bad)


def test_peers_share_a_lane_of_their_own_and_cannot_take_the_holders_calls(index):
    holder = sidecar(workers=4, max_calls_per_tenant=3)
    try:
        calls = holder.service.calls
        from lmtier.server.auth import peer_lane, tenant_tag

        lane = peer_lane(tenant_tag("fleet"))
        held = []
        for _ in range(2):  # half the workers
            ctx = calls.admitted(lane)
            ctx.__enter__()
            held.append(ctx)
        with pytest.raises(Exception, match="limit is 2"), calls.admitted(lane):
            pass
        with calls.admitted(tenant_tag("fleet")):  # the instance's own calls go on
            pass
        for ctx in held:
            ctx.__exit__(None, None, None)
    finally:
        holder.stop(0)

"""Tier events (``lmtier.store.events``) from real tiers, and the vLLM adapter's bookkeeping
(``connectors/vllm/events.py``): what each tier announces, bounds, tensor parallelism."""

from __future__ import annotations

from lmtier import metrics
from lmtier.config import ServerConfig
from lmtier.kv.chunk import release_all
from lmtier.server import create_server
from lmtier.store.events import TierEvents
from lmtier.store.tiered import TieredStore
from lmtier.tiers.base import open_tier

from conftest import eventually, make_prompt


def records(events: TierEvents) -> list[tuple[str, int, list[bytes]]]:
    return [(r.kind, r.tier, list(r.keys)) for r in events.drain()]


def test_the_queue_is_bounded_and_counts_what_it_drops():
    before = metrics.REGISTRY.get_sample_value("lmtier_events_dropped_total") or 0
    events = TierEvents(limit=3)
    for i in range(5):
        events.add("stored", 0, [bytes([i]) * 16])
    events.add("stored", 0, [])  # nothing: no record
    assert [r.keys[0][0] for r in events.drain()] == [2, 3, 4]
    assert events.dropped == 2
    assert metrics.REGISTRY.get_sample_value("lmtier_events_dropped_total") == before + 2
    assert events.drain() == []


def test_memory_and_disk_announce_stores_evictions_deletes_and_damage(tmp_path):
    a, b = make_prompt(3, seed=1), make_prompt(2, seed=2)
    size = a.chunks()[0].nbytes
    with TieredStore.open([f"cpu://?size={3 * size}&slot={size}", f"file://{tmp_path}/d?size=64MiB"]) as store:
        events = store.watch()
        assert store.watch() is events  # one queue per store
        store.put(a.chunks())
        store.flush()
        assert records(events) == [("stored", 0, a.keys), ("stored", 1, a.keys)]
        release_all(store.get(a.keys[:1]))  # a0 most recent: a2, then a1 go first
        store.put(b.chunks())
        store.flush()
        assert records(events) == [
            ("removed", 0, [a.keys[2]]),
            ("removed", 0, [a.keys[1]]),
            ("stored", 0, b.keys),
            ("stored", 1, b.keys),
        ]
        store.delete(a.keys[:1])
        assert records(events) == [("removed", 0, a.keys[:1]), ("removed", 1, a.keys[:1])]
        store.put(a.chunks()[:1])  # back in memory: announced again
        store.flush()
        assert ("stored", 0, a.keys[:1]) in records(events)
        memory = store.tiers[0]
        entry = memory._index[a.keys[0]]
        memory.slab.array[entry.slots[0] * memory.slot_bytes + 7] ^= 1  # damaged in memory
        got = store.tiers[0].get(a.keys[:1])
        try:
            got[0].tobytes()
        except Exception:
            pass
        release_all(got)
        assert ("removed", 0, a.keys[:1]) in records(events)


def test_a_read_from_a_lower_tier_announces_its_landing_in_memory(tmp_path):
    a = make_prompt(2, seed=3)
    size = a.chunks()[0].nbytes
    urls = [f"cpu://?size={4 * size}&slot={size}", f"file://{tmp_path}/d?size=64MiB"]
    with TieredStore.open(urls) as store:
        store.put(a.chunks())
    with TieredStore.open(urls) as store:  # a new instance: memory empty, the disk holds a
        events = store.watch()
        release_all(store.get(a.keys))
        assert ("stored", 0, a.keys[:1]) in records(events) or store.tiers[0].contains(a.keys) == 2


def test_shared_tiers_announce_what_they_were_given_and_what_was_deleted(redis_server):
    redis_server.call("FLUSHALL")
    server, port = create_server(ServerConfig(port=0, tiers=("cpu://?size=16MiB&slot=64KiB",)))
    a = make_prompt(2, seed=4)
    try:
        for url in (redis_server.url, f"grpc://127.0.0.1:{port}"):
            tier = open_tier(url)
            events = TierEvents()
            tier.listener = lambda kind, keys, add=events.add: add(kind, 0, keys)
            tier.put(a.chunks())
            tier.delete(a.keys[1:])
            assert records(events) == [("stored", 0, a.keys), ("removed", 0, a.keys[1:])], url
            tier.close()
    finally:
        server.stop(0)


def test_a_tier_that_opens_late_announces_through_the_listener_set_before(tmp_path):
    from lmtier.testing.redis_server import RedisServer, cli, free_port

    port = free_port(cluster=True)  # its bus port free too
    a = make_prompt(2, seed=5)
    urls = ["cpu://?size=8MiB&slot=1MiB", f"redis+cluster://127.0.0.1:{port}?connect_timeout=0.2"]
    with TieredStore.open(urls, defer="lower") as store:
        events = store.watch()
        deferred = store.tiers[1]
        assert deferred.listener is not None and deferred.opened is None
        node = RedisServer(tmp_path, "--cluster-enabled", "yes", port=port)  # up after the store opened
        cli(port, "CLUSTER", "ADDSLOTSRANGE", "0", "16383")
        try:
            assert eventually(lambda: "cluster_state:ok" in cli(port, "CLUSTER", "INFO"))
            assert eventually(lambda: deferred.opened is not None)
            store.put(a.chunks())
            store.flush()
            assert ("stored", 1, a.keys) in records(events)
        finally:
            node.stop()


def test_the_event_book_turns_records_into_vllm_events_and_forgets_them_at_a_reset():
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from lmtier.connectors.vllm.events import EventBook, LMTierKVEvents

    tiers = ["cpu://?size=1GiB", "redis://cache:6379?password=secret"]
    book = EventBook(tiers, chunk_tokens=4, tp_size=2, specs=[("full_attention", None)])
    keys, tokens = [b"k0" * 8, b"k1" * 8], list(range(8))
    book.remember(keys, tokens)
    book.absorb(LMTierKVEvents([(0, "stored", 0, keys), (0, "stored", 1, keys[:1])]))
    assert book.take() == []  # rank 1 has not stored them yet
    book.absorb(LMTierKVEvents([(1, "stored", 0, keys), (1, "stored", 1, keys[:1]), (1, "removed", 0, keys[1:])]))
    stored, shared, removed = book.take()
    assert isinstance(stored, BlockStored) and stored.block_hashes == keys and stored.token_ids == tokens
    assert (stored.block_size, stored.parent_block_hash, stored.medium, stored.locality) == (4, None, "CPU", "LOCAL")
    assert (stored.group_idx, stored.kv_cache_spec_kind, stored.kv_cache_spec_sliding_window) == (
        0,
        "full_attention",
        None,
    )
    assert shared.ownership == "lmtier:redis://cache:6379" and shared.locality == "REMOTE"  # no secret
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == keys[1:]
    book.clear()  # vLLM's own AllBlocksCleared says the reset; what was in flight is dropped
    book.absorb(LMTierKVEvents([(0, "stored", 0, keys), (1, "stored", 0, keys)]))
    assert book.take() == []


def test_the_event_book_speaks_in_the_engines_blocks_so_that_a_router_counting_them_credits_chunks():
    """vllm-router's kv_aware policy counts in the engine's block size and ignores events of
    any other: a chunk of four 2-token blocks is announced as four blocks, chained, each
    hash the chunk's key and the block's place in it."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from lmtier.connectors.vllm.events import EventBook, LMTierKVEvents

    book = EventBook(["cpu://?size=1GiB"], chunk_tokens=8, tp_size=1, block_size=2)
    keys, tokens = [b"k0" * 8, b"k1" * 8], list(range(16))
    book.remember(keys, tokens)
    book.absorb(LMTierKVEvents([(0, "stored", 0, keys[:1])]))
    (first,) = book.take()
    book.absorb(LMTierKVEvents([(0, "stored", 0, keys[1:])]))
    (second,) = book.take()
    assert isinstance(first, BlockStored) and first.block_size == 2
    assert first.block_hashes == [keys[0] + bytes([0, j]) for j in range(4)] and first.token_ids == tokens[:8]
    assert first.parent_block_hash is None and first.ownership is None  # this instance's own memory
    assert second.block_hashes == [keys[1] + bytes([0, j]) for j in range(4)] and second.token_ids == tokens[8:]
    assert second.parent_block_hash == keys[0] + bytes([0, 3])  # the first chunk's last block
    book.absorb(LMTierKVEvents([(0, "removed", 0, keys[1:])]))
    (removed,) = book.take()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == second.block_hashes
    # a chunk that is no whole number of blocks, or events asked in chunks: one block a chunk
    assert EventBook(["cpu://"], chunk_tokens=8, tp_size=1, block_size=3).per == 1
    assert EventBook(["cpu://"], chunk_tokens=8, tp_size=1, block_size=0).per == 1


def test_ownership_names_what_is_shared_however_the_url_is_written(monkeypatch):
    """A router counts a shared chunk once per ownership: the same key space written three
    ways is one owner; another tenant, database or key prefix is another; no secret shows."""
    from lmtier.connectors.vllm.events import tier_labels

    def owner(url):
        return tier_labels(url)[2]

    same = {
        owner(u)
        for u in (
            "redis://:pw@cache:6379",
            "redis://user:pw@cache:6379/0",
            "redis://cache:6379?password=pw",
            "redis://cache/0",  # the default port and database
            "rediss://CACHE",  # the host's case; TLS reaches the same key space
        )
    }
    assert same == {"lmtier:redis://cache:6379"}
    assert owner("redis+cluster://b:7001,A:7000") == owner("redis+cluster://a:7000,b:7001")
    assert owner("grpc://Cache?token=t") == owner("grpc://cache:50051?token=t")
    assert owner("redis://cache:6379/2") != owner("redis://cache:6379") != owner("redis://cache:6379?prefix=b:")
    assert tier_labels("unix:///run/redis.sock")[1] == "REMOTE"
    alice, bob = owner("grpc://cache:50051?token=alice-secret"), owner("grpc://cache:50051?token=bob-secret")
    assert alice != bob and "secret" not in alice + bob
    monkeypatch.setenv("LMTIER_TOKEN", "alice-secret")  # the token from the environment: the same tenant
    assert owner("grpc://cache:50051") == alice
    assert tier_labels("file:///var/lib/lmtier?size=1GiB")[:2] == ("STORAGE", "LOCAL")
    s3 = tier_labels("s3://kv/fleet-a?endpoint=http://MinIO:9000&region=eu-west-1&size=1TiB")
    assert s3 == ("STORAGE", "REMOTE", "lmtier:s3://minio:9000/kv/fleet-a")
    assert tier_labels("s3://kv/fleet-a?size=2TiB&endpoint=http://minio:9000")[2] == s3[2]  # same bucket prefix
    assert tier_labels("s3://kv/fleet-b?endpoint=http://minio:9000")[2] != s3[2]  # another deployment
    # a memory tier is this instance's own host memory: no owner but the instance
    assert tier_labels("cpu://?size=1GiB") == ("CPU", "LOCAL", "")

"""Redis tier against real redis-server processes: a single node and a three-master cluster."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest

import lmtier
from lmtier.errors import ConfigError, TierError
from lmtier.kv.chunk import release_all
from lmtier.store.tiered import TieredStore
from lmtier.testing.certs import make_certificates
from lmtier.testing.redis_cluster import RedisCluster
from lmtier.testing.redis_server import RedisServer
from lmtier.tiers.base import open_tier
from lmtier.tiers.deferred import DeferredTier, open_or_defer
from lmtier.tiers.redis import RedisTier

from conftest import eventually, make_namespace, make_prompt
from tier_contract import TierContract

BIG = make_namespace(chunk_tokens=256)  # 128 KiB chunks


def flip_a_payload_byte(tier: RedisTier, key: bytes) -> None:
    node = tier._node_for(tier._rkey(key))

    def work(conn):
        value = conn.call(b"GET", tier._rkey(key))
        damaged = bytearray(value)
        damaged[-100] ^= 0x40
        assert conn.call(b"SET", tier._rkey(key), bytes(damaged)) == "OK"

    node.run(work)


class TestRedisTier(TierContract):
    @pytest.fixture(autouse=True)
    def _fresh(self, redis_server):
        redis_server.call("FLUSHALL")
        self.url = redis_server.url

    def make_tier(self, capacity_chunks, chunk_bytes):
        return open_tier(self.url)

    def corrupt(self, tier, key):
        flip_a_payload_byte(tier, key)


class TestRedisClusterTier(TestRedisTier):
    @pytest.fixture(autouse=True)
    def _fresh(self, redis_cluster):
        redis_cluster.flush()
        self.url = redis_cluster.url


def test_chunks_spread_over_every_master(redis_cluster):
    redis_cluster.flush()
    tier = open_tier(redis_cluster.url)
    try:
        assert len(tier.masters()) == 3
        prompt = make_prompt(60, seed=3)
        tier.put(prompt.chunks())
        per_master = [int(n.call("DBSIZE")) for n in redis_cluster.nodes]
        assert sum(per_master) == 60
        assert all(count >= 5 for count in per_master), per_master
        assert tier.contains(prompt.keys) == 60
    finally:
        tier.close()


def test_a_stale_slot_map_is_learnt_again_from_the_first_moved(redis_cluster):
    """Slots move between masters (a reshard, a failover). Told MOVED, every operation
    sends the moved keys once more to the master the reply names, and learns the slot map
    again: the call itself loses nothing, and the next call goes to the right masters."""
    redis_cluster.flush()
    tier = open_tier(redis_cluster.url)
    try:
        prompt, later = make_prompt(12, seed=5), make_prompt(12, seed=6)
        tier.put(prompt.chunks())
        right = tier.router._slots
        one = right[0]
        at_one = [str(tier._node_for(tier._rkey(k))) == str(one) for k in prompt.keys]
        assert 0 < sum(at_one) < 12

        def stale() -> None:  # every slot on one master, as before a reshard
            tier.router._slots = [one] * len(right)

        stale()
        assert tier.contains(prompt.keys) == 12  # MOVED, sent on, the map learnt again
        assert tier.router._slots == right

        stale()
        got = tier.get(prompt.keys)
        assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(12)]
        release_all(got)
        assert tier.router._slots == right

        stale()
        tier.put(later.chunks())
        assert tier.router._slots == right
        assert tier.contains(later.keys) == 12 and tier._counts["errors"] == 0

        stale()
        tier.delete(prompt.keys)
        assert tier.router._slots == right
        assert [tier.contains([k]) for k in prompt.keys] == [0] * 12
    finally:
        tier.close()


def test_urls_and_options(redis_server):
    tier = open_tier(f"{redis_server.url}/3?prefix=t1:&ttl=60&pool=2&timeout=1.5")
    try:
        assert (tier.db, tier.prefix, tier.ttl_ms, tier.pool, tier.timeout) == (3, b"t1:", 60_000, 2, 1.5)
        prompt = make_prompt(2)
        tier.put(prompt.chunks())
        assert redis_server.call("-n", "3", "DBSIZE") == "2"
        keys = redis_server.call("-n", "3", "KEYS", "t1:*").split()
        assert sorted(keys) == sorted("t1:" + k.hex() for k in prompt.keys)
        assert 0 < int(redis_server.call("-n", "3", "TTL", keys[0])) <= 60
    finally:
        tier.close()
    for bad, match in [
        ("redis://h1:1,h2:2", "several for redis\\+cluster"),
        ("redis://localhost:6379/x", "database number"),
        ("redis://localhost:6379?pool=0", "pool"),
        ("redis://localhost:6379?colour=red", "unknown option"),
        ("unix://", "names a path"),
    ]:
        with pytest.raises(ConfigError, match=match):
            open_tier(bad)


def test_password_and_user_from_the_url(tmp_path):
    node = RedisServer(tmp_path, "--requirepass", "s3cret")
    try:
        tier = open_tier(f"redis://:s3cret@127.0.0.1:{node.port}")
        prompt = make_prompt(2)
        tier.put(prompt.chunks())
        assert tier.contains(prompt.keys) == 2
        tier.close()
        wrong = open_tier(f"redis://:nope@127.0.0.1:{node.port}?timeout=1")
        with TieredStore([wrong]) as store:  # refused: misses, never an exception
            assert store.lookup(prompt.keys) == 0
            assert store.get(prompt.keys) == []
    finally:
        node.stop()


def test_a_unix_socket(tmp_path):
    sock = tmp_path / "redis.sock"
    node = RedisServer(tmp_path, "--unixsocket", str(sock), "--unixsocketperm", "700")
    try:
        tier = open_tier(f"unix://{sock}?db=1")
        prompt = make_prompt(3)
        tier.put(prompt.chunks())
        got = tier.get(prompt.keys)
        assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(3)]
        release_all(got)
        assert node.call("-n", "1", "DBSIZE") == "3"
        tier.close()
    finally:
        node.stop()


def test_the_server_bounds_memory_and_evicts_least_recently_used(tmp_path):
    node = RedisServer(tmp_path, "--maxmemory", "8mb", "--maxmemory-policy", "allkeys-lru")
    tier = open_tier(node.url)
    try:
        prompts = [make_prompt(8, seed=s, namespace=BIG) for s in range(20)]
        for p in prompts:
            tier.put(p.chunks())
        stats = tier.stats()
        assert stats["capacity_bytes"] == 8 << 20
        assert stats["used_bytes"] <= stats["capacity_bytes"] * 1.05
        assert tier.contains(prompts[-1].keys) == 8  # the newest prompt is there
        assert sum(tier.contains(p.keys) for p in prompts) < 20 * 8  # and older ones went
        got = tier.get(prompts[-1].keys)
        assert [c.tobytes() for c in got] == [prompts[-1].chunk_bytes(i) for i in range(8)]
        release_all(got)
    finally:
        tier.close()
        node.stop()


def test_a_full_server_without_eviction_refuses_writes_as_drops(tmp_path):
    node = RedisServer(tmp_path, "--maxmemory", "4mb", "--maxmemory-policy", "noeviction")
    tier = open_tier(node.url)
    try:
        with TieredStore([tier]) as store:
            for s in range(20):
                store.put(make_prompt(8, seed=s, namespace=BIG).chunks())  # never raises
        assert tier.stats()["oom"] > 0
        first = make_prompt(8, seed=0, namespace=BIG)
        assert tier.contains(first.keys) == 8  # what was stored stays readable
    finally:
        tier.close()
        node.stop()


def test_a_dead_server_is_a_miss_within_the_timeout_and_recovers(tmp_path):
    node = RedisServer(tmp_path)
    prompt = make_prompt(4)
    try:
        with TieredStore([open_tier(f"{node.url}?timeout=1&connect_timeout=0.5")]) as store:
            store.put(prompt.chunks())
            assert store.lookup(prompt.keys) == 4
            node.kill()
            results = []

            def use() -> None:
                results.append(store.lookup(prompt.keys))
                results.append(store.get(prompt.keys))
                store.put(make_prompt(2, seed=8).chunks())  # dropped, not raised
                results.append("put")

            worker = threading.Thread(target=use)
            worker.start()
            worker.join(60)  # a hang detector, far above the 1 s timeouts, not a speed claim
            assert not worker.is_alive() and results == [0, [], "put"]
            node.start()  # empty: no persistence
            deadline = time.monotonic() + 60
            while store.lookup(prompt.keys) == 0 and time.monotonic() < deadline:
                store.put(prompt.chunks())
                time.sleep(0.5)
            assert store.lookup(prompt.keys) == 4
    finally:
        node.stop()


def test_a_killed_cluster_master_costs_only_its_chunks(tmp_path):
    c = RedisCluster(tmp_path)
    try:
        tier = open_tier(f"{c.url}?timeout=1&connect_timeout=0.5")
        prompts = [make_prompt(1, seed=s) for s in range(30)]
        for p in prompts:
            tier.put(p.chunks())
        victim = c.nodes[1]
        on_victim = {
            p.keys[0] for p in prompts if str(tier._node_for(tier._rkey(p.keys[0]))).endswith(str(victim.port))
        }
        assert 0 < len(on_victim) < 30
        victim.kill()
        with TieredStore([tier]) as store:
            for p in prompts:
                want = 0 if p.keys[0] in on_victim else 1
                assert store.lookup(p.keys) == want
            victim.start()
            deadline = time.monotonic() + 60
            back = [p for p in prompts if p.keys[0] in on_victim]
            while time.monotonic() < deadline:
                store.put(back[0].chunks())
                if store.lookup(back[0].keys) == 1:
                    break
                time.sleep(0.5)
            assert store.lookup(back[0].keys) == 1
    finally:
        c.stop()


def test_tls(tmp_path):
    node = RedisServer(tmp_path, certificates=make_certificates(tmp_path / "certs"))
    try:
        tier = open_tier(node.url)
        prompt = make_prompt(3)
        tier.put(prompt.chunks())
        got = tier.get(prompt.keys)
        assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(3)]
        release_all(got)
        tier.close()
        assert node.call("DBSIZE") == "3"
        untrusted = open_tier(f"rediss://127.0.0.1:{node.port}?timeout=1")  # the system CAs do not know ours
        with TieredStore([untrusted]) as store:
            assert store.lookup(prompt.keys) == 0
    finally:
        node.stop()


def test_a_cluster_that_does_not_answer_at_start_misses_and_is_opened_once_it_does(redis_cluster, caplog):
    """An engine starting while its shared tier is down keeps running: the tier misses,
    says so once, and serves as soon as it answers. A misconfigured one still raises."""
    redis_cluster.flush()
    url = redis_cluster.url + "?timeout=0.3&connect_timeout=0.3"
    chunks = make_prompt(3, seed=11).chunks()
    keys = [c.key for c in chunks]
    for node in redis_cluster.nodes:
        os.kill(node.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(TierError):
            open_tier(url)  # without defer, as before: the caller decides
        with caplog.at_level(logging.WARNING):
            tier = open_or_defer(url)
        assert isinstance(tier, DeferredTier)
        said = [r.getMessage() for r in caplog.records if r.name == "lmtier.tiers.deferred"]
        assert len(said) == 1 and "cannot be opened now" in said[0]
        tier.put(chunks)
        assert tier.contains(keys) == 0 and tier.get(keys) == [None] * 3
        assert tier.stats()["state"] == "unavailable" and tier.stats()["dropped_puts"] == 3
        with pytest.warns(DeprecationWarning, match="open_or_defer"):  # as earlier releases wrote it
            old = lmtier.open_tier(url, defer=True)
        assert isinstance(old, DeferredTier)
        old.close()
    finally:
        for node in redis_cluster.nodes:
            os.kill(node.proc.pid, signal.SIGCONT)
    try:
        assert eventually(lambda: tier.opened is not None)  # the calls it gets trigger retries
        tier.put(chunks)
        assert tier.contains(keys) == 3
        got = tier.get(keys)
        assert [c.tobytes() for c in got] == [c.tobytes() for c in chunks]
        release_all(got)
    finally:
        tier.close()
    with pytest.raises(ConfigError):
        open_or_defer(redis_cluster.url + "?timeout=-1")


@pytest.mark.parametrize(
    ("reply", "opens"),
    [
        (b"-LOADING Redis is loading the dataset in memory", "deferred"),
        (b"-CLUSTERDOWN The cluster is down", "deferred"),
        (b"-ERR This instance has cluster support disabled", "config error"),
        (b"-WRONGPASS invalid username-password pair or user is disabled.", "config error"),
        (b"-NOAUTH Authentication required.", "config error"),
    ],
)
def test_a_cluster_node_that_is_not_ready_yet_is_retried_and_a_misconfigured_one_refused(reply, opens):
    """Fault injection: a node that answers every command with ``reply``."""
    import socketserver

    class Answer(socketserver.BaseRequestHandler):
        def handle(self):
            while self.request.recv(65536):
                self.request.sendall(reply + b"\r\n")

    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), Answer) as fake:
        fake.daemon_threads = True
        threading.Thread(target=fake.serve_forever, daemon=True).start()
        url = f"redis+cluster://127.0.0.1:{fake.server_address[1]}?timeout=1"
        try:
            if opens == "deferred":
                tier = open_or_defer(url)
                assert isinstance(tier, DeferredTier) and tier.contains([b"k" * 16]) == 0
                tier.close()
            else:
                with pytest.raises(ConfigError):
                    open_or_defer(url)
        finally:
            fake.shutdown()

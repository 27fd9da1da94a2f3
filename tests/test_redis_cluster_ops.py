"""Redis Cluster under what an operator does to it, against real redis-server processes:
masters with replicas, a failover, slots half moved, a node lost and its replica promoted,
reads from replicas. ``test_cluster_ops_under_load`` then drives every operation of
``benchmarks/bench_cluster_ops.py`` (each node on a host of its own in a network namespace
where the machine allows it) with client processes saving and loading throughout."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from lmtier import metrics
from lmtier.kv.chunk import release_all
from lmtier.testing.redis_cluster import RedisCluster
from lmtier.tiers.base import open_tier

from conftest import eventually, make_prompt

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_cluster_ops.py"


@pytest.fixture
def replicated(tmp_path):
    """Three masters, one replica each, on loopback (node timeout 1 s)."""
    cluster = RedisCluster(tmp_path, masters=3, replicas=1, node_timeout_ms=1000)
    yield cluster
    cluster.stop()


def changes() -> float:
    return metrics.REGISTRY.get_sample_value("lmtier_redis_slot_map_changes_total", {"tier": "redis"}) or 0


def test_a_promoted_replica_serves_its_dead_masters_chunks_to_a_running_client(replicated, caplog):
    """A master dies; its replica is promoted. A client that was running finds every chunk
    again without a restart: the failed connection makes it learn the slot map once more
    (no MOVED would ever come: the dead node answers nothing). Said once, counted once."""
    tier = open_tier(f"{replicated.url}?timeout=0.5&connect_timeout=0.3")
    prompts = [make_prompt(1, seed=s) for s in range(24)]
    try:
        for p in prompts:
            tier.put(p.chunks())
        assert eventually(replicated.caught_up)
        victim = max(replicated.masters(), key=replicated.slots_of)
        on_victim = [p for p in prompts if str(tier._node_for(tier._rkey(p.keys[0]))) == victim.address]
        assert on_victim
        before = changes()
        replicated.kill(victim)
        replicated.wait_healthy(60)
        with caplog.at_level(logging.INFO, logger="lmtier.tiers.redis.cluster"):
            assert eventually(lambda: all(tier.contains(p.keys) == 1 for p in prompts), 10)
        got = [c for p in on_victim for c in tier.get(p.keys)]
        assert [c.tobytes() for c in got] == [p.chunk_bytes(0) for p in on_victim]
        release_all(got)
        assert victim.address not in tier.router.masters()
        said = [r for r in caplog.records if "slot map changed" in r.getMessage()]
        assert len(said) == 1 and changes() == before + 1
        failed = [r for r in caplog.records if f"{victim.address} failed" in r.getMessage()]
        assert 1 <= len(failed) <= 2  # once as it started failing (a second thread may race)
        replicated.restart(victim)  # it comes back empty, as a replica: nothing else changes
        replicated.wait_healthy(60)
        assert all(tier.contains(p.keys) == 1 for p in prompts)
    finally:
        tier.close()


@pytest.mark.parametrize("endpoint", ["ip", "unknown-endpoint"])
def test_keys_of_a_slot_being_moved_are_followed_with_asking(replicated, endpoint):
    """Mid-reshard a slot is MIGRATING on its master and IMPORTING on the next: a key
    already moved answers ASK, and is read (and a new one written) on the importing node
    after ASKING; the keys not moved yet are read where they were. Once the slot is the
    new node's, a client with the old map is answered MOVED and follows it. With
    ``cluster-preferred-endpoint-type unknown-endpoint`` every redirection names a port
    alone (``ASK 123 :7001``) and CLUSTER SLOTS a null host: the host that answered."""
    for node in replicated.nodes:
        assert node.call("CONFIG", "SET", "cluster-preferred-endpoint-type", endpoint) == "OK"
    tier = open_tier(replicated.url + "?prefix={ask}:")  # a hash tag: every key in one slot
    try:
        slot = tier.router._key_slot(tier._rkey(b"any"))
        src = next(m for m in replicated.masters() if m.address == str(tier.router._slots[slot]))
        dst = next(m for m in replicated.masters() if m is not src)
        moved, stays, new = [make_prompt(1, seed=900 + s) for s in range(3)]
        moved, stays, new = [moved], [stays], [new]
        for p in moved + stays:
            tier.put(p.chunks())
        src_id, dst_id = replicated.node_id(src), replicated.node_id(dst)
        assert dst.call("CLUSTER", "SETSLOT", str(slot), "IMPORTING", src_id) == "OK"
        assert src.call("CLUSTER", "SETSLOT", str(slot), "MIGRATING", dst_id) == "OK"
        host, port = dst.address.rsplit(":", 1)
        answer = src.call("MIGRATE", host, port, tier._rkey(moved[0].keys[0]).decode(), "0", "5000")
        assert answer == "OK"
        for p in moved + stays:  # one on each side
            got = tier.get(p.keys)
            assert [c.tobytes() for c in got] == [p.chunk_bytes(0)]
            release_all(got)
        assert tier.contains(moved[0].keys) == 1
        tier.put(new[0].chunks())  # a new key of a migrating slot goes to its new node
        assert dst.call("CLUSTER", "COUNTKEYSINSLOT", str(slot)) == "2"
        got = tier.get(new[0].keys)
        assert [c.tobytes() for c in got] == [new[0].chunk_bytes(0)]
        release_all(got)
        answer = src.call("MIGRATE", host, port, tier._rkey(stays[0].keys[0]).decode(), "0", "5000")
        assert answer == "OK"
        for node in [dst, src] + [m for m in replicated.masters() if m not in (src, dst)]:
            assert node.call("CLUSTER", "SETSLOT", str(slot), "NODE", dst_id) == "OK"
        assert eventually(replicated.healthy)  # every node names the new owner
        assert str(tier.router._slots[slot]) == src.address  # the client's map is the old one
        got = tier.get(stays[0].keys)
        assert [c.tobytes() for c in got] == [stays[0].chunk_bytes(0)]
        release_all(got)
        assert str(tier.router._slots[slot]) == dst.address  # and learnt again
    finally:
        tier.close()


def test_reads_from_replicas_when_configured(replicated):
    """``replica_reads=true``: EXISTS and GET go to the replicas (READONLY), writes to
    the masters; what a replica serves is what was written."""
    writer = open_tier(replicated.url)
    prompts = [make_prompt(2, seed=s) for s in range(40, 52)]
    for p in prompts:
        writer.put(p.chunks())
    writer.close()
    assert eventually(replicated.caught_up)

    def named() -> bool:  # CLUSTER SLOTS names a replica once it has copied something
        return all(len(r) > 3 for r in replicated.slot_ranges(replicated.masters()[0]))

    assert eventually(named)
    tier = open_tier(f"{replicated.url}?replica_reads=true")

    def gets(nodes) -> int:
        total = 0
        for n in nodes:
            line = [x for x in n.call("INFO", "commandstats").splitlines() if x.startswith("cmdstat_get:")]
            total += int(line[0].split("calls=")[1].split(",")[0]) if line else 0
        return total

    try:
        masters, replicas = replicated.masters(), replicated.replicas()
        on_masters = gets(masters)
        assert eventually(lambda: all(tier.contains(p.keys) == 2 for p in prompts))
        for p in prompts:
            got = tier.get(p.keys)
            assert [c.tobytes() for c in got] == [p.chunk_bytes(i) for i in range(2)]
            release_all(got)
        assert gets(replicas) >= 24 and gets(masters) == on_masters
    finally:
        tier.close()
    with pytest.raises(Exception, match="replica_reads is for redis\\+cluster"):
        open_tier(f"redis://{replicated.nodes[0].address}?replica_reads=true")


class HeldTimer:
    """A ``threading.Timer`` that fires only when a test calls ``fire``: what a window of
    real time would do on a machine of any speed, without the race."""

    def __init__(self, delay: float, function) -> None:
        self.delay, self.function, self.started, self.daemon = delay, function, False, False

    @classmethod
    def maker(cls, made: list):
        def make(delay: float, function) -> HeldTimer:
            made.append(cls(delay, function))
            return made[-1]

        return make

    def start(self) -> None:
        self.started = True

    def cancel(self) -> None:
        self.started = False

    def fire(self) -> None:
        self.function()


def test_a_reshards_many_map_changes_are_logged_in_a_few_lines(monkeypatch, caplog):
    """A reshard moves slots one at a time, and every MOVED learns a new map: the first
    change is logged at once, those that follow within ``CHANGES_LOGGED_EVERY_S`` in one
    line when that time is up (with the masters then), each of them counted."""
    from lmtier.tiers.redis import cluster as routing

    now = [1000.0]  # the router's clock, moved by hand
    monkeypatch.setattr(routing, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(routing, "CHANGES_LOGGED_EVERY_S", 0.3)
    timers: list[HeldTimer] = []  # the timer that sums fires when the test says: when the window is up
    monkeypatch.setattr(routing, "threading", SimpleNamespace(**{**vars(threading), "Timer": HeldTimer.maker(timers)}))
    seed = routing.Node(routing.Settings(), "127.0.0.1", 1)
    router = routing.Router(routing.Settings(name="reshard-log"), [seed], False)
    router.cluster = True  # driven by hand below: no node is asked

    def owner(first_to_b: int) -> list:  # slots below ``first_to_b`` on a, the rest on b
        return [(0, first_to_b - 1, "127.0.0.1:7001", ()), (first_to_b, 16383, "127.0.0.1:7002", ())]

    def counted() -> float:
        sample = {"tier": "reshard-log"}
        return metrics.REGISTRY.get_sample_value("lmtier_redis_slot_map_changes_total", sample) or 0

    def said() -> list[str]:
        return [m for m in (r.getMessage() for r in caplog.records) if m.startswith("redis tier reshard-log:")]

    with caplog.at_level(logging.INFO, logger="lmtier.tiers.redis.cluster"):
        router._adopt(owner(8192))  # the first map: nothing changed
        for step in range(1, 31):  # 30 changes, a slot at a time
            router._adopt(owner(8192 - step))
        assert said() == [
            "redis tier reshard-log: the cluster's slot map changed (1 slots to another master); masters now: "
            "127.0.0.1:7001, 127.0.0.1:7002"
        ]
        assert counted() == 30 and len(timers) == 1 and timers[0].started
        timers[0].fire()  # the window is up
        assert len(said()) == 2
        assert "29 more changes of the cluster's slot map (29 slots to another master in all)" in said()[1]
        now[0] += 1  # a quiet while: the next change is one line, at once
        router._adopt(owner(100))
        router._adopt(owner(99))
        router.close()  # what is left unsaid is said as the router closes
    assert len(said()) == 4 and "(8062 slots to another master)" in said()[2]
    assert "1 more changes of the cluster's slot map (1 slots" in said()[3]
    assert counted() == 32


def test_redirections_and_slot_maps_name_nodes_only_as_redis_does():
    """What a reply names is believed only as Redis means it: a port alone is on the host
    that answered (an IPv6 address that begins with ``::`` is not a port alone); a port
    of other digits than ASCII, a host that is no string, is refused as that node's
    failure, never an exception out of the tier; a bracketed IPv6 host is the node of the
    same name unbracketed (a map that names it so changes nothing)."""
    from lmtier.errors import TierError
    from lmtier.tiers.redis import cluster as routing
    from lmtier.tiers.redis.pipeline import redirection
    from lmtier.tiers.redis.resp import ReplyError

    v4, v6 = routing.Node(routing.Settings(), "10.0.0.5", 7001), routing.Node(routing.Settings(), "::1", 7001)
    assert redirection(ReplyError("MOVED 3999 :7002"), v4) == ("10.0.0.5:7002", False)
    assert redirection(ReplyError("ASK 3999 :7002"), v6) == ("::1:7002", True)
    assert redirection(ReplyError("MOVED 3999 ::1:7002"), v4) == ("::1:7002", False)
    assert redirection(ReplyError("MOVED 3999 ::ffff:10.0.0.6:7002"), v6) == ("::ffff:10.0.0.6:7002", False)
    assert redirection(ReplyError("MOVED 3999 10.0.0.6:7002"), v6) == ("10.0.0.6:7002", False)
    assert redirection(ReplyError("MOVED 3999"), v4) is None and redirection(b"value", v4) is None

    router = routing.Router(routing.Settings(), [v4], False)
    for bad in ("10.0.0.5:\u00b2", "10.0.0.5:\u2460", "10.0.0.5:0", "10.0.0.5:70000", ":7002", "10.0.0.5:"):
        with pytest.raises(TierError):
            router.node_at(bad)
    assert list(router.nodes) == ["10.0.0.5:7001"]
    assert routing._address(v6, b"[::2]", 7003) == "::2:7003"
    assert routing._address(v6, None, 7003) == routing._address(v6, b"?", 7003) == "::1:7003"
    for host, port in ((5, 7003), ([b"x"], 7003), (b"[]", 7003), (b"h", "7003"), (b"h", 0)):
        with pytest.raises(TierError):
            routing._address(v4, host, port)


def test_a_routers_locks_and_unlogged_changes_are_its_own_process(monkeypatch, caplog):
    """Forked while another thread refreshes, the child's router refreshes on locks of its
    own (the parent's may be held by a thread the child does not have), and logs none of
    the parent's changes. ``close`` says what is left without waiting for a refresh."""
    import os
    import threading

    from lmtier.errors import RetryableError
    from lmtier.tiers.redis import cluster as routing

    monkeypatch.setattr(routing, "CHANGES_LOGGED_EVERY_S", 3600.0)
    dead = routing.Node(routing.Settings(connect_timeout=0.2, timeout=0.2), "127.0.0.1", 1)
    router = routing.Router(routing.Settings(name="forked"), [dead], False)
    router.cluster = True
    ranges = [[(0, 16383, "127.0.0.1:7001", ())], [(0, 16383, "127.0.0.1:7002", ())]]
    for i in range(3):  # the first map, one change logged, one held back for the summary
        router._adopt(ranges[i % 2])
    assert router._unsaid == [1, 16384]
    router._refreshing.acquire()  # a refresh in flight in another thread
    try:
        pid = os.fork()
        if pid == 0:  # the child: a refresh of its own fails fast (no node answers), unsaid is empty
            code = 1
            try:
                try:
                    router.refresh("connection")
                except RetryableError:
                    code = 0 if router._unsaid == [0, 0] and router._summary is None else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        with caplog.at_level(logging.INFO, logger="lmtier.tiers.redis.cluster"):
            closing = threading.Thread(target=router.close)
            closing.start()
            closing.join(30)
            assert not closing.is_alive()  # it did not wait for the refresh
    finally:
        router._refreshing.release()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "1 more changes of the cluster's slot map (16384 slots" in said[0]


def test_the_slot_map_is_learnt_on_the_clusters_word_not_polled(replicated):
    """In steady state no call asks for the slot map (CLUSTER SLOTS or NODES): only a
    MOVED or a failed node does."""
    tier = open_tier(f"{replicated.url}?replica_reads=true")

    def asked() -> int:
        total = 0
        for n in replicated.live():
            for line in n.call("INFO", "commandstats").splitlines():
                if line.startswith("cmdstat_cluster"):
                    total += int(line.split("calls=")[1].split(",")[0])
        return total

    try:
        prompts = [make_prompt(3, seed=s) for s in range(60, 100)]
        before = asked()
        for p in prompts:
            tier.put(p.chunks())
            tier.contains(p.keys)
            release_all([c for c in tier.get(p.keys) if c is not None])
        assert asked() == before
    finally:
        tier.close()


# The first test that uses ``ops`` pays for the whole run (minutes on a slow 2-core machine)
OPS_TIMEOUT = pytest.mark.timeout(1600)


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    out = tmp_path_factory.mktemp("ops") / "ops.json"
    run = subprocess.run(
        # Every event, the clients a little slower than the page's (a load every 0.1 s: the
        # same code at a fifth of the CPU) and a reshard of 1,024 slots (the page's moves a
        # third): redis-py beside them is the page's.
        [sys.executable, str(BENCH), "--reads-seconds", "3", "--pause", "0.1", "--moved-slots", "1024",
         "--json-out", str(out)],
        capture_output=True, text=True, timeout=1500, cwd=BENCH.parent,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    print(run.stderr[-3000:])
    return report


@OPS_TIMEOUT
def test_the_operations_run_where_the_machine_allows_hosts_of_their_own(ops):
    from lmtier.testing.netns import unavailable

    reason = unavailable()
    assert ops["where"] == ("namespaces" if reason is None else f"loopback ports ({reason})")


@OPS_TIMEOUT
@pytest.mark.parametrize("event", ["kill", "failover", "reshard", "add", "cut", "maxmemory"])
def test_cluster_ops_under_load(ops, event):
    """Each operation with clients saving and loading throughout (redis-py beside them on the
    results page only): nothing wrong, ever;
    loads and saves went on; the hits came back to their level (for ``maxmemory``, the
    store keeps working at what fits); no thread or connection piles up."""
    found = next(e for e in ops["events"] if e["event"] == event)
    for name, f in found["clients"].items():
        assert f["wrong"] == 0, (name, f)
        assert f["loads"] > 0 and f["hit_rate_before"] >= 0.95, (name, f)
        if event != "maxmemory":  # the cut host or killed master still away: its replica serves
            assert f["hit_rate_after"] >= 0.9 * f["hit_rate_before"], (name, f)
        else:
            assert f["hit_rate_after"] > 0, (name, f)
        if event in ("kill", "cut"):  # back as a replica: nothing changes for the clients
            assert f["hit_rate_after_restore"] >= 0.9 * f["hit_rate_before"], (name, f)
        first = ops["events"][0]["clients"][name]
        assert f["threads_max"] <= first["threads_max"] + 8, (name, f, first)
        assert f["fds_max"] <= first["fds_max"] + 12, (name, f, first)


@OPS_TIMEOUT
def test_replica_reads_are_measured_and_serve_right_bytes(ops):
    reads = ops["replica_reads"]
    for mode in ("masters", "replicas"):
        assert reads[mode]["wrong"] == 0 and reads[mode]["loads_per_s"] > 0 and reads[mode]["hit_rate"] >= 0.95


def test_a_node_that_trickles_its_reply_cannot_hold_a_load(tmp_path):
    """A hostile or sick node answers a GET one byte at a time, each within the timeout:
    the call still ends (a reply must keep up 10 MB/s past the timeout), as a miss."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def drip() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"$1000000\r\n")
        while not stop.wait(0.05):
            try:
                conn.sendall(b"x")
            except OSError:
                return

    server = threading.Thread(target=drip, daemon=True)
    server.start()
    tier = open_tier(f"redis://127.0.0.1:{listener.getsockname()[1]}?timeout=0.5")
    result: list = []
    reader = threading.Thread(target=lambda: result.append(_get_or_error(tier, make_prompt(1, seed=7).keys)))
    try:
        reader.start()
        reader.join(30)  # the drip alone would take 14 hours
        assert not reader.is_alive() and (isinstance(result[0], Exception) or result[0] == [None])
    finally:
        stop.set()
        tier.close()
        listener.close()


def _get_or_error(tier, keys):
    try:
        return tier.get(keys)
    except Exception as exc:  # the one server failing: the tier raises, the store turns it into a miss
        return exc

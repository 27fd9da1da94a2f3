"""Which node serves a key: the one server, or the master (or a replica) of the key's slot.

    Router(settings, seeds, cluster, replica_reads=False, name="redis")
        .node_for(rkey, read=False) -> Node
        .groups(rkeys, positions, read=False) -> {Node: [position, ...]}    in key order
        .node_at("host:port") -> (Node, known)   the node a redirection names
        .refresh(reason, seen=None)     learn every slot's master and replicas (CLUSTER SLOTS)
        .after_failure(seen)            a connection failed: learn the map again, at most
                                        every 0.25 s (doubling to 1 s while nothing changes)
        .replicas_wanted()              replica_reads and a slot without one: every 5 s
        .generation                     how many maps were learnt (``seen`` above)
        .masters() -> [str]             "host:port" of each master (the one server when not a cluster)
        .down() -> bool                 the tier as a whole is down: the one server, or every master
        .nodes                          every node of the current map, and the seeds, by name
        .close()

A cluster's slot map is learnt at start from any seed that answers, and again on the
cluster's word: a reply that says MOVED (``lmtier.tiers.redis.pipeline``), or a connection
to a node that fails (its master may be gone and a replica promoted: nothing else would
say so, since the dead node answers nothing). Nothing polls it. A map that differs from
the one before is counted (``lmtier_redis_slot_map_changes_total``) and logged: the first
change at once, the changes that follow within ``CHANGES_LOGGED_EVERY_S`` of it (a reshard
moves its slots one at a time: a refresh on every MOVED sees a new map) in one line when
that time is up, with the masters then. Nodes the map no longer names are closed, so that
a fleet whose cluster changes often keeps no connections to nodes long gone.

With ``replica_reads``, EXISTS and GET go to a replica of the slot's master (one that is
not backing off; the master when there is none), over connections that said READONLY.
The replicas are those CLUSTER SLOTS names (it leaves out one that has copied nothing
yet, which would miss everything), and while a slot has none the map is asked for every
5 s. A replica that lags misses; it never serves other bytes than were written (every
chunk is checked). Every reply is checked before it is believed (slot ranges, addresses,
ports): a malformed one is a failure of the node that sent it, nothing more. The slot of
a key is redis-py's ``key_slot``: what redis-py does well is not redone here.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Sequence

from lmtier import metrics
from lmtier.breaker import QuietWarning
from lmtier.errors import ConfigError, MissingDependency, RetryableError, TierError
from lmtier.tiers.redis.conn import Node, Settings
from lmtier.tiers.redis.resp import ReplyError

log = logging.getLogger(__name__)

SLOTS = 16384
REFRESH_AFTER_FAILURE_S = 0.25  # a failing node asks for the map at most this often
REFRESH_TRIES = 5  # nodes asked for the map in one refresh at most
REFRESH_AT_MOST_S = 1.0  # ... and while they learn nothing new, the wait doubles up to this
REPLICAS_EVERY_S = 5.0  # replica_reads: the map asked for this often while a slot lacks a replica
CHANGES_LOGGED_EVERY_S = 10.0  # changes of the map after a logged one: summed in one line this often


class Router:
    def __init__(self, settings: Settings, seeds: Sequence[Node], cluster: bool, replica_reads: bool = False) -> None:
        self.settings, self.cluster, self.replica_reads = settings, cluster, replica_reads
        self.seeds = list(seeds)
        self.nodes: dict[str, Node] = {str(n): n for n in self.seeds}
        # replaced whole on refresh: readers need no lock
        self._slots: list[Node] = []
        self._replicas: list[tuple[Node, ...]] = []
        self.generation = 0
        self._refreshed_at = 0.0
        self._refresh_every = REFRESH_AFTER_FAILURE_S  # doubles while refreshes learn nothing new
        self._without_replica = False  # replica_reads, and a slot has no replica that serves
        self._quiet = QuietWarning(log)
        self._said_at = float("-inf")  # when a change of the map was last logged
        self._closed = False
        self._fresh()
        if cluster:
            try:
                from redis.crc import key_slot
            except ImportError as exc:
                raise MissingDependency("redis", "redis") from exc
            self._key_slot = key_slot
            self.refresh("start")

    def _fresh(self) -> None:
        """Locks and the changes not logged yet, of this process: after ``fork`` a lock may
        be held by a thread that does not exist here, and the parent's changes are the
        parent's to log."""
        self._refreshing = threading.Lock()  # one refresh at a time
        self._saying = threading.Lock()  # the changes not logged yet (never held across a call)
        self._unsaid = [0, 0]  # changes (and slots moved) since the last line, not logged yet
        self._summary: threading.Timer | None = None  # the timer that will log them
        self._pid = os.getpid()

    def node_for(self, rkey: bytes, read: bool = False) -> Node:
        if not self.cluster:
            return self.seeds[0]
        slot = self._key_slot(rkey)
        if read and self.replica_reads:
            up = [n for n in self._replicas[slot] if not n.down()]
            if up:
                return random.choice(up)
        return self._slots[slot]

    def groups(
        self, rkeys: Sequence[bytes], positions: Sequence[int] | None = None, read: bool = False
    ) -> dict[Node, list[int]]:
        """Positions of ``rkeys`` (all, or those named) per node, in key order."""
        by_node: dict[Node, list[int]] = {}
        for i in range(len(rkeys)) if positions is None else positions:
            by_node.setdefault(self.node_for(rkeys[i], read), []).append(i)
        return by_node

    def node_at(self, address: str) -> tuple[Node, bool]:
        """The node at ``host:port`` (as a MOVED or ASK reply names it), and whether it is
        one of the map's. One the map does not name is made for the call alone (the
        caller closes it): a reply cannot grow the node table."""
        node = self.nodes.get(address)
        if node is not None:
            return node, True
        host, _, port = address.rpartition(":")
        if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
            raise TierError(f"a redirection to {address!r} is not host:port")
        return self._node(address), False

    def _node(self, address: str) -> Node:
        """A new node for a checked ``host:port``."""
        host, _, port = address.rpartition(":")
        return Node(self.settings, host.strip("[]"), int(port))

    def replicas_wanted(self) -> None:
        """With ``replica_reads``, while some slot has no replica that serves: learn the
        map again at most every ``REPLICAS_EVERY_S`` (CLUSTER SLOTS names a replica only
        once it has copied something: not those of a cluster just made, nor one that is
        copying its master afresh, which would miss everything meanwhile)."""
        if not self._without_replica or time.monotonic() - self._refreshed_at < REPLICAS_EVERY_S:
            return
        try:
            self.refresh("replicas")
        except TierError as exc:
            self._quiet.warning("redis tier %s: cannot refresh the slot map: %s", self.settings.name, exc)

    def after_failure(self, seen: int) -> None:
        """A node failed during a batch begun at map ``seen``: its slots may have another
        master now. Learn the map again unless that was done since, or very recently."""
        if not self.cluster or time.monotonic() - self._refreshed_at < self._refresh_every:
            return
        try:
            self.refresh("connection", seen)
        except TierError as exc:
            self._quiet.warning("redis tier %s: cannot refresh the slot map: %s", self.settings.name, exc)

    def refresh(self, reason: str = "moved", seen: int | None = None) -> None:
        """Learn which master (and replicas) serve each of the 16384 slots (CLUSTER SLOTS),
        asking the nodes that are not backing off first. ``seen``: the map the caller
        acted on; when another thread learnt a newer one meanwhile, that one stands. A node
        that is not a cluster node, or refuses the credentials, is a ``ConfigError``; a
        cluster that is not ready yet (LOADING, CLUSTERDOWN ...) or unreachable is retryable."""
        if self._pid != os.getpid():
            self._fresh()
        with self._refreshing:
            if seen is not None and seen != self.generation:
                return
            self._refreshed_at = time.monotonic()
            metrics.SLOT_MAP_REFRESHES.labels(self.settings.name, reason).inc()
            self._learn()

    def _learn(self) -> None:
        last: Exception | None = None
        known = sorted(self.nodes.values(), key=lambda n: n.down())  # a node backing off is asked last
        for node in known[:REFRESH_TRIES]:  # each may cost a connect timeout: a few, not the whole fleet
            try:
                answer = node.run(lambda c: c.call(b"CLUSTER", b"SLOTS"))
            except TierError as exc:
                last = exc
                continue
            if isinstance(answer, ReplyError):
                text = str(answer)
                if "cluster support disabled" in text or "unknown command" in text.lower():
                    raise ConfigError(f"{node} is not a cluster node: {text}")
                if text.startswith(("NOAUTH", "WRONGPASS")):
                    raise ConfigError(f"{node} refused the credentials: {text}")
                last = RetryableError(f"{node}: {text}")  # LOADING, BUSY, CLUSTERDOWN...: later
                continue
            try:
                ranges = _ranges(node, answer)
            except TierError as exc:
                last = exc
                continue
            self._adopt(ranges)
            return
        raise RetryableError(f"no cluster node answered CLUSTER SLOTS: {last}")

    def _adopt(self, ranges: list[tuple[int, int, str, tuple[str, ...]]]) -> None:
        slots: list[Node | None] = [None] * SLOTS
        replicas: list[tuple[Node, ...]] = [()] * SLOTS
        for start, end, master, others in ranges:
            owner = self._named(master)
            copies = tuple(self._named(r) for r in others)
            slots[start : end + 1] = [owner] * (end - start + 1)
            replicas[start : end + 1] = [copies] * (end - start + 1)
        if any(s is None for s in slots):
            raise TierError("the cluster does not cover every slot")
        before = self._slots
        self._slots, self._replicas = slots, replicas  # type: ignore[assignment]
        self._without_replica = self.replica_reads and not all(replicas)
        self.generation += 1
        if before and before != slots:
            self._refresh_every = REFRESH_AFTER_FAILURE_S
            metrics.SLOT_MAP_CHANGES.labels(self.settings.name).inc()
            self._said(sum(a is not b for a, b in zip(before, slots, strict=True)))
        else:
            self._refresh_every = min(REFRESH_AT_MOST_S, 2 * self._refresh_every)
        self._forget_unnamed()

    def _said(self, moved: int) -> None:
        """Log a change of the map (``moved`` slots to another master): at once when none
        was logged in the last ``CHANGES_LOGGED_EVERY_S``, else summed with those that
        follow into one line when that time is up."""
        now = time.monotonic()
        with self._saying:
            if now - self._said_at < CHANGES_LOGGED_EVERY_S or self._closed:
                self._unsaid[0] += 1
                self._unsaid[1] += moved
                if self._summary is None and not self._closed:
                    self._summary = threading.Timer(self._said_at + CHANGES_LOGGED_EVERY_S - now, self._say_the_rest)
                    self._summary.daemon = True
                    self._summary.start()
                return
            self._said_at = now
        log.info("redis tier %s: the cluster's slot map changed (%d slots to another master); masters now: %s",
                 self.settings.name, moved, ", ".join(self.masters()))  # fmt: skip

    def _say_the_rest(self) -> None:
        with self._saying:
            changes, moved = self._unsaid
            self._unsaid = [0, 0]
            self._summary = None
            self._said_at = time.monotonic()
        if changes:
            log.info("redis tier %s: %d more changes of the cluster's slot map (%d slots to another master in all);"
                     " masters now: %s", self.settings.name, changes, moved, ", ".join(self.masters()))  # fmt: skip

    def _named(self, address: str) -> Node:
        node = self.nodes.get(address)
        if node is None:
            node = self.nodes[address] = self._node(address)
        return node

    def _forget_unnamed(self) -> None:
        """Close the nodes the map no longer names (a node removed, a host replaced)."""
        named = {str(n) for n in self._slots} | {str(r) for rs in set(self._replicas) for r in rs}
        named |= {str(n) for n in self.seeds}
        for name in [name for name in self.nodes if name not in named]:
            self.nodes.pop(name).close()

    def masters(self) -> list[str]:
        return sorted({str(n) for n in self._slots}) if self.cluster else [str(self.seeds[0])]

    def down(self) -> bool:
        """Whether a failed call means the tier as a whole is down: always for one server;
        for a cluster only when every master is backing off (one master down costs only
        its own chunks)."""
        if not self.cluster:
            return True
        return all(node.down() for node in {id(n): n for n in self._slots}.values())

    def close(self) -> None:
        if self._pid != os.getpid():
            self._fresh()
        with self._saying:
            self._closed = True  # a refresh still in flight counts its change, and starts no timer
            timer = self._summary
        if timer is not None:
            timer.cancel()
        self._say_the_rest()
        for node in list(self.nodes.values()):
            node.close()


def _address(asked: Node, host: object, port: object) -> str:
    """``host:port`` of a node a reply names; a null, empty or ``?`` endpoint (Redis 7's
    ``cluster-preferred-endpoint-type unknown-endpoint``) is the node that answered."""
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    if host is None or host in ("", "?"):
        host = asked.host
    if isinstance(host, str):
        host = host.strip("[]")  # an IPv6 address may come bracketed: a node's name never is
    if not (isinstance(host, str) and host and isinstance(port, int) and 0 < port < 65536):
        raise TierError(f"{asked}: a node named at {host!r}:{port!r}")
    return f"{host}:{port}"


def _ranges(asked: Node, answer: object) -> list[tuple[int, int, str, tuple[str, ...]]]:
    """CLUSTER SLOTS, checked: (first slot, last slot, master, replicas) per range."""
    if not isinstance(answer, list) or not answer or len(answer) > SLOTS:
        raise TierError(f"{asked}: CLUSTER SLOTS answered no list of slot ranges")
    out = []
    for item in answer:
        if not (
            isinstance(item, list) and len(item) >= 3 and all(isinstance(x, list) and len(x) >= 2 for x in item[2:])
        ):
            raise TierError(f"{asked}: a malformed CLUSTER SLOTS range")
        start, end = item[0], item[1]
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end < SLOTS):
            raise TierError(f"{asked}: CLUSTER SLOTS names slots {start!r}-{end!r}")
        others = tuple(_address(asked, r[0], r[1]) for r in item[3:])
        out.append((start, end, _address(asked, item[2][0], item[2][1]), others))
    return out

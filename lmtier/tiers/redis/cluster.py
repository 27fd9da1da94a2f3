"""Which node serves a key: the one server, or the master of the key's slot in a cluster.

    Router(settings, seeds, cluster)
        .node_for(rkey) -> Node
        .groups(rkeys, positions) -> {Node: [position, ...]}    in key order
        .refresh()               learn every slot's master (CLUSTER SLOTS)
        .masters() -> [str]      "host:port" of each master (the one server when not a cluster)
        .down() -> bool          the tier as a whole is down: the one server, or every master
        .nodes                   every node seen, by name
        .close()

A cluster's slot map is learnt at start from any seed that answers and again whenever a
reply says MOVED or ASK (``lmtier.tiers.redis.pipeline``). The slot of a key is redis-py's
``key_slot``: what redis-py does well is not redone here.
"""

from __future__ import annotations

from collections.abc import Sequence

from lmtier.errors import ConfigError, MissingDependency, RetryableError, TierError
from lmtier.tiers.redis.conn import Node, Settings
from lmtier.tiers.redis.resp import ReplyError

SLOTS = 16384


class Router:
    def __init__(self, settings: Settings, seeds: Sequence[Node], cluster: bool) -> None:
        self.settings, self.cluster = settings, cluster
        self.seeds = list(seeds)
        self.nodes: dict[str, Node] = {str(n): n for n in self.seeds}
        self._slots: list[Node] = []  # replaced whole on refresh: readers need no lock
        if cluster:
            try:
                from redis.crc import key_slot
            except ImportError as exc:
                raise MissingDependency("redis", "redis") from exc
            self._key_slot = key_slot
            self.refresh()

    def node_for(self, rkey: bytes) -> Node:
        if not self.cluster:
            return self.seeds[0]
        return self._slots[self._key_slot(rkey)]

    def groups(self, rkeys: Sequence[bytes], positions: Sequence[int] | None = None) -> dict[Node, list[int]]:
        """Positions of ``rkeys`` (all, or those named) per node, in key order."""
        by_node: dict[Node, list[int]] = {}
        for i in range(len(rkeys)) if positions is None else positions:
            by_node.setdefault(self.node_for(rkeys[i]), []).append(i)
        return by_node

    def refresh(self) -> None:
        """Learn which master serves each of the 16384 slots (CLUSTER SLOTS). A node that
        is not a cluster node, or refuses the credentials, is a ``ConfigError``; a cluster
        that is not ready yet (LOADING, CLUSTERDOWN ...) or unreachable is retryable."""
        last: Exception | None = None
        for node in list(self.nodes.values()):
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
            slots: list[Node | None] = [None] * SLOTS
            for start, end, master, *_replicas in answer:
                host, port = master[0].decode() or node.host, int(master[1])
                name = f"{host}:{port}"
                target = self.nodes.get(name)
                if target is None:
                    target = self.nodes[name] = Node(self.settings, host, port)
                for s in range(start, end + 1):
                    slots[s] = target
            if any(s is None for s in slots):
                raise TierError("the cluster does not cover every slot")
            self._slots = slots  # type: ignore[assignment]
            return
        raise RetryableError(f"no cluster node answered CLUSTER SLOTS: {last}")

    def masters(self) -> list[str]:
        return sorted({str(n) for n in self._slots}) if self.cluster else [str(self.seeds[0])]

    def down(self) -> bool:
        """Whether a failed call means the tier as a whole is down: always for one server;
        for a cluster only when every master is backing off (one master down costs only
        its own chunks)."""
        return not self.cluster or all(self.nodes[m].down() for m in self.masters())

    def close(self) -> None:
        for node in self.nodes.values():
            node.close()

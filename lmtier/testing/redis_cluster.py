"""A Redis Cluster for tests and benchmarks, and what an operator does to one.

    cluster = RedisCluster(workdir, masters=3, replicas=0, hosts=False, node_timeout_ms=2000)
        .where                   "namespaces", or "loopback ports (why)"
        .url                     redis+cluster://seed,seed,...
        .nodes                   every node started (RedisServer), in order
        .masters() / .replicas() the live nodes in each role now
        .healthy() -> bool       every reachable node says cluster_state:ok, and all of
                                 them name the same live masters for every slot
        .wait_healthy(timeout)   ... and every master's replicas are in sync
        .kill(node) / .restart(node)
        .cut(node) / .mend(node) the node's host off the network and back (loopback: the
                                 process paused and resumed, which a client sees alike)
        .failover(replica)       CLUSTER FAILOVER: the replica and its master swap
        .reshard(src, dst, n)    move n slots with their keys (redis-cli --cluster reshard)
        .add_master() -> node    a new empty master, joined (redis-cli --cluster add-node)
        .flush() / .stop()

With ``hosts=True`` each node runs on a host of its own: a network namespace on a switch
(``lmtier.testing.netns.Switch``), so that a host can be cut off rather than only killed.
Where the machine cannot make namespaces (no root, no iproute2) the nodes run on loopback
ports and ``where`` says why. Nodes keep nothing on disk (no RDB, no AOF): a killed node
comes back empty, as a cache node would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from lmtier.errors import TierError
from lmtier.testing import netns
from lmtier.testing.redis_server import RedisServer

PORT = 6379  # every host has an address of its own: the same port on each


class RedisCluster:
    def __init__(
        self,
        workdir: Path,
        masters: int = 3,
        replicas: int = 0,
        hosts: bool = False,
        node_timeout_ms: int = 2000,
        config: tuple[str, ...] = (),
    ) -> None:
        self.workdir, self.node_timeout_ms = workdir, node_timeout_ms
        self.config = ("--cluster-enabled", "yes", "--cluster-node-timeout", str(node_timeout_ms), *config)
        self.nodes: list[RedisServer] = []
        self.switch: netns.Switch | None = None
        self._netns: dict[str, str] = {}  # node address -> its host's namespace
        self._down: set[str] = set()  # addresses killed or cut off, not back yet
        reason = netns.unavailable() if hosts else "not asked for"
        if reason is None:
            self.switch = netns.Switch()
        self.where = "namespaces" if self.switch else f"loopback ports ({reason})"
        try:
            self._create(masters, replicas)
        except BaseException:
            self.stop()
            raise

    # -- making it -----------------------------------------------------------------------
    def _node(self) -> RedisServer:
        if self.switch is None:
            node = RedisServer(self.workdir, *self.config)
        else:
            ns, ip = self.switch.add_host()
            node = RedisServer(self.workdir, *self.config, host=ip, port=PORT, wrap=tuple(self.switch.command(ns, [])))
            self._netns[node.address] = ns
        node.call("CONFIG", "SET", "cluster-require-full-coverage", "no")
        self.nodes.append(node)
        return node

    def _create(self, masters: int, replicas: int) -> None:
        made = [self._node() for _ in range(masters * (1 + replicas))]
        self._cli("--cluster", "create", *[n.address for n in made], "--cluster-replicas", str(replicas),
                  "--cluster-yes")  # fmt: skip
        self.wait_healthy(60)

    def _cli(self, *args: str, timeout: float = 120) -> str:
        run = subprocess.run(["redis-cli", *args], capture_output=True, text=True, timeout=timeout, check=False)
        if run.returncode:
            raise RuntimeError(f"redis-cli {' '.join(args[:2])} failed: {run.stdout[-2000:]} {run.stderr[-2000:]}")
        return run.stdout

    # -- what it is now ------------------------------------------------------------------
    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(n.address for n in self.nodes)

    def live(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.address not in self._down]

    def role(self, node: RedisServer) -> str:
        return node.call("ROLE", timeout=5).split("\n", 1)[0].strip()

    def masters(self) -> list[RedisServer]:
        return [n for n in self.live() if self.role(n) == "master"]

    def replicas(self) -> list[RedisServer]:
        return [n for n in self.live() if self.role(n) == "slave"]

    def replica_of(self, master: RedisServer) -> RedisServer:
        """A live replica of ``master``."""
        for n in self.replicas():
            info = dict(line.split(":", 1) for line in n.call("INFO", "replication").splitlines() if ":" in line)
            if (info.get("master_host"), info.get("master_port")) == (master.host, str(master.port)):
                return n
        raise RuntimeError(f"{master.address} has no live replica")

    def node_id(self, node: RedisServer) -> str:
        return node.call("CLUSTER", "MYID")

    def slot_ranges(self, node: RedisServer) -> list:
        """CLUSTER SLOTS as ``node`` answers it (lmtier's RESP: nested lists)."""
        from lmtier.tiers.redis.conn import Settings, connect  # the tier's modules load only where used

        stream = connect(Settings(timeout=5, connect_timeout=2), node.host, node.port)
        try:
            answer = stream.call(b"CLUSTER", b"SLOTS")
        finally:
            stream.close()
        if not isinstance(answer, list):
            raise RuntimeError(f"{node.address}: CLUSTER SLOTS answered {answer!r}")
        return answer

    def slot_owners(self, node: RedisServer) -> frozenset[tuple[int, int, str]]:
        """(first slot, last slot, master's address) of each range, as ``node`` sees them
        (a null or ``?`` host, with ``cluster-preferred-endpoint-type unknown-endpoint``,
        is ``node``'s own)."""

        from lmtier.tiers.redis.cluster import _address  # the client's own reading of a node's name

        return frozenset((r[0], r[1], _address(node, r[2][0], r[2][1])) for r in self.slot_ranges(node))

    def healthy(self) -> bool:
        """Every reachable node says the cluster is ok, and all of them name the same
        masters, each one live, for the same slots: what a client that asks any of them
        is told agrees with where the keys are."""
        live = self.live()
        try:
            if not all("cluster_state:ok" in n.call("CLUSTER", "INFO", timeout=5) for n in live):
                return False
            views = {self.slot_owners(n) for n in live}
        except (subprocess.TimeoutExpired, TierError):
            return False
        if len(views) != 1:
            return False
        ranges = views.pop()
        covered = sum(last - first + 1 for first, last, _ in ranges)
        return covered == 16384 and {owner for _, _, owner in ranges} <= {n.address for n in live}

    def in_sync(self) -> bool:
        """Every live replica is connected to its master and not copying it afresh."""
        for n in self.replicas():
            info = n.call("INFO", "replication", timeout=5)
            if "master_link_status:up" not in info or "master_sync_in_progress:1" in info:
                return False
        return True

    def caught_up(self) -> bool:
        """``in_sync``, and every replica has acknowledged every byte its master has written
        (replication is asynchronous: a master killed before would take writes its replica
        never saw). For a cluster at rest: a replica acknowledges once a second."""
        if not self.in_sync():
            return False
        for n in self.masters():
            info = n.call("INFO", "replication", timeout=5)
            fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
            for i in range(int(fields.get("connected_slaves", "0"))):
                copy = dict(kv.split("=", 1) for kv in fields.get(f"slave{i}", "").split(",") if "=" in kv)
                if copy.get("state") != "online" or copy.get("offset") != fields.get("master_repl_offset"):
                    return False
        return True

    def wait_healthy(self, timeout: float = 60) -> float:
        """Wait until ``healthy`` and ``in_sync``; returns when it became healthy (monotonic)."""
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not become healthy in {timeout} s")
            time.sleep(0.05)
        at = time.monotonic()
        while not self.in_sync():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster's replicas did not catch up in {timeout} s")
            time.sleep(0.1)
        return at

    # -- what an operator does -----------------------------------------------------------
    def kill(self, node: RedisServer) -> None:
        node.kill()
        self._down.add(node.address)

    def restart(self, node: RedisServer) -> None:
        """Start a killed node again: it comes back empty and rejoins (as a replica of
        whoever took its slots)."""
        node.start()
        self._down.discard(node.address)

    def cut(self, node: RedisServer) -> None:
        if self.switch is not None:
            self.switch.cut(self._netns[node.address])
        else:
            os.kill(node.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
        self._down.add(node.address)

    def mend(self, node: RedisServer) -> None:
        if self.switch is not None:
            self.switch.mend(self._netns[node.address])
        else:
            os.kill(node.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
        self._down.discard(node.address)

    def failover(self, replica: RedisServer, timeout: float = 30) -> None:
        """A planned failover: the replica takes its master's slots once it has caught up."""
        if replica.call("CLUSTER", "FAILOVER") != "OK":
            raise RuntimeError(f"{replica.address} refused CLUSTER FAILOVER")
        deadline = time.monotonic() + timeout
        while self.role(replica) != "master":
            if time.monotonic() > deadline:
                raise RuntimeError(f"{replica.address} did not become a master")
            time.sleep(0.05)

    def reshard(self, src: RedisServer, dst: RedisServer, slots: int) -> None:
        """Move ``slots`` slots and their keys from ``src`` to ``dst``, live: while a slot is
        half moved, its keys answer ASK from one side or the other."""
        self._cli("--cluster", "reshard", src.address, "--cluster-from", self.node_id(src), "--cluster-to",
                  self.node_id(dst), "--cluster-slots", str(slots), "--cluster-yes", timeout=300)  # fmt: skip

    def add_master(self) -> RedisServer:
        node = self._node()
        seed = self.masters()[0]
        self._cli("--cluster", "add-node", node.address, seed.address)
        deadline = time.monotonic() + 30
        while not all(node.address in n.call("CLUSTER", "NODES") for n in self.live()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{node.address} was not seen by every node")
            time.sleep(0.05)
        self.wait_healthy(60)  # the newcomer too knows every slot's master
        return node

    def slots_of(self, node: RedisServer) -> int:
        """How many slots ``node`` serves."""
        me = self.node_id(node)
        for line in node.call("CLUSTER", "NODES").splitlines():
            fields = line.split()
            if fields and fields[0] == me:
                return sum(int(r.split("-")[-1]) - int(r.split("-")[0]) + 1 for r in fields[8:] if r[0].isdigit())
        return 0

    def flush(self) -> None:
        for node in self.masters():
            node.call("FLUSHALL")

    def stop(self) -> None:
        for node in self.nodes:
            if node.address in self._down and self.switch is None and node.proc is not None:
                try:
                    os.kill(node.proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            node.kill()
        if self.switch is not None:
            self.switch.close()

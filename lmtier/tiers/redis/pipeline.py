"""One batch of commands over a tier's nodes: the loop every operation shares.

    Op(request, read=Stream.reply, window=0, discard=None)
                                  what one operation sends and reads for each key
    spread(positions, nbytes, pool) -> [[position, ...], ...]
                                  one node's share of a batch, cut over its connections
    Pipeline(router, pool, threads, name)
        .run(rkeys, op, positions=None, sizes=None) -> Replies
        .close()
    Replies                       per position: its reply, the ``TierError`` of the
                                  connection that carried it, or None where nothing was sent
        .moved                      a MOVED or ASK came back (and the key was sent on)
        .raise_if_down()            raise when the tier as a whole is down, after
                                    discarding what did arrive

``run`` groups the keys by node, cuts a large group over up to ``pool`` connections,
pipelines each part on one connection (every request sent, or ``window`` of them in
flight, then the replies read in order), runs the parts in parallel. In a cluster, a key
whose reply is MOVED or ASK is sent once more where the reply says, and a node that fails
makes the router learn the slot map again (a failover moves its slots: the failed keys
are sent once more to their new master). An operation (EXISTS, GET, SET, DEL)
supplies only its ``Op`` and what it makes of the replies.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from lmtier.errors import TierError
from lmtier.tiers.redis.cluster import Router
from lmtier.tiers.redis.conn import Node
from lmtier.tiers.redis.resp import ReplyError, Stream, command

log = logging.getLogger(__name__)

# A batch is cut over several connections only in pieces of this much: on 2 cores one
# pipelined connection measured fastest (SET 3.0-3.3 GB/s against 2.3-2.7 with 2-4).
SPREAD_BYTES = 32 << 20


def _keep(reply: Any) -> None:
    """Nothing to undo: the reply holds no resource."""


@dataclass(frozen=True)
class Op:
    request: Callable[[int], list]  # the command for position i, as the parts to send
    read: Callable[[Stream], Any] = Stream.reply  # one reply off the stream
    window: int = 0  # requests in flight per connection; 0: all of them at once
    discard: Callable[[Any], None] = _keep  # undo a reply that will not be used (free its buffer)
    reads: bool = False  # reads only: a replica may serve it (``Router.replica_reads``)


Job = tuple[Node, list[int], Op]  # a node, the positions it is sent, what is sent


def _asking(op: Op) -> Op:
    """``op`` with each command after ASKING (a key of a slot being moved, on its new node)."""

    def read(stream: Stream) -> Any:
        stream.reply()  # +OK
        return op.read(stream)

    return Op(lambda i: [command(b"ASKING"), *op.request(i)], read, op.window, op.discard, op.reads)


class Replies(list):
    """Per position of a batch: its reply, the ``TierError`` of the connection that
    carried it (a reply may itself be a ``ReplyError``: test that first), or None."""

    def __init__(self, n: int, op: Op) -> None:
        super().__init__([None] * n)
        self.op = op
        self.moved = False
        self.via: dict[int, Node] = {}  # the node that answered each ReplyError (a redirection names it)
        self.failure: TierError | None = None  # set when the tier as a whole is down

    def raise_if_down(self) -> None:
        """Raise a connection's failure when the tier as a whole is down (the one server,
        or every master of a cluster). A cluster with one master down keeps serving the
        others; that master's keys are failures in the replies meanwhile."""
        if self.failure is None:
            return
        for reply in self:
            if not isinstance(reply, TierError):
                self.op.discard(reply)
        raise self.failure


def spread(positions: list[int], nbytes: int, pool: int) -> list[list[int]]:
    """Cut a node's batch over up to ``pool`` connections, ``SPREAD_BYTES`` each at least."""
    parts = max(1, min(pool, len(positions), nbytes // SPREAD_BYTES))
    step = -(-len(positions) // parts)
    return [positions[i : i + step] for i in range(0, len(positions), step)]


def exchange(stream: Stream, part: list[int], op: Op) -> list[Any]:
    """Pipeline ``op`` for the positions ``part`` on one connection: the first ``window``
    requests at once, then one more as each reply is read. A window of replies in flight
    keeps the socket busy without the server piling a whole batch into its output buffer."""
    window = op.window or len(part)
    stream.send([p for i in part[:window] for p in op.request(i)])
    replies: list[Any] = []
    try:
        for j in range(len(part)):
            if j + window < len(part):
                stream.send(op.request(part[j + window]))
            replies.append(op.read(stream))
    except BaseException:
        for reply in replies:
            op.discard(reply)
        raise
    return replies


def redirection(reply: Any, asked: Node | None) -> tuple[str, bool] | None:
    """Where a ``MOVED``/``ASK`` reply sends its key, and whether after ``ASKING``; None for
    any other reply. A port alone (``:7002``, not ``::1:7002``) is on ``asked``'s host."""
    if not (isinstance(reply, ReplyError) and reply.redirect):
        return None
    parts = str(reply).split()
    if len(parts) != 3 or parts[0] not in ("MOVED", "ASK") or ":" not in parts[2]:
        return None
    where = parts[2]
    if asked is not None and where.startswith(":") and where.count(":") == 1:
        where = f"{asked.host}{where}"
    return where, parts[0] == "ASK"


class Pipeline:
    def __init__(self, router: Router, pool: int, threads: int, name: str) -> None:
        self.router, self.pool, self.max_threads, self.name = router, pool, threads, name
        self._executor_pid = -1  # the executor is made per process (threads do not survive fork)

    def run(
        self,
        rkeys: Sequence[bytes],
        op: Op,
        positions: Sequence[int] | None = None,
        sizes: Sequence[int] | None = None,
    ) -> Replies:
        """``op`` for each of ``rkeys`` (or only those at ``positions``); with ``sizes``
        (bytes per position), a node's group may be cut over several connections."""
        if op.reads and self.router.replica_reads:
            self.router.replicas_wanted()
        seen = self.router.generation
        jobs: list[Job] = []
        for node, group in self.router.groups(rkeys, positions, op.reads).items():
            parts = [group] if sizes is None else spread(group, sum(sizes[i] for i in group), self.pool)
            jobs += [(node, part, op) for part in parts]
        replies = Replies(len(rkeys), op)
        failed = self._fill(replies, jobs)
        if self.router.cluster:
            if failed:
                self._after_failure(rkeys, op, replies, seen)
            self._follow_redirects(replies, op, seen)
        failed = [r for r in replies if isinstance(r, TierError) and not isinstance(r, ReplyError)]
        if failed and self.router.down():
            replies.failure = failed[0]
        return replies

    def _fill(self, replies: Replies, jobs: list[Job]) -> list[TierError]:
        failed: list[TierError] = []
        for (node, part, _), result in zip(jobs, self._run_all(jobs), strict=True):
            if isinstance(result, TierError):
                failed.append(result)
                result = [result] * len(part)
            for i, reply in zip(part, result, strict=True):
                replies[i] = reply
                if isinstance(reply, ReplyError):
                    replies.via[i] = node
        return failed

    def _after_failure(self, rkeys: Sequence[bytes], op: Op, replies: Replies, seen: int) -> None:
        """A node failed: the cluster may have given its slots to another master (a
        failover). Learn the map again (at most every ``REFRESH_AFTER_FAILURE_S``) and send
        the failed keys once more where it now puts them, when that is elsewhere."""
        failed_at = {i: r for i, r in enumerate(replies) if isinstance(r, TierError) and not isinstance(r, ReplyError)}
        before = {i: self.router.node_for(rkeys[i]) for i in failed_at}
        self.router.after_failure(seen)
        if self.router.generation == seen:
            return
        again = [i for i in failed_at if self.router.node_for(rkeys[i]) is not before[i]]
        jobs = [(node, group, op) for node, group in self.router.groups(rkeys, again, op.reads).items()]
        self._fill(replies, jobs)

    def _follow_redirects(self, replies: Replies, op: Op, seen: int) -> None:
        """Send each redirected key once more, to the node its reply names: after MOVED
        (the slot has a new master: the map is learnt again for the next batches) as is,
        after ASK (the slot is being moved, and the key is on the other side already)
        after ASKING. A key redirected again is left as its reply says (a miss, a drop). A
        reply that names a port alone (``MOVED 3999 :6381``: Redis 7's
        ``cluster-preferred-endpoint-type unknown-endpoint``) means that port on the host
        that answered."""
        targets: dict[tuple[str, bool], list[int]] = {}
        for i, reply in enumerate(replies):
            target = redirection(reply, replies.via.get(i))
            if target is not None:
                targets.setdefault(target, []).append(i)
        if not targets:
            return
        replies.moved = True
        if any(not asking for _, asking in targets):
            try:
                self.router.refresh("moved", seen)
            except TierError as exc:
                log.warning("redis tier %s: cannot refresh the slot map: %s", self.name, exc)
        jobs, passing = [], []
        for (where, asking), group in targets.items():
            try:
                node, known = self.router.node_at(where)
            except TierError as exc:
                for i in group:
                    replies[i] = exc
                continue
            jobs.append((node, group, _asking(op) if asking else op))
            if not known:
                passing.append(node)
        try:
            self._fill(replies, jobs)
        finally:
            for node in passing:
                node.close()

    def _run_all(self, jobs: list[Job]) -> list[Any]:
        """Run jobs (in parallel when several); a job's failure is returned, not raised."""

        def one(job: Job) -> Any:
            node, part, op = job
            try:
                return node.run(lambda stream: exchange(stream, part, op))
            except TierError as exc:
                return exc

        if len(jobs) <= 1:
            return [one(job) for job in jobs]
        return list(self._threads().map(one, jobs))

    def _threads(self) -> ThreadPoolExecutor:
        if self._executor_pid != os.getpid():
            self._executor = ThreadPoolExecutor(self.max_threads, thread_name_prefix=self.name)
            self._executor_pid = os.getpid()
        return self._executor

    def close(self) -> None:
        if self._executor_pid == os.getpid():
            self._executor.shutdown(wait=True)
        self._executor_pid = -1

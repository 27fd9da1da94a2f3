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
        .moved                      a MOVED or ASK came back: the slot map was refreshed
        .raise_if_down()            raise when the tier as a whole is down, after
                                    discarding what did arrive

``run`` groups the keys by node, cuts a large group over up to ``pool`` connections,
pipelines each part on one connection (every request sent, or ``window`` of them in
flight, then the replies read in order), runs the parts in parallel, and refreshes a
cluster's slot map when a reply was redirected. An operation (EXISTS, GET, SET, DEL)
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
from lmtier.tiers.redis.resp import ReplyError, Stream

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


class Replies(list):
    """Per position of a batch: its reply, the ``TierError`` of the connection that
    carried it (a reply may itself be a ``ReplyError``: test that first), or None."""

    def __init__(self, n: int, op: Op) -> None:
        super().__init__([None] * n)
        self.op = op
        self.moved = False
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
        jobs: list[tuple[Node, list[int]]] = []
        for node, group in self.router.groups(rkeys, positions).items():
            parts = [group] if sizes is None else spread(group, sum(sizes[i] for i in group), self.pool)
            jobs += [(node, part) for part in parts]
        replies = Replies(len(rkeys), op)
        failed: list[TierError] = []
        for (_, part), result in zip(jobs, self._run_all(jobs, op), strict=True):
            if isinstance(result, TierError):
                failed.append(result)
                result = [result] * len(part)
            for i, reply in zip(part, result, strict=True):
                replies[i] = reply
        if failed and self.router.down():
            replies.failure = failed[0]
        if self.router.cluster and any(isinstance(r, ReplyError) and r.redirect for r in replies):
            replies.moved = True
            try:
                self.router.refresh()
            except TierError as exc:
                log.warning("redis tier %s: cannot refresh the slot map: %s", self.name, exc)
        return replies

    def _run_all(self, jobs: list[tuple[Node, list[int]]], op: Op) -> list[Any]:
        """Run jobs (in parallel when several); a job's failure is returned, not raised."""

        def one(job: tuple[Node, list[int]]) -> Any:
            node, part = job
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

"""The fleet's index of who holds which chunk, kept in the fleet's Redis by the sidecars
(no coordinator of lmtier's own): one string per chunk a sidecar holds, naming the
sidecar, with a time to live.

    entry(prefix, tag, key) -> bytes          the Redis key of a tenant's chunk
    IndexReader(url, prefix, tag, timeout)    an engine's peer tier
        .holders(keys) -> list[str | None]    one round trip: the sidecar that last stored each
        .drained(peers) -> set[str]           which of them are draining before they stop
    IndexWriter(url, prefix, advertise, ttl)  a sidecar (``lmtier serve --peer-index``)
        .stored(scoped_keys), .removed(scoped_keys), .drain(), .close()

Entries are per tenant (the tenant's tag is part of each name), so a tenant's lookups
find only its own tenant's chunks; the sidecar that serves them checks the caller's
token anyway. An entry is a hint: a sidecar that evicted the chunk, or is gone, costs
one miss, never a wrong chunk (every load is verified), and entries expire after the
writer's ``ttl`` unless stored again. A sidecar removes its own entries (compare and
delete: never another's), and announces a drain so that readers stop choosing it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "lmtier:peers"
DRAIN_S = 600.0  # a drained sidecar is skipped this long (it stops well within it)
ADDRESS_BYTES = 256  # of an entry read at most (a host:port)
DRAINED_KEPT = 1024  # sidecars whose drain mark is remembered
# Delete the entry only if it still names this sidecar: another may have stored it since.
_DELETE_MINE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


def drain_key(prefix: str, address: str) -> str:
    return f"{prefix}:drained:{address}"


def entry(prefix: str, tag: bytes, key: bytes) -> bytes:
    return prefix.encode() + b":" + (tag + key).hex().encode()


def _client(url: str, timeout: float):
    import redis

    return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                health_check_interval=30)  # fmt: skip


class IndexReader:
    def __init__(self, url: str, prefix: str, tag: bytes, timeout: float, refresh: float = 5.0) -> None:
        self.prefix, self.tag, self.refresh = prefix, tag, refresh
        self._redis = _client(url, timeout)
        self._drained: OrderedDict[str, tuple[float, bool]] = OrderedDict()  # peer -> (read at, drained)
        self._lock = threading.Lock()

    def holders(self, keys: Sequence[bytes]) -> list[str | None]:
        if not keys:
            return []
        # at most ADDRESS_BYTES of each entry: a huge value (written by whoever can write the
        # index) costs this lookup nothing more than an address would
        pipe = self._redis.pipeline(transaction=False)
        for k in keys:
            pipe.getrange(entry(self.prefix, self.tag, k), 0, ADDRESS_BYTES - 1)
        return [v.decode("ascii", "replace") if v else None for v in pipe.execute()]

    def drained(self, peers: set[str]) -> set[str]:
        """Which of ``peers`` announced a drain: one key per sidecar (its value never read),
        each answer kept ``refresh`` seconds (a failed read keeps the last answer)."""
        now = time.monotonic()
        with self._lock:
            stale = sorted(p for p in peers if now - self._drained.get(p, (-self.refresh, False))[0] >= self.refresh)
        if stale:
            try:
                pipe = self._redis.pipeline(transaction=False)
                for peer in stale:
                    pipe.exists(drain_key(self.prefix, peer))
                answers = pipe.execute()
                with self._lock:
                    for peer, found in zip(stale, answers, strict=True):
                        self._drained[peer] = (now, bool(found))
                        self._drained.move_to_end(peer)
                    while len(self._drained) > DRAINED_KEPT:
                        self._drained.popitem(last=False)
            except Exception as exc:
                log.debug("peers: reading the drained sidecars failed: %s", exc)
        with self._lock:
            return {p for p in peers if self._drained.get(p, (0.0, False))[1]}

    def close(self) -> None:
        self._redis.close()


class IndexWriter:
    """A sidecar's entries, written by the caller's thread (``lmtier.server.peers``
    batches the store's events into it)."""

    def __init__(self, url: str, prefix: str, advertise: str, ttl: float, timeout: float = 2.0) -> None:
        self.prefix, self.advertise, self.ttl = prefix, advertise, max(1, int(ttl))
        self._redis = _client(url, timeout)
        self._delete = self._redis.register_script(_DELETE_MINE)

    def stored(self, scoped: Sequence[bytes], tag_bytes: int) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for key in scoped:
            pipe.set(entry(self.prefix, key[:tag_bytes], key[tag_bytes:]), self.advertise, ex=self.ttl)
        pipe.execute()

    def removed(self, scoped: Sequence[bytes], tag_bytes: int) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for key in scoped:
            name = entry(self.prefix, key[:tag_bytes], key[tag_bytes:])
            self._delete(keys=[name], args=[self.advertise], client=pipe)
        pipe.execute()

    def drain(self, undo: bool = False) -> None:
        """Tell readers to stop choosing this sidecar (``undo``: it serves again); the mark
        ends by itself after ``DRAIN_S``."""
        name = drain_key(self.prefix, self.advertise)
        if undo:
            self._redis.delete(name)
        else:
            self._redis.set(name, b"1", ex=int(DRAIN_S))

    def close(self) -> None:
        self._redis.close()

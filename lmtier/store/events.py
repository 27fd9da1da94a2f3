"""Tier events: which chunks landed in or left each tier of a store, for routers.

    TierEvents(limit)                 a bounded queue of records, filled from any thread
      .add(kind, tier, keys)          never blocks: past ``limit`` records the oldest is
                                      dropped and counted (``dropped``)
      .drain() -> list[Record]        everything queued, oldest first
    Record(kind, tier, keys)          kind: "stored" | "removed"; tier: its index in the store

A store's tiers announce what they do to their own contents (``Tier.listener``): a put
that stored chunks, an eviction, a delete, a chunk dropped because it failed its check.
``TieredStore.watch`` connects every tier of a store to one queue; an engine adapter
drains it once per step and turns the records into its engine's events (vLLM's
``BlockStored`` / ``BlockRemoved``: ``connectors/vllm/events.py``).

What a tier cannot see it cannot announce: a chunk a shared tier (Redis, a cache server)
evicts on its own, or one another process evicts from a shared disk directory. Routers
ask a shared tier directly for those (the server's ``Match`` call).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from lmtier import metrics

DEFAULT_LIMIT = 65536  # records queued between two drains before the oldest are dropped


class Record(NamedTuple):
    kind: str  # "stored" | "removed"
    tier: int  # the tier's index in its store
    keys: tuple[bytes, ...]


class TierEvents:
    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self.limit = max(1, limit)
        self.dropped = 0
        self._queue: deque[Record] = deque()
        self._lock = threading.Lock()

    def add(self, kind: str, tier: int, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        with self._lock:
            self._queue.append(Record(kind, tier, tuple(keys)))
            if len(self._queue) > self.limit:
                self._queue.popleft()
                self.dropped += 1
                metrics.EVENTS_DROPPED.inc()

    def drain(self) -> list[Record]:
        with self._lock:
            out = list(self._queue)
            self._queue.clear()
        return out

    def __len__(self) -> int:
        return len(self._queue)

"""A sidecar's part in the fleet's index (``lmtier serve --peer-index redis://... --advertise
host:port``): what its tiers hold, told to the fleet's Redis so that other instances' peer
tiers (``lmtier.tiers.peers``) find it.

    IndexPublisher(store, url, advertise, ttl)   .start(), .stop(drain=True)

A thread drains the store's tier events every ``EVERY_S``: chunks stored in any tier are
announced (an entry naming this sidecar, for ``ttl`` seconds); chunks removed from a tier
are withdrawn once no tier of the store holds them (compare and delete: an entry another
sidecar wrote since stays). Every ``ttl / 3`` seconds the chunks the tiers still hold are
announced again (at most ``REFRESH_KEYS``), so entries of live chunks do not expire. On
stop, the sidecar is marked drained first: readers stop choosing it while it finishes.
Only the chunks of tenants that have peers (``peer_tokens``) are announced: the others'
keys, which no peer may read, stay out of the fleet's Redis. A Redis that does not answer
costs peers their hits, never this server a call: failures are logged once a minute, and
the events queue is bounded (``lmtier.store.events``).
"""

from __future__ import annotations

import logging
import threading
import time

from lmtier.server.auth import TAG_BYTES
from lmtier.store.tiered import TieredStore
from lmtier.tiers.peers.index import DEFAULT_PREFIX, IndexWriter

log = logging.getLogger(__name__)

EVERY_S = 0.05  # a chunk stored is announced within this (peers find it no later)
REFRESH_KEYS = 1_000_000  # chunks announced again per refresh at most
BATCH = 4096  # keys per Redis pipeline
WARN_EVERY_S = 60.0


class IndexPublisher:
    def __init__(
        self,
        store: TieredStore,
        url: str,
        advertise: str,
        ttl: float,
        prefix: str = DEFAULT_PREFIX,
        tenants: frozenset[bytes] | None = None,
    ) -> None:
        self.store = store
        # the tags of the tenants whose chunks are announced (those peers may read); None: all
        self.tenants = tenants
        self.writer = IndexWriter(url, prefix, advertise, ttl)
        self.ttl = ttl
        self.events = store.watch()
        self.announced = 0
        self.withdrawn = 0
        self.failures = 0
        self._warned = -WARN_EVERY_S
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lmtier-peer-index", daemon=True)

    def start(self) -> IndexPublisher:
        self._guard(lambda: self.writer.drain(undo=True))  # a sidecar back at its address serves again
        self._thread.start()
        return self

    def stop(self, drain: bool = True) -> None:
        if drain:
            self._guard(self.writer.drain)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.writer.close()

    def _loop(self) -> None:
        refreshed = time.monotonic()
        while not self._stop.wait(EVERY_S):
            self._guard(self._publish)
            if time.monotonic() - refreshed >= self.ttl / 3:
                refreshed = time.monotonic()
                self._guard(self._refresh)

    def _publish(self) -> None:
        last: dict[bytes, bool] = {}  # key -> stored (True) or removed, as its last record says
        for record in self.events.drain():
            for key in record.keys:
                if self._announced(key):
                    last[key] = record.kind == "stored"
        stored = [k for k, held in last.items() if held]
        gone = [k for k, held in last.items() if not held and not self._held(k)]
        for i in range(0, len(stored), BATCH):
            batch = stored[i : i + BATCH]
            self.writer.stored(batch, TAG_BYTES)
            self.announced += len(batch)
        for i in range(0, len(gone), BATCH):
            self.writer.removed(gone[i : i + BATCH], TAG_BYTES)
            self.withdrawn += len(gone[i : i + BATCH])

    def _announced(self, scoped: bytes) -> bool:
        return self.tenants is None or scoped[:TAG_BYTES] in self.tenants

    def _held(self, key: bytes) -> bool:
        return any(self.store._call(t, "contains", t.contains, [key], default=0) for t in self.store.tiers)

    def _refresh(self) -> None:
        left = REFRESH_KEYS
        for tier in self.store.tiers:
            if not tier.capabilities.listing or left <= 0:
                continue
            listed = self.store._call(tier, "keys", tier.keys, b"", left, default=[])
            keys = [k for k in listed if len(k) > TAG_BYTES and self._announced(k)]
            for i in range(0, len(keys), BATCH):
                self.writer.stored(keys[i : i + BATCH], TAG_BYTES)
            left -= len(keys)

    def _guard(self, fn) -> None:
        try:
            fn()
        except Exception as exc:
            self.failures += 1
            now = time.monotonic()
            if now - self._warned >= WARN_EVERY_S:
                self._warned = now
                log.warning("peer index: %s (peers miss what this sidecar holds until it answers)", exc)

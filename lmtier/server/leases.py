"""``Leases``: the server's memory lent to same-host clients, and its bound.

    open(tag, owner) -> lease id       one per Get call that lends
    hold(lease, chunk) -> bool         lend one chunk (False past the bound: copy it instead)
    finish(lease)                      the call ended
    release(lease, tag)                the client let go (``Release``)
    reap(everything=False)             the leases of clients that are gone (or all, at stop)
    held                               bytes lent now

The chunks of one call share a lease, held (never evicted, never overwritten) until the
client releases it (``Release``, once it has let go of every chunk) or is gone: a client
lives as long as it holds the lock on its shared-memory segment, which the probe loop
checks (``reap``). At most ``limit`` bytes are leased in all; past that, chunks are
copied to the client instead, so a client that never releases costs speed, never memory.
"""

from __future__ import annotations

import os
import threading
import time

from lmtier.kv.chunk import Chunk, release_all
from lmtier.transport.shm.segment import alive


class Leases:
    def __init__(self, limit: int, shm_dir: str, ttl: float = 300.0) -> None:
        self.limit = limit
        self.shm_dir = shm_dir
        self.ttl = ttl  # seconds a lease outlives its call, whatever its owner says
        self.held = 0
        self._next = int.from_bytes(os.urandom(4), "little") << 20  # ids unlike a restarted server's
        self._leases: dict[int, dict] = {}
        self._lock = threading.Lock()

    def open(self, tag: bytes, owner: str) -> int:
        with self._lock:
            self._next += 1
            self._leases[self._next] = {"tag": tag, "owner": owner, "chunks": [], "ended": False}
            return self._next

    def hold(self, lease: int, chunk: Chunk) -> bool:
        with self._lock:
            entry = self._leases.get(lease)
            if entry is None or self.held + chunk.nbytes > self.limit:
                return False
            entry["chunks"].append(chunk.share())
            self.held += chunk.nbytes
        return True

    def finish(self, lease: int) -> None:
        """The call ended; an empty lease is dropped at once."""
        with self._lock:
            entry = self._leases.get(lease)
            if entry is not None:
                entry["ended"] = time.monotonic()
                if not entry["chunks"]:
                    del self._leases[lease]

    def release(self, lease: int, tag: bytes) -> None:
        with self._lock:
            entry = self._leases.get(lease)
            if entry is None or entry["tag"] != tag:
                return
            self._drop(lease)

    def reap(self, everything: bool = False) -> None:
        """Release the leases of clients that are gone, and any lease ``ttl`` seconds past
        its call (a client that never releases, or names a segment that outlives it,
        holds memory that long at most); everything at shutdown."""
        with self._lock:
            owners = {e["owner"] for e in self._leases.values() if e["ended"]}
        gone = owners if everything else {o for o in owners if not alive(self.shm_dir, o)}
        old = time.monotonic() - self.ttl
        with self._lock:
            for lease in [
                k
                for k, e in self._leases.items()
                if everything or (e["ended"] and (e["owner"] in gone or e["ended"] < old))
            ]:
                self._drop(lease)

    def _drop(self, lease: int) -> None:  # with the lock held
        chunks = self._leases.pop(lease)["chunks"]
        self.held -= sum(c.nbytes for c in chunks)
        release_all(chunks)

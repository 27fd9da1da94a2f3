"""Write-back: memory alone holds a new chunk, written down when it is let go or has stayed a while.

Write-through pays a lower-tier write for every save; write-back pays it only for what
the save policy says earned it, when the first tier evicts it (through the write queue,
one job for a burst of evictions) or when the writer's checkpoint finds it has stayed
``writeback_after`` seconds (so a process killed without ``close`` loses seconds, not
all of memory). ``close`` and ``persist`` write down what memory still holds.
``TieredStore`` (``lmtier.store.tiered``) is where the policy is told whole.

    WriteBack                    TieredStore's demotion, checkpoints and persist
    DEMOTED                      a write job's chunks: those evicted, waiting together
"""

from __future__ import annotations

import logging
import time

from lmtier.kv.chunk import Chunk, release_all

log = logging.getLogger("lmtier.store.tiered")  # the store's log, whichever section speaks
DEMOTED = object()  # a write job's chunks: those evicted from the first tier, waiting together
DEMOTE_BYTES = 256 << 20  # bound on evicted chunks waiting for the lower tiers (write-back)
WRITEBACK_AFTER_S = 2.0  # write-back: a chunk only memory holds is written down after this long
CHECKPOINT_KEYS = 4096  # chunks a checkpoint considers at most (the rest at the next one)
CHECKPOINTS_PER_WAIT = 4  # a chunk waits writeback_after, then at most a quarter of it more
CHECKPOINT_BATCH = 16  # chunks per lower-tier write of a checkpoint


class WriteBack:
    """``TieredStore``'s write-back, a mixin: one state with the store, whose sections these are.

    Uses the store's ``tiers``, ``policy`` (what earns a write down), ``_call``,
    ``_closed``, ``write_back``, ``writeback_after`` and ``WritePath``'s ``_enqueue``,
    ``_drop_write``, ``_unwritten``, ``flush`` and ``policy_skipped``. Owns
    ``_demote_lock`` with ``_demoting``, ``_demote_bytes`` and ``_demote_queued`` (the
    evicted chunks waiting for one job of the writer) and ``checkpointed``.
    """

    def _demote(self, key: bytes, reads: int, chunk: Chunk | None) -> bool:
        """The first tier's evict hook in write-back mode: queue the chunk for the lower
        tiers, if the save policy says it earned it (``reads``: its reads in memory);
        ``chunk`` None: a checkpoint wrote it down already, the policy only learns it went.

        One save can evict hundreds of chunks at once: they wait together (at most
        ``DEMOTE_BYTES``), written as one batch by one job of the write queue, rather than
        a job each (a queue of 64 jobs dropped most of a burst)."""
        if chunk is None:
            self.policy.let_go([key], [reads])
            return False
        if self._closed:
            return False
        if not self.policy.admit_lower([key], [reads])[0]:
            self.policy_skipped += 1
            return False
        with self._demote_lock:
            if self._demote_bytes + chunk.nbytes > DEMOTE_BYTES:
                full = True
            else:
                full = False
                self._demoting.append(chunk)
                self._demote_bytes += chunk.nbytes
                if self._demote_queued:
                    return True
                self._demote_queued = True
        if full:
            self._drop_write(self.tiers[1:], 1)
            return False
        if self._enqueue(None, self.tiers[1:], DEMOTED):  # type: ignore[arg-type]
            return True
        with self._demote_lock:  # the queue is full: what waits is dropped, counted
            dropped, self._demoting, self._demote_bytes, self._demote_queued = self._demoting, [], 0, False
        self._unwritten(len(dropped))
        release_all(dropped)
        return True  # released here, with the rest

    def _take_demoted(self) -> list[Chunk]:
        """The writer's part of a ``DEMOTED`` job: every chunk evicted since it was queued."""
        with self._demote_lock:
            given, self._demoting = self._demoting, []
            self._demote_bytes, self._demote_queued = 0, False
        return given

    def _checkpoint(self) -> None:
        """Write-back: write down the chunks memory has held for ``writeback_after`` seconds
        and that the policy admits now (what their eviction would write), then mark them
        written so that their eviction writes nothing. A chunk is marked only once the
        next tier holds it; one the policy turns away waits for the next checkpoint."""
        if self._closed:
            return
        first, below = self.tiers[0], self.tiers[1]
        pending = first.unwritten(self.writeback_after, CHECKPOINT_KEYS)
        if not pending:
            return
        keys, reads = zip(*pending, strict=True)
        wanted = [k for k, ok in zip(keys, self.policy.checkpoint(keys, reads), strict=True) if ok]
        for start in range(0, len(wanted), CHECKPOINT_BATCH):
            if self._closed:
                return
            chunks = [c for c in first.hold(wanted[start : start + CHECKPOINT_BATCH]) if c is not None]
            try:
                for tier in self.tiers[1:]:
                    self._call(tier, "put", tier.put, chunks, default=None)
            finally:
                release_all(chunks)
            landed = [c.key for c in chunks if self._call(below, "contains", below.contains, [c.key], default=0)]
            first.mark_written(landed)
            self.checkpointed += len(landed)

    def persist(self, timeout: float = 30.0) -> bool:
        """Write-back mode: write what only the first tier holds to the lower tiers, then
        wait for every queued write (an engine shutting down; ``close`` does it too).
        Write-through: ``flush``. False on timeout."""
        deadline = time.monotonic() + timeout
        if self.write_back and not self._closed:
            self._flush_first_tier(timeout)
        return self.flush(max(0.0, deadline - time.monotonic()))

    def _flush_first_tier(self, timeout: float) -> None:
        """Write-back mode, closing: write what only the first tier holds to the others
        (a chunk the next tier holds already, read from it or written before, is not
        written again), as far as ``timeout`` allows."""
        first, below = self.tiers[0], self.tiers[1]
        deadline = time.monotonic() + timeout
        keys = self._call(first, "keys", first.keys, default=[]) if first.capabilities.listing else []
        for start in range(0, len(keys), 16):
            if time.monotonic() > deadline:
                log.warning(
                    "write-back flush of %s stopped at its deadline (%.0f s) with %d of %d chunks left: "
                    "give close() or persist() more time",
                    first.name, timeout, len(keys) - start, len(keys),
                )  # fmt: skip
                return
            batch = [
                k for k in keys[start : start + 16] if not self._call(below, "contains", below.contains, [k], default=0)
            ]
            held = self._call(first, "get", first.get, batch, default=None) or []
            chunks = [c for c in held if c is not None]
            try:
                for tier in self.tiers[1:]:
                    self._call(tier, "put", tier.put, chunks, default=None)
            finally:
                release_all(chunks)

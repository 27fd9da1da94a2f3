"""The store's read path: each chunk from the fastest tier holding it, lower-tier hits promoted.

A load is on the engine's critical path, so nothing here waits on a write: promotion
goes through the write queue (``get``), or is done by the read-ahead thread that read
the chunk, beside the caller's use of the batch before (``iter_get``). ``TieredStore``
(``lmtier.store.tiered``) is where the policy is told whole.

    ReadPath                     TieredStore's reads: get, iter_get, promotion
    load_batch(chunk_bytes)      keys per iter_get batch for an engine's load
    deadline_after(seconds)      the iter_get deadline that many seconds from now
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from lmtier import metrics
from lmtier.kv.chunk import Chunk, release_all
from lmtier.tiers.base import Placement

log = logging.getLogger("lmtier.store.tiered")  # the store's log, whichever section speaks
READ_AHEAD = 2  # batches in flight beyond the one being used, in iter_get
LOAD_BATCH_BYTES = 4 << 20  # an engine's load reads this much KV per iter_get batch


def load_batch(chunk_bytes: int) -> int:
    """Keys per ``iter_get`` batch for a load of chunks of ``chunk_bytes``."""
    return max(1, LOAD_BATCH_BYTES // chunk_bytes)


def deadline_after(seconds: float) -> float | None:
    """The ``iter_get`` deadline ``seconds`` from now; None for 0 (no deadline)."""
    return time.monotonic() + seconds if seconds else None


class ReadPath:
    """``TieredStore``'s reads, a mixin: one state with the store, whose sections these are.

    Uses the store's ``tiers``, ``policy`` (every read is a sighting), ``_call`` (each tier
    call), ``_closed``, ``_counts_lock`` and ``_gets`` (callers' hits and misses per tier)
    and ``_enqueue`` (``WritePath``: a promotion is a background write). Owns
    ``_reader_pool`` and ``_reader_pid``: ``iter_get``'s read-ahead threads, made anew
    after ``fork``.
    """

    def get(self, keys: Sequence[bytes]) -> list[Chunk]:
        chunks, source = self._get_placed(keys)
        self._promote(chunks, source)
        return chunks

    def _get_placed(self, keys: Sequence[bytes]) -> tuple[list[Chunk], list[int]]:
        """``_get``, the lower tiers reading payloads straight into the first tier's memory
        where they can (``Tier.get_into``): those chunks come back as the first tier's,
        promoted with no copy, and their level is 0."""
        first = self.tiers[0]
        placements: list[Placement] = []
        try:
            chunks, source = self._get(keys, placements)
        finally:
            for p in placements:  # ended by the tier that read into it, save on an error
                p.abort()
        into = {p.key for p in placements if p.committed}
        if into:
            metrics.PROMOTIONS.labels(first.name).inc(sum(c.key in into for c in chunks))
            # the prompt's order, head most recent (the I/O threads commit in any order)
            self._call(first, "touch", first.touch, [c.key for c in chunks if c.key in into], default=None)
            source = [0 if c.key in into and level == 1 else level for c, level in zip(chunks, source, strict=True)]
        return chunks, source

    def _get(self, keys: Sequence[bytes], placed: list[Placement] | None = None) -> tuple[list[Chunk], list[int]]:
        """The leading run of ``keys`` found, and the level of the tier each came from.

        ``placed``: lower tiers may read payloads straight into the first tier's memory
        (``Tier.get_into``); each placement made is appended to it (a committed one is a
        chunk the first tier now holds)."""
        found: list[Chunk | None] = [None] * len(keys)
        source = [0] * len(keys)
        first = self.tiers[0]

        def place(key: bytes, nbytes: int) -> Placement | None:
            p = self._call(first, "place", first.place, key, nbytes, default=None)
            if p is not None:
                placed.append(p)  # type: ignore[union-attr]
            return p

        for level, tier in enumerate(self.tiers):
            want = [i for i, c in enumerate(found) if c is None]
            if not want:
                break
            wanted = [keys[i] for i in want]
            if placed is not None and level > 0:
                got = self._call(tier, "get", tier.get_into, wanted, place, default=None)
            else:
                got = self._call(tier, "get", tier.get, wanted, default=None)
            hits = nbytes = 0
            for i, chunk in zip(want, got or (), strict=False):
                if chunk is not None:
                    found[i], source[i] = chunk, level
                    hits += 1
                    nbytes += chunk.nbytes
            metrics.TIER_OPS.labels(tier.name, "get", "hit").inc(hits)
            metrics.TIER_OPS.labels(tier.name, "get", "miss").inc(len(want) - hits)
            metrics.TIER_BYTES.labels(tier.name, "get").inc(nbytes)
            with self._counts_lock:
                counts = self._gets[id(tier)]
                counts[0] += hits
                counts[1] += len(want) - hits
        prefix = next((i for i, c in enumerate(found) if c is None), len(found))
        release_all(found[prefix:])
        chunks: list[Chunk] = found[:prefix]  # type: ignore[assignment]
        self.policy.seen([c.key for c in chunks])
        return chunks, source[:prefix]

    def iter_get(
        self, keys: Sequence[bytes], batch: int, ahead: int = READ_AHEAD, deadline: float | None = None
    ) -> Iterator[list[Chunk]]:
        """``get`` in batches of ``batch`` keys, with up to ``ahead`` batches being read in
        the background while the caller uses the current one (so a disk's queue never
        drains between batches); stops after the first batch with a miss.

        Each yielded list is the leading run found in its batch; the caller releases the
        chunks. Chunks found below a first tier in memory are copied into it by the thread
        that read them, and the caller gets the copies (see ``_read_batch``). Close the
        generator (or exhaust it) when stopping early: batches read ahead are then released
        here.

        ``deadline`` (``time.monotonic()`` seconds): a batch not read by then ends the
        iteration (the caller recomputes the rest) without waiting for it; what it reads
        later is released as it arrives. A slow tier costs the load at most the deadline.
        """
        batches = [keys[i : i + batch] for i in range(0, len(keys), max(1, batch))]
        pending: deque[Future] = deque()
        submitted = found = 0

        def top_up() -> None:
            nonlocal submitted
            while submitted < len(batches) and len(pending) <= ahead and not self._closed:
                try:
                    pending.append(self._reader().submit(self._read_batch, batches[submitted]))
                except RuntimeError:  # the store closed meanwhile: what is left misses
                    return
                submitted += 1

        late = False
        try:
            for wanted in batches:
                top_up()
                if not pending:
                    return
                future = pending[0]
                try:
                    current = future.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
                except FutureTimeout:
                    late = True
                    metrics.LOAD_DEADLINES.inc()
                    log.warning("load deadline passed with %d of %d chunks read; the rest is recomputed",
                                found, len(keys))  # fmt: skip
                    return
                pending.popleft()
                found += len(current)
                yield current
                if len(current) < len(wanted):
                    return
        finally:
            for future in pending:
                if late:  # never wait on a slow tier past the deadline
                    future.add_done_callback(lambda f: release_all(f.result()))
                else:
                    release_all(future.result())
            if len(batches) > 1:
                self._touch(keys[:found])

    def _read_batch(self, keys: Sequence[bytes]) -> list[Chunk]:
        """``iter_get``'s reads: ``get``, with every promotion done here, in the read-ahead
        thread, and the caller handed the first tier's chunks. A lower tier that can reads
        straight into the first tier's memory (``Tier.get_into``: the read is the
        promotion); other lower-tier hits are copied into it here. Either way the lower
        tier's read buffers go back at once: a promotion queued for later held them (a new
        instance loading 192 MiB from disk through a memory tier paid 60 ms more per hit
        for fresh buffers), and a copy into the first tier beside the caller's use of the
        batch before competed with it for the cores (2.3x slower scatters in the engine)."""
        chunks, source = self._get_placed(keys)
        first = self.tiers[0]
        below = [i for i, level in enumerate(source) if level > 0]
        if not below or not first.capabilities.leases or self._closed:
            self._promote(chunks, source)
            return chunks
        moved = [chunks[i] for i in below]
        self._call(first, "put", first.put, moved, default=None)
        copies = self._call(first, "get", first.get, [c.key for c in moved], default=None) or [None] * len(moved)
        for i, old, new in zip(below, moved, copies, strict=True):
            if new is None:
                continue
            if old.verified and new.checksum == old.checksum:
                new.verified = True  # a copy just made of bytes verified as they were read
            chunks[i] = new
            old.release()
        metrics.PROMOTIONS.labels(first.name).inc(sum(c is not None for c in copies))
        self._promote(chunks, [level if level > 1 else 0 for level in source])  # tiers between
        return chunks

    def _touch(self, keys: Sequence[bytes]) -> None:
        """Mark a prompt's keys used, head most recent: read batch by batch, the later
        batches would otherwise look more recent than the head and be kept longer."""
        for tier in self.tiers:
            if tier.capabilities.touch and keys:
                self._call(tier, "touch", tier.touch, keys, default=None)

    def _promote(self, chunks: list[Chunk], source: list[int]) -> None:
        """Copy chunks found below the first tier up to the tiers above their own."""
        self._queue_promotion([(c.share(), level) for c, level in zip(chunks, source, strict=True) if level > 0])

    def _queue_promotion(self, held: list[tuple[Chunk, int]]) -> None:
        """Queue held chunks (each with the level it came from) for the tiers above;
        released here if nothing will write them."""
        shared = [c for c, _ in held]
        if not shared:
            return
        top = max(level for _, level in held)
        if not self._closed and self._enqueue([c.key for c in shared], self.tiers[:top], shared):
            metrics.PROMOTIONS.labels(self.tiers[0].name).inc(len(shared))
        else:
            release_all(shared)

    def _reader(self) -> ThreadPoolExecutor:
        """Threads that read batches for ``iter_get``, made anew after ``fork``."""
        if self._reader_pid != os.getpid():
            self._reader_pool = ThreadPoolExecutor(READ_AHEAD + 1, thread_name_prefix="lmtier-read-ahead")
            self._reader_pid = os.getpid()
        return self._reader_pool

    def _stop_reader(self) -> None:
        """``close``'s part: wait for this process's read-ahead threads, then let them go."""
        if self._reader_pid == os.getpid():
            self._reader_pool.shutdown(wait=True)
            self._reader_pid = -1

"""The store's write path: the first tier in the caller's thread, the lower tiers behind a queue.

The caller of ``put`` is an engine saving KV: it never waits on a slow tier. What the
lower tiers get goes through one bounded queue and one writer thread per process; when
the queue is full the write is dropped and counted (``dropped_writes``, and the chunks
no tier below will hold in ``unwritten_chunks``), never waited for. The same queue
carries promotions (``ReadPath``) and write-back's demotions; the writer thread also
runs write-back's checkpoints (``WriteBack``). ``TieredStore`` (``lmtier.store.tiered``)
is where the policy is told whole.

    WritePath                    TieredStore's writes: put, put_all, the writer, flush
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Sequence

from lmtier import metrics
from lmtier.kv.chunk import Chunk, release_all
from lmtier.store.fairqueue import FairQueue
from lmtier.store.writeback import CHECKPOINTS_PER_WAIT, DEMOTED
from lmtier.tiers.base import Tier

log = logging.getLogger("lmtier.store.tiered")  # the store's log, whichever section speaks
_STOP = object()


class WritePath:
    """``TieredStore``'s writes, a mixin: one state with the store, whose sections these are.

    Uses the store's ``tiers``, ``policy`` (every put is a sighting; it admits what the
    lower tiers get), ``_call`` (each tier call), ``_closed``, ``write_back`` and
    ``writeback_after``, and ``WriteBack``'s ``_take_demoted`` and ``_checkpoint``. Owns
    ``_queue_size``, ``_tenant_prefix`` (a tenant's writes queue in a lane of its own),
    ``_pid``, ``_jobs`` and ``_thread`` (the queue and its writer, made lazily and anew
    after ``fork``) and the counts ``dropped_writes``, ``unwritten_chunks`` and
    ``policy_skipped``.
    """

    def put(self, chunks: Sequence[Chunk]) -> int:
        if not chunks or self._closed:
            return 0
        first = self.tiers[0]
        self._call(first, "put", first.put, chunks, default=None)
        keys = [c.key for c in chunks]
        self.policy.seen(keys)
        if len(self.tiers) > 1 and not self.write_back:
            # a policy that decides at save time: what it turns away stays in the first tier
            admitted = self.policy.admit_lower(keys)
            if not all(admitted):
                kept = next(i for i, ok in enumerate(admitted) if not ok)  # a prefix: the lower tiers serve runs
                self.policy_skipped += len(keys) - kept
                keys = keys[:kept]
                if not keys:
                    return self._call(first, "contains", first.contains, [c.key for c in chunks], default=0)
        if len(self.tiers) > 1 and not self.write_back and first.capabilities.leases:
            # The writer gets the chunks now, leased from the memory tier (which keeps them
            # until written): read back later, a chunk evicted meanwhile would be lost
            # without a trace. What the first tier did not keep is counted as unwritten.
            held = self._call(first, "get", first.get, keys, default=None) or [None] * len(keys)
            kept = next((i for i, c in enumerate(held) if c is None), len(held))
            batch = chunks[: len(keys)]
            if kept < len(keys) and 0 < first.capacity < sum(c.nbytes for c in batch) and self._put_lower(batch):
                release_all(held)  # a batch larger than the whole first tier: written here, whole
                return len(keys)
            release_all(held[kept:])
            self._unwritten(len(keys) - kept)
            if kept and not self._enqueue(keys[:kept], self.tiers[1:], held[:kept]):
                release_all(held[:kept])
            return kept
        if len(self.tiers) > 1 and not self.write_back:  # a first tier without leases: read back later
            self._enqueue(keys, self.tiers[1:])
        if self.write_back and self.writeback_after:
            self._writer()  # its thread checkpoints what memory holds
        held = self._call(first, "contains", first.contains, keys, default=0)
        # write-back: memory writes a chunk down when it lets it go, but a batch larger than
        # all of memory was never kept whole: the lower tiers get it now, or nothing does
        oversized = self.write_back and held < len(keys) and 0 < first.capacity < sum(c.nbytes for c in chunks)
        return len(keys) if oversized and self._put_lower(chunks) else held

    def put_all(self, chunks: Sequence[Chunk]) -> bool:
        """Write ``chunks`` to every tier in the caller's thread, past the save policy and
        the write queue: a disaggregated prefill's hand-off, which must be readable by
        another instance before its answer leaves. True when the last tier holds them all."""
        if not chunks or self._closed:
            return False
        keys = [c.key for c in chunks]
        self.policy.seen(keys)
        for tier in self.tiers:
            self._call(tier, "put", tier.put, chunks, default=None)
        last = self.tiers[-1]
        return self._call(last, "contains", last.contains, keys, default=0) == len(keys)

    def _put_lower(self, chunks: Sequence[Chunk]) -> bool:
        """Write ``chunks`` (the caller's, valid for the length of its ``put``) to the lower
        tiers now, in the caller's thread: a batch larger than the whole first tier (a long
        prompt of a big model beside a small memory tier) still reaches the tiers that have
        room for it, instead of being lost everywhere. (A batch that would fit but finds the
        first tier full of chunks still being written is counted unwritten, as before: the
        caller is never held by a slow lower tier for that.) True when a lower tier holds
        them all."""
        keys = [c.key for c in chunks]
        stored = False
        for tier in self.tiers[1:]:
            self._call(tier, "put", tier.put, chunks, default=None)
            stored = stored or self._call(tier, "contains", tier.contains, keys, default=0) == len(keys)
        return stored

    def _unwritten(self, n: int) -> None:
        if n:
            self.unwritten_chunks += n
            for tier in self.tiers[1:]:
                metrics.UNWRITTEN_CHUNKS.labels(tier.name).inc(n)

    def _writer(self) -> queue.Queue:
        """The write queue and its thread, made lazily and anew after ``fork``."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            n = self._tenant_prefix
            self._jobs: queue.Queue = (
                FairQueue(self._queue_size, lambda job: job[0][0][:n] if isinstance(job, tuple) and job[0] else b"")
                if n
                else queue.Queue(maxsize=self._queue_size)
            )
            self._thread = threading.Thread(target=self._drain, name="lmtier-writer", daemon=True)
            self._thread.start()
        return self._jobs

    def _enqueue(self, keys: list[bytes], targets: list[Tier], chunks: list[Chunk] | None = None) -> bool:
        """Queue a background write of ``keys`` (read back from the first tier) or of
        ``chunks`` (leased, released once written); False when the queue is full."""
        try:
            self._writer().put_nowait((keys, targets, chunks))
        except queue.Full:
            self._drop_write(targets, len(chunks) if chunks is not None and chunks is not DEMOTED else 0)
            return False
        return True

    def _drop_write(self, targets: list[Tier], chunks: int) -> None:
        """A background write that found no room: counted, ``chunks`` of it unwritten."""
        self.dropped_writes += 1
        for tier in targets:
            metrics.WRITE_QUEUE_DROPS.labels(tier.name).inc()
        if chunks and targets == self.tiers[1:]:
            self._unwritten(chunks)

    def _drain(self) -> None:
        jobs = self._jobs
        checkpoint = self.write_back and self.writeback_after > 0
        every = self.writeback_after / CHECKPOINTS_PER_WAIT
        due = time.monotonic() + every
        while True:
            if checkpoint and time.monotonic() >= due:
                try:
                    self._checkpoint()
                except Exception:  # the writer thread must survive anything
                    log.exception("write-back checkpoint failed")
                due = time.monotonic() + every
            try:
                job = jobs.get(timeout=max(0.0, due - time.monotonic())) if checkpoint else jobs.get()
            except queue.Empty:
                continue
            try:
                if job is _STOP:
                    return
                keys, targets, given = job
                if given is DEMOTED:  # every chunk evicted since the job was queued, as one batch
                    given = self._take_demoted()
                first = self.tiers[0]
                held = given if given is not None else self._call(first, "get", first.get, keys, default=None) or []
                chunks = []
                for chunk in held:  # the leading run that is present; each tier verifies
                    if chunk is None:  # what it writes as it encodes (one pass, not two)
                        break
                    chunks.append(chunk)
                release_all(held[len(chunks) :])
                try:
                    for tier in targets:
                        self._call(tier, "put", tier.put, chunks, default=None)
                finally:
                    release_all(chunks)
            except Exception:  # the writer thread must survive anything
                log.exception("background write failed")
            finally:
                jobs.task_done()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued background write is done; False on timeout."""
        if self._pid != os.getpid():
            return True
        deadline = time.monotonic() + timeout
        with self._jobs.all_tasks_done:
            while self._jobs.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._jobs.all_tasks_done.wait(left)
        return True

    def _stop_writer(self, timeout: float) -> None:
        """``close``'s part: wait for the queued writes (at most ``timeout`` seconds), then
        stop this process's writer thread."""
        if self._pid == os.getpid():
            self.flush(timeout)
            try:
                self._jobs.put(_STOP, timeout=1)
                self._thread.join(timeout=1)
            except queue.Full:
                pass

"""``TieredStore``: tiers composed fastest-first, and the one home of caching policy.

    TieredStore.open(urls, ...)  the tiers the URLs name, opened in order (or none at all)
    lookup(keys) -> int          leading chunks present across all tiers
    get(keys) -> list[Chunk]     the leading run of chunks found; caller releases them
    put(chunks) -> int           stores; returns the leading chunks the first tier holds
    put_all(chunks) -> bool      stores in every tier before it returns (a PD hand-off)
    delete(keys), warm(), flush(timeout), persist(timeout), close(), stats()

Longer than 400 lines: the store is the one home of caching policy, and its parts (the
tiers it opens, lookup and promotion, the write queue, failures) share one state.

Policy, in one place:
- ``lookup`` walks the tiers fastest-first; a prefix may be spread over several tiers.
- ``get`` reads each chunk from the fastest tier holding it and promotes lower-tier hits
  into the faster tiers in the background (off the caller's critical path; the job holds
  its own lease on the chunks). ``iter_get`` does the same batch by batch, reading up to
  two batches ahead while the caller consumes the current one; a lower-tier hit is copied
  into a first tier in memory by the thread that read it, and served from there.
- ``put`` writes the first tier synchronously and lower tiers in the background
  (write-through), through a bounded queue; when the queue is full the write is dropped
  and counted. The caller never waits on a slow tier.
- In write-back mode ``put`` writes the first tier only; a chunk it evicts is demoted to
  the lower tiers (through the same queue) instead of being lost, and ``close`` flushes
  what the first tier still holds. So that a process that dies without closing (``kill
  -9``, a pod stopped without grace) loses only its last seconds, not all of memory, the
  writer also checkpoints: four times every ``writeback_after`` seconds it writes down
  the chunks that have been in memory that long and that the policy would write at their eviction
  (``SavePolicy.checkpoint``); their eviction then writes nothing.
- What reaches the lower tiers at all is the save policy's call (``lmtier.store.admission``):
  ``always`` writes every chunk; ``reuse`` (write-back) writes what memory lets go once it
  has proven itself (read while resident, or seen by two requests) and new chunks only
  while such chunks measurably come back. Every ``put`` and ``get`` is a sighting.
- A tier that raises is a miss plus a metric; a tier that keeps failing opens a circuit
  breaker and is skipped until its cooldown has passed. A ``RetryableError`` is first
  retried as the tier's ``backoff`` says (tiers raise, the store retries: no tier runs a
  retry loop or a breaker of its own). Nothing raises from here on the engine's hot path.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Literal, TypeVar

from lmtier import metrics
from lmtier.breaker import CircuitBreaker, QuietWarning
from lmtier.errors import ConfigError
from lmtier.kv.chunk import Chunk, release_all
from lmtier.store.admission import SavePolicy
from lmtier.store.events import DEFAULT_LIMIT as DEFAULT_EVENTS
from lmtier.store.events import TierEvents
from lmtier.store.fairqueue import FairQueue
from lmtier.tiers.base import Placement, Tier, TierContext, open_tier

log = logging.getLogger(__name__)
T = TypeVar("T")
WRITE_MODES = ("auto", "through", "back")  # auto: the save policy's
READ_AHEAD = 2  # batches in flight beyond the one being used, in iter_get
LOAD_BATCH_BYTES = 4 << 20  # an engine's load reads this much KV per iter_get batch
_STOP = object()
_DEMOTED = object()  # a write job's chunks: those evicted from the first tier, waiting together
DEMOTE_BYTES = 256 << 20  # bound on evicted chunks waiting for the lower tiers (write-back)
WRITEBACK_AFTER_S = 2.0  # write-back: a chunk only memory holds is written down after this long
CHECKPOINT_KEYS = 4096  # chunks a checkpoint considers at most (the rest at the next one)
CHECKPOINTS_PER_WAIT = 4  # a chunk waits writeback_after, then at most a quarter of it more
CHECKPOINT_BATCH = 16  # chunks per lower-tier write of a checkpoint


def load_batch(chunk_bytes: int) -> int:
    """Keys per ``iter_get`` batch for a load of chunks of ``chunk_bytes``."""
    return max(1, LOAD_BATCH_BYTES // chunk_bytes)


def deadline_after(seconds: float) -> float | None:
    """The ``iter_get`` deadline ``seconds`` from now; None for 0 (no deadline)."""
    return time.monotonic() + seconds if seconds else None


LOOKUP_RUNS = 32  # runs of one tier a lookup follows before it stops (see lookup_tiers)


class TieredStore:
    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        write_queue: int = 64,
        write_mode: str = "through",
        breaker: Callable[[], CircuitBreaker] | None = None,  # default: each tier's cooldown
        policy: SavePolicy | None = None,  # default: always
        writeback_after: float = WRITEBACK_AFTER_S,  # write-back's checkpoint (0: off)
        tenant_prefix: int = 0,  # keys begin with a tenant's tag: its writes queue in a lane of its own
    ) -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier")
        if write_mode not in WRITE_MODES:
            raise ConfigError(f"write_mode must be one of {WRITE_MODES}, got {write_mode!r}")
        if write_queue < 1:  # a queue.Queue of size 0 has no bound
            raise ConfigError(f"write_queue must be at least 1, got {write_queue}")
        self.tiers = list(tiers)
        self.policy = policy or SavePolicy("always")
        self._tenant_prefix = tenant_prefix
        if write_mode == "auto":  # the policy's choice, where the first tier allows it
            write_mode = self.policy.write_mode if self.tiers[0].capabilities.leases else "through"
        self.write_back = write_mode == "back" and len(self.tiers) > 1
        self.writeback_after = writeback_after
        if self.write_back:
            if not self.tiers[0].capabilities.leases:
                raise ConfigError(f"write-back needs a first tier that reports evictions (cpu://), not {tiers[0]}")
            self.tiers[0].evict_hook = self._demote
        self.policy_skipped = 0  # chunks the policy kept from the lower tiers
        self._breakers = {id(t): breaker() if breaker else CircuitBreaker(cooldown=t.cooldown) for t in self.tiers}
        self._policy = {id(t): {"retries": 0, "skipped": 0} for t in self.tiers}  # what _call did
        self._warnings = {id(t): QuietWarning(log) for t in self.tiers}
        # Hits and misses of callers' reads, per tier: the store's, not the tiers' own
        # counts, which also see the store's internal reads (write-through, promotion) and
        # a server's readiness probes.
        self._gets = {id(t): [0, 0] for t in self.tiers}
        self._counts_lock = threading.Lock()
        self._queue_size = write_queue
        self._pid = -1
        self._reader_pid = -1
        self._closed = False
        self.dropped_writes = 0
        self.unwritten_chunks = 0  # chunks a put could not hand to the lower tiers
        self._demote_lock = threading.Lock()
        self._demoting: list[Chunk] = []  # evicted (write-back), waiting for one job of the writer
        self._demote_bytes = 0
        self._demote_queued = False
        self.events: TierEvents | None = None  # what lands in and leaves the tiers, once watched
        self.checkpointed = 0  # chunks written down by write-back's checkpoint

    @classmethod
    def open(
        cls,
        urls: Sequence[str],
        context: TierContext | None = None,
        *,
        defer: bool | Literal["lower"] = False,
        first: TierContext | None = None,
        wrap: Callable[[Tier], Tier] | None = None,
        write_queue: int = 64,
        write_mode: str = "through",
        save_policy: str = "always",
        min_tokens: int = 0,
    ) -> TieredStore:
        """The store over the tiers ``urls`` name, fastest first: the one place a
        configured list of tiers is opened (``open_tier`` opens one).

        ``defer``: a tier that is configured well but cannot be opened now misses and is
        opened again in the background instead of failing the start
        (``open_tier(defer=True)``): True for every tier (an engine must start), "lower"
        for all but the first (the server serves from its first tier). ``first``: the first
        tier's own context (the server's memory tier keeps its slab in shared memory).
        ``wrap``: what stands in the store for each tier opened (the server re-keys an
        upstream server's tier). ``save_policy`` and ``min_tokens``: which chunks the lower
        tiers get (``lmtier.store.admission``; its memory is sized by the tiers' capacity).

        A misconfigured URL raises ``ConfigError`` (or ``MissingDependency``), as does a
        store that refuses its tiers; either way every tier already opened is closed
        first, so a failed start holds no memory, threads, files or sockets.
        """
        if defer not in (True, False, "lower"):
            raise ValueError(f"defer must be True, False or 'lower', got {defer!r}")
        context = context or TierContext()
        tiers: list[Tier] = []
        try:
            for i, url in enumerate(urls):
                deferred = defer is True or (defer == "lower" and i > 0)
                tiers.append(open_tier(url, first if i == 0 and first is not None else context, defer=deferred))
                if wrap is not None:
                    tiers[-1] = wrap(tiers[-1])
            policy = SavePolicy(save_policy, min_tokens=min_tokens, keys=_policy_keys(tiers, context.chunk_bytes))
            return cls(
                tiers,
                write_queue=write_queue,
                write_mode=write_mode,
                policy=policy,
                tenant_prefix=context.tenant_prefix,
            )
        except BaseException:
            for tier in reversed(tiers):
                try:
                    tier.close()
                except Exception:  # the error to report is the one that stopped the open
                    log.exception("closing tier %s after a failed open", tier.name)
            raise

    # -- the hot path -------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> int:
        return sum(n for _, n in self.lookup_tiers(keys))

    def lookup_tiers(self, keys: Sequence[bytes]) -> list[tuple[Tier, int]]:
        """``lookup``, by tier: the leading run found, as (tier, chunks) in prompt order
        (a prefix may be spread over tiers; on a tie the faster tier is named). Each run
        asks every tier about all the keys left, so a prefix that changes tier at every
        chunk would cost the square of its length: past ``LOOKUP_RUNS`` runs the prefix is
        taken to end (hits lost, never a wrong one; real prefixes change tier a few times)."""
        runs: list[tuple[Tier, int]] = []
        found = 0
        while found < len(keys) and len(runs) < LOOKUP_RUNS:
            rest = keys[found:]
            best, tier = max(
                ((self._call(t, "contains", t.contains, rest, default=0), t) for t in self.tiers), key=lambda c: c[0]
            )
            if best == 0:
                break
            runs.append((tier, best))
            found += best
        return runs

    def answering(self, tier: Tier) -> bool:
        """Whether ``tier`` answers now: its breaker is closed and, if it could not be
        opened at start, it has opened since (a caller waiting on it can stop early)."""
        if self._breakers[id(tier)].is_open:
            return False
        return getattr(tier, "opened", tier) is not None

    def read_counts(self) -> dict[str, tuple[int, int]]:
        """Chunks read per tier since the store opened, (hits, misses): cheap, for engines
        that report intervals."""
        with self._counts_lock:
            return {t.name: (self._gets[id(t)][0], self._gets[id(t)][1]) for t in self.tiers}

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

    def delete(self, keys: Sequence[bytes]) -> None:
        for tier in self.tiers:
            self._call(tier, "delete", tier.delete, keys, default=None)

    # -- background work ----------------------------------------------------------------
    def _reader(self) -> ThreadPoolExecutor:
        """Threads that read batches for ``iter_get``, made anew after ``fork``."""
        if self._reader_pid != os.getpid():
            self._reader_pool = ThreadPoolExecutor(READ_AHEAD + 1, thread_name_prefix="lmtier-read-ahead")
            self._reader_pid = os.getpid()
        return self._reader_pool

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
            self._drop_write(targets, len(chunks) if chunks is not None and chunks is not _DEMOTED else 0)
            return False
        return True

    def _drop_write(self, targets: list[Tier], chunks: int) -> None:
        """A background write that found no room: counted, ``chunks`` of it unwritten."""
        self.dropped_writes += 1
        for tier in targets:
            metrics.WRITE_QUEUE_DROPS.labels(tier.name).inc()
        if chunks and targets == self.tiers[1:]:
            self._unwritten(chunks)

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
        if self._enqueue(None, self.tiers[1:], _DEMOTED):  # type: ignore[arg-type]
            return True
        with self._demote_lock:  # the queue is full: what waits is dropped, counted
            dropped, self._demoting, self._demote_bytes, self._demote_queued = self._demoting, [], 0, False
        self._unwritten(len(dropped))
        release_all(dropped)
        return True  # released here, with the rest

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
                if given is _DEMOTED:  # every chunk evicted since the job was queued, as one batch
                    with self._demote_lock:
                        given, self._demoting = self._demoting, []
                        self._demote_bytes, self._demote_queued = 0, False
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

    def watch(self, limit: int = DEFAULT_EVENTS) -> TierEvents:
        """The queue of what lands in and leaves each tier (``lmtier.store.events``), made on the
        first call and connected to every tier; later calls return the same queue."""
        with self._counts_lock:
            if self.events is None:
                self.events = TierEvents(limit)
                for i, tier in enumerate(self.tiers):
                    tier.listener = lambda kind, keys, i=i, add=self.events.add: add(kind, i, keys)
            return self.events

    def warm(self) -> None:
        """Have the tiers that can (the memory tier: its slab mapped and its first pages
        faulted in) get ready for the first load now, off its path. For an engine that has
        just started; never raises."""
        for tier in self.tiers:
            self._call(tier, "warm", tier.warm, default=None)

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

    # -- failure handling ---------------------------------------------------------------
    def _call(self, tier: Tier, op: str, fn: Callable[..., T], *args: Any, default: T) -> T:
        """Run one tier call, retried after a ``RetryableError`` as ``tier.backoff`` says
        (each retry counted); an exception left becomes ``default``, a metric and a log line."""
        breaker = self._breakers[id(tier)]
        if not breaker.allow():
            self._note(tier, op, "skipped")
            return default
        start = time.perf_counter()
        try:
            result = tier.backoff.call(fn, *args, on_retry=lambda: self._note(tier, op, "retries"))
        except Exception as exc:
            breaker.failure()
            metrics.BREAKER_OPEN.labels(tier.name).set(int(breaker.is_open))
            metrics.TIER_ERRORS.labels(tier.name, op).inc()
            self._warnings[id(tier)].warning("tier %s failed on %s: %s", tier.name, op, exc)
            return default
        finally:
            metrics.TIER_SECONDS.labels(tier.name, op).observe(time.perf_counter() - start)
        breaker.success()
        metrics.BREAKER_OPEN.labels(tier.name).set(0)
        return result

    def _note(self, tier: Tier, op: str, what: str) -> None:
        metrics.TIER_OPS.labels(tier.name, op, "retried" if what == "retries" else what).inc()
        with self._counts_lock:
            self._policy[id(tier)][what] += 1

    def stats(self) -> dict[str, Any]:
        tiers = []
        for t in self.tiers:
            stats = dict(self._call(t, "stats", t.stats, default={"tier": t.name, "error": True}))
            stats["breaker_open"] = self._breakers[id(t)].is_open
            with self._counts_lock:
                stats["hits"], stats["misses"] = self._gets[id(t)]
                stats.update(self._policy[id(t)])
            tiers.append(stats)
        return {
            "tiers": tiers,
            "dropped_writes": self.dropped_writes,
            "unwritten_chunks": self.unwritten_chunks,
            "checkpointed_chunks": self.checkpointed,
            "write_mode": "back" if self.write_back else "through",
            "policy": {**self.policy.stats(), "skipped_chunks": self.policy_skipped},
        }

    def close(self, timeout: float = 30.0) -> None:
        """Write back what only memory holds (write-back mode), wait for queued writes (at
        most ``timeout`` seconds for each), and close every tier."""
        if self._closed:
            return
        if self.write_back:
            self._flush_first_tier(timeout)
        self._closed = True
        if self._reader_pid == os.getpid():
            self._reader_pool.shutdown(wait=True)
            self._reader_pid = -1
        if self._pid == os.getpid():
            self.flush(timeout)
            try:
                self._jobs.put(_STOP, timeout=1)
                self._thread.join(timeout=1)
            except queue.Full:
                pass
        for tier in self.tiers:
            self._call(tier, "close", tier.close, default=None)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _policy_keys(tiers: Sequence[Tier], chunk_bytes: int | None) -> int:
    """How many chunks the tiers hold together (what sizes a save policy's sketch),
    within [4,096, 4M]; 65,536 when the tiers do not say."""
    capacity = sum(t.capacity for t in tiers if t.capacity)
    if not capacity or not chunk_bytes:
        return 1 << 16
    return max(1 << 12, min(capacity // chunk_bytes, 1 << 22))

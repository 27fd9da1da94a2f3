"""``TieredStore``: tiers composed fastest-first, and the one home of caching policy.

    TieredStore.open(urls, ...)  the tiers the URLs name, opened in order (or none at all)
    lookup(keys) -> int          leading chunks present across all tiers
    get(keys) -> list[Chunk]     the leading run of chunks found; caller releases them
    put(chunks) -> int           stores; returns the leading chunks the first tier holds
    put_all(chunks) -> bool      stores in every tier before it returns (a PD hand-off)
    delete(keys), warm(), flush(timeout), persist(timeout), close(), stats()

The store's parts share one state (the tiers, the save policy, the breakers, the write
queue), so they are sections of this one class, each in a module of its own: here the
tiers it opens, lookup, and the failure handling every tier call goes through;
``lmtier.store.readpath`` reads and promotes, ``lmtier.store.writepath`` writes and runs
the write queue, ``lmtier.store.writeback`` demotes, checkpoints and persists.

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
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

from lmtier import metrics
from lmtier.breaker import CircuitBreaker, QuietWarning
from lmtier.errors import ConfigError
from lmtier.kv.chunk import Chunk
from lmtier.store.admission import SavePolicy
from lmtier.store.events import DEFAULT_LIMIT as DEFAULT_EVENTS
from lmtier.store.events import TierEvents
from lmtier.store.readpath import ReadPath
from lmtier.store.writeback import WRITEBACK_AFTER_S, WriteBack
from lmtier.store.writepath import WritePath
from lmtier.tiers.base import Tier, TierContext, open_tier
from lmtier.tiers.deferred import open_or_defer

log = logging.getLogger(__name__)
T = TypeVar("T")
WRITE_MODES = ("auto", "through", "back")  # auto: the save policy's
LOOKUP_RUNS = 32  # runs of one tier a lookup follows before it stops (see lookup_tiers)


class TieredStore(ReadPath, WritePath, WriteBack):
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
                its = first if i == 0 and first is not None else context
                tiers.append(open_or_defer(url, its) if deferred else open_tier(url, its))
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

    # -- lookup (reads, writes and write-back: the mixins) ------------------------------
    def lookup(self, keys: Sequence[bytes]) -> int:
        return sum(n for _, n in self.lookup_tiers(keys))

    def lookup_tiers(self, keys: Sequence[bytes]) -> list[tuple[Tier, int]]:
        """``lookup``, by tier: the leading run found, as (tier, chunks) in prompt order
        (a prefix may be spread over tiers; on a tie the faster tier is named). Each run
        asks every tier about all the keys left, so a prefix that changes tier at every
        chunk would cost the square of its length: past ``LOOKUP_RUNS`` runs the prefix is
        taken to end (hits lost, never a wrong one; real prefixes change tier a few times).
        The tier of the last run is not asked again: its run ended where it found no more
        (or where its own deadline fell: an object store's lookup, asked again, would spend
        it again)."""
        runs: list[tuple[Tier, int]] = []
        found = 0
        while found < len(keys) and len(runs) < LOOKUP_RUNS:
            rest = keys[found:]
            asked = [t for t in self.tiers if not runs or t is not runs[-1][0]]
            if not asked:
                break
            best, tier = max(
                ((self._call(t, "contains", t.contains, rest, default=0), t) for t in asked), key=lambda c: c[0]
            )
            best = max(0, min(best, len(rest)))  # no tier finds more than it was asked for
            if best == 0:
                break
            runs.append((tier, best))
            found += best
        return runs

    def direct(self, keys: Sequence[bytes], peer: str) -> bool:
        """A router named ``peer`` (host:port) as the holder of ``keys``: told to the tiers
        that read from peers (``peers://``). False where none takes it (no such tier, or
        the peer is not a member)."""
        taken = False
        for tier in self.tiers:
            direct = getattr(tier, "direct", None)
            if direct is not None:
                taken = bool(self._call(tier, "direct", direct, keys, peer, default=False)) or taken
        return taken

    def advertised(self) -> str:
        """Where peers read this instance's chunks (its ``peers://`` tier's ``advertise``), or ""."""
        return next((t.advertise for t in self.tiers if getattr(t, "advertise", "")), "")

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

    def request_counts(self) -> dict[str, dict[str, int]]:
        """Requests sent per tier that bills by request (an object store: ``request_counts``),
        by kind, since it opened: cheap, for engines that report intervals."""
        out = {}
        for tier in self.tiers:
            counts = getattr(tier, "request_counts", None)
            if counts is not None:
                out[tier.name] = counts()
        return out

    def count_hits(self, tier: Tier, hits: int) -> None:
        """``hits`` chunks of ``tier`` were read without the store (a same-host client,
        straight from a cache server's published memory): counted as the store's own."""
        metrics.TIER_OPS.labels(tier.name, "get", "hit").inc(hits)
        with self._counts_lock:
            self._gets[id(tier)][0] += hits

    def delete(self, keys: Sequence[bytes]) -> None:
        for tier in self.tiers:
            self._call(tier, "delete", tier.delete, keys, default=None)

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
        self._stop_reader()
        self._stop_writer(timeout)
        for tier in self.tiers:
            self._call(tier, "close", tier.close, default=None)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _policy_keys(tiers: Sequence[Tier], chunk_bytes: int | None) -> int:
    """How many chunks the tiers hold together (what sizes a save policy's sketch),
    within [4,096, 4M]; 65,536 when the tiers do not say."""
    return policy_keys(sum(t.capacity for t in tiers if t.capacity), chunk_bytes)


def policy_keys(capacity: int, chunk_bytes: int | None) -> int:
    """A save policy's sketch for tiers of ``capacity`` bytes together: their chunks,
    within [4,096, 4M]; 65,536 when the size is not known (``lmtier plan`` sizes its own
    with it too)."""
    if not capacity or not chunk_bytes:
        return 1 << 16
    return max(1 << 12, min(capacity // chunk_bytes, 1 << 22))

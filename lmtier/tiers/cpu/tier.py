"""``CpuTier``: the Tier primitives over the slab (``slab``: the memory and its free slots)
and the index (``index``: entries, recency, tenants, write-back's queue), and the leases
that keep a slot handed out from being evicted or reused. One lock guards slab and index;
placements (``placement``, a mixin of this class's) take it too. See the package docstring.

    contains / get / put / delete / close     the Tier primitives
    keys(prefix, limit) / touch(keys)         listing and recency (capabilities)
    place(key, nbytes, written) -> Placement  from ``placement.Placing``
    unwritten / hold / mark_written           write-back: what the store writes down
    evict_hook; publisher, set_publisher      told of evictions; of chunks readable in one slot
    warm / shared_name / locate / probe       map the slab now; where a chunk lies; readiness
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from lmtier import metrics
from lmtier.buffers import BufferPool
from lmtier.errors import ConfigError, IntegrityError, LayoutError, TierError
from lmtier.kv.chunk import Chunk, checksum
from lmtier.kv.layout import KVLayout
from lmtier.tiers.base import Capabilities, Tier, TierContext, parse_bool
from lmtier.tiers.cpu.index import Entry, EvictHook, Index, demote
from lmtier.tiers.cpu.placement import Placing
from lmtier.tiers.cpu.slab import Slab, is_run, scatter
from lmtier.units import parse_size

DEFAULT_SIZE = 1024**3
# Slots where no chunk size is known (a cache server's tier: its clients send what their
# models make): small, so that a chunk wastes at most one slot's end (a tier of any size
# keeps 80% of it in KV for chunks of four slots or more), and at most MAX_SLOTS of them
# (the published directory keeps a head per slot).
MIN_SLOT = 64 * 1024
MAX_SLOTS = 1 << 18
PROBE_WAIT_S = 2.0  # a readiness probe waits this long for the lock


class CpuTier(Placing, Tier):
    scheme = "cpu"
    OPTIONS = {"size": parse_size, "slot": parse_size, "name": str, "pin": parse_bool}
    capabilities = Capabilities(listing=True, touch=True, leases=True)  # shared_memory: per instance

    def __init__(
        self,
        size: int = DEFAULT_SIZE,
        slot: int | None = None,
        name: str = "cpu",
        pin: bool | None = None,
        context: TierContext | None = None,
    ) -> None:
        self.slot_bytes = slot or (context.chunk_bytes if context and context.chunk_bytes else default_slot(size))
        if self.slot_bytes <= 0:
            raise ConfigError("cpu tier slot size must be positive")
        self.num_slots = size // self.slot_bytes
        if self.num_slots == 0:
            raise ConfigError(f"cpu tier of {size} bytes holds no slot of {self.slot_bytes} bytes")
        self.capacity = self.num_slots * self.slot_bytes
        self.name = name
        self._pin = pin
        self._shared_dir = context.shared_dir if context else ""
        self._tenant_prefix = context.tenant_prefix if context else 0
        self.capabilities = Capabilities(listing=True, touch=True, leases=True, shared_memory=bool(self._shared_dir))
        self._closed = False
        # Offered each evicted chunk (see ``index.EvictHook``). Set by a TieredStore in
        # write-back mode.
        self.evict_hook: EvictHook | None = None
        # Told, under the tier's lock, each chunk that becomes readable in one slot and each
        # that stops being (before its slot is reused): a cache server's published
        # directory (``lmtier.server.published``).
        self.publisher: Publisher | None = None
        self._demote_buffers = BufferPool(max_free=8)
        self._reset()
        metrics.TIER_CAPACITY_BYTES.labels(name).set(self.capacity)

    def _reset(self) -> None:
        """(Re)initialize state: at start, and in a forked child, which starts empty."""
        self._pid = os.getpid()
        self._lock = threading.Lock()
        # a forked child makes its own mapping, segment and prefaulting thread
        self.slab = Slab(self.num_slots, self.slot_bytes, self._pin, self._shared_dir)
        self._index = Index(self.num_slots, self._tenant_prefix)
        self._counts = {"hits": 0, "misses": 0, "stored": 0, "dropped": 0, "evictions": 0, "corrupt": 0,
                        "directory_reads": 0}  # fmt: skip

    def _state(self) -> threading.Lock:
        if self._pid != os.getpid():
            self._reset()
        return self._lock

    def warm(self) -> None:
        """Map the slab now and start faulting its first ``slab.PREFAULT_AHEAD`` bytes in, as
        its first use would: an engine calls it once it is up, so that a new instance's first
        load (lower-tier hits copied into memory) writes into mapped memory instead of
        paying a page fault per 4 KiB on the load's path (0.4 GB/s on a virtual machine
        here). Commits no more memory than the first use would."""
        with self._state():
            if not self._closed:
                self.slab.ensure()

    @property
    def shared_name(self) -> str | None:
        """The shared-memory segment holding the slab, when it is shared."""
        with self._state():
            self.slab.ensure()
            return self.slab.segment.name if self.slab.segment is not None else None

    def locate(self, chunk: Chunk) -> int | None:
        """Where ``chunk``'s bytes lie in the slab, if it is a view of one slot of it."""
        return self.slab.locate(chunk.data)

    # -- primitives ---------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> int:
        with self._state():
            n = 0
            for key in keys:
                entry = self._index.get(key)
                if entry is None or not entry.ready:
                    break
                n += 1
            return n

    def put(self, chunks: Sequence[Chunk]) -> None:
        """Store a batch, its first chunk the most recent. Whatever fails part-way leaves
        nothing reserved: a chunk of no bytes is refused before anything is taken, and an
        error while reserving or writing gives back every slot of the batch not stored."""
        if self._closed:
            return
        for chunk in chunks:
            if chunk.nbytes <= 0 or chunk.num_tokens <= 0:
                raise LayoutError(f"chunk {chunk.key.hex()} holds no KV ({chunk.num_tokens} tokens)")
        plan: list[tuple[Chunk, Entry]] = []
        with self._state():
            slab = self.slab.ensure()
            touched: list[bytes] = []
            held: list[Entry] = []  # already stored: leased for the batch so that
            try:
                for chunk in chunks:  # making room for later chunks cannot evict them
                    existing = self._index.get(chunk.key)
                    if existing is not None:
                        existing.leases += 1
                        held.append(existing)
                        touched.append(chunk.key)
                        continue
                    slots = self._allocate(-(-chunk.nbytes // self.slot_bytes), chunk.key)
                    if slots is None:  # no room: keep the prefix, drop the rest of the batch
                        dropped = len(chunks) - len(touched)
                        self._counts["dropped"] += dropped
                        metrics.TIER_OPS.labels(self.name, "put", "dropped").inc(dropped)
                        break
                    entry = Entry(slots, chunk.nbytes, chunk)
                    self._index.insert(chunk.key, entry)
                    plan.append((chunk, entry))
                    touched.append(chunk.key)
            except BaseException:
                self._give_back(plan)
                raise
            finally:
                for entry in held:
                    self._unlease(entry)
            for key in reversed(touched):  # first chunk of the batch = most recent
                self._index.recent(key)
        bad: list[bytes] = []
        try:
            for chunk, entry in plan:
                try:
                    entry.checksum = self._write(chunk, self.slab.views(slab, entry.slots, entry.nbytes))
                except IntegrityError:  # a corrupted chunk from another tier: not stored
                    bad.append(chunk.key)
        except BaseException:
            with self._lock:
                self._give_back(plan)
            raise
        with self._lock:
            now = time.monotonic()
            for chunk, entry in plan:
                entry.ready = True
                self._unlease(entry)
                if self.evict_hook is not None and not entry.dead:
                    self._index.unwritten[chunk.key] = now
            for key in bad:
                self._drop(key, announce=False)
            if self.publisher is not None:
                for chunk, entry in plan:
                    if not entry.dead and chunk.key not in bad:
                        self._publish(chunk.key, entry)
            self._counts["stored"] += len(plan) - len(bad)
            self._announce("stored", [c.key for c, _ in plan if c.key not in bad])  # in order with evictions
        if plan:
            metrics.TIER_OPS.labels(self.name, "put", "stored").inc(len(plan))
            metrics.TIER_BYTES.labels(self.name, "put").inc(sum(e.nbytes for _, e in plan))
            metrics.TIER_USED_BYTES.labels(self.name).set(self.used_bytes)

    def _give_back(self, plan: list[tuple[Chunk, Entry]]) -> None:
        """A failed put's reservations, none of them published: their slots free again
        (called under the lock)."""
        for chunk, entry in plan:
            if self._index.get(chunk.key) is entry:
                self._drop(chunk.key, announce=False)
            entry.dead = True
            self._unlease(entry)

    def get(self, keys: Sequence[bytes]) -> list[Chunk | None]:
        if self._closed:
            return [None] * len(keys)
        out = self._lease(keys, use=True)
        hits = sum(c is not None for c in out)
        with self._lock:
            self._counts["hits"] += hits
            self._counts["misses"] += len(keys) - hits
        return out

    def _lease(self, keys: Sequence[bytes], use: bool) -> list[Chunk | None]:
        """Leased views of the ``keys`` held; a ``use`` counts as a read (what the save
        policy weighs) and makes them the most recent, the first one most of all."""
        out: list[Chunk | None] = [None] * len(keys)
        if self._closed:
            return out
        leased: list[tuple[int, Entry]] = []
        with self._state():
            slab = self.slab.array
            for i, key in enumerate(keys):
                entry = self._index.get(key)
                if entry is not None and entry.ready:
                    entry.leases += 1
                    entry.reads += use
                    leased.append((i, entry))
            if use:
                for i, _ in reversed(leased):
                    self._index.recent(keys[i])
        for i, entry in leased:
            out[i] = self._chunk(keys[i], entry, self.slab.views(slab, entry.slots, entry.nbytes))
        return out

    def probe(self, key: bytes) -> None:
        """No round trip (in a full tier one evicts a chunk): the tier is open and its lock
        comes free in time (a stuck lock would hang every call)."""
        if self._closed:
            raise TierError(f"cpu tier {self.name} is closed")
        lock = self._state()
        if not lock.acquire(timeout=PROBE_WAIT_S):
            raise TierError(f"cpu tier {self.name}: its lock stayed held for {PROBE_WAIT_S} s")
        lock.release()

    def touch(self, keys: Sequence[bytes]) -> None:
        """Make ``keys`` the most recently used, the first one most of all (as ``get`` does
        for one batch); for a prompt read in several batches."""
        with self._state():
            for key in reversed(keys):
                if key in self._index:
                    self._index.recent(key)

    def count_reads(self, keys: Sequence[bytes]) -> int:
        """``keys`` were read without a ``get``: by a same-host client, straight from the
        published slab. Each one held is a hit and a read (what the save policy weighs), as
        a ``get`` would count it, and the most recently used; returns how many were held."""
        held = 0
        with self._state():
            for key in reversed(keys):  # the first the most recent, as ``touch`` makes it
                entry = self._index.get(key)
                if entry is not None:
                    entry.reads += 1
                    self._index.recent(key)
                    held += 1
            self._counts["hits"] += held
            self._counts["directory_reads"] += held
        return held

    def unwritten(self, older_than: float, limit: int) -> list[tuple[bytes, int]]:
        """Write-back: up to ``limit`` chunks only memory holds, stored at least
        ``older_than`` seconds ago, oldest first, each with its reads so far. The ones
        returned go to the back of the line: a chunk the store does not write now (not
        proven yet) is asked about again after the others."""
        cutoff = time.monotonic() - older_than
        with self._state():
            return self._index.due(cutoff, limit)

    def hold(self, keys: Sequence[bytes]) -> list[Chunk | None]:
        """Leased views of ``keys`` for the store's own writes to the lower tiers: neither
        a read (what the save policy weighs) nor a use (recency)."""
        return self._lease(keys, use=False)

    def mark_written(self, keys: Sequence[bytes]) -> None:
        """The lower tiers hold ``keys`` now: their eviction writes nothing."""
        with self._state():
            self._index.mark_written(keys)

    def delete(self, keys: Sequence[bytes]) -> None:
        with self._state():
            for key in keys:
                self._drop(key)
        metrics.TIER_USED_BYTES.labels(self.name).set(self.used_bytes)

    def close(self) -> None:
        with self._state():
            self._closed = True
            self._index.clear()
            self.slab.close()

    # -- derived ------------------------------------------------------------------------
    def keys(self, prefix: bytes = b"", limit: int | None = None) -> list[bytes]:
        """Keys held that start with ``prefix``, most recently used first (for flushing in
        write-back mode, and for listing a tenant's chunks on the server)."""
        with self._state():
            return self._index.listing(prefix, limit)

    @property
    def used_bytes(self) -> int:
        return (self.num_slots - self.slab.available) * self.slot_bytes if not self._closed else 0

    def stats(self) -> dict[str, Any]:
        with self._state():
            return {
                "tier": self.name,
                "capacity_bytes": self.capacity,
                "used_bytes": self.used_bytes,
                "kv_bytes": sum(e.nbytes for e in self._index.values() if e.ready),  # used_bytes less slots' ends
                "slot_bytes": self.slot_bytes,
                "chunks": sum(1 for e in self._index.values() if e.ready),
                **self._counts,
            }

    # -- internals (call with the lock held unless noted) -------------------------------
    def _allocate(self, count: int, key: bytes) -> list[int] | None:
        """``count`` free slots for ``key``, evicting what must go (see ``Index.victim``)."""
        if count > self.num_slots:
            return None
        while self.slab.available < count:
            victim = self._index.victim(count, key)
            if victim is None:
                return None  # everything is leased or being written
            if self.evict_hook is not None:
                demote(victim, self._index[victim], self.slab, self.evict_hook, self._demote_buffers)
            self._drop(victim)
            self._counts["evictions"] += 1
            metrics.EVICTIONS.labels(self.name).inc()
        return self.slab.take(count)

    def _drop(self, key: bytes, announce: bool = True) -> None:
        entry = self._index.remove(key)
        if entry is None:
            return
        if entry.ready and self.publisher is not None:
            self.publisher.withdraw(key)  # before its slots can go to another chunk
        if announce and entry.ready:
            self._announce("removed", [key])
        entry.dead = True
        if entry.leases == 0:
            self.slab.give(entry.slots)

    def set_publisher(self, publisher: Publisher | None) -> None:
        """Tell ``publisher`` of every chunk that becomes readable in one slot, and of each
        one that stops being, from now on (chunks held now are published at once)."""
        with self._state():
            self.publisher = publisher
            if publisher is not None:
                for key, entry in self._index.items():
                    if entry.ready and not entry.dead:
                        self._publish(key, entry)

    def _publish(self, key: bytes, entry: Entry, head: bytes = b"") -> None:  # with the lock held
        if is_run(entry.slots) and entry.layout is not None and entry.checksum is not None:
            tokens = entry.nbytes // entry.layout.bytes_per_token
            self.publisher.publish(key, entry.slots[0], entry.namespace, entry.layout, tokens, entry.checksum, head)  # type: ignore[union-attr]

    def _unlease(self, entry: Entry) -> None:
        entry.leases -= 1
        if entry.leases == 0 and entry.dead:
            self.slab.give(entry.slots)

    def _release(self, entry: Entry) -> None:
        """A lease ends (called without the lock)."""
        if self._pid != os.getpid():
            return  # the entry belongs to the parent's state; this child started empty
        with self._lock:
            if not self._closed:
                self._unlease(entry)

    def _chunk(self, key: bytes, entry: Entry, views: list[np.ndarray]) -> Chunk:
        """A chunk over the entry's slots, verified lazily when it is read."""
        shape = entry.layout.byte_shape(entry.nbytes // entry.layout.bytes_per_token)
        common = {
            "namespace": entry.namespace,
            "checksum": entry.checksum,
            "verified": False,
            "on_corrupt": lambda: self._corrupt(key, entry),
        }
        if len(views) == 1:  # zero-copy view, held by a lease
            return Chunk(key, entry.layout, views[0].reshape(shape), on_release=lambda: self._release(entry), **common)
        data = np.concatenate(views).reshape(shape)  # spans slots: copy out, end the lease
        self._release(entry)
        return Chunk(key, entry.layout, data, **common)

    def _write(self, chunk: Chunk, views: list[np.ndarray]) -> int:
        """Copy a chunk into its slots, verifying it on the way; returns its checksum."""
        if len(views) == 1:
            chunk.copy_to(views[0].reshape(chunk.data.shape), need_checksum=True)
            return chunk.checksum  # type: ignore[return-value]
        if not chunk.verify():
            raise IntegrityError("chunk failed its checksum")
        scatter(chunk.data, views)
        return chunk.checksum if chunk.checksum is not None else checksum(*views)

    def _corrupt(self, key: bytes, entry: Entry) -> None:
        """A reader found this entry's bytes damaged: drop it, count it."""
        if self._pid != os.getpid():
            return
        with self._lock:
            if self._index.get(key) is entry:
                self._drop(key)
            self._counts["corrupt"] += 1
        metrics.INTEGRITY_FAILURES.labels(self.name).inc()


class Publisher(Protocol):
    """``head``, where given: the chunk's frame head as it came (checked, and agreeing with
    the other arguments), which the publisher may use instead of making one."""

    def publish(self, key: bytes, slot: int, namespace: bytes, layout: KVLayout, num_tokens: int,
                checksum: int, head: bytes = b"") -> None: ...  # fmt: skip

    def withdraw(self, key: bytes) -> None: ...


def default_slot(size: int) -> int:
    """The slot of a tier of ``size`` bytes whose chunks' size is not known: ``MIN_SLOT``, or
    the power of two that keeps the slots to ``MAX_SLOTS``."""
    return max(MIN_SLOT, 1 << max(0, (-(-size // MAX_SLOTS) - 1).bit_length()))

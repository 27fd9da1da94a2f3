"""``cpu://?size=8GiB``: chunks in one preallocated slab of host memory.

The slab is cut into fixed slots (``slot=``, by default one full chunk), so allocation
and freeing are a pop and a push on a free list. A chunk larger than a slot takes several
slots; the common case of one chunk per slot hands out zero-copy views. The slab is
pinned when CUDA is present, so copies to the GPU can be asynchronous, and is allocated
on first use and anew in a forked child (which starts empty). Its pages are faulted in
by a background thread a little ahead of the slots handed out (``buffers.Prefault``), so a
save copies into mapped memory instead of paying page faults on the engine's save path.

Eviction is LRU with one twist that keeps prefixes usable: a chunk is worth nothing
without the chunks before it, so within one batch (a prompt, in order) the *first* chunk
is made the most recent and the last chunk the least. Under pressure a prompt then loses
its tail first and whatever remains is still reachable from its first chunk; plain LRU,
touching the chunks in order, would evict the head first and strand the rest.

Leases: ``get`` returns views of the slab; each holds a lease on its slot until released,
and a leased slot is never evicted or reused. A chunk deleted while leased is freed when
its last lease ends.

Integrity: ``put`` records the xxh3-64 checksum of what it copied (hashing each block as it
lands, while it is in cache). ``get`` hands out chunks that verify against it when they are
read (see ``lmtier.kv.chunk``): the reader's copy and the check are one pass over memory, which
is what keeps a verified tier close to a bare ``memcpy``. A mismatch drops the entry.

Write-back (a ``TieredStore`` whose lower tiers get what memory lets go): ``evict_hook`` is
offered each chunk evicted, and the store writes the chunks it wants down before they go
(``unwritten`` lists what only memory holds, ``hold`` leases it without counting a read,
``mark_written`` records that the lower tiers have it), so that a process that dies loses
only what arrived in its last seconds. A chunk placed here from a lower tier is written.

Longer than 400 lines: slots, leases, eviction and the write-back hook share one lock
and one index; split, each part would reach into the others' state.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from lmtier import metrics
from lmtier.buffers import BufferPool, Prefault
from lmtier.errors import ConfigError, IntegrityError, LayoutError, TierError
from lmtier.kv.chunk import Chunk, checksum, iter_segments
from lmtier.kv.layout import KVLayout
from lmtier.tiers.base import Capabilities, Tier, TierContext, parse_bool
from lmtier.transport.shm import Segment
from lmtier.units import parse_size

DEFAULT_SIZE = 1024**3
DEFAULT_SLOT = 2 * 1024**2
PREFAULT_AHEAD = 256 << 20  # memory faulted in beyond the highest slot handed out so far
PAGE = 4096  # a placed slot is page-aligned: a lower tier may read into it with O_DIRECT
PROBE_WAIT_S = 2.0  # a readiness probe waits this long for the lock


class _Entry:
    __slots__ = ("checksum", "dead", "layout", "leases", "namespace", "nbytes", "reads", "ready", "slots", "written")

    def __init__(self, slots: list[int], nbytes: int, chunk: Chunk | None = None) -> None:
        self.slots = slots
        self.nbytes = nbytes
        self.layout: KVLayout | None = chunk.layout if chunk is not None else None  # None: being placed
        self.namespace = chunk.namespace if chunk is not None else b""
        self.checksum: int | None = chunk.checksum if chunk is not None else None
        self.leases = 1  # the writer's, until the bytes are in place
        self.reads = 0  # gets that found it: what a write-back policy asks at eviction
        self.ready = False
        self.dead = False
        self.written = False  # the lower tiers hold it (write-back): eviction writes nothing


class CpuTier(Tier):
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
        self.slot_bytes = slot or (context.chunk_bytes if context and context.chunk_bytes else DEFAULT_SLOT)
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
        self._segment: Segment | None = None
        self._closed = False
        # Called with each evicted chunk's key, how often it was read while here, and the
        # chunk (a copy of its bytes; None when the lower tiers hold it already); returns
        # whether it took the chunk. Set by a TieredStore in write-back mode.
        self.evict_hook: Callable[[bytes, int, Chunk | None], bool] | None = None
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
        self._slab: np.ndarray | None = None
        self._segment = None  # a forked child makes its own
        self._prefault: Prefault | None = None  # ... and its own prefaulting thread
        self._free = list(range(self.num_slots - 1, -1, -1))  # pop() yields slot 0 first
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # front = evicted first
        self._owned: dict[bytes, int] = {}  # tenant prefix -> slots its chunks take (tenant_prefix)
        # tenant prefix -> its keys, least recently used first (listing one tenant's chunks)
        self._tenant_keys: dict[bytes, OrderedDict[bytes, None]] = {}
        # Write-back: stored chunks the lower tiers do not hold yet -> when they were stored
        # (front = examined first by ``unwritten``). Only kept while evict_hook is set.
        self._unwritten: OrderedDict[bytes, float] = OrderedDict()
        self._counts = {"hits": 0, "misses": 0, "stored": 0, "dropped": 0, "evictions": 0, "corrupt": 0}

    def _state(self) -> threading.Lock:
        if self._pid != os.getpid():
            self._reset()
        return self._lock

    def _ensure_slab(self) -> np.ndarray:
        if self._slab is None:
            if self._shared_dir:
                self._segment = Segment(self._shared_dir, self.capacity, self.slot_bytes)
                self._segment.protect()  # clients map it read-only; none may cut it short
                self._slab, region = np.frombuffer(self._segment.map, dtype=np.uint8), self._segment.map
            else:
                self._slab, region = _allocate(self.capacity, self._pin)
            if region is not None:  # slots are handed out from slot 0 up: fault them in ahead
                self._prefault = Prefault(region, PREFAULT_AHEAD)
                self._prefault.need(0)
        return self._slab

    def warm(self) -> None:
        """Map the slab now and start faulting its first ``PREFAULT_AHEAD`` bytes in, as its
        first use would: an engine calls it once it is up, so that a new instance's first
        load (lower-tier hits copied into memory) writes into mapped memory instead of
        paying a page fault per 4 KiB on the load's path (0.4 GB/s on a virtual machine
        here). Commits no more memory than the first use would."""
        with self._state():
            if not self._closed:
                self._ensure_slab()

    @property
    def shared_name(self) -> str | None:
        """The shared-memory segment holding the slab, when it is shared."""
        with self._state():
            self._ensure_slab()
            return self._segment.name if self._segment is not None else None

    def locate(self, chunk: Chunk) -> int | None:
        """Where ``chunk``'s bytes lie in the slab, if it is a view of one slot of it."""
        slab = self._slab
        data = chunk.data
        if slab is None or not data.flags.c_contiguous:
            return None
        offset = data.__array_interface__["data"][0] - slab.__array_interface__["data"][0]
        return offset if offset >= 0 and offset + data.size <= slab.size else None

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
        plan: list[tuple[Chunk, _Entry]] = []
        with self._state():
            slab = self._ensure_slab()
            touched: list[bytes] = []
            held: list[_Entry] = []  # already stored: leased for the batch so that
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
                    entry = _Entry(slots, chunk.nbytes, chunk)
                    self._insert(chunk.key, entry)
                    plan.append((chunk, entry))
                    touched.append(chunk.key)
            except BaseException:
                self._give_back(plan)
                raise
            finally:
                for entry in held:
                    self._unlease(entry)
            for key in reversed(touched):  # first chunk of the batch = most recent
                self._recent(key)
        bad: list[bytes] = []
        try:
            for chunk, entry in plan:
                try:
                    entry.checksum = self._write(chunk, self._slot_views(slab, entry))
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
                    self._unwritten[chunk.key] = now
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

    def _give_back(self, plan: list[tuple[Chunk, _Entry]]) -> None:
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
        leased: list[tuple[int, _Entry]] = []
        with self._state():
            slab = self._slab
            for i, key in enumerate(keys):
                entry = self._index.get(key)
                if entry is not None and entry.ready:
                    entry.leases += 1
                    entry.reads += use
                    leased.append((i, entry))
            if use:
                for i, _ in reversed(leased):
                    self._recent(keys[i])
        for i, entry in leased:
            out[i] = self._chunk(keys[i], entry, self._slot_views(slab, entry))
        return out

    def place(self, key: bytes, nbytes: int, written: bool = True) -> _Placement | None:
        """Page-aligned memory in the slab for a reader to land ``key``'s payload in, one
        slot or a run of consecutive ones: a lower tier's read into it is the promotion
        (``written``: the lower tiers hold it already), a cache server's read of a client's
        save is the save (``written=False``: write-back writes it down later); no copy
        either way. None when the key is here (or being written), when no run of slots is
        free, or when nothing can be evicted to make room. The slots are invisible to
        readers until the placement commits."""
        if self._closed or nbytes <= 0 or self.slot_bytes % PAGE:
            return None
        count = -(-nbytes // self.slot_bytes)
        with self._state():
            if key in self._index:
                return None
            slab = self._ensure_slab()
            if slab.ctypes.data % PAGE:
                return None
            slots = self._allocate(count, key)
            if slots is None:
                return None
            if not _run(slots):  # scattered: the caller reads into memory of its own instead
                self._free.extend(slots)
                return None
            entry = _Entry(slots, nbytes)
            self._insert(key, entry)
        start = slots[0] * self.slot_bytes
        return _Placement(self, key, entry, slab[start : start + nbytes], written)

    def _placed(
        self, key: bytes, entry: _Entry, view: np.ndarray, chunk: Chunk | None, written: bool = True, head: bytes = b""
    ) -> Chunk | None:
        """A placement ends: committed with ``chunk`` (the bytes read into the slots,
        already verified or carrying the checksum to verify them by), or aborted (None).
        Slots whose key was deleted meanwhile (or whose tier closed) still serve this
        reader: the bytes are good; they are freed when the reader lets go."""
        digest = None
        if chunk is not None and chunk.nbytes == entry.nbytes:
            digest = chunk.checksum if chunk.checksum is not None else checksum(chunk.data)
        with self._lock:
            mine = self._index.get(key) is entry and not self._closed
            if digest is None:
                if mine:
                    self._drop(key, announce=False)  # never ready, never announced
                self._unlease(entry)
                return None
            entry.layout, entry.namespace, entry.checksum = chunk.layout, chunk.namespace, digest  # type: ignore[union-attr]
            if mine:
                entry.ready = True
                entry.written = written
                entry.reads += written  # a promotion is a read; a save is not
                if not written and self.evict_hook is not None:
                    self._unwritten[key] = time.monotonic()
                self._counts["stored"] += 1
                self._announce("stored", [key])
                if self.publisher is not None:
                    self._publish(key, entry, head)
        if mine:
            metrics.TIER_OPS.labels(self.name, "put", "stored").inc()
            metrics.TIER_BYTES.labels(self.name, "put").inc(entry.nbytes)
            metrics.TIER_USED_BYTES.labels(self.name).set(self.used_bytes)
        out = self._chunk(key, entry, [view])  # the writer's lease, now the reader's
        out.verified = chunk.verified  # type: ignore[union-attr]
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
                    self._recent(key)

    def unwritten(self, older_than: float, limit: int) -> list[tuple[bytes, int]]:
        """Write-back: up to ``limit`` chunks only memory holds, stored at least
        ``older_than`` seconds ago, oldest first, each with its reads so far. The ones
        returned go to the back of the line: a chunk the store does not write now (not
        proven yet) is asked about again after the others."""
        out: list[tuple[bytes, int]] = []
        cutoff = time.monotonic() - older_than
        with self._state():
            for key, stored_at in self._unwritten.items():
                if stored_at > cutoff or len(out) >= limit:
                    break
                out.append((key, self._index[key].reads))
            for key, _ in out:
                self._unwritten.move_to_end(key)
        return out

    def hold(self, keys: Sequence[bytes]) -> list[Chunk | None]:
        """Leased views of ``keys`` for the store's own writes to the lower tiers: neither
        a read (what the save policy weighs) nor a use (recency)."""
        return self._lease(keys, use=False)

    def mark_written(self, keys: Sequence[bytes]) -> None:
        """The lower tiers hold ``keys`` now: their eviction writes nothing."""
        with self._state():
            for key in keys:
                entry = self._index.get(key)
                if entry is not None:
                    entry.written = True
                self._unwritten.pop(key, None)

    def delete(self, keys: Sequence[bytes]) -> None:
        with self._state():
            for key in keys:
                self._drop(key)
        metrics.TIER_USED_BYTES.labels(self.name).set(self.used_bytes)

    def close(self) -> None:
        with self._state():
            self._closed = True
            self._index.clear()
            self._owned.clear()
            self._tenant_keys.clear()
            self._unwritten.clear()
            self._free = []
            self._slab = None  # leased views keep their memory alive until released
            if self._prefault is not None:
                self._prefault.close()
                self._prefault = None  # it holds the mapping: let it go with the slab
            if self._segment is not None:
                self._segment.close()

    # -- derived ------------------------------------------------------------------------
    def keys(self, prefix: bytes = b"", limit: int | None = None) -> list[bytes]:
        """Keys held that start with ``prefix``, most recently used first (for flushing in
        write-back mode, and for listing a tenant's chunks on the server)."""
        out: list[bytes] = []
        n = self._tenant_prefix
        with self._state():
            # one tenant's keys: its own index, not every tenant's
            mine = n and len(prefix) >= n
            for k in reversed(self._tenant_keys.get(prefix[:n], {}) if mine else self._index):
                if k.startswith(prefix) and self._index[k].ready:
                    out.append(k)
                    if limit is not None and len(out) >= limit:
                        break
        return out

    @property
    def used_bytes(self) -> int:
        return (self.num_slots - len(self._free)) * self.slot_bytes if not self._closed else 0

    def stats(self) -> dict[str, Any]:
        with self._state():
            return {
                "tier": self.name,
                "capacity_bytes": self.capacity,
                "used_bytes": self.used_bytes,
                "slot_bytes": self.slot_bytes,
                "chunks": sum(1 for e in self._index.values() if e.ready),
                **self._counts,
            }

    # -- internals (call with the lock held unless noted) -------------------------------
    def _allocate(self, count: int, key: bytes) -> list[int] | None:
        """``count`` free slots for ``key``, evicting what must go (see ``_victim``)."""
        if count > self.num_slots:
            return None
        while len(self._free) < count:
            victim = self._victim(count, key)
            if victim is None:
                return None  # everything is leased or being written
            if self.evict_hook is not None:
                self._demote(victim)
            self._drop(victim)
            self._counts["evictions"] += 1
            metrics.EVICTIONS.labels(self.name).inc()
        # Consecutive slots where the free list's top holds them (always in a fresh slab,
        # and after chunks of one size come and go): a chunk larger than a slot then lies
        # in one run of the slab, served as one view (and published) rather than copied.
        slots = sorted(self._free.pop() for _ in range(count))
        if self._prefault is not None:
            self._prefault.need((max(slots) + 1) * self.slot_bytes)
        return slots

    def _victim(self, count: int, key: bytes) -> bytes | None:
        """What to evict to make room for ``key``: the least recently used chunk, except
        where the tier is shared by tenants (``tenant_prefix``): each tenant with chunks
        here has a fair share of the slots (all of them over the tenants). A tenant that
        would go over its share evicts its own chunks, else those of tenants over theirs,
        never one within its share (its put is dropped instead); a tenant within its share
        evicts from the tenants over theirs first, then the least recently used."""

        def first(where: Callable[[bytes], bool] | None = None) -> bytes | None:
            return next(
                (k for k, e in self._index.items() if e.ready and e.leases == 0 and (where is None or where(k))), None
            )

        n = self._tenant_prefix
        if not n or not self._owned:
            return first()
        tenant = key[:n]
        share = max(1, self.num_slots // (len(self._owned) + (tenant not in self._owned)))
        over = {t for t, used in self._owned.items() if used > share and t != tenant}
        if self._owned.get(tenant, 0) + count > share:
            return first(lambda k: k[:n] == tenant) or (first(lambda k: k[:n] in over) if over else None)
        return (first(lambda k: k[:n] in over) if over else None) or first()

    def _insert(self, key: bytes, entry: _Entry) -> None:
        self._index[key] = entry
        if self._tenant_prefix:
            tenant = key[: self._tenant_prefix]
            self._owned[tenant] = self._owned.get(tenant, 0) + len(entry.slots)
            self._tenant_keys.setdefault(tenant, OrderedDict())[key] = None

    def _recent(self, key: bytes) -> None:
        """``key`` becomes the most recently used (in its tenant's order too)."""
        self._index.move_to_end(key)
        if self._tenant_prefix:
            self._tenant_keys[key[: self._tenant_prefix]].move_to_end(key)

    def _demote(self, key: bytes) -> None:
        """Offer an evicted chunk to ``evict_hook`` (write-back to a lower tier).

        The bytes are copied out into a pooled buffer first, so the slot is free at once:
        waiting for the lower tier to write them would starve the very put that needs the
        room. The hook must not block (it queues); when it refuses, the chunk is lost.
        """
        entry = self._index[key]
        if entry.written:  # the lower tiers hold it: the store only learns it went
            try:
                self.evict_hook(key, entry.reads, None)
            except Exception:
                pass
            return
        buf = self._demote_buffers.acquire(entry.nbytes)
        flat = np.frombuffer(buf, dtype=np.uint8, count=entry.nbytes)
        np.concatenate(self._slot_views(self._slab, entry), out=flat)
        shape = entry.layout.byte_shape(entry.nbytes // entry.layout.bytes_per_token)
        chunk = Chunk(
            key,
            entry.layout,
            flat.reshape(shape),
            namespace=entry.namespace,
            checksum=entry.checksum,
            verified=False,
            on_release=lambda: self._demote_buffers.release(buf),
        )
        try:
            accepted = self.evict_hook(key, entry.reads, chunk)
        except Exception:
            accepted = False
        if not accepted:
            chunk.release()

    def _drop(self, key: bytes, announce: bool = True) -> None:
        entry = self._index.pop(key, None)
        self._unwritten.pop(key, None)
        if entry is None:
            return
        if self._tenant_prefix:
            tenant = key[: self._tenant_prefix]
            left = self._owned.get(tenant, 0) - len(entry.slots)
            if left > 0:
                self._owned[tenant] = left
            else:
                self._owned.pop(tenant, None)
            mine = self._tenant_keys.get(tenant)
            if mine is not None:
                mine.pop(key, None)
                if not mine:
                    del self._tenant_keys[tenant]
        if entry.ready and self.publisher is not None:
            self.publisher.withdraw(key)  # before its slots can go to another chunk
        if announce and entry.ready:
            self._announce("removed", [key])
        entry.dead = True
        if entry.leases == 0:
            self._free.extend(entry.slots)

    def set_publisher(self, publisher: Publisher | None) -> None:
        """Tell ``publisher`` of every chunk that becomes readable in one slot, and of each
        one that stops being, from now on (chunks held now are published at once)."""
        with self._state():
            self.publisher = publisher
            if publisher is not None:
                for key, entry in self._index.items():
                    if entry.ready and not entry.dead:
                        self._publish(key, entry)

    def _publish(self, key: bytes, entry: _Entry, head: bytes = b"") -> None:  # with the lock held
        if _run(entry.slots) and entry.layout is not None and entry.checksum is not None:
            tokens = entry.nbytes // entry.layout.bytes_per_token
            self.publisher.publish(key, entry.slots[0], entry.namespace, entry.layout, tokens, entry.checksum, head)  # type: ignore[union-attr]

    def _unlease(self, entry: _Entry) -> None:
        entry.leases -= 1
        if entry.leases == 0 and entry.dead:
            self._free.extend(entry.slots)

    def _release(self, entry: _Entry) -> None:
        """A lease ends (called without the lock)."""
        if self._pid != os.getpid():
            return  # the entry belongs to the parent's state; this child started empty
        with self._lock:
            if not self._closed:
                self._unlease(entry)

    def _slot_views(self, slab: np.ndarray, entry: _Entry) -> list[np.ndarray]:
        if _run(entry.slots):
            start = entry.slots[0] * self.slot_bytes
            return [slab[start : start + entry.nbytes]]
        views, left = [], entry.nbytes
        for slot in entry.slots:
            start = slot * self.slot_bytes
            take = min(left, self.slot_bytes)
            views.append(slab[start : start + take])
            left -= take
        return views

    def _chunk(self, key: bytes, entry: _Entry, views: list[np.ndarray]) -> Chunk:
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
        _scatter(chunk.data, views)
        return chunk.checksum if chunk.checksum is not None else checksum(*views)

    def _corrupt(self, key: bytes, entry: _Entry) -> None:
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


class _Placement:
    """Slots set aside by ``CpuTier.place`` (see ``lmtier.tiers.base.Placement``)."""

    __slots__ = ("_done", "_entry", "_tier", "_written", "committed", "key", "view")

    def __init__(self, tier: CpuTier, key: bytes, entry: _Entry, view: np.ndarray, written: bool) -> None:
        self._tier, self.key, self._entry, self.view, self._written = tier, key, entry, view, written
        self._done = self.committed = False

    def commit(self, chunk: Chunk, head: bytes = b"") -> Chunk | None:
        """``chunk``: the payload read into ``view`` (its header's layout and checksum;
        ``head``: that frame head's bytes, checked, where the reader has them); returns the
        tier's chunk over the slots, leased to the caller (None if the tier closed or
        dropped them meanwhile)."""
        if self._done:
            raise RuntimeError("placement already ended")
        self._done = True
        out = self._tier._placed(self.key, self._entry, self.view, chunk, self._written, head)
        self.committed = out is not None
        return out

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._tier._placed(self.key, self._entry, self.view, None)


def _run(slots: list[int]) -> bool:
    """Whether an entry's ``slots`` (distinct, in order: ``_allocate``) are one run of the slab."""
    return slots[-1] - slots[0] == len(slots) - 1


def _allocate(nbytes: int, pin: bool | None) -> tuple[np.ndarray, mmap.mmap | None]:
    """The slab: pinned through torch when CUDA is present (or asked for: pinned memory is
    resident from the start), else an anonymous mapping, returned too for prefaulting."""
    torch = sys.modules.get("torch")
    if pin is None:
        pin = bool(torch is not None and torch.cuda.is_available())
    if pin:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy(), None
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(region, dtype=np.uint8), region


def _scatter(src: np.ndarray, dst: list[np.ndarray]) -> None:
    """Copy the canonical bytes of a (possibly strided) 4-d chunk into slot views."""
    if len(dst) == 1:
        np.copyto(dst[0].reshape(src.shape), src)
        return
    it = iter(dst)
    out, pos = next(it), 0
    for seg in iter_segments(src):
        done = 0
        while done < seg.size:
            if pos == out.size:
                out, pos = next(it), 0
            n = min(seg.size - done, out.size - pos)
            out[pos : pos + n] = seg[done : done + n]
            pos += n
            done += n

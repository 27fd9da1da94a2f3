"""The memory tier's index: which chunk holds which slots, the order in which chunks are
evicted, whose chunks they are, and what only memory holds (write-back).

The order is least recently used first, and the tier makes a batch's *first* chunk its
most recent (a prompt then loses its tail first; see the package docstring). Where
tenants share the tier (``tenant_prefix``), each tenant with chunks here has a fair share
of the slots, and the victim is picked to keep every tenant within its share. The tier's
lock guards all of it.

    Entry(slots, nbytes, chunk)          one chunk's slots, leases, reads and state
    Index(num_slots, tenant_prefix)      key -> Entry, least recently used first
      .insert(key, entry) / .remove(key) a chunk in, a chunk out (the tenants' counts kept)
      .recent(key)                       the most recently used, in its tenant's order too
      .victim(count, key) -> key | None  what to evict to make room for ``key``
      .listing(prefix, limit)            keys held, most recently used first
      .unwritten                         key -> when stored, for chunks only memory holds
      .due(cutoff, limit) / .mark_written(keys)   write-back's queue: what to write down next
    demote(key, entry, slab, hook, buffers)    an evicted chunk offered to the evict hook
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from lmtier.buffers import BufferPool
from lmtier.kv.chunk import Chunk
from lmtier.kv.layout import KVLayout
from lmtier.tiers.cpu.slab import Slab

# Called with each evicted chunk's key, how often it was read while here, and the chunk (a
# copy of its bytes; None when the lower tiers hold it already); returns whether it took
# the chunk. Set by a TieredStore in write-back mode (``CpuTier.evict_hook``).
EvictHook = Callable[[bytes, int, Chunk | None], bool]


class Entry:
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


class Index(OrderedDict[bytes, Entry]):
    """The entries, front = evicted first. Add and remove them only through ``insert`` and
    ``remove`` (or ``clear``), which keep the tenants' counts and lists in step."""

    def __init__(self, num_slots: int, tenant_prefix: int) -> None:
        super().__init__()
        self.num_slots = num_slots
        self.tenant_prefix = tenant_prefix
        self.owned: dict[bytes, int] = {}  # tenant prefix -> slots its chunks take (tenant_prefix)
        # tenant prefix -> its keys, least recently used first (listing one tenant's chunks)
        self.tenant_keys: dict[bytes, OrderedDict[bytes, None]] = {}
        # Write-back: stored chunks the lower tiers do not hold yet -> when they were stored
        # (front = examined first by ``unwritten``). Only kept while evict_hook is set.
        self.unwritten: OrderedDict[bytes, float] = OrderedDict()

    def insert(self, key: bytes, entry: Entry) -> None:
        self[key] = entry
        if self.tenant_prefix:
            tenant = key[: self.tenant_prefix]
            self.owned[tenant] = self.owned.get(tenant, 0) + len(entry.slots)
            self.tenant_keys.setdefault(tenant, OrderedDict())[key] = None

    def recent(self, key: bytes) -> None:
        """``key`` becomes the most recently used (in its tenant's order too)."""
        self.move_to_end(key)
        if self.tenant_prefix:
            self.tenant_keys[key[: self.tenant_prefix]].move_to_end(key)

    def remove(self, key: bytes) -> Entry | None:
        """``key``'s entry, out of the index (its slots are the caller's to free)."""
        entry = self.pop(key, None)
        self.unwritten.pop(key, None)
        if entry is None:
            return None
        if self.tenant_prefix:
            tenant = key[: self.tenant_prefix]
            left = self.owned.get(tenant, 0) - len(entry.slots)
            if left > 0:
                self.owned[tenant] = left
            else:
                self.owned.pop(tenant, None)
            mine = self.tenant_keys.get(tenant)
            if mine is not None:
                mine.pop(key, None)
                if not mine:
                    del self.tenant_keys[tenant]
        return entry

    def clear(self) -> None:
        super().clear()
        self.owned.clear()
        self.tenant_keys.clear()
        self.unwritten.clear()

    def victim(self, count: int, key: bytes) -> bytes | None:
        """What to evict to make room for ``key``: the least recently used chunk, except
        where the tier is shared by tenants (``tenant_prefix``): each tenant with chunks
        here has a fair share of the slots (all of them over the tenants). A tenant that
        would go over its share evicts its own chunks, else those of tenants over theirs,
        never one within its share (its put is dropped instead); a tenant within its share
        evicts from the tenants over theirs first, then the least recently used."""

        def first(where: Callable[[bytes], bool] | None = None) -> bytes | None:
            return next((k for k, e in self.items() if e.ready and e.leases == 0 and (where is None or where(k))), None)

        n = self.tenant_prefix
        if not n or not self.owned:
            return first()
        tenant = key[:n]
        share = max(1, self.num_slots // (len(self.owned) + (tenant not in self.owned)))
        over = {t for t, used in self.owned.items() if used > share and t != tenant}
        if self.owned.get(tenant, 0) + count > share:
            return first(lambda k: k[:n] == tenant) or (first(lambda k: k[:n] in over) if over else None)
        return (first(lambda k: k[:n] in over) if over else None) or first()

    def due(self, cutoff: float, limit: int) -> list[tuple[bytes, int]]:
        """Up to ``limit`` chunks only memory holds, stored at ``cutoff`` or before, oldest
        first, each with its reads; they go to the back of the line (``CpuTier.unwritten``)."""
        out: list[tuple[bytes, int]] = []
        for key, stored_at in self.unwritten.items():
            if stored_at > cutoff or len(out) >= limit:
                break
            out.append((key, self[key].reads))
        for key, _ in out:
            self.unwritten.move_to_end(key)
        return out

    def mark_written(self, keys: Sequence[bytes]) -> None:
        """The lower tiers hold ``keys`` now: their eviction writes nothing."""
        for key in keys:
            entry = self.get(key)
            if entry is not None:
                entry.written = True
            self.unwritten.pop(key, None)

    def listing(self, prefix: bytes, limit: int | None) -> list[bytes]:
        """Ready keys that start with ``prefix``, most recently used first."""
        out: list[bytes] = []
        n = self.tenant_prefix
        # one tenant's keys: its own index, not every tenant's
        mine = n and len(prefix) >= n
        for k in reversed(self.tenant_keys.get(prefix[:n], {}) if mine else self):
            if k.startswith(prefix) and self[k].ready:
                out.append(k)
                if limit is not None and len(out) >= limit:
                    break
        return out


def demote(key: bytes, entry: Entry, slab: Slab, hook: EvictHook, buffers: BufferPool) -> None:
    """Offer an evicted chunk (its bytes in ``slab``) to ``hook`` (write-back to a lower tier).

    The bytes are copied out into a buffer from ``buffers`` first, so the slot is free at
    once: waiting for the lower tier to write them would starve the very put that needs the
    room. The hook must not block (it queues); when it refuses, the chunk is lost.
    """
    if entry.written:  # the lower tiers hold it: the store only learns it went
        try:
            hook(key, entry.reads, None)
        except Exception:
            pass
        return
    buf = buffers.acquire(entry.nbytes)
    flat = np.frombuffer(buf, dtype=np.uint8, count=entry.nbytes)
    np.concatenate(slab.views(slab.array, entry.slots, entry.nbytes), out=flat)  # type: ignore[arg-type]
    shape = entry.layout.byte_shape(entry.nbytes // entry.layout.bytes_per_token)
    chunk = Chunk(
        key,
        entry.layout,
        flat.reshape(shape),
        namespace=entry.namespace,
        checksum=entry.checksum,
        verified=False,
        on_release=lambda: buffers.release(buf),
    )
    try:
        accepted = hook(key, entry.reads, chunk)
    except Exception:
        accepted = False
    if not accepted:
        chunk.release()

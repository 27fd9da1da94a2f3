"""Placements in the memory tier: slots set aside for a reader to land a chunk's payload in
directly, so that a payload read from elsewhere is stored with no copy. A lower tier's
read into them is a promotion (the lower tiers hold the chunk already); a cache server's
read of a client's save is the save (write-back writes it down later). The slots are
page-aligned (a lower tier may read into them with O_DIRECT) and invisible to readers
until the placement commits.

    Placing                        CpuTier's placements (a mixin: one state, one lock)
      .place(key, nbytes, written) -> _Placement | None
    _Placement                     ``lmtier.tiers.base.Placement``: commit(chunk, head) or abort()
"""

from __future__ import annotations

import time

import numpy as np

from lmtier import metrics
from lmtier.kv.chunk import Chunk, checksum
from lmtier.tiers.cpu.index import Entry
from lmtier.tiers.cpu.slab import is_run

PAGE = 4096  # a placed slot is page-aligned: a lower tier may read into it with O_DIRECT


class Placing:
    """``CpuTier.place`` and the end of each placement. A mixin of ``CpuTier``'s, sharing
    its state and lock, the class's placement section apart: it uses the tier's
    ``_closed``, ``slot_bytes``, ``slab``, ``_index``, ``_lock``, ``_counts``, ``name``,
    ``evict_hook``, ``publisher`` and ``used_bytes``, and its ``_state``, ``_allocate``,
    ``_drop``, ``_unlease``, ``_publish``, ``_chunk`` and ``_announce``."""

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
            slab = self.slab.ensure()
            if slab.ctypes.data % PAGE:
                return None
            slots = self._allocate(count, key)
            if slots is None:
                return None
            if not is_run(slots):  # scattered: the caller reads into memory of its own instead
                self.slab.give(slots)
                return None
            entry = Entry(slots, nbytes)
            self._index.insert(key, entry)
        start = slots[0] * self.slot_bytes
        return _Placement(self, key, entry, slab[start : start + nbytes], written)

    def _placed(
        self, key: bytes, entry: Entry, view: np.ndarray, chunk: Chunk | None, written: bool = True, head: bytes = b""
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
                    self._index.unwritten[key] = time.monotonic()
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


class _Placement:
    """Slots set aside by ``Placing.place`` (see ``lmtier.tiers.base.Placement``)."""

    __slots__ = ("_done", "_entry", "_tier", "_written", "committed", "key", "view")

    def __init__(self, tier: Placing, key: bytes, entry: Entry, view: np.ndarray, written: bool) -> None:
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

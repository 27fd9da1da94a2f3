"""The published directory of a cache server's memory tier: same-host loads without a call.

A server with one tenant keeps its memory tier in a shared-memory slab that its same-host
clients already map read-only (they read chunks where they lie). Beside it the server
publishes which chunk lies where, so that a client finds and reads its chunks with no call
at all: a file in the same shared-memory directory, read-only to others, laid out as

    header   4096 bytes: magic, version, sets, ways, head bytes, slots, slot bytes,
             heartbeat interval, the server's last heartbeat (monotonic ns), the slab's name
    ways     sets x ways entries of 64 bytes: seq, slot + 1 (0: empty), head length,
             key length, the key
    heads    one per slot of the slab, ``head_bytes`` each: the chunk's frame without
             its payload (preamble and header, ``codec.frame_head``)

A key lies in set ``xxh3_64(key) % sets``, in any free way of it; a key whose set is full
is not published (its reader asks the server, as it would without a directory). Entries
and slots are bounded by the slab: the file's size is fixed when the server starts.

Writers and readers agree without locks. The writer makes a way's ``seq`` odd, writes the
way and its head, then makes ``seq`` even again; a reader copies the way and the head and
keeps them only if ``seq`` was even and unchanged. Correctness does not rest on that: the
head carries its own checksum and the payload's, and the reader verifies both, so bytes
that change under a reader (an eviction while it copies) are a miss, never wrong KV. A
slot is withdrawn (its way cleared, ``seq`` moved on) before the slab reuses it, so a
reader whose copy failed can tell a race (``moved``) from damage.

    DirectoryWriter(shm_dir, slab_name, num_slots, slot_bytes, interval)    the server's
        publish(key, slot, head), withdraw(key), beat(), close(), name
    DirectoryReader(shm_dir, name)                                          a client's
        find(key) -> Entry | None          where a published chunk lies, and its head
        payload(entry) -> memoryview       its bytes in the slab (pages mapped once per slot)
        moved(entry) -> bool               its way changed since it was found
        fresh -> bool                      the server beat within three intervals and lives
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from lmtier.buffers import populate_read
from lmtier.errors import FormatError, LmtierError
from lmtier.transport.shm.access import SegmentMaps
from lmtier.transport.shm.segment import Segment, locked

MAGIC = b"LMTDIR01"
# magic, version, sets, ways, head bytes, slots, slot bytes, interval, heartbeat, slab name
HEADER = struct.Struct("<8sIIIIQQQQ48s")
HEADER_BYTES = 4096
BEAT_AT = struct.calcsize("<8sIIIIQQQ")
WAY = 64
WAY_HEAD = struct.Struct("<QIHB")  # seq, slot + 1, head length, key length
KEY_AT = 16
WAYS = 8
HEAD_BYTES = 512  # a frame's preamble and header: ~150 bytes for lmtier's keys and layouts
MAX_KEY = WAY - KEY_AT


@dataclass(frozen=True)
class Entry:
    key: bytes
    way: int  # the way's offset in the file
    seq: int
    slot: int
    head: bytes


def _sets(num_slots: int) -> int:
    return max(1, -(-2 * num_slots // WAYS))  # twice the slots in ways: a set rarely fills


class DirectoryWriter:
    """The server's side. Called with the memory tier's lock held (publish and withdraw),
    so that a slot is withdrawn before it is handed to another chunk."""

    def __init__(self, shm_dir: str, slab_name: str, num_slots: int, slot_bytes: int, interval: float) -> None:
        self.sets, self.slots = _sets(num_slots), num_slots
        self._ways_at = HEADER_BYTES
        self._heads_at = HEADER_BYTES + self.sets * WAYS * WAY
        size = self._heads_at + num_slots * HEAD_BYTES
        self._segment = Segment(shm_dir, -(-size // 4096) * 4096, 4096)
        self._segment.protect()  # clients read it; none may write or cut it short
        self.name = self._segment.name
        self._map = memoryview(self._segment.map)
        self._where: dict[bytes, int] = {}  # key -> its way's offset (at most one per slot)
        self._free = [WAYS] * self.sets  # free ways per set
        self._lock = threading.Lock()
        nanos = int(interval * 1e9)
        HEADER.pack_into(self._map, 0, MAGIC, 1, self.sets, WAYS, HEAD_BYTES, num_slots, slot_bytes, nanos,
                         time.monotonic_ns(), slab_name.encode())  # fmt: skip

    def publish(self, key: bytes, slot: int, head: bytes) -> bool:
        """``key``'s chunk lies in ``slot`` and its frame head is ``head``; False when it
        cannot be published (its set full, a head or key too long)."""
        if len(head) > HEAD_BYTES or len(key) > MAX_KEY or not 0 <= slot < self.slots:
            return False
        with self._lock:
            self._withdraw(key)
            s = xxhash.xxh3_64_intdigest(key) % self.sets
            if not self._free[s]:
                return False
            base = self._ways_at + s * WAYS * WAY
            way = next(base + w * WAY for w in range(WAYS) if not self._slot_of(base + w * WAY))
            seq = self._seq(way) + 1
            self._set_seq(way, seq)  # odd: being written
            at = self._heads_at + slot * HEAD_BYTES
            self._map[at : at + len(head)] = head
            self._map[way + KEY_AT : way + KEY_AT + len(key)] = key
            struct.pack_into("<IHB", self._map, way + 8, slot + 1, len(head), len(key))
            self._set_seq(way, seq + 1)
            self._where[key] = way
            self._free[s] -= 1
            return True

    def withdraw(self, key: bytes) -> None:
        with self._lock:
            self._withdraw(key)

    def _withdraw(self, key: bytes) -> None:
        way = self._where.pop(key, None)
        if way is None:
            return
        seq = self._seq(way) + 1
        self._set_seq(way, seq)
        struct.pack_into("<IHB", self._map, way + 8, 0, 0, 0)
        self._set_seq(way, seq + 1)
        self._free[(way - self._ways_at) // (WAYS * WAY)] += 1

    def beat(self) -> None:
        struct.pack_into("<Q", self._map, BEAT_AT, time.monotonic_ns())

    def close(self) -> None:
        """Say that no server stands behind it any more, and remove it."""
        struct.pack_into("<Q", self._map, BEAT_AT, 0)
        self._map.release()
        self._segment.close()

    def __len__(self) -> int:
        return len(self._where)

    def _slot_of(self, way: int) -> int:
        return struct.unpack_from("<I", self._map, way + 8)[0]

    def _seq(self, way: int) -> int:
        return struct.unpack_from("<Q", self._map, way)[0]

    def _set_seq(self, way: int, seq: int) -> None:
        struct.pack_into("<Q", self._map, way, seq)


class DirectoryReader:
    """A client's side: the directory ``name`` and the slab it names, mapped read-only."""

    def __init__(self, shm_dir: str, name: str) -> None:
        maps = SegmentMaps(shm_dir, limit=2)
        self.name = name
        self._path = os.path.join(shm_dir, name)
        self._map = maps.region(name, 0, None)
        if len(self._map) < HEADER_BYTES:
            raise FormatError(f"directory {name} is too short")
        magic, version, sets, ways, head_bytes, slots, slot_bytes, self._interval, _, slab = HEADER.unpack_from(
            self._map
        )
        if magic != MAGIC or version != 1 or ways != WAYS or not sets or not slots or not slot_bytes:
            raise FormatError(f"{name} is not a directory this client reads")
        self.sets, self.head_bytes, self.slot_bytes = sets, head_bytes, slot_bytes
        self._ways_at = HEADER_BYTES
        self._heads_at = HEADER_BYTES + sets * WAYS * WAY
        if len(self._map) < self._heads_at + slots * head_bytes:
            raise FormatError(f"directory {name} is shorter than its header says")
        self.slab_name = slab.rstrip(b"\0").decode("ascii", "replace")
        self._slab = maps.region(self.slab_name, 0, None)
        if len(self._slab) < slots * slot_bytes:
            raise FormatError(f"slab {self.slab_name} is shorter than its directory says")
        self._slots = slots
        self._mapped = bytearray(slots)  # slots whose pages this process has mapped
        self.warmed = False  # whether a thread was started to map its chunks' pages (``populate``)
        self._barrier = threading.Lock()

    @property
    def fresh(self) -> bool:
        """The server stands behind it: it beat within three intervals, and its process
        lives (it holds the lock on the file: a killed server is seen at once)."""
        beat = struct.unpack_from("<Q", self._map, BEAT_AT)[0]
        recent = beat > 0 and time.monotonic_ns() - beat <= 3 * self._interval + 1_000_000_000
        return recent and locked(self._path)

    def find(self, key: bytes) -> Entry | None:
        base = self._ways_at + xxhash.xxh3_64_intdigest(key) % self.sets * WAYS * WAY
        ways = bytes(self._map[base : base + WAYS * WAY])
        at = ways.find(key)
        while at >= 0 and (at - KEY_AT) % WAY:
            at = ways.find(key, at + 1)
        if at < 0:
            return None
        way = at - KEY_AT
        seq, slot, head_len, key_len = WAY_HEAD.unpack_from(ways, way)
        if seq & 1 or not 0 < slot <= self._slots or key_len != len(key) or head_len > self.head_bytes:
            return None
        start = self._heads_at + (slot - 1) * self.head_bytes
        head = bytes(self._map[start : start + head_len])
        entry = Entry(key, base + way, seq, slot - 1, head)
        return None if self.moved(entry) else entry

    def moved(self, entry: Entry) -> bool:
        """Whether ``entry``'s way changed since it was found. Asked after a copy of its
        bytes: the lock is a barrier, so that this read of ``seq`` comes after the copy's
        reads on any processor (the writer changes ``seq`` before the slot is reused)."""
        with self._barrier:
            pass
        return struct.unpack_from("<Q", self._map, entry.way)[0] != entry.seq

    def populate(self, length_of: Callable[[bytes], int], limit: int, stop: Callable[[], bool] = bool) -> int:
        """Map the pages of the chunks published now (at most ``limit`` bytes of them) into
        this process, so that a first read of each costs no page faults: a new engine's
        first hit otherwise maps a 192 MiB prompt's pages on its path (~15 ms). The pages
        are the server's, already in memory; only this process's page tables grow, as the
        reads would grow them. ``length_of`` gives an entry's payload length from its head
        and raises for a head that is not a whole, checked one (an entry half written, or
        garbage): such an entry is skipped, as is one whose way moved meanwhile. ``stop``
        is asked before each entry. Returns the bytes newly mapped (whole slots)."""
        ways = bytes(self._map[self._ways_at : self._heads_at])
        done = 0
        for way in range(0, len(ways), WAY):
            if done >= limit or stop():
                break
            seq, slot, head_len, _ = WAY_HEAD.unpack_from(ways, way)
            if seq & 1 or not 0 < slot <= self._slots or not 0 < head_len <= self.head_bytes:
                continue
            first = slot - 1
            at = self._heads_at + first * self.head_bytes
            try:
                length = length_of(bytes(self._map[at : at + head_len]))
            except (LmtierError, ValueError):
                continue
            if struct.unpack_from("<Q", self._map, self._ways_at + way)[0] != seq:
                continue  # rewritten while its head was read: its reader maps it
            slots = max(1, -(-length // self.slot_bytes))
            last = min(self._slots, first + slots, first + -(-(limit - done) // self.slot_bytes))
            new = last - first - sum(self._mapped[first:last])
            if new and populate_read(self._slab[first * self.slot_bytes : last * self.slot_bytes]):
                self._mapped[first:last] = b"\x01" * (last - first)
                done += new * self.slot_bytes
        return done

    def payload(self, entry: Entry, length: int) -> memoryview:
        """``length`` bytes from the start of ``entry``'s slot (a chunk larger than a slot
        lies in consecutive slots; never past the slab's end)."""
        start = entry.slot * self.slot_bytes
        view = self._slab[start : min(start + length, self._slots * self.slot_bytes)]
        last = min(self._slots, entry.slot + -(-len(view) // self.slot_bytes))
        if not all(self._mapped[entry.slot : last]):  # once per slot and process
            populate_read(self._slab[start : last * self.slot_bytes])
            self._mapped[entry.slot : last] = b"\x01" * (last - entry.slot)
        return view

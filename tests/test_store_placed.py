"""A lower tier's hit read straight into the memory tier's slot (``Tier.place`` and
``Tier.get_into``): the read is the promotion, nothing is copied, and a damaged, odd or
unplaceable frame is still a miss or a plain read, never wrong KV or a lost slot."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from lmtier.buffers import ALIGN
from lmtier.kv import codec
from lmtier.kv.chunk import release_all
from lmtier.store.tiered import TieredStore
from lmtier.tiers.cpu import CpuTier
from lmtier.tiers.disk import DiskTier

from conftest import make_prompt
from test_disk_tier import flip
from tier_contract import CHUNK_BYTES

ROOM = 64 * (CHUNK_BYTES + ALIGN)


def written(tmp_path, n: int, seed: int = 0, **disk):
    """A prompt of ``n`` chunks stored on a disk tier by another store (another process, in
    effect), and that tier reopened."""
    p = make_prompt(n, seed=seed)
    with TieredStore([CpuTier(size=16 * CHUNK_BYTES, slot=CHUNK_BYTES), DiskTier(tmp_path, size=ROOM, **disk)]) as s:
        assert s.put(p.chunks()) == n
        assert s.flush()
    return p, DiskTier(tmp_path, size=ROOM, **disk)


@pytest.mark.parametrize("o_direct", [False, True])
def test_a_disk_hit_lands_in_a_memory_slot_with_no_copy(tmp_path, o_direct):
    p, disk = written(tmp_path, 6, o_direct=o_direct)
    hot = CpuTier(size=8 * CHUNK_BYTES, slot=CHUNK_BYTES)
    with TieredStore([hot, disk]) as store:
        chunks = [c for batch in store.iter_get(p.keys, batch=2) for c in batch]
        assert [c.tobytes() for c in chunks] == [p.chunk_bytes(i) for i in range(6)]
        assert all(hot.locate(c) is not None for c in chunks)  # views of the slab: no copy made
        assert all(c.verified for c in chunks)  # hashed as they were read
        assert hot.contains(p.keys) == 6  # promoted at once, not by a queued write
        release_all(chunks)
        assert disk.files.buffers.outstanding == 0
        assert store.stats()["tiers"][0]["stored"] == 6
        again = store.get(p.keys)  # now memory hits
        assert [c.tobytes() for c in again] == [p.chunk_bytes(i) for i in range(6)]
        release_all(again)


def test_get_reads_into_the_memory_tier_too(tmp_path):
    p, disk = written(tmp_path, 3, seed=1)
    hot = CpuTier(size=8 * CHUNK_BYTES, slot=CHUNK_BYTES)
    with TieredStore([hot, disk]) as store:
        chunks = store.get(p.keys)
        assert [c.tobytes() for c in chunks] == [p.chunk_bytes(i) for i in range(3)]
        assert all(hot.locate(c) is not None for c in chunks)
        release_all(chunks)
        assert hot.contains(p.keys) == 3


def test_a_damaged_payload_read_into_a_slot_is_a_miss_and_gives_the_slot_back(tmp_path):
    p, disk = written(tmp_path, 4, seed=2)
    flip(disk, p.keys[2], -10)  # one bit near the end of chunk 2's payload
    hot = CpuTier(size=4 * CHUNK_BYTES, slot=CHUNK_BYTES)
    with TieredStore([hot, disk]) as store:
        chunks = [c for batch in store.iter_get(p.keys, batch=4) for c in batch]
        assert [c.tobytes() for c in chunks] == [p.chunk_bytes(0), p.chunk_bytes(1)]
        release_all(chunks)
        assert hot.contains(p.keys) == 2 and not hot.has(p.keys[2])  # chunk 3 is good: it may stay
        assert disk.stats()["corrupt"] == 1
        other = make_prompt(4, seed=3)  # every slot can be used again: none was lost
        hot.put(other.chunks())
        assert hot.contains(other.keys) == 4


def test_a_frame_whose_payload_is_not_on_its_second_page_is_read_whole(tmp_path, monkeypatch):
    """Frames whose header takes more than a page (written by another version, say) are
    read whole into the disk's buffer and copied up, as before."""
    encode_parts, encoded_size = codec.encode_parts, codec.encoded_size
    monkeypatch.setattr(codec, "encode_parts", lambda chunk, **kw: encode_parts(chunk, **{**kw, "align": 2 * ALIGN}))
    monkeypatch.setattr(codec, "encoded_size", lambda chunk, align=0: encoded_size(chunk, 2 * ALIGN))
    p, disk = written(tmp_path, 3, seed=4)
    monkeypatch.undo()
    length = disk.locate(p.keys[0])[2]
    assert length == 2 * ALIGN + CHUNK_BYTES  # the payload is on the frame's third page
    hot = CpuTier(size=8 * CHUNK_BYTES, slot=2 * CHUNK_BYTES)  # room enough to be offered a slot
    with TieredStore([hot, disk]) as store:
        chunks = [c for batch in store.iter_get(p.keys, batch=3) for c in batch]
        assert [c.tobytes() for c in chunks] == [p.chunk_bytes(i) for i in range(3)]
        release_all(chunks)
        assert hot.contains(p.keys) == 3 and hot.used_bytes == 3 * hot.slot_bytes
        assert disk.files.buffers.outstanding == 0 and disk.stats()["corrupt"] == 0


def test_with_no_room_to_place_the_hit_is_served_from_the_disk_buffer(tmp_path):
    p, disk = written(tmp_path, 3, seed=5)
    hot = CpuTier(size=2 * CHUNK_BYTES, slot=CHUNK_BYTES)
    squatters = make_prompt(2, seed=6)
    hot.put(squatters.chunks())
    held = hot.get(squatters.keys)  # leased: nothing can be evicted
    with TieredStore([hot, disk]) as store:
        chunks = [c for batch in store.iter_get(p.keys, batch=3) for c in batch]
        assert [c.tobytes() for c in chunks] == [p.chunk_bytes(i) for i in range(3)]
        assert all(hot.locate(c) is None for c in chunks)
        release_all(chunks)
        release_all(held)
        assert disk.files.buffers.outstanding == 0


def test_a_placement_is_invisible_until_committed_and_never_leaks_its_slot():
    hot = CpuTier(size=2 * CHUNK_BYTES, slot=CHUNK_BYTES)
    p = make_prompt(2, seed=7)
    a = hot.place(p.keys[0], CHUNK_BYTES)
    assert a is not None and a.view.ctypes.data % ALIGN == 0
    assert hot.place(p.keys[0], CHUNK_BYTES) is None  # being written
    assert hot.place(p.keys[1], 2 * CHUNK_BYTES) is None  # two slots: the other one is being written
    assert hot.contains(p.keys[:1]) == 0 and hot.get(p.keys[:1]) == [None]
    a.abort()
    a.abort()  # once is enough; twice is harmless
    assert hot.used_bytes == 0

    b = hot.place(p.keys[0], CHUNK_BYTES)
    chunk = p.chunks()[0]
    b.view[:] = np.frombuffer(p.chunk_bytes(0), dtype=np.uint8)
    short = make_prompt(1, seed=8).chunks()[0]
    wrong = hot.place(p.keys[1], CHUNK_BYTES - ALIGN)
    assert wrong.commit(short) is None  # a chunk of another size than the slot was set for
    got = b.commit(chunk)
    assert got is not None and b.committed and got.tobytes() == p.chunk_bytes(0)
    with pytest.raises(RuntimeError):
        b.commit(chunk)
    got.release()
    assert hot.contains(p.keys) == 1 and hot.used_bytes == CHUNK_BYTES

    late = hot.place(p.keys[1], CHUNK_BYTES)
    late.view[:] = np.frombuffer(p.chunk_bytes(1), dtype=np.uint8)
    hot.close()  # the bytes read are good: this reader gets them, the closed tier keeps nothing
    served = late.commit(p.chunks()[1])
    assert served.tobytes() == p.chunk_bytes(1) and hot.contains(p.keys[1:]) == 0
    served.release()


def test_a_key_deleted_while_its_read_runs_is_still_served(tmp_path):
    p, disk = written(tmp_path, 4, seed=9)
    hot = CpuTier(size=8 * CHUNK_BYTES, slot=CHUNK_BYTES)
    place = hot.place

    def racing(key, nbytes):  # fault injection: another thread's delete lands mid-read
        placed = place(key, nbytes)
        if key == p.keys[1]:
            hot.delete([key])
        return placed

    hot.place = racing
    with TieredStore([hot, disk]) as store:
        chunks = store.get(p.keys)
        assert [c.tobytes() for c in chunks] == [p.chunk_bytes(i) for i in range(4)]
        release_all(chunks)
        assert not hot.has(p.keys[1]) and hot.used_bytes == 3 * CHUNK_BYTES  # its slot came back


def test_a_load_cut_short_evicts_nothing_for_chunks_it_cannot_serve(tmp_path):
    """The disk holds a prompt's tail but not its head: the load is a miss, and the memory
    tier keeps what it held (no slot is taken for chunks no prefix reaches)."""
    p, disk = written(tmp_path, 4, seed=10)
    disk.delete(p.keys[:1])
    hot = CpuTier(size=4 * CHUNK_BYTES, slot=CHUNK_BYTES)
    resident = make_prompt(4, seed=11)
    hot.put(resident.chunks())
    with TieredStore([hot, disk]) as store:
        assert store.get(p.keys) == []
        assert hot.contains(resident.keys) == 4


def test_placed_chunks_keep_the_prefix_order_for_eviction(tmp_path):
    """Read into memory in one batch, a prompt's head is the most recent: memory pressure
    takes its tail first, and what stays is still a usable prefix."""
    p, disk = written(tmp_path, 6, seed=12)
    hot = CpuTier(size=8 * CHUNK_BYTES, slot=CHUNK_BYTES)
    with TieredStore([hot, disk]) as store:
        release_all(store.get(p.keys))
        hot.put(make_prompt(4, seed=13).chunks())  # evicts two of the six: the last two
        assert hot.contains(p.keys) == 4


def test_closing_the_store_during_a_load_ends_it_without_an_error(tmp_path):
    p, disk = written(tmp_path, 6, seed=14)
    slow, started = disk.get_into, threading.Event()

    def get_into(keys, place):  # fault injection: a slow disk, so that close lands mid-load
        if keys[0] != p.keys[0]:
            started.set()
            time.sleep(0.3)
        return slow(keys, place)

    disk.get_into = get_into
    store = TieredStore([CpuTier(size=8 * CHUNK_BYTES, slot=CHUNK_BYTES), disk])
    loads = store.iter_get(p.keys, batch=1)
    first = next(loads)
    assert started.wait(10)
    closer = threading.Thread(target=store.close)
    closer.start()
    rest = [c for batch in loads for c in batch]  # ends, early or not, but never raises
    release_all(first + rest)
    closer.join(30)
    assert not closer.is_alive() and [c.key for c in first] == p.keys[:1]


def test_a_save_placed_in_a_run_of_slots_is_not_yet_written_and_goes_down_when_evicted(tmp_path):
    """``place(written=False)``: a cache server's save read into memory in place. It spans
    a run of slots, counts as no read, and write-back writes it down when it is evicted
    (a promotion, ``written=True``, is known to be below already)."""
    hot = CpuTier(size=4 * CHUNK_BYTES, slot=CHUNK_BYTES // 2)
    disk = DiskTier(tmp_path, size=ROOM)
    store = TieredStore([hot, disk], write_mode="back", writeback_after=0)  # eviction and close only
    p = make_prompt(3, seed=12)
    try:
        placed = [hot.place(k, CHUNK_BYTES, written=False) for k in p.keys[:2]]
        assert all(x is not None and x.view.size == CHUNK_BYTES for x in placed)
        assert hot.contains(p.keys[:1]) == 0  # invisible until committed
        for i, x in enumerate(placed):
            x.view[:] = np.frombuffer(p.chunk_bytes(i), dtype=np.uint8)
            got = x.commit(p.chunks()[i])
            assert got.tobytes() == p.chunk_bytes(i)
            got.release()
        assert hot.contains(p.keys[:2]) == 2 and hot.stats()["hits"] == 0
        assert [k for k, _ in hot.unwritten(older_than=0, limit=8)] == p.keys[:2]
        store.put(p.chunks()[2:])  # another chunk: the least recent of the two goes down
        assert store.put(make_prompt(2, seed=13).chunks()) == 2  # five chunks in room for four
        assert store.flush()
        assert disk.contains(p.keys[:1]) == 1 and hot.contains(p.keys[:1]) == 0
        got = disk.get(p.keys[:1])
        assert got[0].tobytes() == p.chunk_bytes(0)
        release_all(got)
    finally:
        store.close()

"""The CPU tier: the contract, plus slab slots, leases and fork behaviour."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from lmtier.errors import ConfigError, LayoutError
from lmtier.kv.chunk import Chunk, release_all
from lmtier.tiers.base import TierContext, open_tier
from lmtier.tiers.cpu import CpuTier

from conftest import eventually, make_prompt
from tier_contract import CHUNK_BYTES, EvictingTierContract


class TestCpuTier(EvictingTierContract):
    def make_tier(self, capacity_chunks, chunk_bytes):
        return CpuTier(size=capacity_chunks * chunk_bytes, context=TierContext(chunk_bytes=chunk_bytes))

    def corrupt(self, tier, key):
        entry = tier._index[key]
        tier.slab.array[entry.slots[0] * tier.slot_bytes + 7] ^= 0x01


class TestCpuTierWithSmallSlots(TestCpuTier):
    """The same contract when each chunk spans several slots (mixed chunk sizes)."""

    def make_tier(self, capacity_chunks, chunk_bytes):
        slot = chunk_bytes // 3 + 1  # every chunk spans three slots
        return CpuTier(size=capacity_chunks * 3 * slot, slot=slot)


def test_url_configures_size_and_slot():
    tier = open_tier("cpu://?size=1MiB&slot=64KiB&name=hot")
    assert (tier.capacity, tier.slot_bytes, tier.num_slots, tier.name) == (1 << 20, 1 << 16, 16, "hot")
    tier.close()
    with pytest.raises(ConfigError, match="unknown option"):
        open_tier("cpu://?sise=1MiB")
    with pytest.raises(ConfigError, match="holds no slot"):
        open_tier("cpu://?size=1KiB&slot=4KiB")
    with pytest.raises(ConfigError, match="takes no location"):
        open_tier("cpu://somewhere?size=1MiB")


def test_slot_defaults_to_the_chunk_size():
    tier = open_tier("cpu://?size=1MiB", TierContext(chunk_bytes=CHUNK_BYTES))
    assert tier.slot_bytes == CHUNK_BYTES
    tier.close()


def test_leased_chunk_survives_eviction_and_delete():
    tier = CpuTier(size=2 * CHUNK_BYTES, slot=CHUNK_BYTES)
    a = make_prompt(2, seed=1)
    tier.put(a.chunks())
    held = tier.get(a.keys[:1])[0]
    tier.delete([a.keys[0]])  # deleted while leased: the slot stays ours
    tier.put(make_prompt(2, seed=2).chunks())  # needs both slots, one is leased
    assert held.tobytes() == a.chunk_bytes(0)  # still intact
    assert tier.stats()["chunks"] == 1  # only one of the new chunks found room
    held.release()
    tier.put(make_prompt(2, seed=3).chunks())
    assert tier.stats()["chunks"] == 2  # the released slot is reusable


def test_fully_leased_tier_drops_new_puts_instead_of_overwriting():
    tier = CpuTier(size=2 * CHUNK_BYTES, slot=CHUNK_BYTES)
    a = make_prompt(2, seed=1)
    tier.put(a.chunks())
    held = tier.get(a.keys)
    b = make_prompt(2, seed=2)
    tier.put(b.chunks())
    assert tier.contains(b.keys) == 0
    assert tier.stats()["dropped"] == 2
    assert [c.tobytes() for c in held] == [a.chunk_bytes(0), a.chunk_bytes(1)]
    release_all(held)


def test_release_is_idempotent_and_garbage_collection_releases():
    tier = CpuTier(size=CHUNK_BYTES, slot=CHUNK_BYTES)
    a = make_prompt(1, seed=1)
    tier.put(a.chunks())
    chunk = tier.get(a.keys)[0]
    chunk.release()
    chunk.release()
    assert tier._index[a.keys[0]].leases == 0
    tier.get(a.keys)  # dropped on the floor: the finalizer ends the lease
    assert tier._index[a.keys[0]].leases == 0


def test_get_hands_out_views_of_the_slab_without_copying():
    tier = CpuTier(size=4 * CHUNK_BYTES, slot=CHUNK_BYTES)
    a = make_prompt(1, seed=1)
    tier.put(a.chunks())
    with tier.get(a.keys)[0] as chunk:
        assert np.shares_memory(chunk.data, tier.slab.array)


def test_forked_child_starts_empty_and_parent_keeps_its_chunks():
    tier = CpuTier(size=4 * CHUNK_BYTES, slot=CHUNK_BYTES)
    a = make_prompt(2, seed=1)
    tier.put(a.chunks())
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report what it sees, store something, exit
        seen = tier.contains(a.keys)
        tier.put(make_prompt(1, seed=2).chunks())
        os.write(write, bytes([seen, tier.stats()["chunks"]]))
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 2) == bytes([0, 1])
    assert tier.contains(a.keys) == 2


def test_closed_tier_answers_misses():
    tier = CpuTier(size=4 * CHUNK_BYTES, slot=CHUNK_BYTES)
    a = make_prompt(2, seed=1)
    tier.put(a.chunks())
    tier.close()
    assert tier.get(a.keys) == [None, None]
    assert tier.contains(a.keys) == 0
    tier.put(a.chunks())
    assert tier.contains(a.keys) == 0


def _resident_bytes(array: np.ndarray) -> int:
    """Bytes of ``array``'s pages that are mapped in, by ``mincore(2)``."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = array.__array_interface__["data"][0]
    assert start % page == 0
    pages = -(-array.nbytes // page)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(array.nbytes), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) * page


def test_warm_maps_the_first_pages_before_any_chunk_arrives(monkeypatch):
    """An engine warms its store when it starts: the slab's first ``PREFAULT_AHEAD`` bytes
    are mapped before the first load copies lower-tier hits into it, and no more."""
    from lmtier.store.tiered import TieredStore
    from lmtier.tiers.cpu import slab as cpu

    monkeypatch.setattr(cpu, "PREFAULT_AHEAD", 8 << 20)
    tier = CpuTier(size=64 << 20, slot=1 << 20)
    assert tier.slab.array is None  # nothing is mapped until asked
    store = TieredStore([tier])
    store.warm()
    assert eventually(lambda: tier.slab.prefault.done >= 8 << 20)
    assert 8 << 20 <= _resident_bytes(tier.slab.array) < 32 << 20
    p = make_prompt(2)
    store.put(p.chunks())
    got = store.get(p.keys)
    assert [c.tobytes() for c in got] == [p.chunk_bytes(i) for i in range(2)]
    release_all(got)
    store.close()
    store.warm()  # a closed store's tiers stay closed


def test_the_slab_is_faulted_in_ahead_of_the_slots_in_use_and_no_further(monkeypatch):
    from lmtier.tiers.cpu import slab as cpu

    monkeypatch.setattr(cpu, "PREFAULT_AHEAD", 8 << 20)
    tier = CpuTier(size=64 << 20, slot=1 << 20)
    p = make_prompt(4)
    tier.put(p.chunks())  # slots 0-3 in use: pages up to 4 + 8 MiB are faulted in
    assert eventually(lambda: tier.slab.prefault.done >= 12 << 20)
    assert 12 << 20 <= _resident_bytes(tier.slab.array) < 32 << 20  # not the whole slab
    got = tier.get(p.keys)  # prefaulting never changes a byte
    assert [c.tobytes() for c in got] == [p.chunk_bytes(i) for i in range(4)]
    release_all(got)
    prefault = tier.slab.prefault
    tier.close()
    assert prefault._stopped and tier.slab.prefault is None  # stopped, and the mapping let go


@pytest.mark.parametrize("fails", ["reserving", "writing"])
def test_a_put_that_fails_part_way_leaves_nothing_reserved(fails, monkeypatch):
    """An error while a batch's slots are taken or filled gives every slot back; a chunk of
    no KV is refused before anything is taken (a batch once kept its slots forever)."""
    prompt = make_prompt(8, seed=5)
    chunks = prompt.chunks()
    tier = CpuTier(size=8 * chunks[0].nbytes, slot=chunks[0].nbytes)
    calls = {"n": 0}
    name = "_allocate" if fails == "reserving" else "_write"
    real = getattr(tier, name)

    def third_fails(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected")
        return real(*args)

    monkeypatch.setattr(tier, name, third_fails)
    with pytest.raises(RuntimeError, match="injected"):
        tier.put(chunks)
    monkeypatch.setattr(tier, name, real)
    assert tier.used_bytes == 0 and tier.contains(prompt.keys) == 0
    layout = chunks[0].layout
    empty = Chunk(b"e" * len(chunks[0].key), layout, np.zeros(layout.byte_shape(0), np.uint8))
    with pytest.raises(LayoutError, match="no KV"):
        tier.put([*chunks[:3], empty])
    assert tier.used_bytes == 0
    tier.put(chunks)
    assert tier.contains(prompt.keys) == 8
    tier.close()

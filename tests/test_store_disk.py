"""Memory over disk: write-through, write-back, promotion, restarts, a slow disk."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import lmtier
from lmtier.errors import ConfigError
from lmtier.kv.chunk import release_all
from lmtier.store.tiered import TieredStore
from lmtier.tiers.cpu import CpuTier
from lmtier.tiers.disk import DiskTier

from conftest import assert_served_then_promoted, make_prompt
from tier_contract import CHUNK_BYTES

FRAME_ROOM = 64 * (CHUNK_BYTES + 4096)


def cpu(chunks: int) -> CpuTier:
    return CpuTier(size=chunks * CHUNK_BYTES, slot=CHUNK_BYTES)


def gated(tier_class: type) -> type:
    """Fault injection: ``tier_class`` whose puts wait until the test opens ``gate``."""

    class Gated(tier_class):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.gate = threading.Event()

        def put(self, chunks):
            self.gate.wait(timeout=60)
            super().put(chunks)

    return Gated


SlowDisk = gated(DiskTier)
GatedCpu = gated(CpuTier)


def test_write_through_survives_a_restart_and_promotes_on_the_way_back(tmp_path):
    p = make_prompt(6)
    with TieredStore([cpu(16), DiskTier(tmp_path, size=FRAME_ROOM)]) as store:
        assert store.put(p.chunks()) == 6
        assert store.flush()
    hot = cpu(16)
    with TieredStore([hot, DiskTier(tmp_path, size=FRAME_ROOM)]) as store:  # a new process, in effect
        assert hot.contains(p.keys) == 0
        assert store.lookup(p.keys) == 6
        assert_served_then_promoted(store, hot, p)


def test_background_promotion_holds_its_own_lease_on_the_read_buffers(tmp_path):
    """The caller releases the chunks at once and the disk tier reuses its buffers for
    other reads; the promotion, still queued, must copy the original bytes."""
    a, b = make_prompt(4, seed=1), make_prompt(4, seed=2)
    with TieredStore([cpu(16), DiskTier(tmp_path, size=FRAME_ROOM)]) as store:
        store.put(a.chunks() + b.chunks())
        assert store.flush()
    hot = GatedCpu(size=16 * CHUNK_BYTES, slot=CHUNK_BYTES)
    with TieredStore([hot, DiskTier(tmp_path, size=FRAME_ROOM)]) as store:
        release_all(store.get(a.keys))  # promotion queued, stuck behind the gate
        for _ in range(3):  # the pool hands the freed buffers out again, if it may
            chunks = store.get(b.keys)
            assert [c.tobytes() for c in chunks] == [b.chunk_bytes(i) for i in range(4)]
            release_all(chunks)
        hot.gate.set()
        assert store.flush()
        held = hot.get(a.keys)
        assert [c.tobytes() for c in held] == [a.chunk_bytes(i) for i in range(4)]
        release_all(held)


def test_a_slow_disk_never_blocks_put_and_what_overflows_is_counted(tmp_path):
    disk = SlowDisk(tmp_path, size=FRAME_ROOM)
    store = TieredStore([cpu(32), disk], write_queue=2)
    prompts = [make_prompt(1, seed=s) for s in range(8)]
    for p in prompts:
        assert store.put(p.chunks()) == 1  # returns at once: the disk is stuck
    assert store.dropped_writes >= 5
    disk.gate.set()
    assert store.flush()
    assert sum(disk.contains(p.keys) for p in prompts) == 8 - store.dropped_writes
    store.close()


def test_write_back_demotes_evicted_chunks_and_flushes_the_rest_on_close(tmp_path):
    hot, disk = cpu(3), DiskTier(tmp_path, size=FRAME_ROOM)
    store = TieredStore([hot, disk], write_mode="back", writeback_after=0)  # eviction and close only
    prompts = [make_prompt(2, seed=s) for s in range(4)]
    for p in prompts:
        store.put(p.chunks())
    assert store.flush()
    assert disk.contains(prompts[-1].keys) == 0  # still only in memory
    assert disk.contains(prompts[0].keys) == 2  # evicted from memory, demoted
    for p in prompts:
        assert store.lookup(p.keys) == 2
    store.close()
    again = DiskTier(tmp_path, size=FRAME_ROOM)
    assert all(again.contains(p.keys) == 2 for p in prompts)
    for p in prompts:
        got = again.get(p.keys)
        assert [c.tobytes() for c in got] == [p.chunk_bytes(0), p.chunk_bytes(1)]
        release_all(got)
    again.close()


def test_write_back_with_a_full_queue_loses_chunks_but_never_memory(tmp_path):
    hot, disk = cpu(2), SlowDisk(tmp_path, size=FRAME_ROOM)
    store = TieredStore([hot, disk], write_mode="back", write_queue=1, writeback_after=0)
    for s in range(10):
        store.put(make_prompt(1, seed=s).chunks())
    assert hot.stats()["used_bytes"] <= hot.capacity
    disk.gate.set()
    assert store.flush()
    assert all(e.leases == 0 for e in hot._index.values())
    assert hot.slab.available + sum(len(e.slots) for e in hot._index.values()) == hot.num_slots  # no slot leaked
    store.close()


def test_write_back_needs_a_first_tier_that_reports_evictions(tmp_path):
    with pytest.raises(ConfigError, match="write-back"):
        TieredStore([DiskTier(tmp_path / "a", size=FRAME_ROOM), cpu(4)], write_mode="back")
    with pytest.raises(ConfigError, match="write_mode"):
        TieredStore([cpu(4)], write_mode="sideways")


def test_a_damaged_disk_chunk_ends_the_prefix_served(tmp_path):
    disk = DiskTier(tmp_path, size=FRAME_ROOM)
    p = make_prompt(4)
    disk.put(p.chunks())
    path, offset, length = disk.locate(p.keys[2])  # one bit-rotted byte near the end of chunk 2's frame
    with open(path, "r+b") as f:
        f.seek(offset + length - 10)
        byte = f.read(1)[0]
        f.seek(offset + length - 10)
        f.write(bytes([byte ^ 0xFF]))
    with TieredStore([cpu(8), disk]) as store:
        chunks = store.get(p.keys)
        assert [c.tobytes() for c in chunks] == [p.chunk_bytes(0), p.chunk_bytes(1)]
        release_all(chunks)
        assert store.lookup(p.keys) == 2


def test_the_embedded_api_shares_kv_between_processes_through_the_disk(tmp_path):
    layout = lmtier.KVLayout(2, 2, 16, "float16")
    tiers = ["cpu://?size=4MiB", f"file://{tmp_path}/disk?size=16MiB"]
    kv = np.random.default_rng(0).standard_normal(layout.tensor_shape(100)).astype(np.float16)
    np.save(tmp_path / "kv.npy", kv)
    script = textwrap.dedent(f"""
        import numpy as np, lmtier
        layout = lmtier.KVLayout(2, 2, 16, "float16")
        with lmtier.open_store({tiers!r}, model="m", layout=layout, chunk_tokens=16) as store:
            print(store.put(np.arange(100), np.load({str(tmp_path / "kv.npy")!r})))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert run.stdout.strip() == "96"
    with lmtier.open_store(tiers, model="m", layout=layout, chunk_tokens=16) as store:
        assert store.lookup(np.arange(100)) == 96
        out = np.zeros_like(kv)
        assert store.get_into(np.arange(100), out) == 96
        assert np.array_equal(out[:, :, :96], kv[:, :, :96])


def test_bytes_damaged_in_memory_never_reach_the_disk(tmp_path):
    """Write-through reads chunks back from the memory tier unverified; the disk tier
    verifies them as it encodes, so a chunk whose bytes changed in memory is not written."""
    hot, slow = cpu(16), gated(DiskTier)(tmp_path, size=FRAME_ROOM)
    p = make_prompt(4)
    with TieredStore([hot, slow]) as store:
        store.put(p.chunks())  # the write-through job waits at the gate
        entry = hot._index[p.keys[2]]
        hot.slab.array[entry.slots[0] * hot.slot_bytes + 11] ^= 0x10  # memory goes bad meanwhile
        slow.gate.set()
        assert store.flush()
    assert slow.contains(p.keys) == 2
    assert slow.get([p.keys[2]]) == [None]
    assert slow.contains([p.keys[3]]) == 1  # written: an orphan without chunk 2, never served
    assert slow.stats()["corrupt"] == 1


def test_write_through_hands_the_writer_its_chunks_so_eviction_cannot_lose_them(tmp_path):
    """The disk is stuck while new prompts push the first ones out of memory: the writer
    already holds them (leased), so they reach the disk; what memory could not keep is
    counted as unwritten, never lost silently."""
    disk = SlowDisk(tmp_path, size=FRAME_ROOM)
    store = TieredStore([cpu(4), disk], write_queue=16)
    first, later = make_prompt(2, seed=81), [make_prompt(2, seed=82 + i) for i in range(3)]
    assert store.put(first.chunks()) == 2
    kept = [store.put(p.chunks()) for p in later]  # memory is full of leased chunks
    disk.gate.set()
    assert store.flush()
    assert disk.contains(first.keys) == 2
    on_disk = sum(disk.contains(p.keys) for p in later)
    assert on_disk == sum(kept)
    assert store.unwritten_chunks == 2 * len(later) - sum(kept) > 0
    store.close()


def test_every_number_has_one_owner_and_the_exact_value(tmp_path):
    """A scripted workload, then the exact counters: hits, misses and bytes read are the
    store's (once per tier), what a tier stored and its bytes are the tier's."""
    from lmtier import metrics

    def value(name, **labels):
        return metrics.REGISTRY.get_sample_value(name, labels) or 0.0

    hot_name, disk_name = "m-hot", "m-disk"
    hot = CpuTier(size=16 * CHUNK_BYTES, slot=CHUNK_BYTES, name=hot_name)
    disk = DiskTier(tmp_path, size=FRAME_ROOM, name=disk_name)
    names = [("get", "hit"), ("get", "miss"), ("put", "stored")]
    before = {(t, o, r): value("lmtier_tier_ops_total", tier=t, op=o, result=r) for t in (hot_name, disk_name)
              for o, r in names}  # fmt: skip
    read_before = value("lmtier_tier_bytes_total", tier=hot_name, op="get")
    put_before = value("lmtier_tier_bytes_total", tier=hot_name, op="put")
    with TieredStore([hot, disk]) as store:
        p, absent = make_prompt(4, seed=91), make_prompt(2, seed=92)
        store.put(p.chunks())
        assert store.flush()
        release_all(store.get(p.keys))  # 4 hits in memory
        assert store.get(absent.keys) == []  # 2 misses in memory, then 2 on disk
        final = store.stats()

    def delta(t, o, r):
        return value("lmtier_tier_ops_total", tier=t, op=o, result=r) - before[(t, o, r)]

    assert (delta(hot_name, "get", "hit"), delta(hot_name, "get", "miss")) == (4, 2)
    assert (delta(disk_name, "get", "hit"), delta(disk_name, "get", "miss")) == (0, 2)
    assert delta(hot_name, "put", "stored") == 4 and delta(disk_name, "put", "stored") == 4
    assert value("lmtier_tier_bytes_total", tier=hot_name, op="get") - read_before == 4 * CHUNK_BYTES
    assert value("lmtier_tier_bytes_total", tier=hot_name, op="put") - put_before == 4 * CHUNK_BYTES
    stats = {t["tier"]: t for t in final["tiers"]}  # callers' reads only, not write-through's
    assert (stats[hot_name]["hits"], stats[hot_name]["misses"]) == (4, 2)
    assert (stats[disk_name]["hits"], stats[disk_name]["misses"]) == (0, 2)


def test_an_engine_exports_no_server_figures():
    """lmtier_server_ready 0 in an engine's /metrics would page someone for every engine."""
    from prometheus_client import generate_latest

    from lmtier import metrics

    assert b"lmtier_server" not in generate_latest(metrics.REGISTRY)
    assert b"lmtier_server_ready" in generate_latest(metrics.SERVER_REGISTRY)

"""The disk tier: the contract, options, persistence, damage, a full disk, the index, the
segment layout and the old layout's migration (processes sharing a directory and crashes:
test_disk_shared.py)."""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from lmtier.buffers import ALIGN, round_up
from lmtier.errors import ConfigError, IntegrityError, TierError
from lmtier.kv import codec
from lmtier.kv.chunk import Chunk, release_all
from lmtier.kv.layout import KVLayout
from lmtier.tiers.base import TierContext, open_tier
from lmtier.tiers.disk import DiskTier

from conftest import SMALL, make_namespace, make_prompt
from tier_contract import CHUNK_BYTES, EvictingTierContract

ROOT = Path(__file__).resolve().parents[1]
# A stored chunk is its frame (a page of preamble and header, then the chunk) padded to 4 KiB.
HEADER = codec.encoded_size(make_prompt(1).chunks()[0], ALIGN) - CHUNK_BYTES
FRAME = round_up(CHUNK_BYTES + HEADER)


def frame_size(chunk_bytes: int) -> int:
    return round_up(chunk_bytes + HEADER)


class TestDiskTier(EvictingTierContract):
    o_direct = "auto"

    @pytest.fixture(autouse=True)
    def _directory(self, tmp_path):
        self.dirs = iter(tmp_path / f"d{i}" for i in range(100))

    def make_tier(self, capacity_chunks, chunk_bytes):
        url = f"file://{next(self.dirs)}?size={capacity_chunks * frame_size(chunk_bytes)}&o_direct={self.o_direct}"
        return open_tier(url)

    def corrupt(self, tier, key):
        flip(tier, key, -100)


class TestDiskTierBuffered(TestDiskTier):
    """The same contract through the page cache (filesystems without O_DIRECT)."""

    o_direct = "false"


def new_tier(path, chunks: int = 64, **options) -> DiskTier:
    return DiskTier(path, size=chunks * FRAME, **options)


def segments_on_disk(root: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (root / "segments").iterdir()}


def flip(tier: DiskTier, key: bytes, at: int) -> None:
    """Flip one bit of ``key``'s stored frame, ``at`` bytes into it (from its end if < 0)."""
    path, offset, length = tier.locate(key)
    with open(path, "r+b") as f:
        f.seek(offset + at % length)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))


def test_url_options_are_typed_and_checked(tmp_path):
    tier = open_tier(f"file://{tmp_path}/t?size=1GiB&o_direct=false&fsync=true&threads=2&name=nvme&segment=8MiB")
    settings = (tier.capacity, tier.o_direct, tier.files.fsync, tier.threads, tier.name, tier.segment_bytes)
    assert settings == (1 << 30, False, True, 2, "nvme", 8 << 20)
    tier.close()
    small = open_tier(f"file://{tmp_path}/s?size=16MiB")  # a small tier still has 16 segments' room
    assert small.segment_bytes == 1 << 20
    small.close()
    with pytest.raises(ConfigError, match="segment"):
        open_tier(f"file://{tmp_path}/t?size=1MiB&segment=1")
    with pytest.raises(ConfigError, match="needs a size"):
        open_tier(f"file://{tmp_path}/t")
    with pytest.raises(ConfigError, match="absolute path"):
        open_tier("file://relative/path?size=1MiB")
    with pytest.raises(ConfigError, match="unknown option"):
        open_tier(f"file://{tmp_path}/t?size=1MiB&odirect=1")


def test_keys_never_reach_a_path(tmp_path):
    """Segments are named by process, random and counter: no key steers a path."""
    tier = new_tier(tmp_path / "d")
    p = make_prompt(1)
    chunk = p.chunks()[0]
    chunk.key = b"../../../etc/passwd\x00"
    tier.put([chunk])
    (segment,) = (tmp_path / "d" / "segments").iterdir()
    assert re.fullmatch(r"[0-9]+-[0-9a-f]{12}-[0-9]+\.seg", segment.name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    assert tier.get([chunk.key])[0].tobytes() == p.chunk_bytes(0)
    with pytest.raises(ValueError):
        tier.contains(["not bytes"])
    tier.close()


def test_a_lost_index_is_rebuilt_from_the_files(tmp_path):
    tier = new_tier(tmp_path)
    prompts = [make_prompt(3, seed=s) for s in range(4)]
    for p in prompts:
        tier.put(p.chunks())
    tier.close()
    for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
        (tmp_path / name).unlink(missing_ok=True)
    again = new_tier(tmp_path)
    assert all(again.contains(p.keys) == 3 for p in prompts)
    assert again.stats()["chunks"] == 12
    assert again.stats()["used_bytes"] == sum(segments_on_disk(tmp_path).values()) == 12 * FRAME
    for p in prompts:
        got = again.get(p.keys)
        assert [c.tobytes() for c in got] == [p.chunk_bytes(i) for i in range(3)]
        release_all(got)
    again.close()


def test_reopening_with_a_smaller_size_evicts_down_to_it(tmp_path):
    tier = new_tier(tmp_path, chunks=10)
    tier.put(make_prompt(10).chunks())
    tier.close()
    small = new_tier(tmp_path, chunks=4)
    assert small.stats()["used_bytes"] == sum(segments_on_disk(tmp_path).values()) <= 4 * FRAME
    assert small.stats()["chunks"] == 4
    small.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "zeroed", "other-layout", "other-key", "junk"])
def test_damaged_frames_are_misses_never_data(tmp_path, damage):
    """One frame of a segment damaged: it is a miss and its record is dropped; the frames
    around it in the same segment are still served. ``truncate`` cuts the segment inside
    its last frame (a torn tail)."""
    tier = new_tier(tmp_path)
    p = make_prompt(4)
    tier.put(p.chunks())
    bad = 3 if damage == "truncate" else 1
    path, offset, length = tier.locate(p.keys[bad])
    rng = random.Random(damage)
    with open(path, "r+b") as f:
        f.seek(offset)
        frame = bytearray(f.read(length))
        if damage == "flip":
            for _ in range(3):
                pos = rng.randrange(len(frame))
                frame[pos] ^= 1 << rng.randrange(8)
        elif damage == "truncate":
            f.truncate(offset + rng.randrange(1, length))
        elif damage == "zeroed":  # a write that never reached the disk
            frame = bytearray(length)
        elif damage == "other-layout":
            ns = make_namespace(layout=KVLayout(2, 1, 64, "float16"))  # same bytes per chunk, other shape
            frame = bytearray(codec.encode(make_prompt(1, namespace=ns).chunks()[0]))
        elif damage == "other-key":
            _, other, _ = tier.locate(p.keys[2])
            f.seek(other)
            frame = bytearray(f.read(length))
        else:
            frame = bytearray(os.urandom(length))
        if damage != "truncate":
            f.seek(offset)
            f.write(bytes(frame))
    got = tier.get(p.keys)
    try:
        for i, chunk in enumerate(got):
            if i == bad:
                if chunk is not None:  # a lazily verified chunk must refuse to be read
                    with pytest.raises(IntegrityError):
                        chunk.copy_to(np.empty_like(chunk.data))
            else:
                assert chunk.tobytes() == p.chunk_bytes(i)
    finally:
        release_all(got)
    assert tier.locate(p.keys[bad]) is None
    assert tier.contains(p.keys) == bad
    assert tier.stats()["corrupt"] == 1
    assert tier.stats()["used_bytes"] <= 4 * FRAME
    tier.close()


def test_a_full_disk_is_a_dropped_write_not_a_crash(tmp_path, monkeypatch):
    tier = new_tier(tmp_path)
    p = make_prompt(3)

    tier.put(make_prompt(2, seed=5).chunks())

    def no_space(fd, buffers, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwritev", no_space)  # fault injection: every write hits ENOSPC
    with pytest.raises(TierError):
        tier.put(p.chunks())
    monkeypatch.undo()
    assert tier.contains(p.keys) == 0
    assert tier.stats()["write_errors"] == 3
    assert list((tmp_path / "tmp").iterdir()) == []  # no temporary left behind
    assert sum(segments_on_disk(tmp_path).values()) == tier.stats()["used_bytes"] == 2 * FRAME  # nothing half-written
    tier.put(p.chunks())  # space is back
    assert tier.contains(p.keys) == 3
    tier.close()


def test_context_is_optional_and_chunks_of_any_layout_share_a_directory(tmp_path):
    tier = open_tier(f"file://{tmp_path}?size=1MiB", TierContext(chunk_bytes=CHUNK_BYTES))
    a = make_prompt(2)
    b = make_prompt(2, namespace=make_namespace(layout=SMALL.with_dtype("float32")))
    tier.put(a.chunks())
    tier.put(b.chunks())
    assert [c.layout for c in tier.get(a.keys + b.keys)] == [SMALL] * 2 + [SMALL.with_dtype("float32")] * 2
    tier.close()
    shutil.rmtree(tmp_path / "segments")


@pytest.mark.parametrize("tier_url", ["cpu://?size=4MiB&slot=16KiB", "file://{dir}?size=4MiB"])
def test_keys_lists_a_prefix_most_recent_first(tmp_path, tier_url):
    tier = open_tier(tier_url.format(dir=tmp_path / "disk"))
    try:
        chunks = make_prompt(6, seed=3).chunks()
        tags = [b"\x00" * 8, b"\x7f" + b"\xff" * 7, b"\xff" * 8]  # the last has no upper bound
        for i, chunk in enumerate(chunks):
            tier.put([chunk.view_as(tags[i % 3] + chunk.key)])
            time.sleep(0.002)  # distinct recency
        for t, tag in enumerate(tags):
            want = [tag + c.key for i, c in enumerate(chunks) if i % 3 == t][::-1]
            assert tier.keys(tag) == want
            assert tier.keys(tag, limit=1) == want[:1]
        assert len(tier.keys()) == 6
    finally:
        tier.close()


def test_a_damaged_index_is_moved_aside_and_rebuilt_from_the_files(tmp_path):
    tier = new_tier(tmp_path)
    prompt = make_prompt(4, seed=71)
    tier.put(prompt.chunks())
    tier.close()
    for suffix in ("-wal", "-shm"):
        (tmp_path / f"index.sqlite{suffix}").unlink(missing_ok=True)
    (tmp_path / "index.sqlite").write_bytes(b"not a database, whatever it was" * 100)
    again = new_tier(tmp_path)
    assert again.contains(prompt.keys) == 4
    got = again.get(prompt.keys)
    assert [c.tobytes() for c in got] == [c.tobytes() for c in prompt.chunks()]
    release_all(got)
    assert again.stats()["used_bytes"] == sum(segments_on_disk(tmp_path).values())
    assert (tmp_path / "index.sqlite.damaged").exists()
    again.close()


# -- the segment layout ---------------------------------------------------------------------
def test_a_batch_is_one_sequential_append_and_comes_back_in_one_read(tmp_path, monkeypatch):
    """A put of 8 chunks: one pwritev, the frames back to back in batch order in one
    segment, each at a 4 KiB boundary and padded with zeros; a get of them: one preadv."""
    tier = new_tier(tmp_path)
    p = make_prompt(8, seed=11)
    calls: dict[str, list[tuple[int, int]]] = {"pwritev": [], "preadv": []}
    for name in calls:
        real = getattr(os, name)

        def spy(fd, buffers, offset, *rest, name=name, real=real):
            calls[name].append((offset, sum(memoryview(b).nbytes for b in buffers)))
            return real(fd, buffers, offset, *rest)

        monkeypatch.setattr(os, name, spy)
    tier.put(p.chunks())
    got = tier.get(p.keys)
    monkeypatch.undo()
    assert [c.tobytes() for c in got] == [p.chunk_bytes(i) for i in range(8)]
    release_all(got)
    assert calls == {"pwritev": [(0, 8 * FRAME)], "preadv": [(0, 8 * FRAME)]}
    (segment,) = (tmp_path / "segments").iterdir()
    data = segment.read_bytes()
    assert len(data) == 8 * FRAME
    for i, key in enumerate(p.keys):
        path, offset, length = tier.locate(key)
        assert (path, offset) == (str(segment), i * FRAME)
        assert codec.decode(data[offset : offset + length], key=key).tobytes() == p.chunk_bytes(i)
        assert not any(data[offset + length : offset + FRAME])
    tier.close()


def test_a_small_tier_cuts_batches_into_segments_and_never_splits_one(tmp_path):
    """A segment takes batches until the next would take it past ``segment``; a batch
    larger than that gets a segment of its own, whole."""
    tier = new_tier(tmp_path, chunks=64, segment=4 * FRAME)
    prompts = [make_prompt(n, seed=20 + i) for i, n in enumerate((1, 2, 6, 1))]
    for p in prompts:
        tier.put(p.chunks())
    where = [{tier.locate(k)[0] for k in p.keys} for p in prompts]
    assert all(len(w) == 1 for w in where)  # each batch in one segment
    assert where[0] == where[1] != where[2] != where[3]
    assert sorted(segments_on_disk(tmp_path).values()) == [FRAME, 3 * FRAME, 6 * FRAME]
    assert tier.stats()["segments"] == 3
    tier.close()


def test_compaction_copies_a_prompts_hot_head_forward_and_keeps_the_bound(tmp_path):
    """A prompt whose head keeps being read while its tail goes cold: the tail is evicted,
    and the head, alone in a half-dead segment, is copied forward when the space is
    needed. The bound holds after every put; what is served verifies."""
    tier = new_tier(tmp_path, chunks=16)
    a = make_prompt(4, seed=30)
    tier.put(a.chunks())
    first = tier.locate(a.keys[0])[0]
    for s in range(40):
        tier.put(make_prompt(2, seed=100 + s).chunks())
        got = tier.get(a.keys[:2])  # the head is hot
        assert [c.tobytes() for c in got] == [a.chunk_bytes(0), a.chunk_bytes(1)]
        release_all(got)
        stats = tier.stats()
        assert stats["used_bytes"] == sum(segments_on_disk(tmp_path).values()) <= stats["capacity_bytes"]
    assert tier.contains(a.keys) == 2  # the head stayed, the tail went
    assert tier.locate(a.keys[0])[0] != first  # its segment was reclaimed around it
    assert tier.stats()["compacted_bytes"] >= 2 * FRAME
    assert tier.contains(make_prompt(2, seed=139).keys) == 2  # the newest prompt is whole
    tier.close()


@pytest.mark.parametrize("bad", [0, 1])
def test_a_chunk_damaged_in_memory_leaves_zeros_that_a_rebuild_steps_over(tmp_path, bad):
    """The batch's place is taken before it is encoded: a chunk that fails verification
    leaves its place zeroed, the chunks after it are stored, and a rebuild of a lost
    index steps over the zeros to find them."""
    tier = new_tier(tmp_path)
    p = make_prompt(4, seed=12)
    chunks = p.chunks()
    good = chunks[bad]
    chunks[bad] = Chunk(good.key, good.layout, good.data.copy(), namespace=good.namespace,
                        checksum=good.compute_checksum() ^ 1, verified=False)  # fmt: skip
    tier.put(chunks)
    held = [i != bad for i in range(4)]
    assert [tier.has(k) for k in p.keys] == held
    assert tier.stats()["corrupt"] == 1
    assert tier.stats()["used_bytes"] == sum(segments_on_disk(tmp_path).values()) == 4 * FRAME
    tier.close()
    for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
        (tmp_path / name).unlink(missing_ok=True)
    again = new_tier(tmp_path)
    assert [again.has(k) for k in p.keys] == held
    got = again.get([k for i, k in enumerate(p.keys) if held[i]])
    assert [c.tobytes() for c in got] == [p.chunk_bytes(i) for i in range(4) if held[i]]
    release_all(got)
    again.close()


def test_tenants_sharing_the_tier_keep_their_shares_whatever_the_batches_mix(tmp_path):
    """Keys that begin with a tenant's tag (the cache server's): a tenant within its share
    keeps its chunks while another floods the tier, and a batch that mixes tenants (what
    a write-back demotion hands down) is held to each tenant's share, not the first's."""
    frame = round_up(len(codec.encode(make_prompt(1, seed=1).chunks()[0])))
    tier = DiskTier(tmp_path / "d", size=64 * frame, context=TierContext(tenant_prefix=1))

    def tagged(tag: bytes, prompt) -> list[Chunk]:
        return [c.view_as(tag + k) for c, k in zip(prompt.chunks(), prompt.keys, strict=True)]

    alice = tagged(b"a", make_prompt(20, seed=2))
    tier.put(alice)
    for i in range(6):  # Bob over his share, in batches mixed with one more of Alice's
        tier.put([*tagged(b"b", make_prompt(24, seed=10 + i)), *tagged(b"a", make_prompt(1, seed=40 + i))])
    assert tier.contains([c.key for c in alice]) == 20
    usage = tier.index.usage()
    assert usage <= tier.capacity
    bob = len(tier.keys(b"b"))
    assert 28 <= bob <= 40  # his share and what Alice leaves free, never her chunks
    tier.close()


def test_a_size_its_filesystem_cannot_hold_is_said_at_open(tmp_path, caplog):
    """README's example asks for 100 GiB: on a smaller disk it was taken in silence, to fail
    later as writes that miss."""
    with caplog.at_level(logging.WARNING, logger="lmtier.tiers.disk.tier"):
        tier = open_tier(f"file://{tmp_path}/big?size=1024TiB")
        tier.close()
        small = open_tier(f"file://{tmp_path}/small?size=1MiB")
        small.close()
    said = [r.getMessage() for r in caplog.records if "more than its filesystem can give it" in r.getMessage()]
    assert len(said) == 1 and "big" in said[0] and "1 PiB" in said[0]  # 1024 TiB, as printed

"""The disk tier: the contract, options, persistence, damage, a full disk, the index
(processes sharing a directory and crashes: test_disk_shared.py)."""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from lmtier import codec
from lmtier.chunk import release_all
from lmtier.errors import ConfigError, IntegrityError, TierError
from lmtier.layout import KVLayout
from lmtier.tiers.base import TierContext, open_tier
from lmtier.tiers.disk import DiskTier

from conftest import SMALL, make_namespace, make_prompt
from tier_contract import CHUNK_BYTES, EvictingTierContract

ROOT = Path(__file__).resolve().parents[1]
# A frame is the chunk plus its preamble and header.


FRAME = codec.encoded_size(make_prompt(1).chunks()[0])


def frame_size(chunk_bytes: int) -> int:
    return chunk_bytes + FRAME - CHUNK_BYTES


class TestDiskTier(EvictingTierContract):
    o_direct = "auto"

    @pytest.fixture(autouse=True)
    def _directory(self, tmp_path):
        self.dirs = iter(tmp_path / f"d{i}" for i in range(100))

    def make_tier(self, capacity_chunks, chunk_bytes):
        url = f"file://{next(self.dirs)}?size={capacity_chunks * frame_size(chunk_bytes)}&o_direct={self.o_direct}"
        return open_tier(url)

    def corrupt(self, tier, key):
        path = tier.files.path(key)
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 100)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))


class TestDiskTierBuffered(TestDiskTier):
    """The same contract through the page cache (filesystems without O_DIRECT)."""

    o_direct = "false"


def new_tier(path, chunks: int = 64, **options) -> DiskTier:
    return DiskTier(path, size=chunks * FRAME, **options)


def files_on_disk(root: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (root / "chunks").glob("*/*")}


def test_url_options_are_typed_and_checked(tmp_path):
    tier = open_tier(f"file://{tmp_path}/t?size=1MiB&o_direct=false&fsync=true&threads=2&name=nvme")
    settings = (tier.capacity, tier.o_direct, tier.files.fsync, tier.threads, tier.name)
    assert settings == (1 << 20, False, True, 2, "nvme")
    tier.close()
    with pytest.raises(ConfigError, match="needs a size"):
        open_tier(f"file://{tmp_path}/t")
    with pytest.raises(ConfigError, match="absolute path"):
        open_tier("file://relative/path?size=1MiB")
    with pytest.raises(ConfigError, match="unknown option"):
        open_tier(f"file://{tmp_path}/t?size=1MiB&odirect=1")


def test_file_names_are_the_hex_key_and_nothing_else(tmp_path):
    tier = new_tier(tmp_path)
    p = make_prompt(1)
    chunk = p.chunks()[0]
    chunk.key = b"../../../etc/passwd\x00"
    tier.put([chunk])
    (path,) = (tmp_path / "chunks").glob("*/*")
    assert path.name == chunk.key.hex() + ".lmt"
    assert path.parent.parent == tmp_path / "chunks"
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
    assert again.stats()["used_bytes"] == sum(files_on_disk(tmp_path).values()) == 12 * FRAME
    again.close()


def test_reopening_with_a_smaller_size_evicts_down_to_it(tmp_path):
    tier = new_tier(tmp_path, chunks=10)
    tier.put(make_prompt(10).chunks())
    tier.close()
    small = new_tier(tmp_path, chunks=4)
    assert small.stats()["used_bytes"] <= 4 * FRAME
    assert small.stats()["chunks"] == len(files_on_disk(tmp_path)) == 4
    small.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "other-layout", "other-key", "junk"])
def test_damaged_files_are_misses_never_data(tmp_path, damage):
    tier = new_tier(tmp_path)
    p = make_prompt(4)
    tier.put(p.chunks())
    path = Path(tier.files.path(p.keys[1]))
    data = bytearray(path.read_bytes())
    rng = random.Random(damage)
    if damage == "flip":
        for _ in range(3):
            pos = rng.randrange(len(data))
            data[pos] ^= 1 << rng.randrange(8)
    elif damage == "truncate":
        data = data[: rng.randrange(1, len(data))]
    elif damage == "empty":
        data = bytearray()
    elif damage == "other-layout":
        ns = make_namespace(layout=KVLayout(2, 1, 64, "float16"))  # same bytes per chunk, other shape
        data = bytearray(codec.encode(make_prompt(1, namespace=ns).chunks()[0]))
    elif damage == "other-key":
        data = bytearray(Path(tier.files.path(p.keys[2])).read_bytes())
    else:
        data = bytearray(os.urandom(len(data)))
    path.write_bytes(bytes(data))
    got = tier.get(p.keys)
    try:
        for i, chunk in enumerate(got):
            if i == 1:
                if chunk is not None:  # a lazily verified chunk must refuse to be read
                    with pytest.raises(IntegrityError):
                        chunk.copy_to(np.empty_like(chunk.data))
            else:
                assert chunk.tobytes() == p.chunk_bytes(i)
    finally:
        release_all(got)
    assert not path.exists()
    assert tier.contains(p.keys) == 1
    assert tier.stats()["corrupt"] == 1
    assert tier.stats()["used_bytes"] == sum(files_on_disk(tmp_path).values())
    tier.close()


def test_a_full_disk_is_a_dropped_write_not_a_crash(tmp_path, monkeypatch):
    tier = new_tier(tmp_path)
    p = make_prompt(3)

    def no_space(fd, buffers):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "writev", no_space)  # fault injection: every write hits ENOSPC
    with pytest.raises(TierError):
        tier.put(p.chunks())
    monkeypatch.undo()
    assert tier.contains(p.keys) == 0
    assert tier.stats()["write_errors"] == 3
    assert list((tmp_path / "tmp").iterdir()) == []  # no temporary left behind
    tier.put(p.chunks())  # space is back
    assert tier.contains(p.keys) == 3
    tier.close()


def test_files_that_are_not_chunks_are_removed_and_never_counted(tmp_path):
    new_tier(tmp_path).close()
    (tmp_path / "chunks" / "00" / "notes.txt").write_text("hello")
    tier = new_tier(tmp_path)
    assert files_on_disk(tmp_path) == {}
    assert tier.stats()["used_bytes"] == 0
    tier.close()


def test_context_is_optional_and_chunks_of_any_layout_share_a_directory(tmp_path):
    tier = open_tier(f"file://{tmp_path}?size=1MiB", TierContext(chunk_bytes=CHUNK_BYTES))
    a = make_prompt(2)
    b = make_prompt(2, namespace=make_namespace(layout=SMALL.with_dtype("float32")))
    tier.put(a.chunks())
    tier.put(b.chunks())
    assert [c.layout for c in tier.get(a.keys + b.keys)] == [SMALL] * 2 + [SMALL.with_dtype("float32")] * 2
    tier.close()
    shutil.rmtree(tmp_path / "chunks")


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
    assert again.stats()["used_bytes"] == sum(files_on_disk(tmp_path).values())
    assert (tmp_path / "index.sqlite.damaged").exists()
    again.close()

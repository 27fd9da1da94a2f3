"""The disk tier's frames on a page (O_DIRECT from where a chunk lies), the directories it
may take as its own, and its bound while a put runs."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from lmtier.buffers import ALIGN, BufferPool
from lmtier.errors import ConfigError, IntegrityError
from lmtier.kv import codec
from lmtier.kv.chunk import Chunk, release_all
from lmtier.kv.layout import KVLayout
from lmtier.tiers.disk import DiskTier

from conftest import make_prompt
from test_disk_tier import FRAME, new_tier, segments_on_disk
from tier_contract import CHUNK_BYTES


def _in_page_aligned_memory(chunk: Chunk, *, offset: int = 0) -> Chunk:
    """A copy of ``chunk`` in page-aligned memory (as a memory tier's slot holds it), or
    ``offset`` bytes past a page boundary."""
    buf = BufferPool().acquire(chunk.nbytes + offset)
    data = np.frombuffer(buf, dtype=np.uint8, count=chunk.nbytes, offset=offset).reshape(chunk.data.shape)
    data[...] = chunk.data
    return Chunk(chunk.key, chunk.layout, data, namespace=chunk.namespace, checksum=chunk.compute_checksum(),
                 verified=False)  # fmt: skip


def test_payloads_start_on_a_page_of_the_segment(tmp_path):
    """Every frame's payload begins at a page boundary of its segment: O_DIRECT can write
    it from where it lies, and a read leaves it page-aligned in its buffer."""
    tier = new_tier(tmp_path)
    p = make_prompt(3, seed=21)
    tier.put(p.chunks())
    got = tier.get(p.keys)
    for i, chunk in enumerate(got):
        assert chunk.data.ctypes.data % ALIGN == 0
        assert chunk.tobytes() == p.chunk_bytes(i)
    release_all(got)
    for path in (tmp_path / "segments").iterdir():
        frames, _ = tier.files.scan(str(path), 0, verify=True)
        raw = path.read_bytes()
        for _, offset, length in frames:
            payload = length - CHUNK_BYTES
            assert payload % ALIGN == 0 and codec.decode(raw[offset : offset + length]).nbytes == CHUNK_BYTES
    tier.close()


def test_o_direct_writes_a_page_aligned_chunk_where_it_lies(tmp_path):
    """With O_DIRECT, a chunk in page-aligned memory (a memory tier's slot) goes to the disk
    from its own memory: only the page of preamble and header is copied. A chunk elsewhere
    is copied into an aligned buffer. Both read back, verified; a damaged one is refused."""
    tier = new_tier(tmp_path, o_direct=True)
    p = make_prompt(3, seed=22)
    aligned, unaligned = _in_page_aligned_memory(p.chunks()[0]), _in_page_aligned_memory(p.chunks()[1], offset=64)
    frame = tier.files.frames(aligned)
    assert frame.buffer is None and len(frame.parts) == 2
    assert np.shares_memory(frame.parts[1], aligned.data) and frame.parts[0].ctypes.data % ALIGN == 0
    copied = tier.files.frames(unaligned)
    assert copied.buffer is not None and not np.shares_memory(np.frombuffer(copied.buffer, np.uint8), unaligned.data)
    tier.files.release([frame, copied])
    damaged = _in_page_aligned_memory(p.chunks()[2])
    damaged.data[0, 0, 0, 0] ^= 1
    with pytest.raises(IntegrityError):
        tier.files.frames(damaged)
    tier.put([aligned, unaligned, damaged])
    assert [tier.has(k) for k in p.keys] == [True, True, False]
    assert tier.stats()["corrupt"] == 1
    got = tier.get(p.keys[:2])
    assert [c.tobytes() for c in got] == [p.chunk_bytes(0), p.chunk_bytes(1)]
    release_all(got)
    tier.close()


# -- what the tier may touch, and how far its files may grow -------------------------------
def test_a_directory_the_tier_did_not_make_is_refused_and_left_as_it_was(tmp_path):
    """A path to someone's project (a mistyped URL) that happens to hold ``tmp/``,
    ``segments/`` or ``chunks/`` is refused with a clear error: nothing in it is removed."""
    theirs = {"tmp/build.o": b"o", "segments/intro.txt": b"t", "chunks/readme.md": b"r", "chunks/part1/notes.txt": b"n"}
    for name, data in theirs.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
        os.utime(tmp_path / name, (0, 0))  # old: what a crashed writer's temporary would look like
    with pytest.raises(ConfigError, match="did not write"):
        DiskTier(tmp_path, size=64 * FRAME)
    assert {name: (tmp_path / name).read_bytes() for name in theirs} == theirs
    assert not (tmp_path / "index.sqlite").exists()


@pytest.mark.parametrize("sub", ["segments", "tmp", "chunks"])
def test_a_symlinked_subdirectory_is_refused_never_followed(tmp_path, sub):
    """Whoever can write the cache directory cannot point the tier's clean-up elsewhere."""
    root, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    new_tier(root).close()
    elsewhere.mkdir()
    (elsewhere / "report.txt").write_text("keep")
    os.utime(elsewhere / "report.txt", (0, 0))
    shutil.rmtree(root / sub, ignore_errors=True)
    (root / sub).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ConfigError, match="symlink"):
        new_tier(root)
    assert (elsewhere / "report.txt").read_text() == "keep"


def test_a_stranger_in_the_tiers_own_directories_is_left_and_the_tier_works(tmp_path):
    new_tier(tmp_path).close()
    stranger = tmp_path / "segments" / "notes.txt"
    stranger.write_text("someone's")
    tier = new_tier(tmp_path)
    p = make_prompt(2, seed=23)
    tier.put(p.chunks())
    got = tier.get(p.keys)
    assert [c.tobytes() for c in got] == [p.chunk_bytes(0), p.chunk_bytes(1)]
    release_all(got)
    tier.close()
    assert stranger.read_text() == "someone's"


def test_files_that_are_not_segments_are_left_alone_and_never_counted(tmp_path):
    """A file the tier did not write is never removed (not even in its own directories): it
    is ignored. A file with a segment's name and no frame in it is the tier's: reclaimed."""
    new_tier(tmp_path).close()
    segments = tmp_path / "segments"
    (segments / "notes.txt").write_text("hello")
    (segments / "1-0123456789ab-0.seg").write_bytes(b"a segment's name, not its bytes" * 300)
    (segments / "link.seg").symlink_to(tmp_path / "elsewhere.txt")
    (tmp_path / "elsewhere.txt").write_text("not to be touched")
    (tmp_path / "tmp" / "my-notes.txt").write_text("mine")
    old = time.time() - 3600  # older than any temporary of a live writer
    os.utime(tmp_path / "tmp" / "my-notes.txt", (old, old))
    tier = new_tier(tmp_path)
    assert segments_on_disk(tmp_path) == {"notes.txt": 5, "link.seg": 17}
    assert (tmp_path / "elsewhere.txt").read_text() == "not to be touched"
    assert (tmp_path / "tmp" / "my-notes.txt").read_text() == "mine"
    assert tier.stats()["used_bytes"] == 0
    tier.close()


def test_a_project_directory_is_refused_and_never_written_into(tmp_path):
    """A path to a project (no index, files of its own at the top) is refused: nothing of
    the tier's is written there."""
    (tmp_path / "README.md").write_text("a project")
    (tmp_path / "src").mkdir()
    with pytest.raises(ConfigError, match=r"did not write.*README\.md"):
        DiskTier(tmp_path, size=64 * FRAME)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "src"]


def test_another_applications_database_named_like_the_index_is_refused_and_left_as_it_was(tmp_path):
    import sqlite3

    db = sqlite3.connect(tmp_path / "index.sqlite")
    db.execute("CREATE TABLE users (name TEXT)")
    db.execute("INSERT INTO users VALUES ('alice')")
    db.commit()
    db.close()
    (tmp_path / "segments").mkdir()
    (tmp_path / "segments" / "data.bin").write_bytes(b"theirs")
    before = (tmp_path / "index.sqlite").read_bytes()
    with pytest.raises(ConfigError, match=r"not a disk tier's index.*users"):
        DiskTier(tmp_path, size=64 * FRAME)
    assert (tmp_path / "index.sqlite").read_bytes() == before
    assert (tmp_path / "segments" / "data.bin").read_bytes() == b"theirs"


def test_a_damaged_index_in_the_tiers_own_directory_is_rebuilt_from_its_segments(tmp_path):
    tier = new_tier(tmp_path)
    p = make_prompt(3, seed=24)
    tier.put(p.chunks())
    tier.close()
    (tmp_path / "index.sqlite").write_bytes(b"not a database any more" * 100)
    for suffix in ("-wal", "-shm"):
        (tmp_path / f"index.sqlite{suffix}").unlink(missing_ok=True)
    tier = new_tier(tmp_path)  # nothing but the tier's own files here: it is the tier's
    assert tier.contains(p.keys) == 3
    tier.close()
    (tmp_path / "index.sqlite").write_bytes(b"garbage" * 100)
    (tmp_path / "thesis.tex").write_text("mine")  # ... but not with a stranger beside it
    with pytest.raises(ConfigError, match="did not write"):
        new_tier(tmp_path)


def test_a_batch_larger_than_the_room_is_cut_before_it_is_written(tmp_path, monkeypatch):
    """The segment files never outgrow ``size``, even while a put runs: a batch is cut to
    what can fit before anything is written (a prefix of it is stored), and room is made
    before the write, not after."""
    from lmtier.tiers.disk import files

    capacity = 6 * FRAME
    tier = new_tier(tmp_path, chunks=6)
    peak = [0]
    real = files._pwritev_all

    def measured(fd, views, offset):
        real(fd, views, offset)
        peak[0] = max(peak[0], sum(segments_on_disk(tmp_path).values()))

    monkeypatch.setattr(files, "_pwritev_all", measured)
    first, second = make_prompt(4, seed=24), make_prompt(40, seed=25)
    tier.put(first.chunks())
    tier.put(second.chunks())
    assert 0 < peak[0] <= capacity
    assert [tier.has(k) for k in second.keys] == [True] * 6 + [False] * 34  # a prefix, as much as fits
    assert tier.stats()["dropped"] == 34
    got = tier.get(second.keys[:6])
    assert [c.tobytes() for c in got] == [second.chunk_bytes(i) for i in range(6)]
    release_all(got)
    tier.close()


def test_a_frame_larger_than_the_tier_is_never_adopted(tmp_path):
    """A crafted segment whose header claims a payload larger than the tier (a sparse file
    of 16 MiB here) is not adopted: reading it would allocate its whole length."""
    layout = KVLayout(64, 8, 128, "bfloat16")
    data = np.zeros(layout.byte_shape(64), dtype=np.uint8)
    big = Chunk(b"k" * 16, layout, data, namespace=b"n" * 16)
    head = bytes(codec.encode_parts(big, align=ALIGN)[0])
    (tmp_path / "segments").mkdir()
    segment = tmp_path / "segments" / "1-0123456789ab-0.seg"
    with open(segment, "wb") as f:
        f.write(head)
        f.truncate(len(head) + big.nbytes)  # the payload: a hole
    tier = DiskTier(tmp_path, size=4 << 20)
    assert not tier.has(big.key) and tier.stats()["chunks"] == 0
    tier.close()


def write_old_layout(root: Path, chunks, atimes: list[int]) -> None:
    """A directory as lmtier wrote it before segments: chunks/<byte>/<hex key>.lmt, one
    frame per file, and an index of (key, size, atime)."""
    import sqlite3

    db = sqlite3.connect(root / "index.sqlite")
    db.executescript(
        "CREATE TABLE chunks (key BLOB PRIMARY KEY, size INTEGER NOT NULL, atime INTEGER NOT NULL) WITHOUT ROWID;"
        "CREATE INDEX chunks_by_atime ON chunks (atime);"
        "CREATE TABLE meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);"
    )
    for chunk, atime in zip(chunks, atimes, strict=True):
        frame = codec.encode(chunk)
        path = root / "chunks" / chunk.key.hex()[:2] / f"{chunk.key.hex()}.lmt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(frame)
        db.execute("INSERT INTO chunks VALUES (?, ?, ?)", (chunk.key, len(frame), atime))
    db.execute("INSERT INTO meta VALUES ('usage', ?)", (sum(len(codec.encode(c)) for c in chunks),))
    db.commit()
    db.close()


def test_a_directory_of_the_one_file_per_chunk_layout_is_adopted(tmp_path):
    """Each old chunk file becomes a one-frame segment (a rename: nothing copied), with
    the recency the old index gave it; a stranger stays where it was (with its directory,
    nothing else); a damaged old file is a miss."""
    p = make_prompt(5, seed=3)
    write_old_layout(tmp_path, p.chunks(), atimes=[1000 - i for i in range(5)])
    (tmp_path / "chunks" / "00").mkdir(exist_ok=True)
    (tmp_path / "chunks" / "00" / "notes.txt").write_text("not a chunk")
    with open(tmp_path / "chunks" / p.keys[4].hex()[:2] / f"{p.keys[4].hex()}.lmt", "r+b") as f:
        f.seek(-30, os.SEEK_END)
        f.write(b"rot")
    tier = new_tier(tmp_path)
    left = sorted(str(f.relative_to(tmp_path)) for f in (tmp_path / "chunks").rglob("*"))
    assert left == ["chunks/00", "chunks/00/notes.txt"]
    assert tier.keys() == p.keys  # most recent first, as the old index had it
    got = tier.get(p.keys)
    assert [c.tobytes() for c in got[:4]] == [p.chunk_bytes(i) for i in range(4)]
    assert got[4] is None
    release_all(got)
    assert tier.contains(p.keys) == 4
    assert tier.stats()["used_bytes"] == sum(segments_on_disk(tmp_path).values()) == 4 * FRAME
    tier.close()
    again = new_tier(tmp_path, chunks=6)  # reopened smaller: the adopted segments evict as any other
    assert again.contains(p.keys) == 4
    again.put(make_prompt(4, seed=4).chunks())
    assert again.contains(p.keys) == 2
    assert again.stats()["used_bytes"] <= 6 * FRAME
    again.close()

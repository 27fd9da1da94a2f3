"""The disk tier shared: several tiers, processes and containers on one directory, writers
killed at random moments, a read beside another process's write lock."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from lmtier.kv import codec
from lmtier.kv.chunk import release_all
from lmtier.tiers.disk import DiskTier

from conftest import make_prompt
from test_disk_tier import FRAME, new_tier, segments_on_disk


def test_a_second_tier_and_a_second_process_see_the_first_ones_chunks(tmp_path):
    tier = new_tier(tmp_path)
    p = make_prompt(6)
    tier.put(p.chunks())
    tier.close()
    again = new_tier(tmp_path)
    assert again.contains(p.keys) == 6
    assert again.stats()["used_bytes"] == sum(segments_on_disk(tmp_path).values())
    again.close()
    script = textwrap.dedent(f"""
        import json, sys
        from lmtier.tiers.disk import DiskTier
        tier = DiskTier({str(tmp_path)!r}, size={64 * FRAME})
        keys = [bytes.fromhex(k) for k in json.loads(sys.argv[1])]
        print(json.dumps([c.tobytes().hex() for c in tier.get(keys)]))
    """)
    run = subprocess.run(
        [sys.executable, "-c", script, json.dumps([k.hex() for k in p.keys])],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(run.stdout) == [p.chunk_bytes(i).hex() for i in range(6)]


WRITER = textwrap.dedent("""
    import sys, numpy as np
    from lmtier.kv.chunk import Chunk
    from lmtier.kv.layout import KVLayout
    from lmtier.tiers.disk import DiskTier
    path, size, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    layout = KVLayout(2, 2, 32, "float16")
    tier = DiskTier(path, size=size, threads=2)
    rng = np.random.default_rng(seed)
    print("ready", flush=True)
    for step in range(100000):
        batch = []
        for _ in range(int(rng.integers(1, 6))):
            data = rng.integers(0, 256, layout.byte_shape(16), dtype=np.uint8)
            batch.append(Chunk(rng.bytes(16), layout, data, namespace=b"crash"))
        tier.put(batch)
        if step % 3 == 0:  # read back our own chunks and, through the listing, anyone's
            keys = [c.key for c in batch] + tier.keys(limit=8)
            for chunk in tier.get(keys):
                if chunk is not None:
                    chunk.tobytes()  # raises if the bytes do not verify
                    chunk.release()
""")


def check_directory(path: Path, size: int) -> int:
    """Open afresh: every chunk verifies, nothing partial is visible, accounting matches."""
    tier = DiskTier(path, size=size)
    assert tier.stats()["used_bytes"] == sum(segments_on_disk(path).values()) <= size
    keys = tier.keys()
    assert tier.stats()["chunks"] == len(keys)
    for chunk in tier.get(keys):
        assert chunk is not None  # recorded frames are complete: none is damaged
        chunk.tobytes()  # verifies
        chunk.release()
    assert tier.stats()["corrupt"] == 0
    tier.close()
    return len(keys)


def test_writers_killed_at_random_moments_leave_a_consistent_directory(tmp_path):
    size = 40 * FRAME  # small: kills land during evictions too
    rng = random.Random(1)
    seen = 0
    for round_ in range(32):
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), str(size), str(round_)], stdout=subprocess.PIPE, text=True
        )
        assert writer.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.25))
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
        seen = max(seen, check_directory(tmp_path, size))
    assert seen > 10  # the writers really wrote


def test_two_processes_sharing_a_directory_stay_consistent_and_bounded(tmp_path):
    size = 30 * FRAME
    script = WRITER.replace("range(100000)", "range(int(sys.argv[4]))")
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path), str(size), str(seed), "400"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    for w in writers:
        assert w.stdout.readline().strip() == "ready"
    for w in writers:
        _, err = w.communicate(timeout=240)
        assert w.returncode == 0, err
    assert check_directory(tmp_path, size) > 10


OPENER = textwrap.dedent("""
    import sys, numpy as np
    from lmtier.kv.chunk import Chunk
    from lmtier.kv.layout import KVLayout
    from lmtier.tiers.disk import DiskTier
    root, me = sys.argv[1], int(sys.argv[2])
    layout = KVLayout(2, 2, 32, "float16")
    print("ready", flush=True)
    for line in sys.stdin:  # one fresh directory per line, opened by every process at once
        tier = DiskTier(f"{root}/{line.strip()}", size=1 << 20, threads=1)
        data = np.full(layout.byte_shape(16), me, dtype=np.uint8)
        tier.put([Chunk(bytes([me]) * 16, layout, data, namespace=b"race")])
        (chunk,) = tier.get([bytes([me]) * 16])
        assert chunk is not None and chunk.tobytes() == data.tobytes()
        chunk.release()
        tier.close()
        print("ok", flush=True)
""")


def test_many_processes_open_one_fresh_directory_at_the_same_instant(tmp_path):
    """Engine ranks, instances and a server start together on a new directory: every one
    of them opens it, every round, and all their chunks are there afterwards."""
    processes, rounds = 8, 20
    openers = [
        subprocess.Popen(
            [sys.executable, "-c", OPENER, str(tmp_path), str(i)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]
    try:
        for p in openers:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
        for r in range(rounds):
            for p in openers:  # as close to one instant as the pipes allow
                p.stdin.write(f"round{r}\n")
                p.stdin.flush()
            for p in openers:
                line = p.stdout.readline().strip()
                if line != "ok":
                    p.kill()
                    pytest.fail(f"round {r}: an opener said {line!r}:\n{p.communicate()[1][-3000:]}")
            tier = DiskTier(tmp_path / f"round{r}", size=1 << 20)
            assert tier.contains([bytes([i]) * 16 for i in range(processes)]) == processes
            tier.close()
    finally:
        for p in openers:
            p.stdin.close()
        for p in openers:
            p.wait(timeout=60)
    assert [p.returncode for p in openers] == [0] * processes


def test_dead_writers_temporary_files_are_removed_on_open_and_live_ones_kept(tmp_path):
    """A pid says nothing about a writer in another container: age decides."""
    from lmtier.tiers.disk import STALE_TEMP_S

    new_tier(tmp_path).close()
    stale = tmp_path / "tmp" / "999999999-00000000abcd-1.tmp"  # a writer's temporary, by its name
    stale.write_bytes(b"half a chunk")
    old = time.time() - STALE_TEMP_S - 5
    os.utime(stale, (old, old))
    elsewhere = tmp_path / "tmp" / "999999999-00000000def0-1.tmp"  # a pid dead here, alive elsewhere
    elsewhere.write_bytes(b"being written")
    new_tier(tmp_path).close()
    assert not stale.exists() and elsewhere.exists()


def test_writers_with_the_same_pid_in_two_containers_never_touch_each_others_files(tmp_path):
    """Two PID namespaces on one directory: the same pid, other temporary names."""
    a, b = new_tier(tmp_path), new_tier(tmp_path)
    b.files._nonce_pid = -1  # as if b were another process with a's pid
    assert a.files._nonce() != b.files._nonce()
    first, second = make_prompt(3, seed=61), make_prompt(3, seed=62)
    a.put(first.chunks())
    b.put(second.chunks())
    assert a.contains(first.keys) == 3 and a.contains(second.keys) == 3
    assert list((tmp_path / "tmp").iterdir()) == []
    a.close()
    b.close()


def test_a_read_does_not_wait_for_another_processes_write_lock(tmp_path):
    """Refreshing recency is best effort: a hit is served while another process holds
    the index's write lock (a long eviction, a stalled writer)."""
    import sqlite3

    tier = new_tier(tmp_path)
    prompt = make_prompt(3, seed=72)
    tier.put(prompt.chunks())
    locker = sqlite3.connect(tmp_path / "index.sqlite", isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        got = []
        reader = threading.Thread(target=lambda: got.extend(tier.get(prompt.keys)))
        reader.start()
        reader.join(30)  # a hang detector: without the fix the read waits for the lock (60 s)
        assert not reader.is_alive()
        assert [c.tobytes() for c in got] == [c.tobytes() for c in prompt.chunks()]
        release_all(got)
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    tier.close()


# -- segments: torn tails, eviction under a reader --------------------------------------------
HOLDER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[3])
    from conftest import make_prompt
    from lmtier.tiers.disk import DiskTier
    tier = DiskTier(sys.argv[1], size=int(sys.argv[2]))
    p = make_prompt(6, seed=81)
    tier.put(p.chunks(0, 3))
    tier.put(p.chunks(3, 6))
    print(tier.locate(p.keys[0])[0], flush=True)
    time.sleep(600)  # killed here, holding its open segment
""")


def test_a_torn_tail_after_sigkill_is_cut_off_and_everything_before_it_served(tmp_path):
    """A writer killed while appending: its segment ends in a frame that was written
    whole but never recorded (adopted: it verifies) and one torn mid-payload (cut off)."""
    size = 256 * FRAME  # segments of 16 frames: both batches in one
    writer = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path), str(size), str(Path(__file__).parent)],
        stdout=subprocess.PIPE,
        text=True,
    )
    segment = Path(writer.stdout.readline().strip())
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    assert segment.stat().st_size == 6 * FRAME
    whole, torn = make_prompt(2, seed=82).chunks()
    with open(segment, "ab") as f:
        f.write(codec.encode(whole).ljust(FRAME, b"\0"))  # complete, never recorded
        frame = bytearray(codec.encode(torn))
        frame[len(frame) // 2 :] = bytes(len(frame) - len(frame) // 2)  # the payload's end never landed
        f.write(frame)
    tier = DiskTier(tmp_path, size=size)
    p = make_prompt(6, seed=81)
    got = tier.get([*p.keys, whole.key, torn.key])
    assert [c.tobytes() for c in got[:7]] == [p.chunk_bytes(i) for i in range(6)] + [whole.tobytes()]
    assert got[7] is None
    release_all(got)
    assert segment.stat().st_size == 7 * FRAME  # the torn frame is gone
    assert tier.stats()["used_bytes"] == 7 * FRAME
    assert tier.stats()["corrupt"] == 0  # never recorded, so never read
    tier.close()


EVICTOR = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[3])
    from conftest import make_prompt
    from lmtier.tiers.disk import DiskTier
    tier = DiskTier(sys.argv[1], size=int(sys.argv[2]))
    tier.put(make_prompt(6, seed=92).chunks())  # room for 6: everything older goes
    tier.close()
""")


def test_a_segment_evicted_by_another_process_mid_read_is_read_whole(tmp_path, monkeypatch):
    """Another process evicts the segment a get is reading (after the get opened it):
    the open descriptor still reads the whole, verified frames; afterwards they are gone."""
    from lmtier.tiers.disk import files

    size = 6 * FRAME
    p = make_prompt(4, seed=91)
    writer = DiskTier(tmp_path, size=size)
    writer.put(p.chunks())
    writer.close()  # its segment is sealed: any process may reclaim it
    (segment,) = (tmp_path / "segments").iterdir()
    reader = DiskTier(tmp_path, size=size)
    real = files._preadv_all

    def evict_then_read(fd, views, offset):
        subprocess.run(
            [sys.executable, "-c", EVICTOR, str(tmp_path), str(size), str(Path(__file__).parent)],
            check=True,
            timeout=60,
        )
        assert not segment.exists()  # unlinked while we hold it open
        return real(fd, views, offset)

    monkeypatch.setattr(files, "_preadv_all", evict_then_read)
    got = reader.get(p.keys)
    monkeypatch.undo()
    assert [c.tobytes() for c in got] == [p.chunk_bytes(i) for i in range(4)]
    release_all(got)
    assert reader.contains(p.keys) == 0
    assert reader.contains(make_prompt(6, seed=92).keys) == 6
    assert reader.stats()["used_bytes"] == sum(segments_on_disk(tmp_path).values()) <= size
    reader.close()

"""The store under a save policy (lmtier.store.admission): what reaches the lower tiers, when."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from lmtier.kv.chunk import release_all
from lmtier.store.admission import SavePolicy
from lmtier.store.tiered import TieredStore
from lmtier.tiers.cpu import CpuTier

from conftest import eventually, make_prompt
from tier_contract import CHUNK_BYTES

# These tests are about what eviction and close write: write-back's checkpoint (a timer) is
# off in them, and tested on its own below.
NO_CHECKPOINT = {"writeback_after": 0}


def cpu(chunks: int, name: str) -> CpuTier:
    return CpuTier(size=chunks * CHUNK_BYTES, slot=CHUNK_BYTES, name=name)


def stored(tier: CpuTier) -> int:
    return tier.stats()["stored"]


def test_always_writes_every_chunk_through_at_once():
    hot, low = cpu(4, "hot"), cpu(64, "low")
    store = TieredStore([hot, low], write_mode="auto", policy=SavePolicy("always"))
    p = make_prompt(3)
    store.put(p.chunks())
    assert store.flush()
    assert low.contains(p.keys) == 3
    assert store.stats()["write_mode"] == "through"
    store.close()


def test_reuse_keeps_new_chunks_in_memory_until_it_lets_them_go_and_flushes_them_at_close():
    hot, low = cpu(16, "hot"), cpu(64, "low")
    store = TieredStore([hot, low], write_mode="auto", policy=SavePolicy("reuse", keys=64), **NO_CHECKPOINT)
    p = make_prompt(3)
    store.put(p.chunks())
    assert store.flush()
    assert low.contains(p.keys) == 0  # memory holds them: nothing written yet
    assert store.stats()["write_mode"] == "back"
    store.close()
    assert stored(low) == 3  # closing wrote what only memory held


def test_reuse_writes_a_chunk_read_in_memory_when_memory_lets_it_go():
    hot, low = cpu(2, "hot"), cpu(64, "low")
    policy = SavePolicy("reuse", keys=64, min_reuse=1.0)
    store = TieredStore([hot, low], write_mode="auto", policy=policy, **NO_CHECKPOINT)
    read = make_prompt(1, seed=1)
    store.put(read.chunks())
    release_all(store.get(read.keys))  # read while resident: proven
    for s in range(2, 40):  # new chunks push it out
        store.put(make_prompt(1, seed=s).chunks())
    assert store.flush()
    assert low.contains(read.keys) == 1
    assert store.stats()["policy"]["proven"] >= 1
    store.close()


def test_reuse_writes_far_less_than_always_when_nothing_is_reused():
    written = {}
    for name in ("always", "reuse"):
        hot, low = cpu(8, "hot"), cpu(1024, "low")
        store = TieredStore([hot, low], write_mode="auto", policy=SavePolicy(name, keys=64), **NO_CHECKPOINT)
        for s in range(400):  # every prompt new, never asked again
            store.put(make_prompt(1, seed=s).chunks())
            assert store.flush()  # nothing dropped for a full queue
        written[name] = stored(low)
        skipped = store.stats()["policy"]["skipped_chunks"]
        store.close()
    assert written["always"] == 400
    assert written["reuse"] < 400 // 2 and skipped > 0  # it learned that such chunks do not come back


def test_reuse_keeps_writing_new_chunks_while_they_come_back():
    hot, low = cpu(8, "hot"), cpu(1024, "low")
    store = TieredStore([hot, low], write_mode="auto", policy=SavePolicy("reuse", keys=64), **NO_CHECKPOINT)
    prompts = [make_prompt(1, seed=s) for s in range(400)]
    for i, p in enumerate(prompts):
        store.put(p.chunks())
        if i >= 20:  # every prompt is asked again 20 prompts later, after memory let it go
            release_all(store.get(prompts[i - 20].keys))
        assert store.flush()
    assert stored(low) > 300  # the bet pays, so it is kept up
    store.close()


# -- write-back's checkpoint: nothing of memory depends on a graceful stop ---------------------
def test_write_back_writes_memory_down_within_seconds_so_a_process_killed_with_sigkill_loses_nothing_older(tmp_path):
    """A process saves with save_policy=reuse (write-back), then is killed with SIGKILL
    before memory let anything go or closed: what it had held for a few seconds is on the
    disk all the same, every byte as saved."""
    disk = tmp_path / "disk"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import sys, time
            from lmtier.store.tiered import TieredStore
            from conftest import make_namespace, make_prompt
            from tier_contract import CHUNK_BYTES
            store = TieredStore.open(["cpu://?size=" + str(64 * CHUNK_BYTES) + "&slot=" + str(CHUNK_BYTES),
                                      "file://{disk}?size=16MiB"], save_policy="reuse", write_mode="auto")
            assert store.write_back
            for seed in range(6):
                store.put(make_prompt(4, seed=seed).chunks())
            print("saved", flush=True)
            time.sleep(600)  # killed long before
        """),
        ],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "saved"
        prompts = [make_prompt(4, seed=s) for s in range(6)]
        from lmtier.tiers.disk import DiskTier

        reader = DiskTier(disk, size=16 << 20)
        assert eventually(lambda: all(reader.contains(p.keys) == 4 for p in prompts), seconds=60)
        reader.close()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    again = TieredStore.open([f"file://{disk}?size=16MiB"])
    for p in prompts:
        got = again.get(p.keys)
        assert [c.tobytes() for c in got] == [p.chunk_bytes(i) for i in range(4)]
        release_all(got)
    again.close()


def test_a_checkpointed_chunk_is_written_once_and_its_eviction_only_tells_the_policy():
    hot, low = cpu(4, "hot"), cpu(64, "low")
    policy = SavePolicy("reuse", keys=64)
    store = TieredStore([hot, low], write_mode="auto", policy=policy, writeback_after=0.05)
    first = make_prompt(2, seed=1)
    store.put(first.chunks())
    assert eventually(lambda: low.contains(first.keys) == 2)  # written down while memory holds it
    assert store.stats()["checkpointed_chunks"] >= 2
    written = policy.stats()["unproven_written"]
    for s in range(2, 8):  # memory lets the first prompt go
        store.put(make_prompt(2, seed=s).chunks())
    assert store.flush()
    assert hot.contains(first.keys) == 0
    assert all(k in policy.ghost for k in first.keys)  # its let-go counted for the return rate
    assert policy.stats()["unproven_written"] >= written  # later prompts' writes, none twice:
    assert policy.stats()["unproven_written"] + policy.stats()["proven"] <= 2 * 7
    store.close()

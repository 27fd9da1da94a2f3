"""The store under a save policy (lmtier.admission): what reaches the lower tiers, when."""

from __future__ import annotations

from lmtier.admission import SavePolicy
from lmtier.chunk import release_all
from lmtier.store import TieredStore
from lmtier.tiers.cpu import CpuTier

from conftest import make_prompt
from tier_contract import CHUNK_BYTES


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
    store = TieredStore([hot, low], write_mode="auto", policy=SavePolicy("reuse", keys=64))
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
    store = TieredStore([hot, low], write_mode="auto", policy=policy)
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
        store = TieredStore([hot, low], write_mode="auto", policy=SavePolicy(name, keys=64))
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
    store = TieredStore([hot, low], write_mode="auto", policy=SavePolicy("reuse", keys=64))
    prompts = [make_prompt(1, seed=s) for s in range(400)]
    for i, p in enumerate(prompts):
        store.put(p.chunks())
        if i >= 20:  # every prompt is asked again 20 prompts later, after memory let it go
            release_all(store.get(prompts[i - 20].keys))
        assert store.flush()
    assert stored(low) > 300  # the bet pays, so it is kept up
    store.close()

"""The memory tier holds what its size says, whatever the size of the chunks it is sent: a
cache server's tier (which cannot know its clients' chunk size) keeps at least 80% of its
size in KV, and its free slots stay in runs, so that chunks of mixed sizes each lie in one
piece of the slab (one zero-copy view, publishable to same-host readers)."""

from __future__ import annotations

import random

import pytest

from lmtier.kv.chunk import release_all
from lmtier.kv.layout import KVLayout
from lmtier.testing.cache_server import ServerProcess
from lmtier.tiers.base import open_tier
from lmtier.tiers.cpu import CpuTier
from lmtier.tiers.cpu.slab import Slab, is_run
from lmtier.tiers.cpu.tier import MIN_SLOT, default_slot

from conftest import make_namespace, make_prompt

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16")  # 4 KiB per token


def namespace(chunk_bytes: int):
    return make_namespace(LAYOUT, chunk_tokens=chunk_bytes // LAYOUT.chunk_bytes(1), model=f"m{chunk_bytes}")


def test_a_256_mib_server_tier_holds_at_least_400_chunks_of_512_kib(tmp_path):
    """``lmtier serve --tier cpu://?size=256MiB``, sent 512 KiB chunks by a client: 2 MiB
    slots once held 128 of them (64 MiB of KV)."""
    server = ServerProcess(tmp_path, "--tier", "cpu://?size=256MiB", "--shm-dir", "")
    client = open_tier(f"grpc://{server.address}")
    ns = namespace(512 * KiB)
    prompts = [make_prompt(8, seed=s, namespace=ns) for s in range(70)]  # 560 chunks, 280 MiB
    try:
        for p in prompts:
            client.put(p.chunks())
        held = sum(client.contains(p.keys) for p in prompts)
        assert held >= 400, held
        last = prompts[-1]  # what it holds is the KV it was sent
        got = client.get(last.keys)
        assert [c.tobytes() for c in got] == [last.chunk_bytes(i) for i in range(8)]
        release_all(got)
    finally:
        client.close()
        server.stop()


def churn(tier: CpuTier, sizes: list[int], seed: int, prompts: int = 400):
    """Prompts of 1 to 4 chunks of the given sizes, one model per size, three times the
    tier's size over; yields the tier's stats after each put once it has been filled twice."""
    rng = random.Random(seed)
    namespaces = {s: namespace(s) for s in sizes}
    put = 0
    for n in range(prompts):
        prompt = make_prompt(rng.randint(1, 4), seed=n, namespace=namespaces[rng.choice(sizes)])
        tier.put(prompt.chunks())
        put += sum(c.nbytes for c in prompt.chunks())
        if put > 2 * tier.capacity:
            yield prompt, tier.stats()


@pytest.mark.parametrize("seed", [1, 2])
def test_chunks_of_mixed_sizes_fill_at_least_80_percent_and_read_back_right(seed):
    """Clients of several models (chunks of 96 KiB to 2 MiB) through a tier that was told no
    chunk size: once full, at least 80% of it is KV after every put, and what it hands out
    is what was stored (a chunk in no single run of slots is gathered from its runs)."""
    tier = CpuTier(size=64 * MiB)
    assert tier.slot_bytes == MIN_SLOT
    fills = 0
    try:
        for prompt, stats in churn(tier, [96 * KiB, 256 * KiB, 384 * KiB, 512 * KiB, 1 * MiB, 2 * MiB], seed):
            assert stats["kv_bytes"] >= 0.8 * tier.capacity, stats
            fills += 1
            got = tier.get(prompt.keys)
            assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(len(prompt.keys))]
            release_all(got)
        assert tier.slab.available + sum(len(e.slots) for e in tier._index.values()) == tier.num_slots
    finally:
        tier.close()
    assert fills > 100


def test_chunks_of_one_size_each_lie_in_one_run_however_long_the_churn():
    """One model's chunks (six slots each, the slab no multiple of six): every chunk a
    single view of the slab, so every one can be published to same-host readers."""
    tier = CpuTier(size=64 * MiB + 64 * KiB)
    try:
        for _ in churn(tier, [384 * KiB], seed=3):
            pass
        entries = [e for e in tier._index.values() if e.ready]
        assert len(entries) >= 150 and all(is_run(e.slots) for e in entries)
        assert sum(e.nbytes for e in entries) >= 0.95 * tier.capacity
    finally:
        tier.close()


def test_free_runs_coalesce_and_a_chunk_takes_one_run_where_one_is_free():
    slab = Slab(64, 4096, False, "")
    rng = random.Random(7)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and (slab.available < 8 or rng.random() < 0.5):
            slab.give(held.pop(rng.randrange(len(held))))
        else:
            count = rng.randint(1, 8)
            slots = slab.take(count)
            assert len(slots) == count == len(set(slots)) and slots == sorted(slots)
            held.append(slots)
        taken = [s for slots in held for s in slots]
        assert len(taken) == len(set(taken)) and slab.available == 64 - len(taken)
    for slots in held:
        slab.give(slots)
    assert slab.take(64) == list(range(64))  # everything back: one run again
    with pytest.raises(ValueError):
        slab.take(1)


def test_a_run_freed_is_taken_whole_by_a_chunk_of_its_size():
    slab = Slab(12, 4096, False, "")
    a, b, c = slab.take(4), slab.take(4), slab.take(4)
    slab.give(b)
    assert slab.take(2) == b[:2]  # the shortest run that fits
    slab.give(a)
    assert slab.take(4) == a
    slab.give(c)  # free: b's last two and c, one run of six
    assert slab.take(6) == b[2:] + c


def test_the_default_slot_is_small_and_bounds_the_number_of_slots():
    assert default_slot(256 * MiB) == default_slot(1 * GiB) == 64 * KiB
    assert default_slot(64 * GiB) == 256 * KiB and 64 * GiB // default_slot(64 * GiB) == 1 << 18
    tier = open_tier("cpu://?size=256MiB")
    assert tier.slot_bytes == 64 * KiB and tier.num_slots == 4096
    tier.close()

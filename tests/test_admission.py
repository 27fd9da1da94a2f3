"""The save policy: its sketch and ghost filter keep their bounds, and each policy stores
what it says it stores, told as the story of a store asking it (seen, save, evict)."""

from __future__ import annotations

import random
import threading

import pytest

from lmtier.config import StoreConfig
from lmtier.errors import ConfigError
from lmtier.store.admission import POLICIES, FrequencySketch, GhostFilter, SavePolicy

_KEYS = random.Random(1)  # fixed: a run sees the same keys every time


def prompt(chunks: int) -> list[bytes]:
    """Keys of a fresh prompt: random, like the digests lmtier's chained keys are."""
    return [_KEYS.randbytes(16) for _ in range(chunks)]


def let_go(policy: SavePolicy, keys: list[bytes], hits: int = 0) -> list[bool]:
    """Memory evicts ``keys``, each read ``hits`` times while resident: which are written?"""
    return policy.admit_lower(keys, [hits] * len(keys))


# -- the sketch ---------------------------------------------------------------------------
def test_sketch_memory_is_fixed_at_construction():
    sketch = FrequencySketch(keys=1024)
    assert sketch.nbytes == sketch.depth * sketch.width == 4 * 4096
    for key in prompt(3 * sketch.window):  # several windows, several halvings
        sketch.add(key)
    assert sketch.halvings >= 3
    assert len(sketch._counts) == sketch.nbytes


def test_sketch_never_under_counts_within_a_window():
    sketch = FrequencySketch(keys=1024)
    truth = {key: 1 + i % 7 for i, key in enumerate(prompt(300))}
    for key, n in truth.items():
        for _ in range(n):
            sketch.add(key)
    assert sketch.halvings == 0
    assert all(sketch.estimate(key) >= n for key, n in truth.items())
    assert sum(sketch.estimate(key) == n for key, n in truth.items()) > 0.95 * len(truth)


def test_sketch_counts_saturate_at_15():
    sketch = FrequencySketch(keys=1024)
    key = prompt(1)[0]
    for _ in range(40):
        sketch.add(key)
    assert sketch.estimate(key) == 15


def test_aging_halves_every_count_once_a_window_is_full():
    sketch = FrequencySketch(keys=1024)
    keys = prompt(50)
    for i, key in enumerate(keys):
        for _ in range(i % 9):
            sketch.add(key)
    before = [sketch.estimate(k) for k in keys]
    filler = random.Random(7)  # fixed: a filler key may share a tracked key's cells
    while sketch.halvings == 0:  # fill the window with keys seen once
        sketch.add(filler.randbytes(16))
    assert [sketch.estimate(k) for k in keys] == [b // 2 for b in before]


def test_a_key_seen_once_rarely_reads_as_seen_twice():
    """The false-positive bound of the docstring: a window of distinct keys, just before
    the halving that would clear them, is the worst case."""
    sketch = FrequencySketch(keys=4096)
    once = prompt(sketch.window - 1)
    for key in once:
        sketch.add(key)
    assert sketch.halvings == 0
    assert sum(sketch.estimate(k) >= 2 for k in once) < 0.01 * len(once)


# -- the ghost filter ----------------------------------------------------------------------
def test_ghost_remembers_the_last_keys_and_forgets_older_ones():
    ghost = GhostFilter(keys=1000)
    old, recent = prompt(1000), prompt(999)
    for key in old + recent:  # the first rotation came after ``old``
        ghost.add(key)
    assert ghost.rotations == 1
    assert all(k in ghost for k in recent) and all(k in ghost for k in old)
    for key in prompt(1000):  # the first of these rotates again: ``old`` is forgotten
        ghost.add(key)
    assert all(k in ghost for k in recent)
    assert sum(k in ghost for k in old) < 20  # forgotten, but for false positives
    assert sum(k in ghost for k in prompt(10_000)) < 200  # under 2% for strangers
    assert ghost.nbytes == 2 * 16384 // 8


# -- the policies ----------------------------------------------------------------------------
def test_policies_by_name_and_bad_settings():
    assert POLICIES == ("always", "min_tokens", "reuse")
    assert SavePolicy().name == "always" == StoreConfig().save_policy
    for bad in ({"name": "lru"}, {"min_tokens": -1}, {"min_reuse": 1.5}):
        with pytest.raises(ConfigError):
            SavePolicy(**bad)


def test_always_stores_every_chunk_in_every_tier_at_save_time():
    policy = SavePolicy("always", min_tokens=10_000)  # today's behaviour: no threshold
    keys = prompt(8)
    policy.seen(keys)
    assert policy.write_mode == "through"
    assert policy.admit_first(keys, prompt_tokens=100) == 8
    assert policy.admit_lower(keys) == [True] * 8
    assert policy.nbytes == 0


def test_min_tokens_skips_short_prompts_and_stores_long_ones_everywhere():
    policy = SavePolicy("min_tokens", min_tokens=2048)
    assert policy.admit_first(prompt(3), prompt_tokens=2047) == 0
    long = prompt(4)
    assert policy.admit_first(long, prompt_tokens=2048) == 4
    assert policy.admit_lower(long) == [True] * 4
    assert SavePolicy("reuse", min_tokens=2048).admit_first(prompt(3), prompt_tokens=1600) == 0


def test_reuse_stores_everything_in_memory_and_decides_lower_tiers_at_eviction():
    policy = SavePolicy("reuse", keys=1024)
    keys = prompt(6)
    policy.seen(keys)
    assert policy.write_mode == "back"
    assert policy.admit_first(keys, prompt_tokens=6 * 512) == 6  # a first reuse is caught in memory
    assert let_go(policy, keys[:2], hits=1) == [True, True]  # read while resident: proven


def test_reuse_writes_a_chunk_two_requests_looked_up_even_if_never_read_in_memory():
    policy = SavePolicy("reuse", keys=1024, min_reuse=1.0)  # no bets on unproven chunks
    shared = prompt(4)
    policy.seen(shared)
    policy.seen(shared + prompt(2))  # a second request, e.g. after memory let it go
    assert let_go(policy, shared) == [True] * 4
    assert let_go(policy, prompt(4)) == [False] * 4  # seen once, never read: not written


def test_reuse_stops_writing_unproven_chunks_when_none_come_back():
    policy = SavePolicy("reuse", keys=1024)
    written = []
    for _ in range(400):  # prompts that are never asked again
        keys = prompt(8)
        policy.seen(keys)
        policy.admit_first(keys, prompt_tokens=8 * 512)
        written += let_go(policy, keys)
    assert policy.return_rate < policy.min_reuse
    # Once the evidence is in, nothing unproven is written: what still is, is a sketch false
    # positive (a key seen once that reads as seen twice).
    assert sum(written[-2000:]) < 0.01 * 2000
    assert sum(written) < 0.35 * len(written)  # the warm-up: about 0.75 x keys chunks
    assert policy.stats()["unproven_skipped"] == len(written) - sum(written)


def test_reuse_keeps_writing_unproven_chunks_that_come_back_after_eviction():
    """Documents asked about again after memory let them go: every first reuse counts."""
    policy = SavePolicy("reuse", keys=1024)
    written, earlier = [], []
    for i in range(400):
        keys = prompt(8)
        policy.seen(keys)
        written += let_go(policy, keys)  # memory lets it go unread
        earlier.append(keys)
        if i >= 20:  # a document from 20 requests ago comes back: seen twice now
            policy.seen(earlier[i - 20])
    assert policy.return_rate > 0.5
    assert all(written)


def test_a_checkpoint_writes_what_an_eviction_would_now_and_the_let_go_still_counts():
    """Write-back writes chunks down a few seconds after they land (so a process that dies
    loses little): the decision is the eviction's, taken early; the let-go is counted when
    memory really lets the chunk go, so a chunk that comes back still shows as a return."""
    policy = SavePolicy("reuse", keys=1024)
    keys = prompt(4)
    policy.seen(keys)
    assert policy.checkpoint(keys, [0, 1, 0, 0]) == [True] * 4  # bets pay at start: all written
    assert policy.stats()["unproven_written"] == 3 and policy.stats()["proven"] == 1
    policy.let_go(keys, [0, 1, 0, 0])  # memory lets them go later: nothing decided, nothing counted as written
    assert policy.stats()["unproven_written"] == 3
    assert all(k in policy.ghost for k in (keys[0], keys[2], keys[3])) and keys[1] not in policy.ghost
    before = policy._returned
    policy.seen(keys[:1])  # an unproven one comes back: a return, as if it had been evicted unwritten
    assert policy._returned == before + 1


def test_a_checkpoint_leaves_unproven_chunks_in_memory_when_bets_do_not_pay_until_they_prove_themselves():
    policy = SavePolicy("reuse", keys=1024)
    for _ in range(400):  # the workload shows that unproven chunks never come back
        keys = prompt(8)
        policy.seen(keys)
        let_go(policy, keys)
    assert policy.return_rate < policy.min_reuse
    fresh = prompt(2)
    policy.seen(fresh)
    counts = dict(policy.stats())
    assert policy.checkpoint(fresh, [0, 0]) == [False, False]  # not yet: asked again later
    assert policy.stats()["unproven_skipped"] == counts["unproven_skipped"]  # a wait, not a let-go
    assert policy.checkpoint(fresh, [1, 0]) == [True, False]  # read while resident: proven, written
    policy.seen(fresh[1:])
    assert policy.checkpoint(fresh[1:], [0]) == [True]  # looked up by a second request: proven


def test_always_checkpoints_everything():
    policy = SavePolicy("always")
    assert policy.checkpoint(prompt(3), [0, 0, 0]) == [True] * 3
    policy.let_go(prompt(1), [0])  # nothing to learn


def test_concurrent_calls_from_two_threads_keep_consistent_counts():
    policy = SavePolicy("reuse", keys=4096)
    batches = [prompt(50) for _ in range(40)]
    errors: list[BaseException] = []

    def scheduler() -> None:
        try:
            for keys in batches:
                policy.seen(keys)
                policy.admit_first(keys, prompt_tokens=50 * 512)
        except BaseException as exc:
            errors.append(exc)

    def writer() -> None:
        try:
            for keys in batches:
                let_go(policy, keys)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=scheduler), threading.Thread(target=writer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    stats = policy.stats()
    assert stats["seen"] == stats["first"] == 2000
    assert stats["proven"] + stats["unproven_written"] + stats["unproven_skipped"] == 2000

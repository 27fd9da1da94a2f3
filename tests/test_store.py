"""TieredStore: prefix lookup across tiers, promotion, write-through, failures as misses."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from lmtier import metrics
from lmtier.breaker import Backoff, CircuitBreaker
from lmtier.errors import RetryableError, TierError
from lmtier.kv.chunk import release_all
from lmtier.store.tiered import TieredStore
from lmtier.tiers.base import Tier
from lmtier.tiers.cpu import CpuTier

from conftest import assert_served_then_promoted, make_prompt
from tier_contract import CHUNK_BYTES


def cpu(chunks: int, name: str) -> CpuTier:
    return CpuTier(size=chunks * CHUNK_BYTES, slot=CHUNK_BYTES, name=name)


class FaultyTier(CpuTier):
    """Fault injection: a CPU tier whose calls can be made to fail or to block."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.fail = False
        self.gate = threading.Event()
        self.gate.set()
        self.calls = 0

    def _maybe_fail(self):
        self.calls += 1
        self.gate.wait(timeout=30)
        if self.fail:
            raise ConnectionError("injected failure")

    def contains(self, keys):
        self._maybe_fail()
        return super().contains(keys)

    def get(self, keys):
        self._maybe_fail()
        return super().get(keys)

    def put(self, chunks):
        self._maybe_fail()
        return super().put(chunks)


def test_put_writes_through_to_every_tier():
    hot, cold = cpu(8, "hot"), cpu(64, "cold")
    with TieredStore([hot, cold]) as store:
        p = make_prompt(5)
        assert store.put(p.chunks()) == 5
        assert store.flush()
        assert hot.contains(p.keys) == cold.contains(p.keys) == 5


def test_a_batch_larger_than_the_first_tier_reaches_the_lower_tiers_whole(tmp_path):
    """A long prompt of a big model: the memory tier keeps what it can, every lower tier
    with room gets the whole batch (none of it is lost everywhere)."""
    from lmtier.tiers.base import open_tier

    hot, disk = cpu(3, "hot"), open_tier(f"file://{tmp_path}/d?size=64MiB")
    with TieredStore([hot, disk]) as store:
        p = make_prompt(8, seed=9)
        assert store.put(p.chunks()) == 8
        assert store.flush()
        assert disk.contains(p.keys) == 8 and hot.contains(p.keys) < 8
        assert store.unwritten_chunks == 0
        got = store.get(p.keys)
        assert [c.tobytes() for c in got] == [p.chunk_bytes(i) for i in range(8)]
        release_all(got)


def test_lookup_finds_a_prefix_spread_over_tiers_and_get_promotes_it():
    hot, cold = cpu(8, "hot"), cpu(64, "cold")
    with TieredStore([hot, cold]) as store:
        p = make_prompt(6)
        cold.put(p.chunks(2, 6))
        hot.put(p.chunks(0, 2))
        assert store.lookup(p.keys) == 6
        assert_served_then_promoted(store, hot, p)


def test_get_returns_only_the_leading_run():
    hot, cold = cpu(8, "hot"), cpu(8, "cold")
    with TieredStore([hot, cold]) as store:
        p = make_prompt(5)
        hot.put(p.chunks(0, 2))
        cold.put(p.chunks(3, 5))  # chunk 2 is nowhere: 3 and 4 are useless
        assert store.lookup(p.keys) == 2
        chunks = store.get(p.keys)
        assert len(chunks) == 2
        release_all(chunks)
        assert cold.get([p.keys[3]])[0] is not None  # and were released, not leaked
        assert cold._index[p.keys[3]].leases == 0


def test_iter_get_reads_ahead_in_batches_and_stops_at_the_first_miss():
    hot = cpu(16, "hot")
    with TieredStore([hot]) as store:
        p = make_prompt(7)
        hot.put(p.chunks(0, 5))  # chunks 5 and 6 missing
        got = []
        for batch in store.iter_get(p.keys, 2):
            got.append(len(batch))
            assert [c.tobytes() for c in batch] == [p.chunk_bytes(i) for i in range(sum(got) - len(batch), sum(got))]
            release_all(batch)
        assert got == [2, 2, 1]  # the third batch ([4, 5]) ends the run
        assert all(e.leases == 0 for e in hot._index.values())


def test_iter_get_copies_lower_tier_hits_into_memory_as_it_reads_them():
    """A load's chunks from a lower tier are copied into the memory tier by the reading
    thread and handed out from there: the lower tier's buffers are free at once (nothing
    queued holds them), and the copies are the stored bytes, already verified."""
    hot, cold = cpu(16, "hot"), cpu(16, "cold")
    with TieredStore([hot, cold]) as store:
        p = make_prompt(6)
        cold.put(p.chunks())
        seen = []
        for batch in store.iter_get(p.keys, 2):
            assert all(c.verified for c in batch)
            seen += [c.tobytes() for c in batch]
            assert all(cold._index[c.key].leases == 0 for c in batch)  # the copies are hot's
            release_all(batch)
        assert seen == [p.chunk_bytes(i) for i in range(6)]
        assert hot.contains(p.keys) == 6
        assert all(e.leases == 0 for e in hot._index.values())


def test_iter_get_closed_early_releases_the_batch_read_ahead():
    hot = cpu(16, "hot")
    with TieredStore([hot]) as store:
        p = make_prompt(6)
        hot.put(p.chunks())
        batches = store.iter_get(p.keys, 2)
        first = next(batches)  # the second batch is being read meanwhile
        release_all(first)
        batches.close()
        assert all(e.leases == 0 for e in hot._index.values())


def test_evicted_from_the_first_tier_still_served_from_the_second():
    hot, cold = cpu(2, "hot"), cpu(64, "cold")
    with TieredStore([hot, cold]) as store:
        a, b = make_prompt(2, seed=1), make_prompt(2, seed=2)
        store.put(a.chunks())
        store.flush()
        store.put(b.chunks())  # evicts a from hot
        store.flush()
        assert hot.contains(a.keys) == 0
        assert store.lookup(a.keys) == 2
        chunks = store.get(a.keys)
        assert [c.tobytes() for c in chunks] == [a.chunk_bytes(0), a.chunk_bytes(1)]
        release_all(chunks)


def test_a_slow_lower_tier_never_blocks_put_and_overflow_is_dropped_and_counted():
    hot = cpu(64, "hot")
    slow = FaultyTier(size=64 * CHUNK_BYTES, slot=CHUNK_BYTES, name="slow")
    slow.gate.clear()  # every call to the slow tier blocks until the gate opens
    drops_before = metrics.WRITE_QUEUE_DROPS.labels("slow")._value.get()
    store = TieredStore([hot, slow], write_queue=2)
    prompts = [make_prompt(1, seed=s) for s in range(6)]
    for p in prompts:
        assert store.put(p.chunks()) == 1  # returns at once, the first tier has it
    assert store.dropped_writes >= 3  # one in flight, two queued, the rest dropped
    assert metrics.WRITE_QUEUE_DROPS.labels("slow")._value.get() - drops_before == store.dropped_writes
    slow.gate.set()
    assert store.flush()
    assert sum(slow.contains(p.keys) for p in prompts) == 6 - store.dropped_writes
    store.close()


def test_a_failing_tier_is_a_miss_never_an_exception():
    bad = FaultyTier(size=8 * CHUNK_BYTES, slot=CHUNK_BYTES, name="bad")
    good = cpu(8, "good")
    with TieredStore([bad, good]) as store:
        p = make_prompt(3)
        good.put(p.chunks())
        bad.fail = True
        errors_before = metrics.TIER_ERRORS.labels("bad", "put")._value.get()
        assert store.put(p.chunks()) == 0  # the first tier failed: nothing held there
        assert store.lookup(p.keys) == 3  # served by the healthy tier
        chunks = store.get(p.keys)
        assert [c.tobytes() for c in chunks] == [p.chunk_bytes(i) for i in range(3)]
        release_all(chunks)
        assert metrics.TIER_ERRORS.labels("bad", "put")._value.get() == errors_before + 1
        assert store._breakers[id(bad)].is_open  # three failures in a row: skipped from now on


def test_a_dead_tier_opens_the_breaker_and_is_retried_after_cooldown():
    now = [0.0]
    bad = FaultyTier(size=8 * CHUNK_BYTES, slot=CHUNK_BYTES, name="flaky")
    bad.fail = True
    store = TieredStore([bad], breaker=lambda: CircuitBreaker(threshold=2, cooldown=10, clock=lambda: now[0]))
    p = make_prompt(2)
    for _ in range(5):
        assert store.lookup(p.keys) == 0
    assert bad.calls == 2  # then the breaker opened: no more calls to the dead tier
    bad.fail = False
    now[0] = 11.0  # cooldown over: one probe goes through, succeeds, closes the breaker
    store.put(p.chunks())
    assert store.lookup(p.keys) == 2
    store.close()


def test_breaker_half_open_failure_reopens():
    now = [0.0]
    breaker = CircuitBreaker(threshold=1, cooldown=5, clock=lambda: now[0])
    breaker.failure()
    assert breaker.is_open and not breaker.allow()
    now[0] = 6
    assert breaker.allow()
    assert not breaker.allow()  # only one probe at a time
    breaker.failure()
    assert not breaker.allow()
    now[0] = 12
    assert breaker.allow()
    breaker.success()
    assert not breaker.is_open and breaker.allow()


def test_store_needs_a_tier():
    with pytest.raises(ValueError):
        TieredStore([])


def test_a_dead_tier_is_one_warning_per_interval_not_one_per_call(caplog):
    """A dead server used by every request must not flood the engine's log."""
    import logging

    from lmtier.testing.redis_server import free_port
    from lmtier.tiers.base import open_tier

    dead = open_tier(f"grpc://127.0.0.1:{free_port()}?timeout=0.2&retries=1&shm=off")
    store = TieredStore([open_tier("cpu://?size=4MiB"), dead], breaker=lambda: CircuitBreaker(cooldown=1.0))
    prompt = make_prompt(2, seed=5)
    with caplog.at_level(logging.WARNING):
        end = time.monotonic() + 4  # several breaker cooldowns (1 s): probes that fail, retried
        while time.monotonic() < end:
            assert store.lookup(prompt.keys) == 0
            time.sleep(0.05)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said  # once per 30 s, from the store: the tier raises and logs nothing
    assert dead.counts["errors"] >= 4  # the first three calls and a probe at least
    store.close()


class FlakyTier(CpuTier):
    """A CPU tier whose first ``failures`` calls raise ``error``, retried as ``backoff`` says."""

    def __init__(self, failures: int, error: type[Exception], backoff: Backoff) -> None:
        super().__init__(size=8 * CHUNK_BYTES, slot=CHUNK_BYTES, name=f"flaky-{error.__name__}")
        self.failures, self.error, self.backoff, self.calls = failures, error, backoff, 0

    def contains(self, keys):
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error("injected")
        return super().contains(keys)


def ops(tier, result: str) -> float:
    return metrics.TIER_OPS.labels(tier.name, "contains", result)._value.get()


@pytest.mark.parametrize(
    "failures, error, backoff, calls, found",
    [
        (2, RetryableError, Backoff(attempts=2, base=0.001), 3, 2),  # retried twice, then served
        (3, RetryableError, Backoff(attempts=2, base=0.001), 3, 0),  # out of retries: a miss
        (1, TierError, Backoff(attempts=2, base=0.001), 1, 0),  # not retryable: a miss at once
        (1, RetryableError, Backoff(attempts=2, base=0.001, budget=0), 1, 0),  # out of time to retry
        (1, RetryableError, Tier.backoff, 1, 0),  # a tier that declares nothing is not retried
    ],
    ids=["retried", "out-of-retries", "not-retryable", "out-of-budget", "default"],
)
def test_a_retryable_error_is_retried_as_the_tiers_backoff_says(failures, error, backoff, calls, found):
    tier = FlakyTier(failures, error, backoff)
    p = make_prompt(2)
    tier.put(p.chunks())
    retried, failed = ops(tier, "retried"), metrics.TIER_ERRORS.labels(tier.name, "contains")._value.get()
    with TieredStore([tier]) as store:
        assert store.lookup(p.keys) == found  # never an exception
        assert tier.calls == calls
        assert ops(tier, "retried") - retried == calls - 1
        assert metrics.TIER_ERRORS.labels(tier.name, "contains")._value.get() - failed == (found == 0)


def test_a_quiet_warning_counts_what_it_held_back(caplog):
    import logging

    from lmtier.breaker import QuietWarning

    now = [0.0]
    quiet = QuietWarning(logging.getLogger("lmtier.test"), every=10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING):
        for t in (0, 1, 2, 3, 11, 12):
            now[0] = t
            quiet.warning("down: %s", "x")
    assert [r.getMessage() for r in caplog.records] == ["down: x", "down: x (and 3 more like it since the last)"]


def test_a_tier_written_before_capabilities_keeps_its_touch_and_keys_with_a_warning():
    """A user's tier that defines ``touch`` and ``keys`` (found by probing in earlier
    releases) gets them declared for it, and is told how to declare them."""
    from lmtier.tiers.base import Tier

    with pytest.warns(DeprecationWarning, match="listing=True, touch=True"):

        class OldTier(Tier):
            def contains(self, keys): return 0  # fmt: skip

            def get(self, keys): return [None] * len(keys)  # fmt: skip

            def put(self, chunks): pass  # fmt: skip

            def delete(self, keys): pass  # fmt: skip

            def close(self): pass  # fmt: skip

            def keys(self, prefix=b"", limit=None): return []  # fmt: skip

            def touch(self, keys): pass  # fmt: skip

    assert OldTier.capabilities.listing and OldTier.capabilities.touch


def test_the_store_reports_each_tiers_breaker_retries_and_skips():
    from lmtier.breaker import Backoff
    from lmtier.errors import RetryableError

    class Down(CpuTier):
        backoff = Backoff(attempts=1, base=0.001)
        cooldown = 60.0

        def contains(self, keys):
            raise RetryableError("down")

    store = TieredStore([cpu(8, "hot"), Down(size=CHUNK_BYTES * 4, slot=CHUNK_BYTES, name="down")])
    keys = make_prompt(2).keys
    for _ in range(4):
        store.lookup(keys)
    (_, down) = store.stats()["tiers"]
    assert down["breaker_open"] is True
    # 3 failing lookups retried once each open the breaker; the 4th lookup and stats() are skipped
    assert (down["retries"], down["skipped"]) == (3, 2)
    assert store._breakers[id(store.tiers[1])].cooldown == 60.0  # the tier's own cooldown
    store.close()


def test_a_lookup_follows_a_bounded_number_of_tier_changes(tmp_path):
    """A prefix that changes tier at every chunk would cost each lookup the square of its
    length (every run asks every tier about all the keys left): it ends after
    LOOKUP_RUNS runs, with the hits up to there."""
    from lmtier.store.tiered import LOOKUP_RUNS
    from lmtier.tiers.cpu import CpuTier

    prompt = make_prompt(2 * LOOKUP_RUNS + 8, seed=11)
    chunks = prompt.chunks()
    a, b = CpuTier(size=64 << 20, name="a"), CpuTier(size=64 << 20, name="b")
    a.put(chunks[0::2])
    b.put(chunks[1::2])
    store = TieredStore([a, b])
    runs = store.lookup_tiers(prompt.keys)
    assert len(runs) == LOOKUP_RUNS and sum(n for _, n in runs) == LOOKUP_RUNS
    store.close()


def test_the_write_queue_of_a_shared_store_serves_tenants_in_turn_and_keeps_room_for_each():
    """On the cache server every tenant's background writes share one queue: one tenant
    saving as fast as it can takes at most three quarters of it alone, a newcomer still
    gets in, the flooder is refused past its share, and the writer serves them in turn."""
    import queue as queue_mod

    from lmtier.store.fairqueue import FairQueue

    jobs = FairQueue(16, lambda job: job[0])
    flooded = 0
    with contextlib.suppress(queue_mod.Full):
        while True:
            jobs.put_nowait((b"bob", flooded))
            flooded += 1
    assert flooded == 12  # three quarters: room kept for others
    for n in range(4):
        jobs.put_nowait((b"alice", n))
    with pytest.raises(queue_mod.Full):
        jobs.put_nowait((b"bob", flooded))  # over his share now that Alice waits too
    order = [jobs.get_nowait()[0] for _ in range(8)]
    assert order == [b"bob", b"alice"] * 4  # in turn, not Bob's twelve first
    assert jobs.qsize() == 8

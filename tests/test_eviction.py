"""Eviction policies beyond LRU (lmtier/plan/policies.py), as ``lmtier plan`` gives them to a
tier: each evicts what its rule says on sequences small enough to follow by hand, none
holds more than its capacity or loses track of what it evicted, and a fleet's tiers take
them from its description. The study that judges them is benchmarks/bench_eviction.py."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from lmtier.errors import ConfigError
from lmtier.plan.fleet import Fleet
from lmtier.plan.policies import ARC, EVICTION, LRU, S3FIFO, SLRU, TinyLFU, make
from lmtier.plan.sim import simulate
from lmtier.plan.traces import Request

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_eviction as be  # noqa: E402

K = [bytes([i]) * 16 for i in range(40)]


def offer(policy, *keys: bytes) -> list[bytes]:
    """Each key used: a hit if held, else inserted; the keys evicted, in order."""
    gone = []
    for key in keys:
        if key in policy:
            policy.hit(key)
        else:
            gone += policy.insert(key) or []
    return gone


@pytest.mark.parametrize("capacity", [8, 1, 0])
@pytest.mark.parametrize("name", EVICTION)
def test_no_policy_holds_more_than_its_capacity_or_loses_track_of_a_chunk(name, capacity):
    """2,000 random uses of 30 keys in 8 places (1, none): after each, what the policy holds
    is what was inserted less what it said it evicted, and never more than its places."""
    rng = random.Random(11)
    policy, held = make(name, capacity), set()
    for _ in range(2000):
        key = K[min(int(rng.paretovariate(1.2)) - 1, 29)]
        if key in policy:
            policy.hit(key)
            continue
        gone = policy.insert(key)
        if gone is not None:
            held.add(key)
            held -= set(gone)
        assert len(policy) <= capacity
        assert held == {k for k in K if k in policy}


def test_lru_evicts_the_least_recently_used():
    assert offer(LRU(2), K[0], K[1], K[0], K[2]) == [K[1]]


def test_slru_keeps_a_chunk_read_again_over_newer_ones_read_once():
    """Capacity 5, protected 1: K0 is read again (protected); K1..K5 then fill probation,
    and the sixth chunk evicts K1, the oldest in probation, where LRU evicts K0."""
    slru = SLRU(5, protected=0.2)
    assert offer(slru, K[0], K[0], K[1], K[2], K[3], K[4], K[5]) == [K[1]]
    assert offer(LRU(5), K[0], K[0], K[1], K[2], K[3], K[4], K[5]) == [K[0]]


def test_s3fifo_lets_a_one_time_chunk_go_from_small_and_brings_a_ghost_back_to_main():
    """Capacity 10, small 1: the first ten chunks wait in small (main is empty) until the
    cache is full. Then K10 comes: K0, used twice, moves to main; K1, used once, is evicted
    (into the ghost list). K1 again evicts K2 the same way and goes straight to main."""
    s3 = S3FIFO(10, small=0.1)
    offer(s3, K[0], K[0], *K[1:10])
    assert offer(s3, K[10]) == [K[1]]
    assert K[0] in s3.main and K[1] in s3.ghost
    assert offer(s3, K[1]) == [K[2]]
    assert K[1] in s3.main


def test_arc_keeps_chunks_used_twice_through_a_scan():
    """Capacity 4: K0 and K1 used twice (T2); a scan of 6 new chunks passes through T1 and
    leaves them, where LRU loses them."""
    arc, lru = ARC(4), LRU(4)
    for policy in (arc, lru):
        offer(policy, K[0], K[1], K[0], K[1], *K[10:16])
    assert K[0] in arc and K[1] in arc
    assert K[0] not in lru and K[1] not in lru


def test_tinylfu_admits_a_chunk_only_when_it_was_used_more_than_the_victim():
    """Capacity 100 (window 1, main 99): main holds K-chunks used twice each; a new chunk
    used once leaving the window is refused (evicted itself); one used three times gets in."""
    t = TinyLFU(100)
    keys = [bytes([200, i]) * 8 for i in range(99)]
    for key in keys:
        offer(t, key, key)
    offer(t, keys[0])  # a hit
    new, hot = K[0], K[1]
    assert offer(t, new, hot) == [new]
    offer(t, hot, hot, K[2])
    assert hot in t.main


def test_a_fleet_takes_one_policy_for_every_tier_or_one_per_tier():
    assert Fleet.from_dict({"eviction": "arc"}).eviction == {"memory": "arc", "disk": "arc", "shared": "arc"}
    assert Fleet.from_dict({"eviction": {"disk": "s3fifo"}}).eviction == {
        "memory": "lru", "disk": "s3fifo", "shared": "lru"}  # fmt: skip
    assert Fleet().eviction == {"memory": "lru", "disk": "lru", "shared": "lru"}


@pytest.mark.parametrize(
    ("given", "error"),
    [
        ("mru", "eviction of memory must be one of"),
        ({"gpu": "arc"}, "one per tier"),
        ({"disk": 3}, "eviction of disk must be one of"),
        (["lru"], "one policy"),
    ],
)
def test_a_fleet_refuses_an_eviction_policy_it_does_not_have(given, error):
    with pytest.raises(ConfigError, match=error):
        Fleet.from_dict({"eviction": given})


A, B, C, D, E, F = (int.from_bytes(bytes([c]) * 8, "little") for c in b"ABCDEF")
TINY = {"chunk_tokens": 4, "kv_bytes_per_token": 1, "prefill_tokens_per_s": 4.0}


def req(t: float, *keys: int) -> Request:
    return Request(t, list(keys), 4 * len(keys))


def test_a_plan_evicts_by_the_tiers_policy():
    """Memory of 5 chunks (20 bytes), SLRU protecting 1 of them. A is stored, then read
    back (a hit: A is protected); B, C, D, E, then F, one request each; then A again.
    LRU: F evicts A (least recently used), the last request misses: 4 of 32 tokens hit.
    SLRU: F evicts B (the oldest unprotected), the last request hits: 8 of 32."""
    trace = [req(t, key) for t, key in enumerate((A, A, B, C, D, E, F, A))]
    base = Fleet.from_dict({**TINY, "memory": 20})
    lru = simulate(base, trace)
    slru = simulate(base.replace(eviction=Fleet.evictions("slru")), trace)
    assert lru["prompt_tokens"] == slru["prompt_tokens"] == 32
    assert lru["hit_ratio_by_tier"]["memory"] == 4 / 32
    assert slru["hit_ratio_by_tier"]["memory"] == 8 / 32


def test_a_peer_is_found_through_a_tier_under_another_policy():
    """Two instances, round robin, peers, memory under S3-FIFO: instance 0 stores A B, the
    request on instance 1 loads both from it (8 of 16 tokens from peers)."""
    plan = simulate(Fleet.from_dict({**TINY, "instances": 2, "memory": 40, "peers": True, "eviction": "s3fifo"}),
                    [req(0, A, B), req(1, A, B)])  # fmt: skip
    assert plan["hit_ratio_by_tier"]["peers"] == 8 / 16
    assert plan["served_to_peers_tokens"] == [8, 0]


def test_the_study_judges_a_policy_against_lru_on_the_same_variants():
    """The verdict pairs each policy with LRU on the same seeds: a lead on every seed
    larger than its spread is a win, a lag as large a loss, a mixed one neither."""
    rows = []
    for policy, each in (("lru", [0.5, 0.6, 0.7]), ("arc", [0.52, 0.62, 0.72]), ("s3fifo", [0.40, 0.61, 0.72]),
                         ("tinylfu", [0.3, 0.4, 0.5]), ("slru", [0.5, 0.6, 0.7])):  # fmt: skip
        rows.append({"workload": "w", "capacity_pct": 10, "policy": policy, "x_belady_each": each,
                     "x_belady": sum(each) / 3, "x_belady_min": min(each), "x_belady_max": max(each)})  # fmt: skip
    v = be.verdict(rows)
    assert v["arc"]["beats_lru_at"] == ["w at 10%"]
    assert v["s3fifo"]["beats_lru_at"] == v["s3fifo"]["loses_to_lru_at"] == []
    assert v["tinylfu"]["loses_to_lru_at"] == ["w at 10%"]
    assert v["slru"]["beats_lru_at"] == v["slru"]["loses_to_lru_at"] == []
    assert not v["lru"]["meets_target_everywhere"]


def test_the_study_on_small_workloads_reports_every_policy_and_the_shape(monkeypatch):
    monkeypatch.setattr(be, "TRACES", {})
    report = be.run(quick=True)
    policies = {r["policy"] for r in report["rows"]}
    assert policies == {"belady", "lru+oracle admission", *EVICTION}
    for r in report["rows"]:
        assert 0 <= r["x_belady_min"] <= r["x_belady"] <= r["x_belady_max"] <= 1.0 + 1e-9
    # no policy beats the offline ceiling, and LRU with perfect admission beats LRU
    by = {(r["workload"], r["capacity_pct"], r["policy"]): r for r in report["rows"]}
    for (w, pct, p), r in by.items():
        if p == "lru+oracle admission":
            assert r["x_belady"] >= by[(w, pct, "lru")]["x_belady"]
    assert set(report["workloads"]) == {"system_prompts", "conversations"}
    assert "| policy | beats LRU at" in be.table(report)

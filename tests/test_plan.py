"""``lmtier plan`` (lmtier/plan): small traces whose answers are worked out by hand in each
test's docstring: hits per tier, bytes, links, TTFT, routers, sweeps and goals; the
simulated tiers evict as lmtier's memory tier does; bad fleets and traces are clear errors."""

from __future__ import annotations

import json
import random

import pytest

from lmtier.cli.parser import main
from lmtier.errors import ConfigError
from lmtier.plan.fleet import Fleet
from lmtier.plan.report import smallest, sweep, values_of
from lmtier.plan.sim import Tier, simulate
from lmtier.plan.traces import Request, chain, mooncake, request_log
from lmtier.tiers.cpu.index import Entry, Index

# A chunk of 4 tokens at 1 byte a token: a tier of 8 bytes holds 2 chunks.
TINY = {"chunk_tokens": 4, "kv_bytes_per_token": 1, "prefill_tokens_per_s": 4.0}
A, B, C, D, X, Y = (int.from_bytes(bytes([c]) * 8, "little") for c in b"ABCDXY")


def req(t: float, *keys: int) -> Request:
    return Request(t, list(keys), 4 * len(keys))


def fleet(**settings) -> Fleet:
    return Fleet.from_dict({**TINY, **settings})


def test_the_simulated_tier_evicts_what_lmtiers_memory_index_evicts():
    """The same adds and reads on ``Tier`` and on the memory tier's ``Index`` (one tenant),
    1,000 random steps over 12 keys in 5 slots: the same chunks are evicted, in order."""
    rng = random.Random(7)
    tier, index = Tier("memory", 5), Index(5, 0)
    gone_tier, gone_index = [], []
    tier.on_evict = lambda key, reads: gone_tier.append(key)
    for _ in range(1000):
        key = bytes([rng.randrange(12)])
        if rng.random() < 0.3:
            tier.touch(key, read=True)
            if key in index:
                index.recent(key)
            continue
        tier.add(key)
        if key in index:
            index.recent(key)
            continue
        while len(index) >= 5:
            victim = index.victim(1, key)
            index.remove(victim)
            gone_index.append(victim)
        entry = Entry([0], 1)
        entry.ready, entry.leases = True, 0
        index.insert(key, entry)
    assert gone_tier == gone_index and len(gone_tier) > 100
    assert list(tier) == list(index)


@pytest.mark.parametrize("only_new", [False, True])
def test_a_prompts_chunks_added_at_once_evict_what_one_at_a_time_would(only_new):
    """``Tier.add_many`` appends a batch of new keys and evicts the oldest after; where a
    key of the batch is held already it goes one key at a time. 2,000 random batches of up
    to 6 keys over 30 keys in 7 slots, some held, some not: the same evictions, in the same
    order, the same contents in the same order, and the same counts of new keys."""
    rng = random.Random(11)
    batched, each = Tier("disk", 7), Tier("disk", 7)
    gone_batched, gone_each = [], []
    batched.on_evict = lambda key, reads: gone_batched.append((key, reads))
    each.on_evict = lambda key, reads: gone_each.append((key, reads))
    for _ in range(2000):
        keys = rng.sample(range(30), rng.randint(1, 6))
        if rng.random() < 0.2:
            batched.touch(keys[0], read=True)
            each.touch(keys[0], read=True)
        assert batched.add_many(keys, only_new=only_new) == each._add_each(keys, only_new)
        assert list(batched.items()) == list(each.items())
    assert gone_batched == gone_each and len(gone_each) > 1000


def test_a_prompts_chunks_are_found_in_runs_each_read_from_its_fastest_tier():
    """Keys 1-6; the engine's cache holds 2, memory 1, 2 and 3, the disk 4 and 5. Memory's
    run from key 1 stops at 2 (the cache, above it, holds that one); the cache's run is 2
    alone; memory's from 3 is 3 alone (4 is not in memory); the disk's from 4 is 4 and 5."""
    from lmtier.plan.tiers import run_end

    gpu, memory, disk = Tier("gpu", 8), Tier("memory", 8), Tier("disk", 8)
    gpu.add_many([2])
    memory.add_many([1, 2, 3])
    disk.add_many([4, 5])
    keys = [1, 2, 3, 4, 5, 6]
    assert run_end(keys, 0, memory, [gpu]) == 1 and run_end(keys, 0, memory) == 3
    assert run_end(keys, 1, gpu) == 2 and run_end(keys, 2, memory, [gpu]) == 3
    assert run_end(keys, 3, disk, [gpu, memory]) == 5 and run_end(keys, 5, disk) == 5
    assert run_end([], 0, memory) == 0


def test_a_links_bytes_per_second_are_each_seconds_share_of_every_transfer():
    """``spread`` sums transfers per second at once; a loop over each transfer's seconds
    gives the same. 3,000 random transfers of 3 senders, some within one second, some over
    many, some of no time, some longer than SPREAD_S."""
    from lmtier.plan.sim import SPREAD_S, spread

    rng = random.Random(5)
    who = [rng.randrange(3) for _ in range(3000)]
    start = [rng.uniform(0, 2000) for _ in range(3000)]
    took = [rng.choice([0.0, rng.uniform(0, 0.9), rng.uniform(0, 30), rng.uniform(SPREAD_S, 2 * SPREAD_S)])
            for _ in range(3000)]  # fmt: skip
    nbytes = [float(rng.randint(1, 10**6)) for _ in range(3000)]
    seconds: dict[tuple[int, int], float] = {}
    for w, s, t, n in zip(who, start, took, nbytes, strict=True):
        end = s + min(t, SPREAD_S)
        if int(s) == int(end) or t <= 0:
            seconds[w, int(s)] = seconds.get((w, int(s)), 0) + n
            continue
        for second in range(int(s), int(end) + 1):
            share = (min(end, second + 1) - max(s, second)) * n / (end - s)
            seconds[w, second] = seconds.get((w, second), 0) + share
    totals, peak = spread(who, start, took, nbytes)
    assert peak == pytest.approx(max(seconds.values()), rel=1e-9)
    assert totals == pytest.approx([sum(n for w, n in zip(who, nbytes, strict=True) if w == i) for i in range(3)])
    assert spread([], [], [], []) == ([], 0.0)


def test_a_plans_keys_are_64_bit_integers_equal_only_for_an_equal_prefix():
    """``chain`` keys name a chunk and all before it: equal ids give equal keys, a
    different id anywhere before gives different ones from there on."""
    one, two = chain([1, 2, 3]), chain([1, 2, 3])
    other = chain([9, 2, 3])
    assert one == two and all(isinstance(k, int) and 0 <= k < 1 << 64 for k in one)
    assert not set(one) & set(other)
    assert chain([1, 2])[:2] == one[:2] and chain([1, 2], salt=7)[0] != one[0]


def test_one_instance_hits_what_its_memory_still_holds():
    """Memory of 2 chunks. A,B computed (0 hits); A,B again: both from memory (8 tokens);
    C,D computed, evicting A and B; A,B computed again. 8 of 32 tokens: 0.25. TTFT at 4
    tokens a second and memory at 8 bytes a second plus 0.5 s a load: 2, 0.5 + 1, 2, 2 s."""
    f = fleet(memory=8, costs={"memory": {"gbps": 8e-9, "ms": 500}})
    r = simulate(f, [req(0, A, B), req(1, A, B), req(2, C, D), req(3, A, B)])
    assert r["hit_ratio"] == 0.25 and r["hit_ratio_by_tier"]["memory"] == 0.25
    assert r["prefill_tokens_saved"] == 8 and r["gpu_seconds_saved"] == 2.0
    assert r["bytes_read"]["memory"] == 8 and r["bytes_written"]["memory"] == 24
    assert r["ttft_ms"]["p50"] == pytest.approx(2000) and r["ttft_ms"]["mean"] == pytest.approx(1875)


def test_the_engines_own_cache_comes_first():
    """A GPU cache of 2 chunks in front of memory: the repeat is the engine's own hit."""
    r = simulate(fleet(gpu=8, memory=8), [req(0, A, B), req(1, A, B)])
    assert r["hit_ratio_by_tier"] == {"gpu": 0.5, "memory": 0.0, "disk": 0.0, "shared": 0.0, "peers": 0.0}


def test_round_robin_instances_share_through_peers_or_a_shared_tier_or_not_at_all():
    """Two instances, round robin: A,B computed on instance 0, asked of instance 1. Alone:
    computed again (0). With peers: 2 chunks from instance 0's memory, which served them.
    With a shared tier of 2 chunks: written through by instance 0 (8 bytes over the 2 s of
    its prefill: 4 in second 0, 4 in second 1), read by instance 1 at 0.5 s in a
    millisecond (8 bytes in second 0): a peak of 12 bytes in second 0."""
    trace = [req(0, A, B), req(0.5, A, B)]
    alone = simulate(fleet(instances=2, memory=8), trace)
    assert alone["hit_ratio"] == 0
    peers = simulate(fleet(instances=2, memory=8, peers=True), trace)
    assert peers["hit_ratio_by_tier"]["peers"] == 0.5 and peers["served_to_peers_tokens"] == [8, 0]
    assert peers["bytes_read"]["peers"] == 8
    shared = simulate(fleet(instances=2, memory=8, shared={"kind": "server", "size": 8}), trace)
    assert shared["hit_ratio_by_tier"]["shared"] == 0.5
    assert shared["bytes_written"]["shared"] == 8 and shared["bytes_read"]["shared"] == 8
    assert shared["links"]["shared"]["peak_bytes_per_s"] == 12


def test_the_kv_aware_router_sends_a_prefix_to_its_holder_and_affinity_by_its_first_chunk():
    """kv_aware: A,B to instance 0 (a tie: the lowest), X,Y to instance 1 (less loaded),
    A,B again to instance 0, its holder: a memory hit. Round robin sends it to instance 0 by
    turn too, so a third instance is needed to tell them apart: there round robin sends it
    to instance 2 (a miss)."""
    trace = [req(0, A, B), req(1, X, Y), req(2, A, B)]
    routed = simulate(fleet(instances=3, memory=8, router="kv_aware"), trace)
    assert routed["hit_ratio_by_tier"]["memory"] == pytest.approx(8 / 24)
    assert simulate(fleet(instances=3, memory=8), trace)["hit_ratio"] == 0
    affinity = simulate(fleet(instances=3, memory=8, router="affinity"), trace)
    assert affinity["hit_ratio"] == pytest.approx(8 / 24)  # the same first chunk, the same instance


def test_the_kv_aware_router_spills_a_hot_prefix_when_its_holder_is_overloaded():
    """spill 1.0: A,B asked 4 times in one window of 10 s on 2 instances. The holder takes it
    while its recent requests are no more than the mean (at least 1): the 2nd request; the
    3rd finds it at 2 against a mean of 1: spilled to instance 1 (a miss, then held there)."""
    trace = [req(t, A, B) for t in (0, 1, 2, 3)]
    r = simulate(fleet(instances=2, memory=8, router="kv_aware", spill=1.0), trace)
    assert r["hit_ratio_by_tier"]["memory"] == pytest.approx(16 / 32)  # requests 2 and 4 hit


def test_a_sweep_finds_the_smallest_memory_that_meets_a_goal():
    """Memory of 1 chunk: A,B stores B then A (the head most recent), A is kept; the repeat
    hits A only: 4 of 32 tokens (0.125). Of 2 chunks: 0.25 (the first test)."""
    trace = [req(0, A, B), req(1, A, B), req(2, C, D), req(3, A, B)]
    rows = sweep(fleet(), trace, "memory", values_of("memory", "8,4"))
    assert [(v, r["hit_ratio"]) for v, r in rows] == [(4, 0.125), (8, 0.25)]
    assert smallest(rows, "hit_ratio>=0.2")[0] == 8
    assert smallest(rows, "hit_ratio>=0.5") is None
    assert smallest(rows, "ttft_p50_ms<=2000")[0] == 4


def test_write_back_writes_the_lower_tier_at_eviction_only():
    """save_policy reuse (write-back): nothing reaches the disk while memory holds it; a
    chunk read while resident is written when memory lets it go."""
    f = fleet(memory=8, disk=64, save_policy="reuse")
    r = simulate(f, [req(0, A, B), req(1, A, B)])
    assert r["bytes_written"]["disk"] == 0
    r = simulate(f, [req(0, A, B), req(1, A, B), req(2, C, D), req(3, X, Y), req(4, A, B)])
    assert r["bytes_written"]["disk"] >= 8  # A and B, proven, written as C and D pushed them out
    assert r["hit_ratio_by_tier"]["disk"] == pytest.approx(8 / 40)


def test_traces_in_the_mooncake_format_and_lmtiers_request_log(tmp_path):
    moon = tmp_path / "m.jsonl"
    moon.write_text(json.dumps({"timestamp": 0, "input_length": 1100, "hash_ids": [1, 2, 3]}) + "\n"
                    + json.dumps({"timestamp": 2500, "input_length": 600, "hash_ids": [1, 9]}) + "\n")  # fmt: skip
    first, second = mooncake(moon)
    assert len(first.keys) == 2 and len(second.keys) == 1  # full 512-token blocks only
    assert first.keys[0] == second.keys[0] == chain([1])[0] and second.t == 2.5
    log = tmp_path / "log.jsonl"
    log.write_text('{"t": 0, "tokens": 9, "chunks": ["a", "b"]}\n{"t": 1, "tokens": 5, "chunks": ["a"]}\n')
    one, two = request_log(log)
    assert one.keys[0] == two.keys[0] and len(one.keys) == 2 and one.tokens == 9


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('{"t": 1, "tokens": 5, "chunks": ["a"]}\n{"t": 0, "tokens": 5, "chunks": ["a"]}\n', "goes back"),
        ('{"t": 0, "tokens": 5}\n', "needs t, tokens and chunks"),
        ('{"t": 0, "tokens": 5, "chunks": [1, 2]}\n', "list of strings"),
        ("not json\n", "not JSON"),
    ],
)
def test_a_bad_request_log_is_a_clear_error_naming_its_line(tmp_path, text, error):
    log = tmp_path / "log.jsonl"
    log.write_text(text)
    with pytest.raises(ConfigError, match=error):
        request_log(log)


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ({"router": "random"}, "router must be one of"),
        ({"instances": 0}, "instances must be at least 1"),
        ({"shared": {"kind": "nfs", "size": 1}}, "shared.kind must be one of"),
        ({"costs": {"tape": {"gbps": 1}}}, "costs are per medium"),
        ({"memroy": "8GiB"}, "unknown fleet settings: memroy"),
        ({"save_policy": "lfu"}, "save_policy must be one of"),
    ],
)
def test_a_bad_fleet_is_a_clear_error(settings, error):
    with pytest.raises(ConfigError, match=error):
        fleet(**settings)


def test_the_command_prints_a_table_and_writes_every_plan(tmp_path, capsys):
    (tmp_path / "fleet.yaml").write_text("chunk_tokens: 4\nkv_bytes_per_token: 1\nprefill_tokens_per_s: 4\n")
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"t": i, "tokens": 8, "chunks": k}) + "\n"
                           for i, k in enumerate((["a", "b"], ["a", "b"], ["c", "d"], ["a", "b"]))))  # fmt: skip
    out = tmp_path / "plan.json"
    code = main(["plan", str(tmp_path / "fleet.yaml"), "--trace", f"log:{log}", "--sweep", "memory=4,8",
                 "--goal", "hit_ratio>=0.2", "--json-out", str(out)])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "| memory | hit ratio |" in printed and "first met at memory=8 B" in printed
    report = json.loads(out.read_text())
    assert [p["hit_ratio"] for p in report["plans"]] == [0.125, 0.25] and report["goal"]["smallest"] == 8
    assert main(["plan", str(tmp_path / "fleet.yaml"), "--trace", "nosuch:x"]) == 2


def test_a_sweep_over_named_choices_runs_each_in_the_order_given(tmp_path, capsys):
    """Two instances of 8 bytes (2 chunks) and the request A B twice. Round robin sends the
    second to the other instance: nothing hits. Affinity sends both to A's instance: the
    second hits both chunks, 8 of 16 tokens. kv_aware finds A's holder: the same."""
    (tmp_path / "fleet.yaml").write_text("chunk_tokens: 4\nkv_bytes_per_token: 1\nprefill_tokens_per_s: 4\n"
                                         "instances: 2\nmemory: 8\n")  # fmt: skip
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"t": i, "tokens": 8, "chunks": ["a", "b"]}) + "\n" for i in range(2)))
    out = tmp_path / "plan.json"
    args = ["plan", str(tmp_path / "fleet.yaml"), "--trace", f"log:{log}", "--json-out", str(out)]
    assert main([*args, "--sweep", "router=kv_aware,round_robin,affinity", "--goal", "hit_ratio>=0.5"]) == 0
    report = json.loads(out.read_text())
    assert [(p["value"], p["hit_ratio"]) for p in report["plans"]] == [
        ("kv_aware", 0.5), ("round_robin", 0.0), ("affinity", 0.5)]  # fmt: skip
    assert report["goal"]["smallest"] == "kv_aware"
    assert "| router | hit ratio |" in capsys.readouterr().out
    assert main([*args, "--sweep", "eviction=lru,slru"]) == 0
    assert [p["fleet"]["eviction"]["memory"] for p in json.loads(out.read_text())["plans"]] == ["lru", "slru"]
    assert main([*args, "--sweep", "router=fastest"]) == 2
    assert main([*args, "--sweep", "router=affinity", "--plot", str(tmp_path / "p.png")]) == 2
    assert "not over router" in capsys.readouterr().err


def test_a_link_over_its_rate_is_a_warning(tmp_path, capsys):
    """Memory of 1 chunk (4 bytes) in front of a disk read at 1e-9 GB/s (1 byte a second).
    A at t=0 and B at t=1 are each written to disk (4 bytes a second); B evicts A from
    memory, so A at t=2 is read from disk (4 bytes, 4 s at that rate). The disk moves 12
    bytes in the 6 s from the first arrival to the last first token: a mean of 2 bytes a
    second, over its rate: the plan says it cannot keep up."""
    plan = simulate(fleet(memory=4, disk=64, costs={"disk": {"gbps": 1e-9}}), [req(0, A), req(1, B), req(2, A)])
    assert plan["hit_ratio_by_tier"]["disk"] == 4 / 12
    assert plan["links"]["disk"]["mean_bytes_per_s"] == pytest.approx(2.0, rel=1e-3)
    (warning,) = plan["warnings"]
    assert warning.startswith("disk (the busiest instance): a mean of") and "cannot keep up" in warning
    assert simulate(fleet(memory=4, disk=64), [req(0, A), req(1, B), req(2, A)])["warnings"] == []


def test_a_requests_bytes_are_spread_over_its_time_and_an_overloaded_fleet_is_a_warning():
    """One request of 40 chunks (160 tokens at 4 a second: 40 s of prefill) written through
    to a shared tier: 160 bytes over 40 s, a peak and a mean of 4 bytes a second, under a
    10-byte link; the instance computes all of its 40 s. Two such requests 10 s apart on
    one instance: 80 s of prefill in the 50 s from the first arrival to the second's end
    (the estimate does not queue the second behind the first)."""
    keys = list(range(2000, 2040))
    shared = {"kind": "server", "size": 1000}
    one = simulate(fleet(memory=400, shared=shared, costs={"shared": {"gbps": 1e-8}}), [req(0, *keys)])
    assert one["links"]["shared"]["peak_bytes_per_s"] == pytest.approx(4.0)
    assert one["links"]["shared"]["mean_bytes_per_s"] == pytest.approx(4.0)
    assert one["warnings"] == [] and one["prefill_busy"]["busiest"] == pytest.approx(1.0)
    other = list(range(3000, 3040))
    two = simulate(fleet(memory=400), [req(0, *keys), req(10, *other)])
    assert two["prefill_busy"] == {"mean": pytest.approx(80 / 50), "busiest": pytest.approx(80 / 50)}
    (warning,) = two["warnings"]
    assert warning.startswith("prefill (the fleet): 160% of its time computing prompts")


def test_a_one_chunk_tier_under_tinylfu_and_reuse_without_memory_plan_as_a_store_runs():
    """W-TinyLFU on a tier of one chunk keeps the newest (its window is all of it). With no
    memory tier, `reuse` writes through, as a store with no memory in front does: the
    second request finds A, B on disk."""
    one = simulate(fleet(memory=4, eviction="tinylfu"), [req(0, A), req(1, A), req(2, B)])
    assert one["hit_ratio_by_tier"]["memory"] == 4 / 12
    plan = simulate(fleet(disk=64, save_policy="reuse"), [req(0, A, B), req(1, A, B)])
    assert plan["hit_ratio_by_tier"]["disk"] == 0.5


def test_the_request_log_holds_at_most_its_bytes_and_a_failed_write_turns_it_off(tmp_path, caplog):
    """Lines of about 100 bytes into a log of 8 KiB: past 4 KiB it rotates to PATH.1, so the
    two files never hold more than 8 KiB, and what is kept is the newest. A directory
    gone mid-run turns it off with one warning; writes after that cost nothing."""
    from lmtier.engine.requestlog import RequestLog

    path = tmp_path / "log.jsonl"
    log = RequestLog(str(path), 8192)
    for n in range(500):
        log.write(100 + n, [bytes([n % 256]) * 16])
    log.close()
    kept = path.stat().st_size + (tmp_path / "log.jsonl.1").stat().st_size
    assert kept <= 8192 and [r.tokens for r in request_log(path)][-1] == 599
    with pytest.raises(ConfigError, match="cannot be written"):
        RequestLog(str(tmp_path / "nosuch" / "log.jsonl"), 8192)
    broken = RequestLog(str(tmp_path / "b.jsonl"), 4096)
    broken._file.close()  # fault injection: the file is gone from under it
    broken.write(5, [b"A" * 16])
    broken.write(6, [b"A" * 16])
    assert not broken.on and sum("request log" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize(
    ("lines", "chunk_tokens", "error"),
    [
        (['{"t": 0, "tokens": 1024, "chunks": ["a", "b", "c", "d"]}'], 512, "do not fit in 1024 tokens"),
        (['{"t": 0, "tokens": 1024, "chunk_tokens": 256, "chunks": ["a"]}'], 512, "set chunk_tokens: 256"),
        (['{"t": 0, "tokens": -8, "chunks": []}'], 4, "tokens is a count"),
        (['{"t": "nan", "tokens": 8, "chunks": []}'], 4, "a time is a number"),
        (['{"t": NaN, "tokens": 8, "chunks": []}'], 4, "number of seconds"),
    ],
)
def test_a_request_log_that_does_not_fit_the_fleets_chunk_is_refused(tmp_path, lines, chunk_tokens, error):
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=error):
        request_log(log, chunk_tokens=chunk_tokens)


def test_a_request_logs_strings_mean_a_prefix_only_at_their_own_position(tmp_path):
    """["x", "a"] then ["a"]: the second prompt's first chunk is not the first's second."""
    log = tmp_path / "log.jsonl"
    log.write_text('{"t": 0, "tokens": 8, "chunks": ["x", "a"]}\n{"t": 1, "tokens": 4, "chunks": ["a"]}\n')
    assert simulate(fleet(memory=64), request_log(log, chunk_tokens=4))["hit_ratio"] == 0


def test_links_mean_over_the_traces_seconds_and_the_holder_sends_what_peers_read():
    """A,B on instance 0 at second 0, read by instance 1 at second 1 from its peer: 8 bytes
    on each one's network in second 1; over the trace's 2 seconds, a mean of 4 a second."""
    r = simulate(fleet(instances=2, memory=8, peers=True), [req(0, A, B), req(1, A, B)])
    network = r["links"]["network"]
    assert network["peak_bytes_per_s"] == 8 and network["mean_bytes_per_s"] == 4


def test_the_calibration_turns_a_traces_chunks_into_prompts_that_share_as_they_do():
    """benchmarks/bench_plan.py: requests sharing a chain of chunks get prompts sharing
    those chunks' tokens, each ending in tokens of its own; a request's copies for the
    speed run share nothing with the original."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_plan as bp

    a, b = chain([1, 2, 3]), chain([1, 2, 9])
    pa, pb = bp.tokens_of(a, 0), bp.tokens_of(b, 1)
    assert len(pa) == 3 * bp.CHUNK + bp.TAIL
    assert pa[: 2 * bp.CHUNK] == pb[: 2 * bp.CHUNK] and pa[2 * bp.CHUNK :] != pb[2 * bp.CHUNK :]
    assert bp.tokens_of(a, 0) == pa  # the same request, the same prompt
    (one, two) = bp.copies([Request(0.0, a, 1536)], 2)
    assert two.t > one.t and not set(one.keys) & set(two.keys)
    synthetic = bp.slice_of("synthetic", 0, 20, max_chunks=4)
    assert len(synthetic) == 20 and all(len(r.keys) <= 4 and r.tokens == len(r.keys) * bp.CHUNK + bp.TAIL
                                        for r in synthetic)  # fmt: skip


def test_a_hit_from_memory_stays_when_the_rest_of_the_prefix_is_promoted_from_disk():
    """Memory of 3 chunks in front of a disk. A,B,C stored; X,Y push B and C out of memory
    (A, the head, stays): memory X Y A... then A,B,C again: A is read from memory first, B
    and C from disk and promoted, pushing out X and Y, not A. The fourth A,B,C finds all
    three in memory: 12 tokens, where a promotion that evicted A would leave 8."""
    f = fleet(memory=12, disk=400)
    trace = [req(0, A, B, C), req(1, X, Y), req(2, A, B, C), req(3, A, B, C)]
    r = simulate(f, trace)
    assert r["hit_ratio_by_tier"]["memory"] == pytest.approx((4 + 12) / 44)
    assert r["hit_ratio_by_tier"]["disk"] == pytest.approx(8 / 44)

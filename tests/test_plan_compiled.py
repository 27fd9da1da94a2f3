"""``lmtier plan``'s compiled replay (lmtier/plan/compiled.py) gives the Python replay's
report to the last bit: every router, every tier and medium, peers before or after the
shared tier, a save policy that leaves short prompts out, tiers that evict at every
request, prompts shorter than a chunk; and its pool and transfers grown from almost
nothing. Plans it does not cover replay in Python, or are refused when it is insisted on."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmtier.errors import ConfigError
from lmtier.plan import compiled, sim
from lmtier.plan.fleet import Fleet
from lmtier.plan.sim import Simulation, simulate
from lmtier.plan.traces import Request, mooncake, synthetic

TRACE = Path(__file__).resolve().parents[1] / "benchmarks" / "traces" / "mooncake_conversation_trace.jsonl.gz"
CHUNK = {"chunk_tokens": 512, "kv_bytes_per_token": 1, "prefill_tokens_per_s": 7919.0, "request_ms": 3.7}


def chunks(n: int) -> int:
    return n * 512  # bytes of n chunks


def shared(kind: str, size: int) -> dict:
    return {"kind": kind, "size": size}


FLEETS = {
    "one instance, memory": {"memory": chunks(40)},
    "round robin, gpu + memory + disk": {"instances": 3, "gpu": chunks(6), "memory": chunks(20), "disk": chunks(60)},
    "affinity, memory + server": {"instances": 4, "router": "affinity", "memory": chunks(15),
                                  "shared": shared("server", chunks(200))},
    "kv_aware, everything": {"instances": 5, "router": "kv_aware", "spill": 1.3, "window": 2.0, "gpu": chunks(4),
                             "memory": chunks(12), "disk": chunks(30), "shared": shared("redis", chunks(90)),
                             "peers": True},
    "kv_aware, peers only": {"instances": 3, "router": "kv_aware", "memory": chunks(25), "peers": True},
    "peers before the shared tier": {"instances": 3, "memory": chunks(10), "disk": chunks(20),
                                     "shared": shared("s3", chunks(100)), "peers": True,
                                     "costs": {"peers": {"gbps": 40, "ms": 0.01}}},
    "min_tokens, disk + server": {"instances": 2, "save_policy": "min_tokens", "min_tokens": 3000,
                                  "memory": chunks(8), "disk": chunks(16), "shared": shared("server", chunks(64))},
    "no memory, a shared tier under one chunk": {"instances": 2, "disk": chunks(30), "shared": shared("server", 100)},
    "nothing at all": {"instances": 2},
}  # fmt: skip


def traces() -> dict[str, list[Request]]:
    short = [Request(0.0, [], 100), Request(0.0, [], 300)]  # prompts under one chunk: no keys
    return {
        "conversations": short + synthetic("conversations", 400, rate=40.0),
        "system prompts": synthetic("system_prompts", 300, rate=25.0),
        "mooncake": mooncake(TRACE, limit=250),
    }


def same(a: dict, b: dict) -> None:
    for report in (a, b):
        report.pop("simulated_in_s")
    assert (a.pop("replay"), b.pop("replay")) == ("python", "compiled")
    assert a == b


@pytest.mark.parametrize("name", FLEETS)
def test_the_compiled_replay_reports_what_the_python_replay_reports(name):
    """Each fleet over each trace, both ways: the whole report equal (hits per tier and
    peer, bytes, links' means and peaks, TTFT percentiles, prefill busy, warnings)."""
    fleet = Fleet.from_dict({**CHUNK, **FLEETS[name]})
    for trace, requests in traces().items():
        python, fast = simulate(fleet, requests, compiled=False), simulate(fleet, requests, compiled=True)
        assert fast["requests"] == len(requests), trace
        same(python, fast)


def test_the_loop_and_its_driver_name_the_same_codes():
    from lmtier.plan import _loop

    for name in ("GPU", "MEMORY", "DISK", "SHARED", "PEERS", "FREE", "NEXT", "OLDEST", "EVENTS", "PROMPT", "STARTED"):
        assert getattr(_loop, name) == getattr(compiled, name), name


def test_a_pool_and_transfers_grown_from_one_slot_change_nothing():
    """The compiled loop returns to Python whenever the next request could need more slots
    or transfer records than are left; starting from one of each, it grows them hundreds of
    times over and ends where the default sizes end."""
    fleet = Fleet.from_dict({**CHUNK, **FLEETS["kv_aware, everything"]})
    requests = traces()["conversations"]
    small, large = Simulation(fleet), Simulation(fleet)
    compiled.replay(small, requests, pool=1, events=1)
    compiled.replay(large, requests)
    span = int(requests[-1].t) + 1
    assert small.report(span) == large.report(span)
    assert small.report(span)["hit_ratio"] > 0.2  # the plan hits: the tiers were used


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")  # the Python replay's NaN time
def test_plans_the_compiled_replay_does_not_cover_replay_in_python_or_are_refused_when_insisted_on(monkeypatch):
    requests = synthetic("conversations", 50)
    uncovered = {
        "a tier evicts by another policy": Fleet.from_dict({**CHUNK, "memory": chunks(8), "eviction": "arc"}),
        "the save policy writes back": Fleet.from_dict(
            {**CHUNK, "memory": chunks(8), "disk": chunks(8), "save_policy": "reuse"}
        ),
    }
    for why, fleet in uncovered.items():
        assert why in compiled.covers(fleet)
        assert simulate(fleet, requests)["replay"] == "python"
        with pytest.raises(ConfigError, match=why):
            simulate(fleet, requests, compiled=True)
    # traces it cannot replay to the Python replay's last bit: refused before it begins, or
    # (by default, here from one request) replayed in Python
    monkeypatch.setattr(sim, "COMPILED_FROM", 1)
    fleet = Fleet.from_dict({**CHUNK, "memory": chunks(8), "disk": chunks(1)})
    nan = float("nan")
    for why, trace in [
        ("not in arrival order", [requests[1], requests[0]]),
        ("not in arrival order", [Request(0.0, [1], 512), Request(nan, [2], 512), Request(0.0, [3], 512)]),
        ("names one chunk twice", [Request(0.0, [1, 2], 1024), Request(1.0, [1, 2, 1], 1536)]),
        (r"not an integer from 0 to 2\*\*64 - 1", [Request(0.0, [-1], 512)]),
        ("not a count", [Request(0.0, [1], 3.5)]),
    ]:
        with pytest.raises(ConfigError, match=why):
            simulate(fleet, trace, compiled=True)
        assert simulate(fleet, trace)["replay"] == "python"
    assert simulate(fleet, requests[:2])["replay"] == "compiled"
    # figures past 64-bit integers: the Python replay's exact integers
    huge = Fleet.from_dict({"chunk_tokens": 1 << 22, "kv_bytes_per_token": 1 << 40, "memory": 1 << 70, "disk": 1 << 70})
    trace = [Request(0.0, [1, 2], 1 << 24), Request(1.0, [1, 2], 1 << 24)]
    with pytest.raises(ConfigError, match="do not fit 64-bit integers"):
        simulate(huge, trace, compiled=True)
    assert simulate(huge, trace)["ttft_ms"]["mean"] > 0
    # tiers and min_tokens past a trace's chunks and prompts: the same answers
    fleet = Fleet.from_dict({"chunk_tokens": 1, "kv_bytes_per_token": 1, "memory": 1 << 70, "disk": 5,
                             "save_policy": "min_tokens", "min_tokens": 1 << 63})  # fmt: skip
    trace = [Request(0.0, [1, 2], 2), Request(1.0, [1, 2, 3], 3)]
    same(simulate(fleet, trace, compiled=False), simulate(fleet, trace, compiled=True))
    fleet = Fleet.from_dict({"chunk_tokens": 1, "kv_bytes_per_token": 1, "memory": 1 << 70})
    same(simulate(fleet, trace, compiled=False), simulate(fleet, trace, compiled=True))
    fleet = Fleet.from_dict({**CHUNK, "memory": chunks(8)})
    # by default, a plan of COMPILED_FROM requests or more is compiled, a shorter one not
    monkeypatch.setattr(sim, "COMPILED_FROM", 51)
    assert simulate(fleet, requests)["replay"] == "python"
    monkeypatch.setattr(sim, "COMPILED_FROM", 50)
    assert simulate(fleet, requests)["replay"] == "compiled"
    # without numba, every plan replays in Python
    monkeypatch.setattr(compiled, "njit", None)
    assert "numba is not installed" in compiled.covers(fleet)
    assert simulate(fleet, requests)["replay"] == "python"

"""The replay of ``lmtier.plan.sim`` with its per-chunk loop compiled (numba, where it is
installed: the ``plan`` extra; vLLM's own environment has it), for the fleets it covers:
every tier in lmtier's own order (LRU) and a save policy that writes through (``always``,
``min_tokens``). Its answers are ``Simulation.request``'s to the last bit: the same steps
in the same order, the same floating-point sums; tests/test_plan_compiled.py replays
fleets of every router, tier and medium both ways and compares the reports whole.

    covers(fleet, requests)     why the compiled replay cannot take this plan, or None
    replay(sim, requests)       the requests through the compiled loop, into ``sim``'s counts

The tiers: every chunk a tier holds is a slot of one pool (its key, its tier, the slots
before and after it in its tier's order, least recent first), found through one
open-addressing table keyed by (tier, key). A tier at its capacity evicts its oldest
chunk and gives the new one its slot. The pool and the table grow between requests (the
loop returns to Python when a request could need more room than is left), as do the
links' transfers.
"""

from __future__ import annotations

from array import array
from itertools import chain, pairwise

import numpy as np

try:  # the compiled loop is optional: without numba, the replay is sim.Simulation's own
    from numba import njit
except ImportError:  # pragma: no cover - exercised where numba is absent
    njit = None

GPU, MEMORY, DISK, SHARED, PEERS = range(5)  # where a chunk is read from
WHERE = ("gpu", "memory", "disk", "shared", "peers")
ROUTERS = {"round_robin": 0, "affinity": 1, "kv_aware": 2}
# state: the pool's next free slot, round robin's next instance, the oldest request in the
# KV-aware router's window, the transfers recorded, the prompts' tokens, whether started
FREE, NEXT, OLDEST, EVENTS, PROMPT, STARTED = range(6)
EVENT_FIELDS = 5  # link (0 disk, 1 network, 2 shared), who, start, seconds, bytes
LINKS = ("disk", "network", "shared")


def covers(fleet, requests) -> str | None:
    """Why the compiled replay does not take this plan (None: it does)."""
    if njit is None:
        return "numba is not installed (pip install 'lmtier[plan]')"
    if any(policy != "lru" for policy in fleet.eviction.values()):
        return "a tier evicts by another policy than lmtier's own order"
    if fleet.save_policy == "reuse":
        return "the save policy writes back"
    if any(b.t < a.t for a, b in pairwise(requests)):
        return "the requests are not in arrival order"
    return None


def replay(sim, requests, pool: int = 1 << 16, events: int = 1 << 16) -> None:
    """``sim.request(r)`` for each of ``requests``, compiled: ``sim``'s counts, TTFTs and
    transfers come out as that loop leaves them (its tiers stay empty). ``pool`` and
    ``events``: the slots and transfer records to start with (each grows as needed)."""
    fleet, n = sim.fleet, sim.fleet.instances
    lengths = np.fromiter((len(r.keys) for r in requests), np.int64, len(requests))
    offsets = np.zeros(len(requests) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    keys = np.fromiter(chain.from_iterable(r.keys for r in requests), np.uint64, int(offsets[-1])).view(np.int64)
    times = np.fromiter((r.t for r in requests), np.float64, len(requests))
    tokens = np.fromiter((r.tokens for r in requests), np.int64, len(requests))
    firsts = keys.view(np.uint64)[offsets[:-1][lengths > 0]] % np.uint64(n)  # affinity: a prompt's first chunk
    affinity = np.full(len(requests), -1, np.int64)
    affinity[lengths > 0] = firsts.astype(np.int64)

    per_instance = [fleet.chunks(fleet.gpu), fleet.chunks(fleet.memory), fleet.chunks(fleet.disk)]
    cap = np.array(per_instance * n + [fleet.chunks(fleet.shared_size) if fleet.shared else 0], np.int64)
    costs = fleet.costs
    cost_s = np.array([0.0] + [costs[m].ms / 1000 for m in WHERE[1:]])
    cost_rate = np.array([1.0] + [costs[m].gbps * 1e9 for m in WHERE[1:]])
    lower = np.array([SHARED if m == "shared" else PEERS for m in sim.lower], np.int64)
    config_i = np.array([n, ROUTERS[fleet.router], fleet.chunk_tokens, fleet.chunk_bytes,
                         fleet.save_policy == "always", fleet.min_tokens,
                         bool(fleet.disk or fleet.shared), bool(fleet.shared)], np.int64)  # fmt: skip
    config_f = np.array([fleet.spill, fleet.window, float(fleet.prefill_tokens_per_s), sim.fixed])

    tiers = _tiers(cap, pool)
    state = np.zeros(6, np.int64)
    clock = np.zeros(2)  # the first arrival, the last first token
    counts = np.zeros((3, 5), np.int64)  # tokens, chunks read, chunks written, by WHERE
    served, busy = np.zeros(n, np.int64), np.zeros(n)
    recent, picks = np.zeros(n, np.int64), np.zeros(len(requests), np.int64)
    ttft = np.zeros(len(requests))
    events = np.zeros((events, EVENT_FIELDS))
    most = int(lengths.max()) if len(requests) else 0
    scratch = np.zeros((6, max(most, n) + 1), np.int64)
    done = 0
    while done < len(requests):
        done = _replay(keys, offsets, times, tokens, affinity, lower, config_i, config_f, cost_s, cost_rate,
                       tiers, state, clock, counts, served, busy, recent, picks, ttft, events, scratch,
                       done)  # fmt: skip
        if done < len(requests):  # room for the next request: the pool, or the transfers
            if state[FREE] + 4 * lengths[done] > len(tiers[4]):
                tiers = _grown(tiers, int(state[FREE]), 2 * len(tiers[4]) + 4 * int(lengths[done]))
            if state[EVENTS] + 3 + n > len(events):
                events = np.concatenate([events, np.zeros_like(events)])

    for i, where in enumerate(WHERE):
        sim.tokens[where] += int(counts[0, i])
        if where in sim.read:
            sim.read[where] += int(counts[1, i])
        if where in sim.written:
            sim.written[where] += int(counts[2, i])
    sim.tokens["prompt"] += int(state[PROMPT])
    sim.served = [int(s) for s in served]
    sim.busy = [float(b) for b in busy]
    sim.ttft = array("d", ttft.tobytes())
    if state[STARTED]:
        sim.start, sim.end = float(clock[0]), float(clock[1])
    recorded = events[: state[EVENTS]]
    for code, link in enumerate(LINKS):
        mine = recorded[recorded[:, 0] == code]
        sim.links[link] = (mine[:, 1].astype(np.int64), mine[:, 2].copy(), mine[:, 3].copy(), mine[:, 4].copy())


def _tiers(cap: np.ndarray, pool: int) -> tuple:
    """Empty tiers of capacities ``cap`` (chunks) over a pool of ``pool`` slots."""
    size, head, tail = np.zeros(len(cap), np.int64), np.full(len(cap), -1, np.int64), np.full(len(cap), -1, np.int64)
    return (cap, size, head, tail, np.full((pool, 4), -1, np.int64), np.full(_table_size(pool), -1, np.int64))


def _table_size(pool: int) -> int:
    return 1 << (2 * pool - 1).bit_length()  # at most half full


def _grown(tiers: tuple, used: int, pool: int) -> tuple:
    """The tiers over a pool of ``pool`` slots, the first ``used`` kept, the table made again."""
    cap, size, head, tail, slots, _ = tiers
    grown = np.full((pool, 4), -1, np.int64)
    grown[:used] = slots[:used]
    out = (cap, size, head, tail, grown, np.full(_table_size(pool), -1, np.int64))
    _index_all(out, used)
    return out


if njit is not None:
    from lmtier.plan._loop import _index_all, _replay

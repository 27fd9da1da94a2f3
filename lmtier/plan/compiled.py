"""The replay of ``lmtier.plan.sim`` with its per-chunk loop compiled (numba, where it is
installed: the ``plan`` extra; vLLM's own environment has it), for the fleets it covers:
every tier in lmtier's own order (LRU) and a save policy that writes through (``always``,
``min_tokens``). Its answers are ``Simulation.request``'s to the last bit: the same steps
in the same order, the same floating-point sums; tests/test_plan_compiled.py replays
fleets of every router, tier and medium both ways and compares the reports whole.

    covers(fleet)                           why the compiled replay cannot take a fleet, or None
    replay(sim, requests)                   the requests through the compiled loop, into
                                            ``sim``'s counts (``Uncovered``: a trace it cannot take)
    attempt(sim, requests, insist, from_n)  ``replay`` where it takes the plan; whether it ran

The tiers: every chunk a tier holds is a slot of one pool (its key, its tier, the slots
before and after it in its tier's order, least recent first), found through one
open-addressing table keyed by (tier, key). A tier at its capacity evicts its oldest
chunk and gives the new one its slot. The pool and the table grow between requests (the
loop returns to Python when a request could need more room than is left), as do the
links' transfers.
"""

from __future__ import annotations

import os
from array import array
from itertools import chain

import numpy as np

from lmtier.errors import ConfigError

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


class Uncovered(Exception):
    """A plan the compiled replay cannot give the Python replay's answers for; raised before
    it changes anything."""


def covers(fleet) -> str | None:
    """Why the compiled replay does not take this fleet (None: it does); ``replay`` refuses
    the traces it cannot take (``Uncovered``)."""
    if njit is None:
        return "numba is not installed (pip install 'lmtier[plan]')"
    if any(policy != "lru" for policy in fleet.eviction.values()):
        return "a tier evicts by another policy than lmtier's own order"
    if fleet.save_policy == "reuse":
        return "the save policy writes back"
    return None


def attempt(sim, requests, insist: bool | None, threshold: int) -> bool:
    """``replay`` where it takes the plan (from ``threshold`` requests on, unless ``insist``
    is True: then a plan it does not take is a ``ConfigError``; False: never); whether it ran."""
    if insist is False:
        return False
    why = covers(sim.fleet)
    if why is None and (insist or len(requests) >= threshold):
        try:
            replay(sim, requests)
            return True
        except Uncovered as exc:
            why = str(exc)
    if insist and why:
        raise ConfigError(f"the compiled replay does not take this plan: {why}")
    return False


LIMIT = 1 << 62  # every count and byte figure of the loop stays below this: int64 arithmetic is exact


def _arrays(fleet, requests) -> tuple[np.ndarray, ...]:
    """The trace as arrays (keys, offsets, times, tokens), or ``Uncovered``: where a figure
    does not fit a 64-bit integer, a key is no unsigned 64-bit integer, the requests are not
    in arrival order, or a request names one chunk twice (the Python replay stores a
    prompt's new chunks at once, this loop one by one: they differ only there)."""
    if not all(type(r.tokens) is int and 0 <= r.tokens < LIMIT for r in requests):
        raise Uncovered("a request's tokens are not a count below 2**62")
    lengths = np.fromiter((len(r.keys) for r in requests), np.int64, len(requests))
    offsets = np.zeros(len(requests) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    try:
        keys = np.fromiter(chain.from_iterable(r.keys for r in requests), np.uint64, int(offsets[-1]))
        times = np.fromiter((r.t for r in requests), np.float64, len(requests))
    except (OverflowError, TypeError, ValueError):
        raise Uncovered("a key is not an integer from 0 to 2**64 - 1, or a time not a number") from None
    if not np.all(times[1:] >= times[:-1]):  # a NaN too
        raise Uncovered("the requests are not in arrival order")
    tokens = np.fromiter((r.tokens for r in requests), np.int64, len(requests))
    chunks = int(offsets[-1]) + 1
    if 4 * chunks * fleet.chunk_bytes >= LIMIT or chunks * fleet.chunk_tokens >= LIMIT or int(tokens.sum()) >= LIMIT:
        raise Uncovered("the trace's bytes or tokens do not fit 64-bit integers")
    keys = keys.view(np.int64)
    repeat = _first_repeat(keys, offsets)
    if repeat >= 0:
        raise Uncovered(f"request {repeat} names one chunk twice")
    return keys, offsets, times, tokens


def replay(sim, requests, pool: int = 1 << 16, events: int = 1 << 16) -> None:
    """``sim.request(r)`` for each of ``requests``, compiled: ``sim``'s counts, TTFTs and
    transfers come out as that loop leaves them (its tiers stay empty); ``Uncovered``
    before anything changes where it cannot. ``pool`` and ``events``: the slots and
    transfer records to start with (each grows as needed)."""
    fleet, n = sim.fleet, sim.fleet.instances
    keys, offsets, times, tokens = _arrays(fleet, requests)
    lengths = np.diff(offsets)
    firsts = keys.view(np.uint64)[offsets[:-1][lengths > 0]] % np.uint64(n)  # affinity: a prompt's first chunk
    affinity = np.full(len(requests), -1, np.int64)
    affinity[lengths > 0] = firsts.astype(np.int64)
    # a tier never holds more chunks than the trace has, nor does min_tokens matter past
    # its longest prompt: the same answers, in 64-bit integers
    most = len(keys) + 1
    per_instance = [min(most, fleet.chunks(size)) for size in (fleet.gpu, fleet.memory, fleet.disk)]
    cap = np.array(per_instance * n + [min(most, fleet.chunks(fleet.shared_size)) if fleet.shared else 0], np.int64)
    costs = fleet.costs
    cost_s = np.array([0.0] + [costs[m].ms / 1000 for m in WHERE[1:]])
    cost_rate = np.array([1.0] + [costs[m].gbps * 1e9 for m in WHERE[1:]])
    lower = np.array([SHARED if m == "shared" else PEERS for m in sim.lower], np.int64)
    config_i = np.array([n, ROUTERS[fleet.router], fleet.chunk_tokens, fleet.chunk_bytes,
                         fleet.save_policy == "always", min(fleet.min_tokens, int(tokens.max(initial=0)) + 1),
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
    longest = int(lengths.max()) if len(requests) else 0
    scratch = np.zeros((6, max(longest, n) + 1), np.int64)
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
    """Empty tiers of capacities ``cap`` (chunks) over a pool of ``pool`` slots; the table's
    hash seeded afresh (keys made to collide under one seed do not under the next)."""
    size, head, tail = np.zeros(len(cap), np.int64), np.full(len(cap), -1, np.int64), np.full(len(cap), -1, np.int64)
    seed = np.frombuffer(os.urandom(8), np.uint64).copy()
    return (cap, size, head, tail, np.full((pool, 4), -1, np.int64), np.full(_table_size(pool), -1, np.int64), seed)


def _table_size(pool: int) -> int:
    return 1 << (2 * pool - 1).bit_length()  # at most half full


def _grown(tiers: tuple, used: int, pool: int) -> tuple:
    """The tiers over a pool of ``pool`` slots, the first ``used`` kept, the table made again."""
    cap, size, head, tail, slots, _, seed = tiers
    grown = np.full((pool, 4), -1, np.int64)
    grown[:used] = slots[:used]
    out = (cap, size, head, tail, grown, np.full(_table_size(pool), -1, np.int64), seed)
    _index_all(out, used)
    return out


if njit is not None:
    from lmtier.plan._loop import _first_repeat, _index_all, _replay

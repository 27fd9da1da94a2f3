"""The compiled loop of ``lmtier.plan.compiled`` (numba): ``Simulation.request``'s steps,
one request after another, over the tiers of ``compiled._tiers``. Imported only where
numba is installed. Each step names the line of ``sim.py`` it follows."""

from __future__ import annotations

import numpy as np
from numba import njit

# the same codes as lmtier/plan/compiled.py's (imported from it they would make a circle)
GPU, MEMORY, DISK, SHARED, PEERS = range(5)
FREE, NEXT, OLDEST, EVENTS, PROMPT, STARTED = range(6)
MIX1, MIX2, MIX3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)
S33, S1 = np.uint64(33), np.uint64(1)


# -- the tiers: (cap, size, head, tail, slots, table, seed) ----------------------------------
# slots: a row per chunk held: its key (the bits of the uint64), tier, the slots before and
# after it in its tier's order (one cache line); table: -1, or a slot and, above bit 32, a
# fingerprint of its (tier, key) hash, so that a probe reads a slot only where they agree
KEY, TIER, BEFORE, AFTER = range(4)


@njit(cache=True, inline="always")
def _hash(key, t, seed):
    """(tier, key) mixed with the run's seed (MurmurHash3's finalizer): 63 bits."""
    x = np.uint64(key) ^ seed ^ (np.uint64(t) * MIX1)
    x = (x ^ (x >> S33)) * MIX2
    x = (x ^ (x >> S33)) * MIX3
    return np.int64((x ^ (x >> S33)) >> S1)


@njit(cache=True)
def _find(tiers, t, key):
    """The slot of ``key`` in tier ``t``, or -1."""
    size, slots, table = tiers[1], tiers[4], tiers[5]
    if size[t] == 0:
        return -1
    mask = len(table) - 1
    x = _hash(key, t, tiers[6][0])
    h, mark = x & mask, x >> 32
    while True:
        e = table[h]
        if e < 0:
            return -1
        s = e & 0xFFFFFFFF
        if e >> 32 == mark and slots[s, KEY] == key and slots[s, TIER] == t:
            return s
        h = (h + 1) & mask


@njit(cache=True)
def _index(tiers, s):
    slots, table = tiers[4], tiers[5]
    mask = len(table) - 1
    x = _hash(slots[s, KEY], slots[s, TIER], tiers[6][0])
    h = x & mask
    while table[h] >= 0:
        h = (h + 1) & mask
    table[h] = (x >> 32) << 32 | s


@njit(cache=True)
def _first_repeat(keys, offsets):
    """The first request that names one key twice, or -1."""
    for r in range(len(offsets) - 1):
        a, b = offsets[r], offsets[r + 1]
        if b - a > 1:
            ordered = np.sort(keys[a:b])
            for j in range(1, b - a):
                if ordered[j] == ordered[j - 1]:
                    return r
    return -1


@njit(cache=True)
def _index_all(tiers, used):
    for s in range(used):
        _index(tiers, s)


@njit(cache=True)
def _unindex(tiers, s):
    """Slot ``s`` out of the table (linear probing's backward shift: no tombstones)."""
    slots, table = tiers[4], tiers[5]
    mask = len(table) - 1
    i = _hash(slots[s, KEY], slots[s, TIER], tiers[6][0]) & mask
    while table[i] & 0xFFFFFFFF != s:
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        e = table[j]
        if e < 0:
            break
        sj = e & 0xFFFFFFFF
        h = _hash(slots[sj, KEY], slots[sj, TIER], tiers[6][0]) & mask
        if (i <= j and (h <= i or h > j)) or (i > j and h <= i and h > j):
            table[i] = e
            i = j
    table[i] = -1


@njit(cache=True)
def _unlink(tiers, t, s):
    head, tail, slots = tiers[2], tiers[3], tiers[4]
    p, q = slots[s, BEFORE], slots[s, AFTER]
    if p >= 0:
        slots[p, AFTER] = q
    else:
        head[t] = q
    if q >= 0:
        slots[q, BEFORE] = p
    else:
        tail[t] = p


@njit(cache=True)
def _append(tiers, t, s):
    head, tail, slots = tiers[2], tiers[3], tiers[4]
    slots[s, BEFORE], slots[s, AFTER] = tail[t], -1
    if tail[t] >= 0:
        slots[tail[t], AFTER] = s
    else:
        head[t] = s
    tail[t] = s


@njit(cache=True)
def _to_end(tiers, t, s):
    """Slot ``s`` made its tier's most recent (``move_to_end``)."""
    if tiers[3][t] != s:
        _unlink(tiers, t, s)
        _append(tiers, t, s)


@njit(cache=True)
def _touch(tiers, t, key):
    s = _find(tiers, t, key)
    if s >= 0:
        _to_end(tiers, t, s)


@njit(cache=True)
def _insert(tiers, t, key, state):
    """``key``, not held, stored as tier ``t``'s most recent, its oldest evicted if full."""
    cap, size, slots = tiers[0], tiers[1], tiers[4]
    if size[t] >= cap[t]:
        s = tiers[2][t]
        _unindex(tiers, s)
        _unlink(tiers, t, s)
    else:
        s = state[FREE]
        state[FREE] += 1
        size[t] += 1
    slots[s, KEY], slots[s, TIER] = key, t
    _append(tiers, t, s)
    _index(tiers, s)


@njit(cache=True)
def _add(tiers, t, key, only_new, state):
    """``Tier.add_many`` of one key: stored, or made most recent (left with ``only_new``);
    1 where it was not held."""
    s = _find(tiers, t, key)
    if s >= 0:
        if not only_new:
            _to_end(tiers, t, s)
        return 0
    _insert(tiers, t, key, state)
    return 1


# -- one request after another ---------------------------------------------------------------
@njit(cache=True)
def _held(tiers, i, key):
    """Whether instance ``i``'s engine cache, memory or disk holds ``key`` (the router's view)."""
    return _find(tiers, 3 * i + 1, key) >= 0 or _find(tiers, 3 * i + 2, key) >= 0 or _find(tiers, 3 * i, key) >= 0


@njit(cache=True)
def _route(r, keys, a, b, times, affinity, config_i, config_f, tiers, state, recent, picks, hold, keep):
    """``Simulation.route``."""
    n, router = config_i[0], config_i[1]
    if router == 1 and b > a:
        return affinity[r]
    if router != 2:
        pick = state[NEXT] % n
        state[NEXT] += 1
        return pick
    oldest = times[r] - config_f[1]  # _kv_aware: the window's requests, in arrival order
    while state[OLDEST] < r and times[state[OLDEST]] < oldest:
        recent[picks[state[OLDEST]]] -= 1
        state[OLDEST] += 1
    mean = recent.sum() / n
    holding = 0  # instances holding the longest prefix (hold[:n]), narrowed key by key
    for i in range(n):
        hold[i] = 1
    for j in range(a, b):
        kept = 0
        for i in range(n):
            keep[i] = 1 if hold[i] and _held(tiers, i, keys[j]) else 0
            kept += keep[i]
        if kept == 0:
            break
        hold[:n] = keep[:n]
        holding = kept
    pick = -1
    if holding:
        for i in range(n):
            if hold[i] and (pick < 0 or recent[i] < recent[pick]):
                pick = i
        if recent[pick] > config_f[0] * max(mean, 1.0):
            pick = -1
    if pick < 0:
        pick = 0
        for i in range(1, n):
            if recent[i] < recent[pick]:
                pick = i
    return pick


@njit(cache=True)
def _lower(tiers, inst, key, lower, n):
    """``Simulation._find_lower``: (SHARED, -1), (PEERS, holder) or (-1, -1)."""
    for medium in lower:
        if medium == SHARED:
            if _find(tiers, 3 * n, key) >= 0:
                return SHARED, -1
            continue
        for other in range(n):
            if other != inst and (_find(tiers, 3 * other + 1, key) >= 0 or _find(tiers, 3 * other + 2, key) >= 0):
                return PEERS, other
    return -1, -1


@njit(cache=True)
def _event(events, state, link, who, start, took, nbytes):
    e = state[EVENTS]
    events[e, 0], events[e, 1], events[e, 2], events[e, 3], events[e, 4] = link, who, start, took, nbytes
    state[EVENTS] += 1


@njit(cache=True)
def _replay(keys, offsets, times, tokens, affinity, lower, config_i, config_f, cost_s, cost_rate,
            tiers, state, clock, counts, served, busy, recent, picks, ttft, events, scratch,
            first_request):  # fmt: skip
    """Requests from ``first_request`` on, until the last or until the next could need more
    slots or transfers than are left; returns the next request to replay."""
    n, chunk, per = config_i[0], config_i[2], config_i[3]
    always, min_tokens, has_lower, has_shared = config_i[4], config_i[5], config_i[6], config_i[7]
    cap = tiers[0]
    run_where, run_start, run_end, peer_at, peer_of, fresh = (scratch[0], scratch[1], scratch[2], scratch[3],
                                                              scratch[4], scratch[5])  # fmt: skip
    hold, keep = np.zeros(n, np.int64), np.zeros(n, np.int64)
    own = np.zeros(3, np.int64)
    fresh_keys = np.zeros(scratch.shape[1], np.int64)
    loaded, order = np.zeros(5, np.int64), np.zeros(5, np.int64)
    for r in range(first_request, len(times)):
        a, b = offsets[r], offsets[r + 1]
        nk = b - a
        if state[FREE] + 4 * nk > len(tiers[4]) or state[EVENTS] + 3 + n > len(events):
            return r
        inst = _route(r, keys, a, b, times, affinity, config_i, config_f, tiers, state, recent, picks, hold, keep)
        picks[r] = inst
        recent[inst] += 1 if config_i[1] == 2 else 0
        gpu, memory, disk, shared = 3 * inst, 3 * inst + 1, 3 * inst + 2, 3 * n
        owned = 0  # its own tiers a chunk is read from, fastest first
        for t in (gpu, memory, disk):
            if cap[t] > 0:
                own[owned] = t
                owned += 1
        # lookup: runs of (where, start, end), in its own tiers, one chunk each from below
        runs, peers, hit = 0, 0, 0
        while hit < nk:
            key = keys[a + hit]
            where = -1
            for o in range(owned):
                t = own[o]
                if _find(tiers, t, key) >= 0:
                    end = hit + 1  # run_end
                    while end < nk and _find(tiers, t, keys[a + end]) >= 0:
                        end += 1
                    for f in range(o):
                        if tiers[1][own[f]] > 0:
                            for e in range(hit, end):
                                if _find(tiers, own[f], keys[a + e]) >= 0:
                                    end = e
                                    break
                    where = t - gpu
                    break
            if where < 0:
                if len(lower) == 0:
                    break
                where, holder = _lower(tiers, inst, key, lower, n)
                if where < 0:
                    break
                if where == PEERS:
                    peer_at[peers], peer_of[peers] = hit, holder
                    peers += 1
                end = hit + 1
            run_where[runs], run_start[runs], run_end[runs] = where, hit, end
            runs += 1
            hit = end
        loaded[:] = 0
        media = 0
        for i in range(runs):
            where, m = run_where[i], run_end[i] - run_start[i]
            counts[0, where] += m * chunk
            if where != GPU:
                if loaded[where] == 0:
                    order[media] = where
                    media += 1
                loaded[where] += m
                counts[1, where] += m
        # load: the engine's cache and memory read, head most recent; then those below
        below = 0
        for i in range(runs - 1, -1, -1):
            where = run_where[i]
            if where in (MEMORY, GPU):
                for j in range(run_end[i] - 1, run_start[i] - 1, -1):
                    _touch(tiers, gpu + where, keys[a + j])
            else:
                for j in range(run_end[i] - 1, run_start[i] - 1, -1):
                    fresh[below] = j * 8 + where  # (position, where) in one
                    below += 1
        to_disk, to_shared = 0, 0
        for i in range(below):
            j, where = fresh[i] // 8, fresh[i] % 8
            key = keys[a + j]
            if where == DISK:
                _touch(tiers, disk, key)
            elif where == SHARED:
                _touch(tiers, shared, key)
            if cap[memory] > 0:  # _promote
                _add(tiers, memory, key, False, state)
                counts[2, MEMORY] += 1
            if where == DISK:
                continue
            if cap[disk] > 0 and _find(tiers, disk, key) < 0:
                _insert(tiers, disk, key, state)
                counts[2, DISK] += 1
                to_disk += 1
            if where == PEERS and has_shared and lower[0] == SHARED and cap[shared] > 0:
                _add(tiers, shared, key, False, state)
                counts[2, SHARED] += 1
                to_shared += 1
        for i in range(peers):  # what each holder's sidecar served
            key, p = keys[a + peer_at[i]], peer_of[i]
            served[p] += 1
            if _find(tiers, 3 * p + 1, key) >= 0:
                _touch(tiers, 3 * p + 1, key)
            else:
                _touch(tiers, 3 * p + 2, key)
        state[PROMPT] += tokens[r]
        # save: what the policy admits to memory; the prompt to the engine's cache; below
        first = nk if always or tokens[r] >= min_tokens else 0
        nfresh = 0
        for j in range(hit, first):
            if _find(tiers, memory, keys[a + j]) < 0:
                fresh_keys[nfresh] = keys[a + j]
                nfresh += 1
        if nfresh and cap[memory] > 0:
            for i in range(nfresh - 1, -1, -1):  # add_new, tail first
                if _find(tiers, memory, fresh_keys[i]) < 0:
                    _insert(tiers, memory, fresh_keys[i], state)
                    counts[2, MEMORY] += 1
        touched = hit if nfresh == first - hit else max(hit, first)
        for j in range(touched - 1, -1, -1):
            _touch(tiers, memory, keys[a + j])
        if cap[gpu] > 0:
            for j in range(nk - 1, -1, -1):
                _add(tiers, gpu, keys[a + j], False, state)
        if nfresh and has_lower:  # _write_lower, write-through
            if cap[disk] > 0:
                for i in range(nfresh):
                    m = _add(tiers, disk, fresh_keys[i], True, state)
                    counts[2, DISK] += m
                    to_disk += m
            if has_shared and cap[shared] > 0:
                for i in range(nfresh):
                    m = _add(tiers, shared, fresh_keys[i], True, state)
                    counts[2, SHARED] += m
                    to_shared += m
        # the time to a first token
        compute = (tokens[r] - hit * chunk) / config_f[2]
        load = 0.0
        for i in range(media):
            where = order[i]
            load += cost_s[where] + (loaded[where] * per) / cost_rate[where]
        took = config_f[3] + compute + load
        ttft[r] = took
        t = times[r]
        if not state[STARTED]:
            state[STARTED] = 1
            clock[0] = t
        if t + took > clock[1]:
            clock[1] = t + took
        busy[inst] += compute
        disk_n = loaded[DISK] + to_disk
        shared_n = loaded[SHARED] + to_shared
        network = shared_n + loaded[PEERS]
        if disk_n:
            _event(events, state, 0, inst, t, took, disk_n * per)
        if network:
            _event(events, state, 1, inst, t, took, network * per)
        if shared_n:
            _event(events, state, 2, 0, t, took, shared_n * per)
        for p in range(n):  # the holders' sidecars send what peers read, in their order
            m = 0
            for i in range(peers):
                m += peer_of[i] == p
            if m:
                _event(events, state, 1, p, t, took, m * per)
    return len(times)

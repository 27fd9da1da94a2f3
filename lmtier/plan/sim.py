"""A fleet replayed request by request: ``simulate(fleet, requests) -> dict``.

Each instance has the engine's own prefix cache (``gpu``), lmtier's memory tier and
optionally a disk tier; the fleet optionally one shared tier, and with ``peers`` each
instance reads what the others' memory and disk hold (their sidecars). Every tier evicts
as lmtier's own do: in the memory tier's order (``lmtier.tiers.cpu.index.Index``: least
recently used first, a prompt's head made most recent so that it loses its tail first;
``Tier`` keeps that order, checked against ``Index`` by the tests); what reaches the
lower tiers is the save policy's call (``lmtier.store.admission.SavePolicy``, the same
calls an engine's store makes).

A request, on the instance its router picks:

1. **Lookup**: the leading run of its chunks found, each in the fastest place that holds
   it: the engine's cache, memory, disk, then the shared tier and peers (the first other
   instance, in their order, whose memory or disk holds it) in the order of their cost.
   A chunk found nowhere ends the run (the rest is computed).
2. **Load**: the chunks found in the engine's cache and memory are read (made most
   recent) first; then each chunk found below memory is promoted into the tiers above
   the one that held it; and every chunk of the prompt lands in the engine's cache.
3. **Save**: the chunks the policy admits (``admit_first``) go to memory; in write-through
   mode the new ones the policy admits (``admit_lower``) to disk and the shared tier; in
   write-back mode (``reuse``) memory's evictions are offered instead.

TTFT is estimated as a request's own time (``request_ms``), the prefill of the tokens not
found (at ``prefill_tokens_per_s``) and, per medium a request loaded from, one round trip
and its bytes at the medium's rate (``Fleet.costs``); queueing is not modelled (a link
over its rate is a warning). Links are counted per second of trace time,
a request's bytes spread over the seconds it takes to its first token: the shared tier's
traffic (reads and writes), and per instance its network (peers and the shared tier) and
its disk; each reported as the mean over the trace and the peak second. An instance's
prefill seconds over the trace's are its ``prefill_busy``: over 1, it could not keep up.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Sequence
from itertools import filterfalse
from typing import Any

import numpy as np

from lmtier.plan import compiled as compiled_loop
from lmtier.plan.fleet import Fleet
from lmtier.plan.tiers import Tier, consume, run_end, tier
from lmtier.plan.traces import Request
from lmtier.store.admission import SavePolicy
from lmtier.store.tiered import policy_keys

LOCAL = ("gpu", "memory", "disk")
SPREAD_S = 600  # a request's traffic is spread over its seconds to a first token, at most these
COMPILED_FROM = 100_000  # requests: a shorter plan replays in Python about as soon as numba first compiles
POLICY_KEYS = 1 << 25  # the save policies' sketches of all instances together, in keys (a few hundred MiB)


def as_bytes(keys: list[int]) -> list[bytes]:
    """A plan's keys as the save policy hashes them (its sketch takes bytes)."""
    return [k.to_bytes(8, "little") for k in keys]


class Instance:
    def __init__(self, i: int, fleet: Fleet, sim: Simulation) -> None:
        self.i = i
        # sized as a store sizes it (the chunks its tiers hold, within [4,096, 4M]), and
        # within the plan's budget of POLICY_KEYS over all its instances, which comes first
        capacity = fleet.memory + fleet.disk + (fleet.shared_size if fleet.shared else 0)
        keys = min(max(1 << 12, policy_keys(capacity, fleet.chunk_bytes)), POLICY_KEYS // fleet.instances)
        self.policy = SavePolicy(fleet.save_policy, min_tokens=fleet.min_tokens, keys=keys)
        # write-back needs memory in front of another tier (as a store does: else through)
        self.lower = bool(fleet.disk or fleet.shared)  # a disk or a shared tier below memory
        self.write_mode = self.policy.write_mode if fleet.chunks(fleet.memory) and self.lower else "through"
        back = self.write_mode == "back"
        self.gpu = Tier("gpu", fleet.chunks(fleet.gpu))  # the engine's own: LRU
        self.memory = tier("memory", fleet.chunks(fleet.memory), fleet.eviction["memory"],
                           (lambda key, reads: sim.demote(self, key, reads)) if back else None)  # fmt: skip
        self.disk = tier("disk", fleet.chunks(fleet.disk), fleet.eviction["disk"])
        # its own tiers a chunk is read from, fastest first, each with those above it
        own = [(name, t) for name, t in (("gpu", self.gpu), ("memory", self.memory), ("disk", self.disk)) if t.capacity]
        self.own = [(name, t, [u for _, u in own[:j]]) for j, (name, t) in enumerate(own)]
        self.recent: deque[float] = deque()  # arrivals within the KV-aware router's window
        # write-back: in memory, and the lower tiers held it (its eviction writes nothing)
        self.stored_below: dict[int, bool] = {}

    def holds(self, key: int) -> bool:
        """Whether this instance's sidecar can serve ``key`` to a peer (memory or disk)."""
        return key in self.memory or key in self.disk


class Simulation:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.instances = [Instance(i, fleet, self) for i in range(fleet.instances)]
        shared = fleet.chunks(fleet.shared_size)
        self.shared = tier("shared", shared, fleet.eviction["shared"]) if fleet.shared else None
        lower = [("shared", fleet.costs["shared"])] if self.shared is not None else []
        if fleet.peers and fleet.instances > 1:
            lower.append(("peers", fleet.costs["peers"]))
        chunk = fleet.chunk_bytes
        self.lower = [name for name, cost in sorted(lower, key=lambda m: m[1].seconds(chunk))]
        self.next = 0
        self.tokens = dict.fromkeys(("prompt", *LOCAL, "shared", "peers"), 0)
        self.read = dict.fromkeys(("memory", "disk", "shared", "peers"), 0)  # chunks
        self.written = dict.fromkeys(("memory", "disk", "shared"), 0)
        self.served = [0] * fleet.instances  # chunks each instance's sidecar served to peers
        self.ttft = array("d")
        # per link, the transfers: who, when, for how long, how many bytes (``spread``)
        self.links = {link: (array("q"), array("d"), array("d"), array("d")) for link in ("shared", "network", "disk")}
        self.to_disk = self.to_shared = 0  # chunks the request being replayed wrote there
        self.fixed = fleet.request_ms / 1000
        self.busy = [0.0] * fleet.instances  # seconds of prefill each instance computed
        self.start: float | None = None  # the first arrival, and the last first token
        self.end = 0.0

    # -- routing ---------------------------------------------------------------------------
    def route(self, r: Request) -> Instance:
        fleet, n = self.fleet, self.fleet.instances
        if fleet.router == "affinity" and r.keys:
            return self.instances[r.keys[0] % n]
        if fleet.router == "kv_aware":
            return self._kv_aware(r)
        inst = self.instances[self.next % n]
        self.next += 1
        return inst

    def _kv_aware(self, r: Request) -> Instance:
        """The least loaded instance holding the longest prefix, unless its requests in the
        window are over ``spill`` times the mean: then the least loaded of all."""
        fleet, n = self.fleet, self.fleet.instances
        for inst in self.instances:
            while inst.recent and inst.recent[0] < r.t - fleet.window:
                inst.recent.popleft()
        loads = [len(inst.recent) for inst in self.instances]
        mean = sum(loads) / n
        best: list[Instance] = []  # the instances holding the longest prefix (in the engine's cache, memory or disk)
        holding = self.instances
        for key in r.keys:
            holding = [inst for inst in holding if key in inst.memory or key in inst.disk or key in inst.gpu]
            if not holding:
                break
            best = holding
        pick = -1
        if best:
            pick = min((inst.i for inst in best), key=lambda i: (loads[i], i))
            if loads[pick] > fleet.spill * max(mean, 1.0):
                pick = -1
        if pick < 0:
            pick = min(range(n), key=lambda i: (loads[i], i))
        inst = self.instances[pick]
        inst.recent.append(r.t)
        return inst

    # -- one request -----------------------------------------------------------------------
    def request(self, r: Request) -> None:
        fleet, keys = self.fleet, r.keys
        inst = self.route(r)
        policy, gpu, memory, disk = inst.policy, inst.gpu, inst.memory, inst.disk
        if policy.sketch is not None:
            policy.seen(as_bytes(keys))
        # lookup: the leading run of chunks found, each where it is read from: runs of
        # (where, start, end) in the instance's own tiers, one chunk each from below them
        runs: list[tuple[str, int, int]] = []
        peer_keys: list[int] = []
        peer_of: list[int] = []
        hit, n, lower = 0, len(keys), self.lower
        while hit < n:
            key = keys[hit]
            for name, t, above in inst.own:
                if key in t:
                    end = run_end(keys, hit, t, above)
                    runs.append((name, hit, end))
                    hit = end
                    break
            else:
                where = self._find_lower(inst, key) if lower else None
                if where is None:
                    break
                if type(where) is int:
                    peer_keys.append(key)
                    peer_of.append(where)
                    where = "peers"
                runs.append((where, hit, hit + 1))
                hit += 1
        chunk, per, tokens, read = fleet.chunk_tokens, fleet.chunk_bytes, self.tokens, self.read
        loaded: dict[str, int] = {}  # chunks read per medium (the engine's cache loads nothing)
        for where, start, end in runs:
            tokens[where] += (end - start) * chunk
            if where != "gpu":
                loaded[where] = loaded.get(where, 0) + end - start
                read[where] += end - start
        # the hits read, the head most recent: first those in the engine's cache and memory
        # (read first, as a store reads them), then those below, promoted into memory
        lru = type(memory) is Tier
        below: list[tuple[int, str]] = []
        for where, start, end in reversed(runs):
            if where == "memory":
                if lru:
                    consume(map(memory.move_to_end, reversed(keys[start:end])))
                    if memory.on_evict is not None:  # its reads (for write-back's policy)
                        for key in keys[start:end]:
                            memory[key] += 1
                else:
                    for key in reversed(keys[start:end]):
                        memory.touch(key, read=True)
            elif where == "gpu":
                consume(map(gpu.move_to_end, reversed(keys[start:end])))
            else:
                below += ((key, where) for key in reversed(keys[start:end]))
        for key, where in below:
            if where == "disk":
                disk.touch(key, read=True)
            elif where == "shared":
                self.shared.touch(key, read=True)  # type: ignore[union-attr]
            self._promote(inst, key, where)
        if peer_of:
            for key, p in zip(peer_keys, peer_of, strict=True):  # what each holder's sidecar served
                self.served[p] += 1
                owner = self.instances[p]
                (owner.memory if key in owner.memory else owner.disk).touch(key, read=True)
        tokens["prompt"] += r.tokens
        # save: what the policy admits to memory, the head most recent; the whole prompt to
        # the engine's cache; in write-through mode, what it admits below at once
        first = policy.admit_first(keys, r.tokens)
        fresh = list(filterfalse(memory.__contains__, keys[hit:first]))
        if fresh:
            self.written["memory"] += memory.add_new(fresh[::-1])
        if lru:  # the prompt's chunks touched: its head most recent (a use for no other policy)
            # the new ones went in tail first, behind the hits: the hits to move, or all where
            # some chunk after the hits was in memory already
            touched = hit if len(fresh) == first - hit else max(hit, first)
            consume(map(memory.move_to_end, filter(memory.__contains__, reversed(keys[:touched]))))
        if gpu.capacity:
            gpu.add_many(keys[::-1])  # the engine computed or loaded the whole prompt
        if fresh and inst.write_mode == "through" and inst.lower:
            if policy.sketch is not None:
                fresh = [k for k, ok in zip(fresh, policy.admit_lower(as_bytes(fresh)), strict=True) if ok]
            self._write_lower(inst, fresh)
        # the estimate of the time to a first token
        compute = (r.tokens - hit * chunk) / fleet.prefill_tokens_per_s
        load = sum(fleet.costs[m].seconds(n * per) for m, n in loaded.items()) if loaded else 0.0
        took = self.fixed + compute + load
        self.ttft.append(took)
        if self.start is None:
            self.start = r.t
        if r.t + took > self.end:
            self.end = r.t + took
        self.busy[inst.i] += compute
        # this request's traffic, reads and writes, per link (writes counted as they happened),
        # spread over the seconds the request takes to its first token
        disk_n = loaded.get("disk", 0) + self.to_disk
        shared_n = loaded.get("shared", 0) + self.to_shared
        network = shared_n + loaded.get("peers", 0)
        self.to_disk = self.to_shared = 0
        if disk_n:
            self._spread("disk", inst.i, r.t, took, disk_n * per)
        if network:
            self._spread("network", inst.i, r.t, took, network * per)
        if shared_n:
            self._spread("shared", 0, r.t, took, shared_n * per)
        for p in sorted(set(peer_of)):  # the holders' sidecars send what peers read, in their order
            self._spread("network", p, r.t, took, peer_of.count(p) * per)

    def _find_lower(self, inst: Instance, key: int) -> str | int | None:
        """Where ``key``, in none of the instance's own tiers, is read from: the shared tier,
        another instance (a peer), in the order of their cost; or None."""
        for medium in self.lower:
            if medium == "shared":
                if key in self.shared:  # type: ignore[operator]
                    return "shared"
                continue
            for other in self.instances:  # the first other instance whose sidecar holds it
                if other is not inst and other.holds(key):
                    return other.i
        return None

    def _promote(self, inst: Instance, key: int, where: str) -> None:
        """A hit below memory lands in this instance's tiers above the one that held it
        (memory; and disk for a shared or peer hit; and the shared tier for a peer's
        chunk where the shared tier comes first)."""
        if inst.memory.add(key):
            self.written["memory"] += 1
            if inst.write_mode == "back":
                inst.stored_below[key] = True
        if where == "disk":
            return
        if inst.disk.capacity and key not in inst.disk and inst.disk.add(key):
            self.written["disk"] += 1
            self.to_disk += 1
        if where == "peers" and self.shared is not None and self.lower[0] == "shared" and self.shared.add(key):
            self.written["shared"] += 1
            self.to_shared += 1

    def _write_lower(self, inst: Instance, keys: list[int]) -> None:
        """``keys`` to the disk and the shared tier, where not there already."""
        if inst.write_mode == "back":
            for key in keys:
                if key in inst.memory:
                    inst.stored_below[key] = True
        if inst.disk.capacity:
            n = inst.disk.add_many(keys, only_new=True)
            self.written["disk"] += n
            self.to_disk += n
        if self.shared is not None:
            n = self.shared.add_many(keys, only_new=True)
            self.written["shared"] += n
            self.to_shared += n

    def demote(self, inst: Instance, key: int, reads: int) -> None:
        """Memory let ``key`` go (write-back): the policy's call to write it down, unless
        the lower tiers held it when it came into memory (a promotion) or it was written
        since (the store's ``written`` mark: its eviction writes nothing)."""
        if inst.stored_below.pop(key, False):
            return
        if inst.policy.admit_lower(as_bytes([key]), [reads])[0]:
            self._write_lower(inst, [key])

    def _spread(self, link: str, who: int, start: float, took: float, nbytes: float) -> None:
        """``nbytes`` moved over [start, start + took] (at most SPREAD_S seconds) on ``who``'s
        ``link``; each second's share is summed at the end (``spread``)."""
        event = self.links[link]
        event[0].append(who)
        event[1].append(start)
        event[2].append(took)
        event[3].append(nbytes)

    # -- the report --------------------------------------------------------------------------
    def warnings(self, links: dict[str, dict]) -> list[str]:
        """Each link whose traffic is over its medium's rate (``Fleet.costs``): at peak,
        loads there would queue, which the TTFT estimate leaves out; on average, the link
        cannot keep up at all."""
        costs = self.fleet.costs
        rates = {"shared": costs["shared"].gbps, "disk": costs["disk"].gbps,
                 "network": max(costs["peers"].gbps, costs["shared"].gbps)}  # fmt: skip
        out = []
        for link, rate in rates.items():
            mean, peak, of = links[link]["mean_bytes_per_s"], links[link]["peak_bytes_per_s"], links[link]["of"]
            if mean > rate * 1e9:
                out.append(f"{link} ({of}): a mean of {mean / 1e9:.2f} GB/s is over its {rate:g} GB/s: it cannot "
                           "keep up; the TTFT estimate is far too low")  # fmt: skip
            elif peak > rate * 1e9:
                out.append(f"{link} ({of}): a peak of {peak / 1e9:.2f} GB/s is over its {rate:g} GB/s: loads in "
                           "its busiest second would queue, which the TTFT estimate leaves out")  # fmt: skip
        return out

    def _overloaded(self, busy: dict[str, float]) -> list[str]:
        """Instances asked for more prefill than they compute in the trace's time."""
        if busy["busiest"] <= 1.0:
            return []
        what = "the fleet" if busy["mean"] > 1.0 else "the busiest instance"
        share = busy["mean"] if busy["mean"] > 1.0 else busy["busiest"]
        return [f"prefill ({what}): {share:.0%} of its time computing prompts: requests would queue, which the "
                "TTFT estimate leaves out; add instances or cache"]  # fmt: skip

    def report(self, span: float) -> dict[str, Any]:
        fleet, prompt = self.fleet, max(1, self.tokens["prompt"])
        hits = {m: self.tokens[m] for m in (*LOCAL, "shared", "peers")}
        saved = sum(hits.values())
        ttft = np.array(self.ttft) if self.ttft else np.zeros(1)
        links = {}
        # the trace's seconds, first arrival to last first token
        seconds = max(1.0, float(span), self.end - (self.start or 0.0))
        for link, events in self.links.items():
            totals, peak = spread(*events)
            links[link] = {
                "mean_bytes_per_s": (max(totals) if totals else 0) / seconds,
                "peak_bytes_per_s": peak,
                "of": "the fleet" if link == "shared" else "the busiest instance",
            }
        per = fleet.chunk_bytes
        busy = {"mean": sum(self.busy) / fleet.instances / seconds, "busiest": max(self.busy) / seconds}
        return {
            "warnings": fleet.empty_tiers() + self.warnings(links) + self._overloaded(busy),
            "prefill_busy": busy,
            "requests": len(self.ttft),
            "prompt_tokens": self.tokens["prompt"],
            "hit_ratio": saved / prompt,
            "hit_ratio_by_tier": {m: n / prompt for m, n in hits.items()},
            "prefill_tokens_saved": saved,
            "prefill_tokens_saved_below_gpu": saved - hits["gpu"],
            "gpu_seconds_saved": saved / fleet.prefill_tokens_per_s,
            "bytes_read": {m: n * per for m, n in self.read.items()},
            "bytes_written": {m: n * per for m, n in self.written.items()},
            "served_to_peers_tokens": [n * fleet.chunk_tokens for n in self.served],
            "links": links,
            "ttft_ms": {
                "mean": float(ttft.mean() * 1e3),
                "p50": float(np.percentile(ttft, 50) * 1e3),
                "p99": float(np.percentile(ttft, 99) * 1e3),
            },
        }


def spread(who: Sequence[int], start: Sequence[float], took: Sequence[float],
           nbytes: Sequence[float]) -> tuple[list[float], float]:  # fmt: skip
    """Transfers on one link, each its bytes at an even rate over [start, start + took] (at
    most SPREAD_S seconds): the bytes each ``who`` moved in all, and the most moved by one
    ``who`` in one second of the clock.

    Each second a transfer covers gets its share: the partial first and last seconds
    their fractions, the whole seconds between them the rate. Whole seconds are summed with
    a difference array over the seconds where some transfer starts or ends, so the work is
    per transfer, not per second: a second without such a point carries only whole-second
    rates, never more than the point before it."""
    if not len(who):
        return [], 0.0
    who_ = np.frombuffer(who, np.int64) if isinstance(who, array) else np.asarray(who, np.int64)
    start_, took_, nbytes_ = (np.asarray(x, np.float64) for x in (start, took, nbytes))
    end = start_ + np.minimum(took_, SPREAD_S)
    first, last = np.floor(start_).astype(np.int64), np.floor(end).astype(np.int64)
    whole = (first != last) & (took_ > 0)  # spans more than one second of the clock
    rate = nbytes_ / np.where(whole, end - start_, 1.0)
    head = np.where(whole, (first + 1 - start_) * rate, nbytes_)
    tail = np.where(whole, (end - last) * rate, 0.0)
    base = who_ << 42  # (who, second) as one sortable integer: seconds below 2**42
    at_first, at_next, at_last = base + first, base + first + 1, base + last
    points = np.unique(np.concatenate([at_first, at_next, at_last]))
    i_first, i_next, i_last = (np.searchsorted(points, x) for x in (at_first, at_next, at_last))
    n = len(points)
    partial = np.bincount(i_first, head, n) + np.bincount(i_last, tail, n)
    rates = np.bincount(i_next[whole], rate[whole], n + 1) - np.bincount(i_last[whole], rate[whole], n + 1)
    per_second = partial + np.cumsum(rates)[:n]  # a who's rates sum to 0 before the next who's seconds
    totals = np.bincount(who_, nbytes_)
    return [float(t) for t in totals if t], float(per_second.max())


def simulate(fleet: Fleet, requests: Sequence[Request], compiled: bool | None = None) -> dict[str, Any]:
    """Replay ``requests`` (in arrival order) through ``fleet``; the report as a dict. By
    ``lmtier.plan.compiled``'s loop (the same answers) where it covers the plan and there
    are COMPILED_FROM requests or more; ``compiled``: True insists on it, False refuses it."""
    started = time.perf_counter()
    sim = Simulation(fleet)
    fast = compiled_loop.attempt(sim, requests, compiled, COMPILED_FROM)
    if not fast:
        for r in requests:
            sim.request(r)
    span = (int(requests[-1].t) - int(requests[0].t) + 1) if requests else 0
    out = sim.report(span)
    out["fleet"] = fleet.to_dict()
    out["trace_seconds"] = (requests[-1].t - requests[0].t) if requests else 0.0
    out["simulated_in_s"] = time.perf_counter() - started
    out["replay"] = "compiled" if fast else "python"
    return out

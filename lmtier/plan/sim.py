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
   it: the engine's cache, memory, disk, then the shared tier and peers in the order of
   their cost. A chunk found nowhere ends the run (the rest is computed).
2. **Load**: each chunk found below memory is promoted into the tiers above the one that
   held it, and every chunk of the prompt lands in the engine's cache.
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
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from lmtier.plan.fleet import Fleet
from lmtier.plan.tiers import Tier, tier
from lmtier.plan.traces import Request
from lmtier.store.admission import SavePolicy
from lmtier.store.tiered import policy_keys

LOCAL = ("gpu", "memory", "disk")
SPREAD_S = 600  # a request's traffic is spread over its seconds to a first token, at most these
POLICY_KEYS = 1 << 25  # the save policies' sketches of all instances together, in keys (a few hundred MiB)


class Instance:
    def __init__(self, i: int, fleet: Fleet, held: dict | None, sim: Simulation) -> None:
        self.i = i
        # sized as a store sizes it (the chunks its tiers hold, within [4,096, 4M]), and
        # within the plan's budget of POLICY_KEYS over all its instances
        capacity = fleet.memory + fleet.disk + (fleet.shared_size if fleet.shared else 0)
        keys = max(1 << 12, min(policy_keys(capacity, fleet.chunk_bytes), POLICY_KEYS // fleet.instances))
        self.policy = SavePolicy(fleet.save_policy, min_tokens=fleet.min_tokens, keys=keys)
        # write-back needs memory in front of another tier (as a store does: else through)
        lower = fleet.disk or fleet.shared
        self.write_mode = self.policy.write_mode if fleet.chunks(fleet.memory) and lower else "through"
        self.gpu = Tier("gpu", fleet.chunks(fleet.gpu), i, held)  # the engine's own: LRU
        self.memory = tier("memory", fleet.chunks(fleet.memory), fleet.eviction["memory"], i, held,
                           on_evict=(lambda key, reads: sim.demote(self, key, reads)))  # fmt: skip
        self.disk = tier("disk", fleet.chunks(fleet.disk), fleet.eviction["disk"], i, held)
        self.recent: deque[float] = deque()  # arrivals within the router's window
        self.stored_below: dict[bytes, bool] = {}  # in memory, and the lower tiers held it: eviction writes nothing


class Simulation:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        # who holds each chunk, kept only where peers read it or the router asks
        self.held: dict[bytes, dict[int, int]] = {}
        tracked = self.held if (fleet.peers or fleet.router == "kv_aware") and fleet.instances > 1 else None
        self.instances = [Instance(i, fleet, tracked, self) for i in range(fleet.instances)]
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
        self.ttft: list[float] = []
        self.links: dict[str, dict[tuple[int, int], int]] = {"shared": {}, "network": {}, "disk": {}}
        self.to_disk = self.to_shared = 0  # chunks the request being replayed wrote there
        self.fixed = fleet.request_ms / 1000
        self.busy = [0.0] * fleet.instances  # seconds of prefill each instance computed
        self.start: float | None = None  # the first arrival, and the last first token
        self.end = 0.0

    # -- routing ---------------------------------------------------------------------------
    def route(self, r: Request) -> Instance:
        fleet, n = self.fleet, self.fleet.instances
        if fleet.router == "affinity" and r.keys:
            return self.instances[int.from_bytes(r.keys[0][:8], "little") % n]
        if fleet.router == "kv_aware":
            for inst in self.instances:
                while inst.recent and inst.recent[0] < r.t - fleet.window:
                    inst.recent.popleft()
            loads = [len(inst.recent) for inst in self.instances]
            mean = sum(loads) / n
            best: set[int] | None = None
            for key in r.keys:  # the instances holding the longest prefix
                holding = self.held.get(key)
                found = set(holding) if best is None and holding else (best & holding.keys() if holding else set())
                if not found:
                    break
                best = found
            if best:
                pick = min(best, key=lambda i: (loads[i], i))
                if loads[pick] <= fleet.spill * max(mean, 1.0):
                    return self.instances[pick]
            return self.instances[min(range(n), key=lambda i: (loads[i], i))]
        inst = self.instances[self.next % n]
        self.next += 1
        return inst

    # -- one request -----------------------------------------------------------------------
    def request(self, r: Request) -> None:
        fleet, keys = self.fleet, r.keys
        inst = self.route(r)
        inst.recent.append(r.t)
        inst.policy.seen(keys)
        sources: list[str] = []
        peer_of: list[int] = []
        for key in keys:
            where = self._find(inst, key)
            if where is None:
                break
            if isinstance(where, int):
                peer_of.append(where)
                where = "peers"
            sources.append(where)
        hit = len(sources)
        chunk, per = fleet.chunk_tokens, fleet.chunk_bytes
        loaded: dict[str, int] = {}
        for key, where in zip(reversed(keys[:hit]), reversed(sources), strict=True):  # the head most recent
            self.tokens[where] += chunk
            if where == "gpu":
                inst.gpu.touch(key)
                continue
            loaded[where] = loaded.get(where, 0) + 1
            self.read[where] += 1
            if where == "memory":
                inst.memory.touch(key, read=True)
                continue
            if where == "disk":
                inst.disk.touch(key, read=True)
            elif where == "shared" and self.shared is not None:
                self.shared.touch(key, read=True)
            self._promote(inst, key, where)
        if peer_of:
            peer_keys = [k for k, w in zip(keys, sources, strict=False) if w == "peers"]
            for key, p in zip(peer_keys, peer_of, strict=True):  # what each holder's sidecar served
                self.served[p] += 1
                owner = self.instances[p]
                (owner.memory if key in owner.memory else owner.disk).touch(key, read=True)
        self.tokens["prompt"] += r.tokens
        first = inst.policy.admit_first(keys, r.tokens)
        fresh = [k for k in keys[hit:first] if k not in inst.memory]
        for key in reversed(fresh):
            if inst.memory.add(key):
                self.written["memory"] += 1
        memory = inst.memory
        if type(memory) is Tier:  # the prompt's chunks touched: its head most recent (a use for no other policy)
            for key in reversed(keys[: max(hit, first)]):
                if key in memory:
                    memory.move_to_end(key)
        if inst.gpu.capacity:
            for key in reversed(keys):  # the engine computed or loaded the whole prompt
                inst.gpu.add(key)
        if fresh and inst.write_mode == "through":
            for key, ok in zip(fresh, inst.policy.admit_lower(fresh), strict=True):
                if ok:
                    self._write_lower(inst, key)
        compute = (r.tokens - hit * chunk) / fleet.prefill_tokens_per_s
        load = sum(fleet.costs[m].seconds(n * per) for m, n in loaded.items()) if loaded else 0.0
        took = self.fixed + compute + load
        self.ttft.append(took)
        if self.start is None:
            self.start = r.t
        self.end = max(self.end, r.t + took)
        self.busy[inst.i] += compute
        # this request's traffic, reads and writes, per link (writes counted as they happened),
        # spread over the seconds the request takes to its first token
        disk = loaded.get("disk", 0) + self.to_disk
        shared = loaded.get("shared", 0) + self.to_shared
        network = shared + loaded.get("peers", 0)
        self.to_disk = self.to_shared = 0
        for link, who, n in (("disk", inst.i, disk), ("network", inst.i, network), ("shared", 0, shared)):
            if n:
                self._spread(link, who, r.t, took, n * per)
        for p in set(peer_of):  # the holders' sidecars send what peers read
            self._spread("network", p, r.t, took, peer_of.count(p) * per)

    def _find(self, inst: Instance, key: bytes) -> str | int | None:
        """Where ``key`` is read from: a local tier's name, another instance (a peer), the
        shared tier, or None."""
        if key in inst.gpu:
            return "gpu"
        if key in inst.memory:
            return "memory"
        if key in inst.disk:
            return "disk"
        for medium in self.lower:
            if medium == "shared" and self.shared is not None and key in self.shared:
                return "shared"
            if medium == "peers":
                holding = self.held.get(key)
                if holding:
                    for p in holding:
                        other = self.instances[p]
                        if p != inst.i and (key in other.memory or key in other.disk):
                            return p
        return None

    def _promote(self, inst: Instance, key: bytes, where: str) -> None:
        """A hit below memory lands in this instance's tiers above the one that held it
        (memory; and disk for a shared or peer hit; and the shared tier for a peer's
        chunk where the shared tier comes first)."""
        if inst.memory.add(key):
            self.written["memory"] += 1
            inst.stored_below[key] = True
        if where == "disk":
            return
        if inst.disk.capacity and key not in inst.disk and inst.disk.add(key):
            self.written["disk"] += 1
            self.to_disk += 1
        if where == "peers" and self.shared is not None and self.lower[0] == "shared" and self.shared.add(key):
            self.written["shared"] += 1
            self.to_shared += 1

    def _write_lower(self, inst: Instance, key: bytes) -> None:
        if key in inst.memory:
            inst.stored_below[key] = True
        if inst.disk.capacity and key not in inst.disk and inst.disk.add(key):
            self.written["disk"] += 1
            self.to_disk += 1
        if self.shared is not None and key not in self.shared and self.shared.add(key):
            self.written["shared"] += 1
            self.to_shared += 1

    def demote(self, inst: Instance, key: bytes, reads: int) -> None:
        """Memory let ``key`` go: in write-back mode, the policy's call to write it down,
        unless the lower tiers held it when it came into memory (a promotion) or it was
        written since (the store's ``written`` mark: its eviction writes nothing)."""
        if inst.stored_below.pop(key, False) or inst.write_mode != "back":
            return
        if inst.policy.admit_lower([key], [reads])[0]:
            self._write_lower(inst, key)

    def _spread(self, link: str, who: int, start: float, took: float, nbytes: float) -> None:
        """``nbytes`` over [start, start + took] (at most SPREAD_S seconds), each second its
        share."""
        buckets = self.links[link]
        end = start + min(took, SPREAD_S)
        first, last = int(start), int(end)
        if first == last or took <= 0:
            buckets[(who, first)] = buckets.get((who, first), 0) + nbytes
            return
        rate = nbytes / (end - start)
        for second in range(first, last + 1):
            part = (min(end, second + 1) - max(start, second)) * rate
            buckets[(who, second)] = buckets.get((who, second), 0) + part

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
        for link, buckets in self.links.items():
            per_who: dict[int, float] = {}
            for (who, _), n in buckets.items():
                per_who[who] = per_who.get(who, 0) + n
            links[link] = {
                "mean_bytes_per_s": (max(per_who.values()) if per_who else 0) / seconds,
                "peak_bytes_per_s": float(max(buckets.values(), default=0)),
                "of": "the fleet" if link == "shared" else "the busiest instance",
            }
        per = fleet.chunk_bytes
        busy = {"mean": sum(self.busy) / fleet.instances / seconds, "busiest": max(self.busy) / seconds}
        return {
            "warnings": self.warnings(links) + self._overloaded(busy),
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


def simulate(fleet: Fleet, requests: Sequence[Request]) -> dict[str, Any]:
    """Replay ``requests`` (in arrival order) through ``fleet``; the report as a dict."""
    started = time.perf_counter()
    sim = Simulation(fleet)
    for r in requests:
        sim.request(r)
    span = (int(requests[-1].t) - int(requests[0].t) + 1) if requests else 0
    out = sim.report(span)
    out["fleet"] = fleet.to_dict()
    out["trace_seconds"] = (requests[-1].t - requests[0].t) if requests else 0.0
    out["simulated_in_s"] = time.perf_counter() - started
    return out

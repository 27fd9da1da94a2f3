"""Save, admission and eviction policies replayed over request traces, against Belady.

Each workload is a list of requests, each a prompt cut into 512-token chunks named by
chained keys (a chunk stands for its whole prefix, as lmtier's keys do). A request looks
its chunks up, hits the leading run held in any tier, and saves the rest; only full chunks
are stored (an engine never stores the partial last one), and the token hit ratio is the
hit chunks' tokens over all prompt tokens.

Workloads: the Mooncake synthetic trace (``../shared/traces``: long documents asked about
again minutes apart, multi-turn conversations); ``no_reuse`` (every prompt unique: the
case where every write is waste); ``system_prompts`` (a few shared system prompts, Zipf
popular, in front of unique tails); ``conversations`` (multi-turn chats whose next turn
extends the whole previous prompt, after a think time of minutes).

The simulated store drives ``lmtier.store.admission.SavePolicy`` itself (not a copy of its
logic) through the calls an engine integration makes: ``seen`` at lookup,
``admit_first`` at save, ``admit_lower`` at save (write-through) or when memory lets a
chunk go (write-back). Memory is LRU with each prompt's head most recent (a prefix loses
its tail first); a lower-tier hit is promoted into memory; the lower tier is LRU.

References, measured in the same run: **Belady** (MIN with bypass: on a miss, skip the
chunk or evict the one whose next use is farthest; ties evict the deeper chunk, so the
cache stays prefix-closed): the offline ceiling; **LRU**: one cache of the same capacity
that stores everything; **LRU + oracle admission**: LRU storing only the chunks that will
be used again, the most any admission rule can add to LRU (on the trace it stays far below
Belady at 10%: what is missing there is knowing *when* a chunk comes back).

Setups: memory only at 10/25/50% of the workload's unique chunks; memory at 10% in front
of a lower tier at 10/25/50% (the references then get the two capacities together: no
arrangement of the two tiers can beat that ceiling). Reported per policy: hit ratio, x
Belady, GiB written to memory and to the lower tier, GiB evicted unread from each.

    python benchmarks/bench_trace.py [--quick] [--trace PATH] [--min-tokens 4096] [--json-out F]
"""

from __future__ import annotations

import argparse
import heapq
import sys
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from lmtier.plan.sim import as_bytes
from lmtier.plan.traces import conversations, mooncake, no_reuse, system_prompts
from lmtier.store.admission import SavePolicy

from common import emit

CHUNK_TOKENS = 512  # one block of the trace
CHUNK_BYTES = 512 * 128 * 1024  # Llama-3-8B in bf16 keeps 128 KiB of KV per token: 64 MiB a chunk
GiB = 1024**3
TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
SIZES = (10, 25, 50)  # capacities, % of a workload's unique chunks
MEMORY_IN_FRONT = 10  # % in the two-tier setup
NEVER = 1 << 62

Request = tuple[list[bytes], int]  # (keys of the prompt's full chunks, prompt tokens)


# -- workloads (lmtier.plan.traces: the same generators `lmtier plan` replays) ---------
def load_trace(path: Path, limit: int | None = None) -> list[Request]:
    return [(r.keys, r.tokens) for r in mooncake(path, limit, CHUNK_TOKENS)]


def named(requests: list[tuple[list[int], int]]) -> list[Request]:
    """A plan's integer keys as the bytes ``SavePolicy`` hashes (``lmtier.plan.sim.as_bytes``)."""
    return [(as_bytes(keys), tokens) for keys, tokens in requests]


# -- references -----------------------------------------------------------------------
def belady(requests: list[Request], capacity: int) -> int:
    """Hit chunks of MIN with bypass: the offline optimum for equal-size chunks."""
    flat = [k for keys, _ in requests for k in keys]
    upcoming: dict[bytes, int] = {}
    nxt = [NEVER] * len(flat)
    for i in range(len(flat) - 1, -1, -1):
        nxt[i] = upcoming.get(flat[i], NEVER)
        upcoming[flat[i]] = i
    held: dict[bytes, int] = {}  # key -> its next use
    heap: list[tuple[int, int, bytes]] = []  # (-next use, -depth, key), stale entries skipped
    hits = i = 0
    for keys, _ in requests:
        leading = True
        for depth, key in enumerate(keys):
            n = nxt[i]
            i += 1
            if key in held:
                hits += leading
            else:
                leading = False
                if n == NEVER or capacity == 0:
                    continue
                if len(held) >= capacity:
                    while held.get(heap[0][2]) != -heap[0][0]:
                        heapq.heappop(heap)
                    if -heap[0][0] < n:  # everything held is needed sooner: bypass
                        continue
                    del held[heapq.heappop(heap)[2]]
            held[key] = n
            heapq.heappush(heap, (-n, -depth, key))
    return hits


def lru(requests: list[Request], capacity: int, oracle: bool = False) -> int:
    """Hit chunks of one LRU cache that stores every chunk, each prompt's head most recent;
    ``oracle``: one that stores only the chunks that will be used again (perfect admission)."""
    cache: OrderedDict[bytes, None] = OrderedDict()
    last = {k: i for i, (keys, _) in enumerate(requests) for k in keys} if oracle else {}
    hits = 0
    for i, (keys, _) in enumerate(requests):
        hit = leading(keys, cache)
        hits += hit
        for key in reversed(keys):
            if key in cache:
                cache.move_to_end(key)
            elif capacity and last.get(key, NEVER) > i:
                cache[key] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits


def leading(keys: Sequence[bytes], *tiers: object) -> int:
    n = 0
    while n < len(keys) and any(keys[n] in t for t in tiers):  # type: ignore[operator]
        n += 1
    return n


# -- the simulated store ----------------------------------------------------------------
class SimStore:
    """A memory tier, optionally a lower tier, and a SavePolicy deciding what goes where."""

    def __init__(self, policy: SavePolicy, memory: int, lower: int | None = None) -> None:
        self.policy, self.capacity, self.lower_capacity = policy, memory, lower
        self.memory: OrderedDict[bytes, int] = OrderedDict()  # key -> reads while resident
        self.lower: OrderedDict[bytes, bool] = OrderedDict()  # key -> read since written
        self.counts = dict.fromkeys(
            ("hits", "memory_written", "lower_written", "memory_evicted_unread", "lower_evicted_unread"), 0
        )

    def request(self, keys: list[bytes], tokens: int) -> int:
        policy, memory, lower = self.policy, self.memory, self.lower
        policy.seen(keys)
        hit = leading(keys, memory, lower)
        self.counts["hits"] += hit
        promoted = []
        for key in reversed(keys[:hit]):  # the load: read and touched, the head most recent
            if key in memory:
                memory[key] += 1
                memory.move_to_end(key)
            else:  # a lower-tier hit, promoted into memory
                lower[key] = True
                lower.move_to_end(key)
                promoted.append(key)
        first = policy.admit_first(keys, tokens)
        fresh = [k for k in keys[hit:first] if k not in memory]
        for key in (*reversed(fresh), *promoted):  # the save, then the promotions
            self._make_room()
            memory[key] = 0
            self.counts["memory_written"] += 1
        for key in reversed(keys[: max(hit, first)]):  # the whole prompt touched: its head most recent
            if key in memory:
                memory.move_to_end(key)
        if self.lower_capacity is not None and policy.write_mode == "through" and fresh:
            for key, ok in zip(fresh, policy.admit_lower(fresh), strict=True):
                if ok:
                    self._write_lower(key)
        return hit

    def _make_room(self) -> None:
        memory = self.memory
        while len(memory) >= self.capacity:
            key, reads = memory.popitem(last=False)
            self.counts["memory_evicted_unread"] += reads == 0
            demote = self.lower_capacity is not None and self.policy.write_mode == "back" and key not in self.lower
            if demote and self.policy.admit_lower([key], [reads])[0]:
                self._write_lower(key)

    def _write_lower(self, key: bytes) -> None:
        lower = self.lower
        if key in lower or not self.lower_capacity:
            return
        lower[key] = False
        self.counts["lower_written"] += 1
        if len(lower) > self.lower_capacity:
            self.counts["lower_evicted_unread"] += not lower.popitem(last=False)[1]


# -- the run ----------------------------------------------------------------------------
def _row(workload: dict, setup: str, memory: int, lower: int | None, policy: str, hits: int,
         ceiling: int, counts: dict | None = None) -> dict:  # fmt: skip
    row = {
        "workload": workload["name"],
        "setup": setup,
        "memory_pct": memory,
        "lower_pct": lower,
        "policy": policy,
        "hit_ratio": hits * CHUNK_TOKENS / workload["tokens"],
        "x_belady": hits / ceiling if ceiling else None,
    }
    for name, value in (counts or {}).items():
        if name != "hits":
            row[f"{name}_gib"] = value * CHUNK_BYTES / GiB
    return row


def replay(workload: dict, policies: dict[str, dict]) -> list[dict]:
    requests, unique = workload["requests"], workload["unique_chunks"]
    rows = []
    for setup, memory_pcts, lower_pcts in (
        ("memory", SIZES, (None,) * len(SIZES)),
        ("memory+lower", (MEMORY_IN_FRONT,) * len(SIZES), SIZES),
    ):
        for mem_pct, low_pct in zip(memory_pcts, lower_pcts, strict=True):
            memory = unique * mem_pct // 100
            lower = None if low_pct is None else unique * low_pct // 100
            total = memory + (lower or 0)
            ceiling = belady(requests, total)
            rows.append(_row(workload, setup, mem_pct, low_pct, "belady", ceiling, ceiling))
            rows.append(_row(workload, setup, mem_pct, low_pct, "lru", lru(requests, total), ceiling))
            rows.append(_row(workload, setup, mem_pct, low_pct, "lru+oracle admission",
                             lru(requests, total, oracle=True), ceiling))  # fmt: skip
            for label, settings in policies.items():
                store = SimStore(SavePolicy(keys=max(1024, total), **settings), memory, lower)
                for keys, tokens in requests:
                    store.request(keys, tokens)
                rows.append(_row(workload, setup, mem_pct, low_pct, label, store.counts["hits"], ceiling,
                                 store.counts))  # fmt: skip
    return rows


def workloads(trace: Path, quick: bool) -> list[dict]:
    n = 600 if quick else 4000
    made = [
        ("trace", named(load_trace(trace, 1000 if quick else None))),
        ("no_reuse", named(no_reuse(n // 4 if quick else n // 2))),
        ("system_prompts", named(system_prompts(n))),
        ("conversations", named(conversations(n))),
    ]
    out = []
    for name, requests in made:
        unique = len({k for keys, _ in requests for k in keys})
        tokens = sum(t for _, t in requests)
        reusable = sum(len(keys) for keys, _ in requests) - unique
        out.append({"name": name, "requests": requests, "unique_chunks": unique, "tokens": tokens,
                    "max_hit_ratio": reusable * CHUNK_TOKENS / tokens})  # fmt: skip
    return out


def run(trace: Path = TRACE, quick: bool = False, min_tokens: int = 4096) -> dict:
    if not trace.exists():
        raise SystemExit(f"trace not found: {trace} (the repository's ../shared/traces, or pass --trace)")
    policies = {
        "always": {"name": "always"},
        f"min_tokens={min_tokens}": {"name": "min_tokens", "min_tokens": min_tokens},
        "reuse": {"name": "reuse"},
    }
    rows, shapes = [], {}
    for w in workloads(trace, quick):
        shapes[w["name"]] = {k: w[k] for k in ("unique_chunks", "tokens", "max_hit_ratio")} | {
            "requests": len(w["requests"])
        }
        rows += replay(w, policies)
    return {
        "benchmark": "trace_replay",
        "mode": "quick" if quick else "full",
        "trace": trace.name,
        "chunk_tokens": CHUNK_TOKENS,
        "chunk_bytes": CHUNK_BYTES,
        "default_policy": "reuse",
        "workloads": shapes,
        "rows": rows,
    }


def _gib(row: dict, name: str) -> str:
    value = row.get(f"{name}_gib")
    return "" if value is None else f"{value:,.0f}"


def table(report: dict) -> str:
    lines = []
    for name, shape in report["workloads"].items():
        lines += [
            "",
            f"{name}: {shape['requests']} requests, {shape['unique_chunks']} unique chunks of {CHUNK_TOKENS} "
            f"tokens ({shape['unique_chunks'] * CHUNK_BYTES / GiB:,.0f} GiB), best possible hit ratio "
            f"{shape['max_hit_ratio']:.3f}",
            "| setup | memory | lower | policy | hit ratio | x Belady | GiB to memory | GiB to lower "
            "| memory GiB evicted unread | lower GiB evicted unread |",
            "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in (r for r in report["rows"] if r["workload"] == name):
            lower = "" if r["lower_pct"] is None else f"{r['lower_pct']}%"
            x = "" if r["x_belady"] is None else f"{r['x_belady']:.2f}"
            lines.append(
                f"| {r['setup']} | {r['memory_pct']}% | {lower} | {r['policy']} | {r['hit_ratio']:.3f} | {x} "
                f"| {_gib(r, 'memory_written')} | {_gib(r, 'lower_written')} "
                f"| {_gib(r, 'memory_evicted_unread')} | {_gib(r, 'lower_evicted_unread')} |"
            )
    return "\n".join(lines[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--quick", action="store_true", help="the trace's first 1000 requests, smaller workloads")
    parser.add_argument("--min-tokens", type=int, default=4096, help="the min_tokens policy's threshold")
    parser.add_argument("--json-out", help="also write the JSON report here")
    args = parser.parse_args(argv)
    report = run(args.trace, args.quick, args.min_tokens)
    emit(report, table(report), args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

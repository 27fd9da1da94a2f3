"""Eviction policies beyond LRU, replayed over public traces and the synthetic workloads,
against Belady: the study behind each tier's default (docs/results/eviction.md).

One cache of ``capacity`` chunks (10%, 25% and 50% of a workload's unique chunks) stores
every chunk it is offered (a prompt's, tail first: its head most recent), and a request
hits the leading run of its chunks held there. The policies are ``lmtier.plan.policies``
(lmtier's ``lru``, ``arc``, ``s3fifo``, ``tinylfu``, ``slru``), the ones ``lmtier plan``
gives a tier. References, from ``bench_trace.py``: **Belady** (MIN with bypass, the
offline ceiling) and **LRU + oracle admission** (LRU storing only the chunks that will be
used again: the most any admission rule can add to LRU).

Workloads:

- the Mooncake FAST'25 synthetic trace (``../shared/traces``) and its conversation trace
  (``benchmarks/traces``: 12,031 requests of one hour of a production chat service); a
  1,000-request slice of Mooncake's arXiv production trace (chat and templated agent
  calls; ``benchmarks/traces/README.md``);
- the synthetic workloads of ``lmtier.plan.traces`` (``system_prompts``,
  ``conversations``), each made from three seeds: the spread over seeds is the noise a
  policy's gain must exceed.

Per workload it also reports its shape: the share of chunks used only once (what an
admission rule must recognise to beat LRU) and the best hit ratio any cache reaches.

    python benchmarks/bench_eviction.py [--quick] [--json-out F]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

from lmtier.plan.fleet import Fleet
from lmtier.plan.policies import EVICTION, make
from lmtier.plan.sim import simulate
from lmtier.plan.traces import Request, conversations, mooncake, system_prompts

from bench_trace import CHUNK_TOKENS, belady, leading, lru
from common import emit

HERE = Path(__file__).resolve().parent
TRACES = {
    "mooncake synthetic": HERE.parents[1] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl",
    "mooncake conversation": HERE / "traces" / "mooncake_conversation_trace.jsonl.gz",
    "mooncake agents (arXiv slice)": HERE / "traces" / "mooncake_arxiv_slice.jsonl.gz",
}
SIZES = (10, 25, 50)  # % of a workload's unique chunks
IN_FRONT, BELOW = 5, 25  # the two-tier setup: memory (LRU) at 5% in front of a disk at 25%
SEEDS = (1, 2, 3)
TARGET = {10: 0.85, 25: 0.98}  # x Belady, the target for a default


def replay(requests: list[tuple[list[bytes], int]], policy) -> int:
    """Hit chunks of ``policy`` over ``requests``."""
    hits = 0
    for keys, _ in requests:
        hits += leading(keys, policy)
        for key in reversed(keys):
            if key in policy:
                policy.hit(key)
            else:
                policy.insert(key)
    return hits


def shape(requests: list[tuple[list[bytes], int]]) -> dict:
    uses = Counter(k for keys, _ in requests for k in keys)
    tokens = sum(t for _, t in requests)
    seen: set[bytes] = set()
    best = 0
    for keys, _ in requests:
        best += leading(keys, seen)
        seen.update(keys)
    return {
        "requests": len(requests),
        "unique_chunks": len(uses),
        "tokens": tokens,
        "used_once": sum(1 for n in uses.values() if n == 1) / max(1, len(uses)),
        "max_hit_ratio": best * CHUNK_TOKENS / max(1, tokens),
    }


def signals(requests: list[tuple[list[bytes], int]]) -> dict[str, dict[str, list[float]]]:
    """What an admission rule could know of a chunk when it is first stored, and how often
    chunks with each answer are used again: per signal, per answer, [share of new chunks,
    share of those used again]. An admission rule beats LRU only where some answer marks
    the chunks used once (a share used again near 0)."""
    uses = Counter(k for keys, _ in requests for k in keys)
    seen: set[bytes] = set()
    groups: dict[str, dict[str, list[int]]] = {}
    for keys, _ in requests:
        found = leading(keys, seen)
        for depth, key in enumerate(keys):
            if key in seen:
                continue
            seen.add(key)
            again = uses[key] > 1
            for signal, answer in (
                ("prefix found", "none" if found == 0 else "1 chunk" if found == 1 else "2+ chunks"),
                ("depth", "chunks 1-4" if depth < 4 else "chunk 5+"),
                ("last full chunk", "yes" if depth == len(keys) - 1 else "no"),
            ):
                count = groups.setdefault(signal, {}).setdefault(answer, [0, 0])
                count[0] += 1
                count[1] += again
    new = max(1, len(seen))
    return {
        signal: {answer: [n / new, again / max(1, n)] for answer, (n, again) in sorted(by.items())}
        for signal, by in groups.items()
    }


def workloads(quick: bool) -> dict[str, list[list[tuple[list[bytes], int]]]]:
    """Each workload as a list of variants (one per seed; a trace has one)."""
    limit = 1500 if quick else None
    out = {}
    for name, path in TRACES.items():
        if not path.exists():
            raise SystemExit(f"trace not found: {path}")
        out[name] = [[(r.keys, r.tokens) for r in mooncake(path, limit)]]
    n = 800 if quick else 4000
    out["system_prompts"] = [system_prompts(n, seed=10 + s) for s in SEEDS]
    out["conversations"] = [conversations(n, seed=20 + s) for s in SEEDS]
    return out


def run(quick: bool = False) -> dict:
    rows, shapes = [], {}
    for name, variants in workloads(quick).items():
        each = [shape(v) for v in variants]
        shapes[name] = {k: sum(s[k] for s in each) / len(each) for k in each[0]} | {"variants": len(variants)}
        shapes[name]["signals"] = signals(variants[0])
        for pct in SIZES:
            hit: dict[str, list[float]] = {}
            x: dict[str, list[float]] = {}
            for requests, s in zip(variants, each, strict=True):
                capacity = s["unique_chunks"] * pct // 100
                ceiling = belady(requests, capacity)
                results = {"belady": ceiling, "lru+oracle admission": lru(requests, capacity, oracle=True)}
                for policy in EVICTION:
                    results[policy] = replay(requests, make(policy, capacity))
                for policy, hits in results.items():
                    hit.setdefault(policy, []).append(hits * CHUNK_TOKENS / s["tokens"])
                    x.setdefault(policy, []).append(hits / ceiling if ceiling else 1.0)
            if pct == SIZES[0]:
                tiers(name, variants, each, rows)
            for policy in hit:
                rows.append({
                    "workload": name, "capacity_pct": pct, "policy": policy,
                    "hit_ratio": sum(hit[policy]) / len(hit[policy]),
                    "x_belady": sum(x[policy]) / len(x[policy]), "x_belady_each": x[policy],
                    "x_belady_min": min(x[policy]), "x_belady_max": max(x[policy]),
                })  # fmt: skip
    return {"benchmark": "eviction", "mode": "quick" if quick else "full", "chunk_tokens": CHUNK_TOKENS,
            "policies": list(EVICTION), "target_x_belady": TARGET, "workloads": shapes, "rows": rows,
            "verdict": verdict(rows)}  # fmt: skip


def tiers(name: str, variants: list, shapes: list[dict], rows: list[dict]) -> None:
    """The lower tier's policy, through ``lmtier plan`` itself: one instance, memory (LRU)
    at IN_FRONT% of the unique chunks in front of a disk at BELOW% under each policy; the
    ceiling is Belady with both capacities together."""
    hit: dict[str, list[float]] = {}
    x: dict[str, list[float]] = {}
    for requests, s in zip(variants, shapes, strict=True):
        unique, tokens = s["unique_chunks"], s["tokens"]
        ceiling = belady(requests, unique * (IN_FRONT + BELOW) // 100)
        trace = [Request(float(i), keys, t) for i, (keys, t) in enumerate(requests)]
        fleet = Fleet(chunk_tokens=CHUNK_TOKENS, kv_bytes_per_token=1, memory=unique * IN_FRONT // 100 * CHUNK_TOKENS,
                      disk=unique * BELOW // 100 * CHUNK_TOKENS)  # fmt: skip
        hit.setdefault("belady", []).append(ceiling * CHUNK_TOKENS / tokens)
        x.setdefault("belady", []).append(1.0)
        for policy in EVICTION:
            plan = simulate(fleet.replace(eviction=Fleet.evictions({"disk": policy})), trace)
            hits = plan["prefill_tokens_saved"] / CHUNK_TOKENS
            hit.setdefault(policy, []).append(hits * CHUNK_TOKENS / tokens)
            x.setdefault(policy, []).append(hits / ceiling if ceiling else 1.0)
    for policy in hit:
        rows.append({
            "workload": name, "capacity_pct": f"{IN_FRONT}+{BELOW}", "policy": policy,
            "hit_ratio": sum(hit[policy]) / len(hit[policy]),
            "x_belady": sum(x[policy]) / len(x[policy]), "x_belady_each": x[policy],
            "x_belady_min": min(x[policy]), "x_belady_max": max(x[policy]),
        })  # fmt: skip


NOISE = 0.005  # x Belady: a difference a deterministic trace's replay calls a tie


def verdict(rows: list[dict]) -> dict:
    """Per policy, against LRU on the same variants (paired): a win where it is ahead on
    every variant by more than the larger of NOISE and the spread of its lead over the
    seeds, a loss where it is behind by as much; and whether it meets the target at every
    variant of every workload."""
    lru_at = {(r["workload"], r["capacity_pct"]): r for r in rows if r["policy"] == "lru"}
    out = {}
    for policy in EVICTION:
        wins, losses, target_met = [], [], True
        for r in (r for r in rows if r["policy"] == policy):
            base = lru_at[(r["workload"], r["capacity_pct"])]
            lead = [a - b for a, b in zip(r["x_belady_each"], base["x_belady_each"], strict=True)]
            mean, noise = sum(lead) / len(lead), max(NOISE, max(lead) - min(lead))
            pct = r["capacity_pct"]
            at = f"memory {pct.replace('+', '% + disk ')}%" if isinstance(pct, str) else f"{pct}%"
            where = f"{r['workload']} at {at}"
            if mean > noise:
                wins.append(where)
            elif mean < -noise:
                losses.append(where)
            goal = TARGET.get(r["capacity_pct"])
            if goal is not None and r["x_belady_min"] < goal:
                target_met = False
        out[policy] = {"beats_lru_at": wins, "loses_to_lru_at": losses, "meets_target_everywhere": target_met}
    return out


def table(report: dict) -> str:
    lines = [
        "| workload | requests | unique chunks | used once | best hit ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, s in report["workloads"].items():
        lines.append(f"| {name} | {s['requests']:,.0f} | {s['unique_chunks']:,.0f} | {s['used_once']:.0%} "
                     f"| {s['max_hit_ratio']:.3f} |")  # fmt: skip
    lines += [
        "",
        "What is known of a chunk when it is first stored, and how often it is used again "
        "(share of new chunks: share of them used again)",
        "",
        "| workload | " + " | ".join(next(iter(report["workloads"].values()))["signals"]) + " |",
        "|---|---|---|---|",
    ]
    for name, s in report["workloads"].items():
        cells = ["; ".join(f"{a} {n:.0%}: {again:.0%}" for a, (n, again) in by.items()) for by in s["signals"].values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    names = ["belady", "lru+oracle admission", *EVICTION]
    lines += ["", "x Belady (hit ratio); over three seeds for the synthetic workloads: mean (min-max)", "",
              "| workload | capacity | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]  # fmt: skip
    cells: dict[tuple[str, int], dict[str, str]] = {}
    for r in report["rows"]:
        cell = f"{r['x_belady']:.3f}"
        if r["x_belady_max"] - r["x_belady_min"] > 0:
            cell += f" ({r['x_belady_min']:.3f}-{r['x_belady_max']:.3f})"
        if r["policy"] == "belady":
            cell = f"{r['hit_ratio']:.3f} hit"
        cells.setdefault((r["workload"], r["capacity_pct"]), {})[r["policy"]] = cell
    for (workload, pct), row in cells.items():
        pct = f"memory {pct.replace('+', '% + disk ')}" if isinstance(pct, str) else pct
        lines.append(f"| {workload} | {pct}% | " + " | ".join(row.get(n, "") for n in names) + " |")
    lines += ["", "| policy | beats LRU at | loses to LRU at | 0.85x / 0.98x Belady everywhere |", "|---|---|---|---|"]
    for policy, v in report["verdict"].items():
        lines.append(f"| {policy} | {', '.join(v['beats_lru_at']) or 'nowhere'} "
                     f"| {', '.join(v['loses_to_lru_at']) or 'nowhere'} "
                     f"| {'yes' if v['meets_target_everywhere'] else 'no'} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="each trace's first 1,500 requests, smaller workloads")
    parser.add_argument("--json-out", help="also write the JSON report here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    report = run(args.quick)
    report["seconds"] = round(time.perf_counter() - started, 1)
    emit(report, table(report), args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

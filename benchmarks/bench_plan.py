"""``lmtier plan`` against itself and against real engines.

**Speed** (``--speed [--runs 3]``): the replay's rate (compiled where numba is installed:
``lmtier.plan.compiled``) on the Mooncake conversation trace, and a million requests (the
trace replayed 84 times, each copy's prefixes its own), for a single instance, for a
fleet of eight behind the KV-aware router with memory and a shared server, and for the
same with disks and peers too; one process, one core, each run's seconds of process time
and whether each met the target (a million in under a minute).

**Calibration** (``--calibrate``): one slice of a trace replayed twice, through real vLLM
engines (CPU build, a tiny random-weight Llama) started from a fleet description
(``benchmarks/plan_calibration.yaml``), and through ``lmtier plan`` given the same
description. Each 512-token block of the trace becomes one 128-token chunk (the engines'
``chunk_tokens``); prompts are cut at ``--max-chunks`` chunks and end with 16 tokens of
their own (so that every full chunk can hit); requests go one at a time, round robin, a
pause after each (its saves land, its engine goes quiet). The engines run without vLLM's
own prefix cache (the plan's ``gpu: 0``): lmtier's memory, the cache server (a Redis in
``benchmarks/plan_calibration_redis.yaml``) and, in
``benchmarks/plan_calibration_disk.yaml``, a disk tier per instance are the only tiers,
counted per tier by what the workers read from each (``vllm:lmtier_tier_reads_total``).

The plan's costs come from the same engines: the prefill rate and a
request's fixed time from cold prompts of six lengths (a least-squares line through each
length's median), and each medium's load from prompts held there, measured before the
slice and again after it (the machine's drift in both). The engines' step budget is over
the longest prompt: each is computed in one step, as the plan's line assumes. Reported per
run and over runs: the hit ratio per tier, real and planned (target: within 0.05), and
TTFT mean and p50, real and planned (target: within the real runs' own spread, or 10%).

    python benchmarks/bench_plan.py --speed [--runs 3] [--json-out F]
    python benchmarks/bench_plan.py --calibrate [--fleet F.yaml] [--runs 3] [--requests 50] [--json-out F]
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

from lmtier.kv.layout import from_hf_config
from lmtier.plan.fleet import Cost, Fleet
from lmtier.plan.sim import Simulation, simulate
from lmtier.plan.traces import Request, mooncake

from common import emit
from plan_engines import CHUNK, TAIL, RealFleet, agreement, fit, hit_row, measure, tokens_of

HERE = Path(__file__).resolve().parent
CONVERSATION = HERE / "traces" / "mooncake_conversation_trace.jsonl.gz"


# -- speed --------------------------------------------------------------------------------
def copies(requests: list[Request], n: int) -> list[Request]:
    """``n`` copies of the trace one after the other, each with prefixes of its own."""
    span = requests[-1].t + 1.0
    out = []
    for c in range(n):
        salt = c << 56  # each copy's keys differ from the others' in their top byte
        out += [Request(r.t + c * span, [k ^ salt for k in r.keys], r.tokens) for r in requests]
    return out


SPEED_TARGET_S = 60.0  # a million requests, one core


def speed(runs: int = 3) -> dict:
    """Each fleet over the conversation trace and over a million requests, ``runs`` times:
    the seconds of each run (process time: one core's work, not the machine's other
    load), and whether every run met the target."""
    trace = mooncake(CONVERSATION)
    eight = Fleet(instances=8, router="kv_aware", memory=1 << 38, shared="server", shared_size=1 << 42,
                  kv_bytes_per_token=1 << 14)  # fmt: skip
    fleets = {
        "one instance, memory": Fleet(memory=2 << 40, kv_bytes_per_token=1 << 14),
        "8 instances, kv_aware, memory + shared": eight,
        "8 instances, kv_aware, memory + disk + shared + peers": eight.replace(disk=1 << 40, peers=True),
    }
    started = time.process_time()  # the compiled loop's code, compiled or read from numba's cache once
    simulate(fleets["one instance, memory"], trace[:10], compiled=True)
    load_s = time.process_time() - started
    rows = []
    for label, requests in (("conversation trace", trace), ("a million requests", copies(trace, 84))):
        chunks = sum(len(r.keys) for r in requests)
        for name, fleet in fleets.items():
            seconds, plan = [], {}
            for _ in range(runs):
                started = time.process_time()
                plan = simulate(fleet, requests)
                seconds.append(time.process_time() - started)
            worst = max(seconds)
            row = {"trace": label, "fleet": name, "requests": len(requests), "chunks": chunks,
                   "seconds": seconds, "median_s": statistics.median(seconds),
                   "requests_per_s": len(requests) / worst, "chunks_per_s": chunks / worst,
                   "hit_ratio": plan["hit_ratio"], "replay": plan["replay"]}  # fmt: skip
            if len(requests) >= 1_000_000:
                row["target_s"] = SPEED_TARGET_S
                row["met_in_runs"] = sum(s < SPEED_TARGET_S for s in seconds)
            rows.append(row)
        del requests
    return {"benchmark": "plan_speed", "runs": runs, "rows": rows, "compiled_code_s": load_s}


# -- calibration --------------------------------------------------------------------------
def slice_of(spec: str, start: int, count: int, max_chunks: int) -> list[Request]:
    """``count`` requests of a Mooncake trace from ``start`` (its blocks as our chunks), or
    of a synthetic conversation workload ("synthetic")."""
    if spec == "synthetic":
        from lmtier.plan.traces import conversations

        made = conversations(start + count, seed=5, chunk_tokens=CHUNK)[start:]
        reqs = [Request(float(i), keys, 0) for i, (keys, _) in enumerate(made)]
    else:
        reqs = mooncake(spec, start + count)[start:]
    return [Request(float(i), r.keys[:max_chunks], len(r.keys[:max_chunks]) * CHUNK + TAIL)
            for i, r in enumerate(reqs)]  # fmt: skip


def planned(fleet: Fleet, measured: dict, requests: list[Request]) -> dict:
    """``lmtier plan`` of ``requests`` on ``fleet`` with the costs fitted to ``measured``."""
    media = {m: Cost(**c) for m, c in measured.items() if m in ("memory", "disk", "shared")}
    rate, fixed = measured["prefill_tokens_per_s"], measured["request_ms"]
    sim = Simulation(fleet.replace(prefill_tokens_per_s=rate, request_ms=fixed, costs={**fleet.costs, **media}))
    for r in requests:
        sim.request(r)
    plan = sim.report(len(requests))
    return {"hit_ratio": {**{t: plan["hit_ratio_by_tier"][t] for t in ("memory", "disk", "shared")},
                          "cached": plan["hit_ratio"]},
            "prompt_tokens": plan["prompt_tokens"], "ttft_ms": plan["ttft_ms"],
            "ttft_each_ms": [t * 1e3 for t in sim.ttft]}  # fmt: skip


def run_requests(requests: list[Request], run: int) -> list[Request]:
    """A run's own prompts: nothing is found from the run before."""
    salt = xxhash.xxh3_64_intdigest(b"run%d" % run)  # a bijection: equal prefixes stay equal, and only they
    return [Request(r.t, [k ^ salt for k in r.keys], r.tokens) for r in requests]


def workloads_of(args) -> dict[str, list[Request]]:
    return {
        "mooncake conversation": slice_of(str(CONVERSATION), args.start, args.requests, args.max_chunks),
        "synthetic conversations": slice_of("synthetic", 0, args.requests, args.max_chunks),
    }


def replan(path: str) -> dict:
    """A calibration report's plans made again from its own measurements (its real side
    unchanged): the fit or the planner changed, the engines need not run again."""
    report = json.loads(Path(path).read_text())
    kept = report.get("args") or {
        "requests": report["requests"],
        "start": 0,
        "max_chunks": report["max_chunks"],
        "pause": 2.0,
        "runs": len(report["runs"]),
    }  # a report of before "args"
    args = argparse.Namespace(**kept)
    fleet = Fleet.from_dict({k: v for k, v in report["fleet"].items() if k not in ("costs", "shared", "shared_size")}
                            | ({"shared": {"kind": report["fleet"]["shared"], "size": report["fleet"]["shared_size"]}}
                               if report["fleet"]["shared"] else {}))  # fmt: skip
    for row in report["runs"]:
        row["costs"] = fit(row["costs"]["measured_ms"], fleet.kv_bytes_per_token)
        for name, requests in workloads_of(args).items():
            row["workloads"][name]["plan"] = planned(fleet, row["costs"], run_requests(requests, row["run"]))
    return summarize(report["runs"], fleet, args)


def calibrate(args) -> dict:
    from lmtier.testing.tinymodel import build

    fleet = Fleet.load(args.fleet)  # a fleet that cannot run here fails before anything starts
    if fleet.chunk_tokens != CHUNK:
        raise SystemExit(f"the calibration's engines use chunks of {CHUNK} tokens, not {fleet.chunk_tokens}")
    tmp = Path(tempfile.mkdtemp(prefix="lmtier-plan-"))
    atexit.register(shutil.rmtree, tmp, True)  # the model, the disks and the engines' logs: gone with the run
    model = str(build(tmp / "model"))
    fleet = fleet.replace(kv_bytes_per_token=from_hf_config(Path(model) / "config.json").bytes_per_token)
    workloads = workloads_of(args)
    runs = []
    for run in range(args.runs):
        real = RealFleet(fleet, model, tmp / f"run-{run}")
        try:
            first = measure(real, run, args.pause)
            row = {"run": run, "workloads": {}}
            for name, requests in workloads.items():
                requests = run_requests(requests, run)
                before, times = real.sources(), []
                for i, r in enumerate(requests):
                    times.append(real.ttft(i % fleet.instances, tokens_of(r.keys, run * 10**5 + i)))
                    time.sleep(args.pause)
                after = real.sources()
                got = {k: after[k] - before[k] for k in after}
                row["workloads"][name] = {
                    "real": {"hit_ratio": {t: got[t] / got["prompt"] for t in ("memory", "disk", "shared", "cached")},
                             "prompt_tokens": got["prompt"], "ttft_ms": _ttft(times),
                             "ttft_each_ms": [t * 1e3 for t in times]}}  # fmt: skip
            last = measure(real, 500 + run, args.pause, warm=False)
            row["costs"] = fit({k: first[k] + last[k] for k in first}, fleet.kv_bytes_per_token)
            for name, requests in workloads.items():
                row["workloads"][name]["plan"] = planned(fleet, row["costs"], run_requests(requests, run))
            runs.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        finally:
            real.stop()
    return summarize(runs, fleet, args)


def _ttft(times: list[float]) -> dict:
    ms = np.array(times) * 1e3
    return {"mean": float(ms.mean()), "p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99))}


def summarize(runs: list[dict], fleet: Fleet, args) -> dict:
    out = {}
    for name in runs[0]["workloads"]:
        rows = [r["workloads"][name] for r in runs]
        tiers = {}
        media = ("memory", "disk", "shared") if fleet.disk else ("memory", "shared")
        for tier in (*media, "cached"):
            tiers[tier] = agreement([w["real"]["hit_ratio"][tier] for w in rows],
                                    [w["plan"]["hit_ratio"][tier] for w in rows])  # fmt: skip
        ttft = {}
        for stat in ("mean", "p50"):
            real = [w["real"]["ttft_ms"][stat] for w in rows]
            plan = [w["plan"]["ttft_ms"][stat] for w in rows]
            noise = max(max(real) - min(real), 0.1 * statistics.median(real))
            ttft[stat] = {"real": real, "plan": plan, "noise_ms": noise,
                          "met": all(abs(p - r) <= noise for p, r in zip(plan, real, strict=True))}  # fmt: skip
        out[name] = {"tiers": tiers, "ttft_ms": ttft}
    kept = {k: getattr(args, k) for k in ("requests", "start", "max_chunks", "pause", "runs")}
    return {"benchmark": "plan_calibration", "fleet": fleet.to_dict(), "args": kept, "runs": runs,
            "summary": out}  # fmt: skip


def table(report: dict) -> str:
    if report["benchmark"] == "plan_speed":
        lines = [
            "| trace | fleet | replay | requests | chunks | seconds (per run) | requests/s (slowest run) | target |",
            "|---|---|---|---:|---:|---|---:|---|",
        ]
        for r in report["rows"]:
            target = (f"under {r['target_s']:.0f} s in {r['met_in_runs']} of {len(r['seconds'])} runs"
                      if "target_s" in r else "")  # fmt: skip
            lines.append(f"| {r['trace']} | {r['fleet']} | {r.get('replay', 'python')} | {r['requests']:,} "
                         f"| {r['chunks']:,} "
                         f"| {' / '.join(f'{x:.1f}' for x in r['seconds'])} | {r['requests_per_s']:,.0f} "
                         f"| {target} |")  # fmt: skip
        if "compiled_code_s" in report:
            lines.append(f"\nThe compiled loop's code: {report['compiled_code_s']:.1f} s before the first plan "
                         "(compiled once, then read from numba's cache).")  # fmt: skip
        return "\n".join(lines)
    lines = ["| workload | what | real (per run) | plan (per run) | within |", "|---|---|---|---|---|"]
    for name, s in report["summary"].items():
        lines += [hit_row(name, tier, t) for tier, t in s["tiers"].items()]
        for stat, t in s["ttft_ms"].items():
            lines.append(f"| {name} | TTFT {stat} ms | {' / '.join(f'{v:.0f}' for v in t['real'])} "
                         f"| {' / '.join(f'{v:.0f}' for v in t['plan'])} | {t['noise_ms']:.0f} ms: "
                         f"{'met' if t['met'] else 'not met'} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument(
        "--replan", metavar="REPORT", help="a calibration's JSON: its plans made again from its own measurements"
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--start", type=int, default=0, help="the trace's first request of the slice")
    parser.add_argument("--max-chunks", type=int, default=16)
    parser.add_argument(
        "--fleet",
        default=str(HERE / "plan_calibration.yaml"),
        help="the fleet to start and to plan (round robin over memory, a disk and a cache server or Redis; gpu: 0, "
        "no peers)",
    )
    parser.add_argument(
        "--pause",
        type=float,
        default=2.0,
        help="seconds after each request: its saves land and its engine goes quiet (on 2 cores, an engine "
        "busy for a second after a request slows the other by as much)",
    )
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    if sum(map(bool, (args.speed, args.calibrate, args.replan))) != 1:
        parser.error("one of --speed, --calibrate and --replan")
    report = speed(args.runs) if args.speed else replan(args.replan) if args.replan else calibrate(args)
    emit(report, table(report), args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

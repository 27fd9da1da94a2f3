"""``lmtier plan`` against a fleet whose front nobody here wrote: three ``vllm serve``
instances (CPU build, one tiny random-weight Llama) behind ``vllm-router`` (round robin),
driven by vLLM's own ``vllm bench serve`` (``prefix_repetition``: a few long prefixes,
each asked many times with its own suffix, in a shuffled order, ``--concurrency`` at a
time), each instance writing lmtier's request log (``request_log``). The three logs,
merged in arrival order, are the trace that ``lmtier plan`` replays on the fleet's own
description; where the fleet's hits came from, real and planned, is compared per tier
(target: within 0.05 of the prompt tokens, ``plan_engines.HIT_TARGET``, as ``bench_plan.py --calibrate``'s).

The fleets (``bench_fleet.py``'s), each started, driven and stopped in every run:

- ``peers``: each instance has vLLM's prefix cache (1 GiB), lmtier's memory (256 MiB),
  its own sidecar (an ``lmtier serve`` of 512 MiB) and a ``peers://`` tier over the
  others' sidecars (announced in a Redis index). Planned as ``gpu: 1GiB``, ``memory:
  256MiB``, ``disk: 512MiB`` (the sidecar: the instance's own tier below its memory, the
  one its peers read) and ``peers: true``.
- ``shared``: each instance has vLLM's prefix cache, lmtier's memory and one cache server
  every instance shares. Planned as ``gpu``, ``memory`` and ``shared: {kind: server,
  size: 512MiB}``.

The engines' block is lmtier's chunk (128 tokens), so that vLLM's prefix cache and the
plan's ``gpu`` count hits in the same units. Real counts are vLLM's own (prompt tokens,
cached tokens, its prefix cache's hits: ``vllm:prompt_tokens_cached_by_source_total
{source="device"}``) and lmtier's chunks read, by the tier that served them
(``vllm:lmtier_tier_reads_total``). Also reported: the requests the plan's round robin
sends to the instance the router sent them to (the logs say which instance saw each; the
plan's instances matched to the real ones as best they can be), the real TTFT from ``vllm
bench serve``'s result (the plan's is not compared here: ``bench_plan.py --calibrate``
fits and checks it).

    python benchmarks/bench_plan_fleet.py [--runs 3] [--fleets peers shared] [--prompts 60] [--json-out F]
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import shutil
import sys
import tempfile
import urllib.request
from pathlib import Path

from lmtier.kv.layout import from_hf_config
from lmtier.plan.fleet import Fleet as Plan
from lmtier.plan.sim import simulate
from lmtier.plan.traces import request_log
from lmtier.testing.tinymodel import build
from lmtier.testing.vllm_serve import BLOCK, CHUNK

from bench_fleet import ENGINES, Fleet, traffic
from common import emit
from plan_engines import agreement, hit_row

KINDS = ("peers", "shared")
TIERS = ("gpu", "memory", "disk", "peers", "shared")
# what each fleet's lmtier tiers are called in the plan: its memory, its own tier behind it
# (the peers fleet's sidecar: a "disk" the others read), the peers tier, the cache server
OWN = {"peers": "disk", "shared": "shared"}


def description(kind: str, kv_bytes_per_token: int) -> Plan:
    """The plan's description of ``bench_fleet.Fleet(kind)``."""
    fleet = {"instances": ENGINES, "router": "round_robin", "chunk_tokens": CHUNK, "save_policy": "always",
             "kv_bytes_per_token": kv_bytes_per_token, "gpu": "1GiB", "memory": "256MiB"}  # fmt: skip
    if kind == "peers":
        fleet |= {"disk": "512MiB", "peers": True}
    else:
        fleet["shared"] = {"kind": "server", "size": "512MiB"}
    return Plan.from_dict(fleet)


def counts(fleet: Fleet) -> dict[str, float]:
    """The fleet's prompt and cached tokens, vLLM's own cache's hits, and lmtier's reads
    (tokens) by the tier that served them, summed over the instances."""
    out = dict.fromkeys(("prompt", "cached", *TIERS), 0.0)
    for e in fleet.engines:
        out["prompt"] += e.metric("vllm:prompt_tokens_total")
        out["cached"] += e.metric("vllm:prompt_tokens_cached_total")
        out["gpu"] += e.metric("vllm:prompt_tokens_cached_by_source_total", source="device")
        text = urllib.request.urlopen(f"{e.url}/metrics", timeout=10).read().decode()
        for labels, value in re.findall(r"^vllm:lmtier_tier_reads_total\{([^}]*)\} (\S+)$", text, re.M):
            tier = re.search(r'tier="([^"]*)"', labels)
            if 'result="hits"' in labels and tier:
                name = tier.group(1)
                where = "memory" if name.startswith("cpu") else "peers" if name.startswith("peers") else OWN[fleet.kind]
                out[where] += float(value) * CHUNK
    return out


def merged(logs: list[Path], out: Path) -> list[int]:
    """The instances' request logs as one, in arrival order (written to ``out``); returns
    the instance that saw each request, in that order."""
    lines = []
    for i, path in enumerate(logs):
        for line in path.read_text().splitlines():
            if line.strip():
                lines.append((json.loads(line)["t"], i, line))
    lines.sort(key=lambda x: (x[0], x[1]))
    out.write_text("".join(line + "\n" for _, _, line in lines))
    return [i for _, i, _ in lines]


def same_instance(real: list[int]) -> int:
    """Requests the plan's round robin (request k on instance k mod n) puts where the router
    did, the plan's instances matched to the real ones in the way that agrees most."""
    perms = itertools.permutations(range(ENGINES))
    return max(sum(perm[k % ENGINES] == i for k, i in enumerate(real)) for perm in perms)


def one(kind: str, tmp: Path, model: str, kv: int, args, seed: int) -> dict:
    logs = [tmp / f"requests-{i}.jsonl" for i in range(ENGINES)]

    def engine_args(i: int) -> dict:
        return {"block": CHUNK, "request_log": str(logs[i])}

    fleet = Fleet(kind, tmp, model, engine_args=engine_args)
    try:
        before = counts(fleet)
        bench = traffic(fleet, tmp, args, seed=seed)
        after = counts(fleet)
    finally:
        fleet.stop()  # the logs flushed and closed
    got = {k: after[k] - before[k] for k in after}
    ttft = {k: bench[f"ttft_{k}_ms"] for k in ("mean", "median", "p99")}
    real_instance = merged(logs, tmp / "requests.jsonl")
    requests = request_log(tmp / "requests.jsonl", chunk_tokens=CHUNK)
    plan = simulate(description(kind, kv), requests)
    return {
        "requests": len(requests),
        "real": {"hit_ratio": {t: got[t] / got["prompt"] for t in TIERS} | {"cached": got["cached"] / got["prompt"]},
                 "prompt_tokens": got["prompt"], "ttft_ms": ttft},
        "plan": {"hit_ratio": {t: plan["hit_ratio_by_tier"][t] for t in TIERS} | {"cached": plan["hit_ratio"]},
                 "prompt_tokens": plan["prompt_tokens"]},
        "same_instance": same_instance(real_instance),
    }  # fmt: skip


def summarize(runs: list[dict], args) -> dict:
    out = {}
    for kind in runs[0]:
        rows = [r[kind] for r in runs]
        tiers = {}
        for tier in (*TIERS, "cached"):
            real = [w["real"]["hit_ratio"][tier] for w in rows]
            plan = [w["plan"]["hit_ratio"][tier] for w in rows]
            if any(real) or any(plan):  # (not a tier this fleet has not)
                tiers[tier] = agreement(real, plan)
        out[kind] = {"tiers": tiers, "same_instance": [w["same_instance"] for w in rows],
                     "requests": [w["requests"] for w in rows]}  # fmt: skip
    kept = {k: getattr(args, k) for k in ("runs", "prompts", "prefixes", "prefix_len", "suffix_len", "concurrency")}
    return {"benchmark": "plan_fleet_calibration", "args": kept, "runs": runs, "summary": out}


def table(report: dict) -> str:
    lines = ["| fleet | what | real (per run) | plan (per run) | within |", "|---|---|---|---|---|"]
    for kind, s in report["summary"].items():
        lines += [hit_row(kind, tier, t) for tier, t in s["tiers"].items()]
        same = " / ".join(f"{a} of {n}" for a, n in zip(s["same_instance"], s["requests"], strict=True))
        lines.append(f"| {kind} | requests the plan sends where the router did | {same} | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--fleets", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--prompts", type=int, default=60)
    parser.add_argument("--prefixes", type=int, default=6)
    parser.add_argument("--prefix-len", type=int, default=8 * CHUNK)
    parser.add_argument("--suffix-len", type=int, default=BLOCK)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="lmtier-plan-fleet-"))
    try:
        model = str(build(tmp / "model"))
        kv = from_hf_config(Path(model) / "config.json").bytes_per_token
        runs = []
        for run in range(args.runs):
            row = {kind: one(kind, tmp / f"{kind}-{run}", model, kv, args, seed=run) for kind in args.fleets}
            runs.append(row)
            print(json.dumps({"run": run, **row}), file=sys.stderr, flush=True)
        report = summarize(runs, args)
        emit(report, table(report), args.json_out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

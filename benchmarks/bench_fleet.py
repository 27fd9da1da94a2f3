"""A fleet of three real vLLM instances (CPU build, one tiny random-weight Llama) behind
``vllm-router``, driven by vLLM's own ``vllm bench serve`` with a shared-prefix dataset
(``prefix_repetition``: a few long prefixes, each asked many times with its own suffix).
The router spreads requests round robin, so a prefix one instance computed reaches the
others: what they do with it is the fleet's cache.

Three fleets, each started, measured and stopped in every run, runs interleaved:

- ``isolated``: each instance's lmtier keeps memory and its own sidecar (``lmtier serve``
  beside it); no instance reads another's.
- ``peers``: the same, plus a ``peers://`` tier: each sidecar announces what it holds in a
  Redis index, and each instance loads a prefix another computed from that one's sidecar.
  No shared tier holds a second copy.
- ``shared``: each instance's lmtier keeps memory and one cache server that every
  instance shares: the reference, a fleet whose shared server holds everything.

For each: TTFT (mean, median, p99, from ``vllm bench serve``'s own result file), the
fleet's hit ratio (cached prompt tokens over prompt tokens, summed over the instances'
``vllm:prompt_tokens_cached`` / ``vllm:prompt_tokens``), and where the hits came from
(vLLM's own prefix cache, lmtier's memory, the sidecar, peers, the shared server).

Then, per run, two paired measurements:

- **one hit from a peer against the same hit from the shared server**, on a fourth fleet
  (``pair``) whose engines are kept up side by side: a prompt computed on instance 0 (which
  saves to its sidecar and to a shared server), then asked of instance 1 (a peers fleet's
  instance: it loads from instance 0's sidecar) and of instance 2 (a shared fleet's: it
  loads from the shared server), in alternating order; streamed, TTFT to the first token,
  the ratio taken per prompt;
- **the holder under peer load**, on the ``peers`` fleet: instance 0's TTFT on fresh
  prompts, alternately alone and while a client reads from its sidecar through a
  ``peers://`` tier at ``--peer-rate`` loads a second.

Targets (issue 49): the peer hit's TTFT <= 1.3x the shared server's; the peers fleet's
hit ratio >= 0.95x the shared fleet's; the holder's TTFT under peer load <= 1.1x. Each is
reported per run and over runs (median, min, max): a target met in some runs only is not
met. Prints JSON and a Markdown table; ``--plot`` draws TTFT and hit sources per fleet.

    python benchmarks/bench_fleet.py [--runs 3] [--prompts 60] [--json-out F] [--plot F.png]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lmtier.testing.cache_server import ServerProcess
from lmtier.testing.redis_server import RedisServer, free_port
from lmtier.testing.router import Router
from lmtier.testing.tinymodel import build
from lmtier.testing.vllm_serve import BLOCK, CHUNK, VllmServer

from common import emit

FLEETS = ("isolated", "peers", "shared", "pair")
ENGINES = 3
WRITER, PEER = "fleet-writer-token-0123456789", "fleet-peer-token-0123456789"
SOURCE = "vllm:prompt_tokens_cached_by_source_total"
TARGETS = {"peer_over_shared_ttft": 1.3, "hit_ratio_peers_over_shared": 0.95, "holder_under_peer_load": 1.1}


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(5, 500, n)]


class Fleet:
    """Three engines, each with its sidecar (isolated, peers) or all with one shared server
    (shared), a Redis index (peers), and vllm-router round robin in front.

    ``pair``: the side-by-side comparison, no router. Instance 0 saves to its sidecar and
    to a shared server; instance 1 is a peers fleet's instance (its own sidecar, and
    peers), instance 2 a shared fleet's (the shared server): the same hit, from a peer and
    from the shared server, on engines kept up side by side."""

    def __init__(self, kind: str, tmp: Path, model: str, engine_args=None) -> None:
        """``engine_args(i)``: more of instance i's ``VllmServer`` arguments (its block, lmtier
        settings such as a request log), for a caller that plans this fleet."""
        self.kind, self.model = kind, model
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "tokens").write_text(f"{WRITER}=fleet\n")
        (tmp / "peers").write_text(f"{PEER}=fleet\n")
        self.redis = RedisServer(tmp) if kind in ("peers", "pair") else None
        self.servers: list[ServerProcess] = []
        auth = ["--token-file", str(tmp / "tokens"), "--tier", "cpu://?size=512MiB", "--no-shm"]
        sidecars = {"isolated": ENGINES, "peers": ENGINES, "shared": 0, "pair": 2}[kind]
        ports = [free_port() for _ in range(sidecars)]
        index = ["--peer-token-file", str(tmp / "peers"), "--peer-index", self.redis.url] if self.redis else []
        for p in ports:
            extra = [*index, "--advertise", f"127.0.0.1:{p}"] if self.redis else []
            self.servers.append(ServerProcess(tmp, *auth, *extra, port=p))
        members = ",".join(s.address for s in self.servers)
        if kind in ("shared", "pair"):
            self.servers.append(ServerProcess(tmp, *auth))
        shared = self.servers[-1].address

        def grpc(address: str) -> str:
            return f"grpc://{address}?token={WRITER}&shm=off"

        def peers(own: str) -> str:
            return (f"peers://?index={self.redis.url}&members={members}&advertise={own}"
                    f"&token={PEER}&tenant=fleet&timeout=5")  # fmt: skip

        def tiers(i: int) -> list[str]:
            if kind == "shared":
                return [grpc(shared)]
            if kind == "pair":
                own = self.servers[i].address if i < 2 else shared
                return {0: [grpc(own), grpc(shared)], 1: [grpc(own), peers(own)], 2: [grpc(shared)]}[i]
            own = self.servers[i].address
            return [grpc(own), peers(own)] if kind == "peers" else [grpc(own)]

        def engine(i: int) -> VllmServer:
            return VllmServer(model, None, tmp / f"engine-{i}.log", tiers=["cpu://?size=256MiB", *tiers(i)],
                              max_model_len=4096, **(engine_args(i) if engine_args else {}))  # fmt: skip

        with ThreadPoolExecutor(ENGINES) as pool:
            self.engines = list(pool.map(engine, range(ENGINES)))
        urls = [e.url for e in self.engines]
        self.router = None if kind == "pair" else Router(tmp / "router.log", "--worker-urls", *urls,
                                                         "--policy", "round_robin")  # fmt: skip

    def counters(self) -> dict[str, float]:
        """The fleet's prompt tokens, cached tokens, and lmtier's chunk hits per tier."""
        out: dict[str, float] = {}
        for e in self.engines:
            by_source = "vllm:prompt_tokens_cached_by_source_total"  # counted as vLLM admits a request
            for key, name, labels in (
                ("prompt_tokens", "vllm:prompt_tokens_total", {}),
                ("cached_tokens", "vllm:prompt_tokens_cached_total", {}),
                ("engine_tokens", by_source, {"source": "device"}),
                ("memory_tokens", by_source, {"source": "host"}),
                ("server_tokens", by_source, {"source": "external_unspecified"}),
                ("peer_tokens", by_source, {"source": "p2p"}),
            ):
                out[key] = out.get(key, 0.0) + e.metric(name, **labels)
        return out

    def stop(self) -> None:
        if self.router:
            self.router.stop()
        for e in self.engines:
            e.stop()
        for s in self.servers:
            s.stop()
        if self.redis:
            self.redis.stop()


def ttft(engine: VllmServer, model: str, prompt: list[int]) -> float:
    """Seconds to the first streamed token of a greedy completion (two tokens asked)."""
    return engine.ttft(model, prompt, max_tokens=2)


def traffic(fleet: Fleet, tmp: Path, args, seed: int) -> dict:
    """``vllm bench serve`` through the router; its result file and the fleet's counters."""
    before = fleet.counters()
    out = tmp / "bench"
    cmd = [str(Path(sys.executable).parent / "vllm"), "bench", "serve", "--backend", "vllm",
           "--base-url", fleet.router.url, "--model", fleet.model, "--tokenizer", fleet.model,
           "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
           "--prefix-repetition-suffix-len", str(args.suffix_len), "--prefix-repetition-num-prefixes",
           str(args.prefixes), "--prefix-repetition-output-len", "4", "--num-prompts", str(args.prompts),
           "--max-concurrency", str(args.concurrency), "--seed", str(seed), "--percentile-metrics", "ttft",
           "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out),
           "--result-filename", "result.json", "--disable-tqdm"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads((out / "result.json").read_text())
    after = fleet.counters()
    delta = {k: after[k] - before[k] for k in after}
    return {
        "completed": result["completed"],
        "ttft_mean_ms": result["mean_ttft_ms"],
        "ttft_median_ms": result["median_ttft_ms"],
        "ttft_p99_ms": result["p99_ttft_ms"],
        "hit_ratio": delta["cached_tokens"] / max(1.0, delta["prompt_tokens"]),
        "prompt_tokens": delta["prompt_tokens"],
        "cached_tokens": delta["cached_tokens"],
        "sources": {where: delta[f"{where}_tokens"] for where in ("engine", "memory", "server", "peer")},
    }


def side_by_side(fleet: Fleet, docs: int, length: int, seed: int) -> dict:
    """A ``pair`` fleet: each prompt computed on instance 0, then asked of instance 1 (from
    instance 0's sidecar, as a peer) and of instance 2 (from the shared server), in
    alternating order; TTFT of each, and their ratio per prompt."""
    writer, peer, shared = fleet.engines
    before = [peer.metric(SOURCE, source="p2p"), shared.metric(SOURCE, source="external_unspecified")]
    warm = ids(length, seed * 1000 - 1)  # a first load on each, untimed: connections opened, paths warm
    ttft(writer, fleet.model, warm)
    time.sleep(1.0)
    ttft(peer, fleet.model, warm)
    ttft(shared, fleet.model, warm)
    from_peer, from_server = [], []
    for d in range(docs):
        p = ids(length, seed * 1000 + d)
        ttft(writer, fleet.model, p)
        time.sleep(1.0)  # the sidecar announces, the shared server has the writes
        first, second = (peer, shared) if d % 2 == 0 else (shared, peer)
        times = {first: ttft(first, fleet.model, p), second: ttft(second, fleet.model, p)}
        from_peer.append(times[peer] * 1e3)
        from_server.append(times[shared] * 1e3)
    loaded = [peer.metric(SOURCE, source="p2p") - before[0],
              shared.metric(SOURCE, source="external_unspecified") - before[1]]  # fmt: skip
    expected = (docs + 1) * (length - CHUNK)  # all but the last chunk (vLLM computes a prompt's last token)
    if min(loaded) < expected:  # a comparison of hits that were not hits measures nothing
        raise RuntimeError(f"side by side: {loaded[0]:.0f} tokens from the peer and {loaded[1]:.0f} from the "
                           f"server, {expected} expected of each")  # fmt: skip
    ratios = [a / b for a, b in zip(from_peer, from_server, strict=True)]
    return {"peer_ms": from_peer, "shared_ms": from_server, "ratios": ratios, "ratio": statistics.median(ratios)}


def holder_under_load(fleet: Fleet, tmp: Path, rounds: int, length: int, rate: float, seed: int) -> dict:
    """Instance 0's TTFT on fresh prompts, alone and while a peer reads its sidecar at ``rate``
    loads a second (paired, alternating)."""
    from lmtier.kv.chunk import release_all
    from lmtier.tiers.base import open_tier

    holder, server = fleet.engines[0], fleet.servers[0]
    shared = ids(8 * CHUNK, seed + 7)
    ttft(holder, fleet.model, shared)  # what the peer will read, held by the holder's sidecar
    time.sleep(1.0)
    keys = [k for k in server_keys(server)][:8]
    reader = open_tier(f"peers://?members={server.address}&token={PEER}&tenant=fleet&timeout=5")
    reader.direct(keys, server.address)
    stop = threading.Event()
    loads = [0]

    def peer_load() -> None:
        while not stop.is_set():
            started = time.monotonic()
            release_all([c for c in reader.get(keys) if c is not None])
            loads[0] += 1
            stop.wait(max(0.0, 1.0 / rate - (time.monotonic() - started)))

    alone, loaded = [], []
    for r in range(rounds):
        alone.append(ttft(holder, fleet.model, ids(length, seed * 100 + 2 * r)))
        stop.clear()
        thread = threading.Thread(target=peer_load, daemon=True)
        started, count = time.monotonic(), loads[0]
        thread.start()
        time.sleep(0.3)
        loaded.append(ttft(holder, fleet.model, ids(length, seed * 100 + 2 * r + 1)))
        stop.set()
        thread.join()
        achieved = (loads[0] - count) / (time.monotonic() - started)
    reader.close()
    return {"alone_ms": [t * 1e3 for t in alone], "under_peer_load_ms": [t * 1e3 for t in loaded],
            "ratio": statistics.median(loaded) / statistics.median(alone), "peer_loads_per_s": achieved,
            "chunks_per_load": len(keys)}  # fmt: skip


def server_keys(server: ServerProcess) -> list[bytes]:
    from lmtier.tiers.base import open_tier

    tier = open_tier(f"grpc://{server.address}?token={WRITER}&shm=off")
    try:
        return tier.keys(b"", 1000)
    finally:
        tier.close()


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=60)
    parser.add_argument("--prefixes", type=int, default=6)
    parser.add_argument("--prefix-len", type=int, default=8 * CHUNK)
    parser.add_argument("--suffix-len", type=int, default=BLOCK)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--docs", type=int, default=8, help="prompts of the peer-against-shared comparison")
    parser.add_argument("--hit-len", type=int, default=16 * CHUNK)
    parser.add_argument("--peer-rate", type=float, default=5.0)
    parser.add_argument("--holder-rounds", type=int, default=4)
    parser.add_argument("--fleets", nargs="+", default=list(FLEETS), choices=FLEETS)
    parser.add_argument("--json-out")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="lmtier-fleet-"))
    try:
        model = str(build(tmp / "model"))
        runs: list[dict] = []
        for run in range(args.runs):
            row: dict = {}
            for kind in args.fleets:
                fleet = Fleet(kind, tmp / f"{kind}-{run}", model)
                try:
                    if kind == "pair":
                        row[kind] = side_by_side(fleet, args.docs, args.hit_len, 50 + run)
                        continue
                    row[kind] = traffic(fleet, tmp / f"{kind}-{run}", args, seed=run)
                    if kind == "peers":
                        row[kind]["holder"] = holder_under_load(fleet, tmp, args.holder_rounds, args.hit_len,
                                                                args.peer_rate, 90 + run)  # fmt: skip
                finally:
                    fleet.stop()
            runs.append(row)
            print(json.dumps({"run": run, **row}), file=sys.stderr, flush=True)
        report = summarize(runs, args)
        emit(report, table(report), args.json_out)
        if args.plot:
            plot(report, Path(args.plot))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def summarize(runs: list[dict], args) -> dict:
    fleets = [k for k in FLEETS if k in runs[0] and k != "pair"]
    out: dict = {"benchmark": "fleet", "engines": ENGINES, "prompts": args.prompts, "prefixes": args.prefixes,
                 "prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "runs": runs, "fleets": {}}  # fmt: skip
    for kind in fleets:
        rows = [r[kind] for r in runs]
        out["fleets"][kind] = {
            key: spread([r[key] for r in rows])
            for key in ("hit_ratio", "ttft_mean_ms", "ttft_median_ms", "ttft_p99_ms")
        }
        out["fleets"][kind]["sources"] = {
            where: statistics.median(r["sources"][where] for r in rows) for where in rows[0]["sources"]
        }
    targets = {}
    measured = []
    if "pair" in runs[0]:
        measured.append(("peer_over_shared_ttft", [r["pair"]["ratio"] for r in runs], True))
    if {"peers", "shared"} <= set(fleets):
        hit = [r["peers"]["hit_ratio"] / r["shared"]["hit_ratio"] for r in runs]
        measured.append(("hit_ratio_peers_over_shared", hit, False))
    if "peers" in fleets:
        measured.append(("holder_under_peer_load", [r["peers"]["holder"]["ratio"] for r in runs], True))
    if measured:
        for name, values, at_most in measured:
            limit = TARGETS[name]
            met = [v <= limit if at_most else v >= limit for v in values]
            targets[name] = {**spread(values), "target": limit, "met_in": f"{sum(met)} of {len(met)}", "met": all(met)}
    out["targets"] = targets
    return out


def table(report: dict) -> str:
    head = "| fleet | hit ratio (median, min-max) | TTFT mean ms | TTFT p99 ms | from vLLM / memory / server / peers |"
    lines = [head, "|---|---|---|---|---|"]
    for kind, row in report["fleets"].items():
        h, m, p = row["hit_ratio"], row["ttft_mean_ms"], row["ttft_p99_ms"]
        t = row["sources"]
        lines.append(f"| {kind} | {h['median']:.3f} ({h['min']:.3f}-{h['max']:.3f}) | {m['median']:.0f} "
                     f"({m['min']:.0f}-{m['max']:.0f}) | {p['median']:.0f} | {t['engine']:.0f} / {t['memory']:.0f} / "
                     f"{t['server']:.0f} / {t['peer']:.0f} |")  # fmt: skip
    if report["targets"]:
        lines += ["", "| target | median | min-max | limit | met in |", "|---|---|---|---|---|"]
        for name, t in report["targets"].items():
            lines.append(
                f"| {name} | {t['median']:.3f} | {t['min']:.3f}-{t['max']:.3f} | {t['target']} | {t['met_in']} |"
            )
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fleets = list(report["fleets"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    means = [report["fleets"][k]["ttft_mean_ms"] for k in fleets]
    left.bar(fleets, [m["median"] for m in means],
             yerr=[[m["median"] - m["min"] for m in means], [m["max"] - m["median"] for m in means]])  # fmt: skip
    left.set_ylabel("TTFT, mean over requests (ms)")
    left.set_title("TTFT (median over runs, min-max)")
    bottom = np.zeros(len(fleets))
    prompt = [statistics.median(r[k]["prompt_tokens"] for r in report["runs"]) for k in fleets]
    labels = {"engine": "vLLM's own prefix cache", "memory": "lmtier memory", "server": "sidecar / shared server",
              "peer": "peers"}  # fmt: skip
    for where, label in labels.items():
        share = np.array([report["fleets"][k]["sources"][where] for k in fleets]) / np.array(prompt)
        right.bar(fleets, share, bottom=bottom, label=label)
        bottom += share
    right.set_ylabel("share of prompt tokens")
    right.set_title("Hit sources")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())

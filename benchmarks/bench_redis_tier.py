"""Redis tier throughput against ``redis-benchmark`` and a naive redis-py loop, same server, same run.

Starts its own ``redis-server`` (no persistence, loopback), then for each chunk size
(1 MiB and 4 MiB by default):

- ``redis_benchmark``: ``redis-benchmark -c 4 -P 1 -d SIZE -t set,get``: the server and
  the loopback at their best, with a C client.
- ``lmtier``: ``RedisTier.put`` of batches of chunks, then ``get`` of the same batches,
  every chunk verified against its checksum on the way back.
- ``naive_redis_py``: what a first implementation would do: ``r.set(key, frame)`` and
  ``decode(r.get(key))`` in a loop, redis-py with hiredis.

Rows: SET, GET, and SET+GET (the same bytes stored and loaded back: the rate of the
whole loop, ``1 / (1/set + 1/get)``).

Rounds interleave the three clients; reported: GB/s of value bytes for SET and GET (best
round of each), lmtier's ratio to each reference, and the median over rounds of the
same-round ratio, as JSON and as a Markdown table.

    python benchmarks/bench_redis_tier.py [--sizes-mib 1 4] [--total-mib 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from lmtier import codec
from lmtier.chunk import Chunk, release_all
from lmtier.layout import KVLayout
from lmtier.testing.redis_server import RedisServer
from lmtier.tiers.base import open_tier

MiB = 1 << 20
CSV = ("-t", "set,get", "--csv")
LAYOUT = KVLayout(num_layers=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")  # 64 KiB per token


def chunks_of(size: int, count: int, seed: int) -> list[Chunk]:
    tokens = size // LAYOUT.bytes_per_token
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (count, *LAYOUT.byte_shape(tokens)), dtype=np.uint8)
    return [Chunk(rng.bytes(16), LAYOUT, data[i]) for i in range(count)]


def redis_benchmark(port: int, size: int, requests: int) -> dict[str, float]:
    out = subprocess.run(
        ["redis-benchmark", "-p", str(port), "-c", "4", "-P", "1", "-d", str(size), "-n", str(requests), *CSV],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    ).stdout
    rates = {}
    for line in out.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if cells and cells[0] in ("SET", "GET"):
            rates[cells[0].lower()] = float(cells[1]) * size / 1e9
    return rates


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(server: RedisServer, size_mib: float, total_mib: int, rounds: int, batch: int) -> list[dict]:
    """Rounds interleave the three clients (redis-benchmark, lmtier, redis-py), so that
    drift in the machine's speed hits all three alike; reported: the best of each, and
    the median over rounds of lmtier's ratio to the others in the same round."""
    import redis

    size = int(size_mib * MiB)
    count = max(batch, total_mib * MiB // size // batch * batch)
    chunks = chunks_of(size, count, seed=int(size_mib * 10))
    keys = [c.key for c in chunks]
    frame_gb = codec.encoded_size(chunks[0]) * count / 1e9
    batches = [slice(i, i + batch) for i in range(0, count, batch)]
    tier = open_tier(f"{server.url}?pool=4")
    client = redis.Redis(port=server.port)

    def lmtier_set() -> None:
        for b in batches:
            tier.put(chunks[b])

    def lmtier_get() -> None:
        for b in batches:
            got = tier.get(keys[b])
            for chunk in got:
                assert chunk is not None and chunk.verify()
            release_all(got)

    def naive_set() -> None:
        for chunk in chunks:
            client.set(tier._rkey(chunk.key), codec.encode(chunk))

    def naive_get() -> None:
        for key in keys:
            codec.decode(client.get(tier._rkey(key)), key=key)

    samples: dict[str, list[float]] = {}
    try:
        # Steady state, as in a cache that has filled up: the server's memory for these
        # values is allocated once, untimed; every timed SET then replaces a value of the
        # same size (redis-benchmark, without -r, replaces one key over and over).
        server.call("FLUSHALL")
        lmtier_set()
        for _ in range(rounds):
            ref = redis_benchmark(server.port, size, count)
            lm = {"set": frame_gb / timed(lmtier_set), "get": frame_gb / timed(lmtier_get)}
            naive = {"set": frame_gb / timed(naive_set), "get": frame_gb / timed(naive_get)}
            for name, rates in (("redis_benchmark", ref), ("lmtier", lm), ("naive", naive)):
                rates["set+get"] = 1 / (1 / rates["set"] + 1 / rates["get"])  # store, then load back
                for op, rate in rates.items():
                    samples.setdefault(f"{name}_{op}", []).append(rate)
    finally:
        tier.close()
        client.close()

    def paired(op: str, other: str) -> float:
        return statistics.median(a / b for a, b in zip(samples[f"lmtier_{op}"], samples[f"{other}_{op}"], strict=True))

    return [
        {
            "chunk_mib": size_mib,
            "op": op,
            "redis_benchmark_gbps": max(samples[f"redis_benchmark_{op}"]),
            "lmtier_gbps": max(samples[f"lmtier_{op}"]),
            "naive_redis_py_gbps": max(samples[f"naive_{op}"]),
            "lmtier_over_redis_benchmark": max(samples[f"lmtier_{op}"]) / max(samples[f"redis_benchmark_{op}"]),
            "lmtier_over_naive": max(samples[f"lmtier_{op}"]) / max(samples[f"naive_{op}"]),
            "paired_median_over_redis_benchmark": paired(op, "redis_benchmark"),
            "paired_median_over_naive": paired(op, "naive"),
            "samples": {k: v for k, v in samples.items() if k.endswith(f"_{op}")},
        }
        for op in ("set", "get", "set+get")
    ]


def run(sizes_mib: list[float], total_mib: int, rounds: int, batch: int) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(prefix="lmtier-redis-bench-") as tmp:
        server = RedisServer(Path(tmp), "--maxmemory", f"{4 * total_mib + 512}mb", "--maxmemory-policy", "allkeys-lru")
        try:
            for size_mib in sizes_mib:
                rows += measure(server, size_mib, total_mib, rounds, batch)
        finally:
            server.stop()
    return {"benchmark": "redis_tier", "total_mib": total_mib, "batch_chunks": batch, "rounds": rounds, "rows": rows}


def table(report: dict) -> str:
    lines = [
        "| chunk | op | redis-benchmark -c 4 GB/s | lmtier GB/s | naive redis-py GB/s | lmtier / redis-benchmark "
        "| lmtier / naive | paired median / redis-benchmark | paired median / naive |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['chunk_mib']:g} MiB | {r['op'].upper()} | {r['redis_benchmark_gbps']:.2f} "
            f"| {r['lmtier_gbps']:.2f} | {r['naive_redis_py_gbps']:.2f} "
            f"| {r['lmtier_over_redis_benchmark']:.2f} | {r['lmtier_over_naive']:.2f} "
            f"| {r['paired_median_over_redis_benchmark']:.2f} | {r['paired_median_over_naive']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4])
    parser.add_argument("--total-mib", type=int, default=256, help="bytes moved per size and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16, help="chunks per put / get call")
    parser.add_argument("--json-out", help="also write the JSON report here")
    args = parser.parse_args(argv)
    report = run(args.sizes_mib, args.total_mib, args.rounds, args.batch)
    text = json.dumps(report, indent=2)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    print(text)
    print()
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

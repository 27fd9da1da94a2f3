"""Redis tier throughput against ``redis-benchmark`` and redis-py's pipeline, same server, same run.

Starts its own ``redis-server`` (no persistence, loopback), then for each chunk size
(1 MiB and 4 MiB by default):

- ``redis_benchmark``: ``redis-benchmark -c 4 -P 1 -d SIZE -t set,get``: the server and
  the loopback at their best, with a C client.
- ``lmtier``: ``RedisTier.put`` of batches of chunks, then ``get`` of the same batches,
  every chunk verified against its checksum on the way back.
- ``redis_py``: the same work with redis-py (hiredis installed):
  ``pipeline(transaction=False)`` of ``SET key encode(chunk)`` per batch, and of ``GET``
  then ``decode`` (which verifies the checksum); each batch cut over as many connections,
  run on as many threads, as the tier cuts it (``pipeline.spread``). This is the
  reference that decides whether the tier's own RESP path earns its place: it must beat
  redis-py by more than 10% (ratio above 1.1) on SET and on GET.

Rows: SET, GET, and SET+GET (the same bytes stored and loaded back: the rate of the
whole loop, ``1 / (1/set + 1/get)``).

Rounds interleave the three clients; reported: GB/s of value bytes for SET and GET (best
round of each), lmtier's ratio to each reference, and the median over rounds of the
same-round ratio, as JSON and as a Markdown table.

    python benchmarks/bench_redis_tier.py [--sizes-mib 1 4] [--total-mib 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lmtier.kv import codec
from lmtier.kv.chunk import release_all
from lmtier.kv.layout import KVLayout
from lmtier.testing.redis_server import RedisServer
from lmtier.tiers.base import TierContext, open_tier
from lmtier.tiers.redis.pipeline import spread

from common import chunks_of, emit, timed

MiB = 1 << 20
CSV = ("-t", "set,get", "--csv")
LAYOUT = KVLayout(num_layers=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")  # 64 KiB per token


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


def measure(server: RedisServer, size_mib: float, total_mib: int, rounds: int, batch: int) -> list[dict]:
    """Rounds interleave the three clients (redis-benchmark, lmtier, redis-py), so that
    drift in the machine's speed hits all three alike; reported: the best of each, and
    the median over rounds of lmtier's ratio to the others in the same round."""
    import redis

    size = int(size_mib * MiB)
    count = max(batch, total_mib * MiB // size // batch * batch)
    chunks = chunks_of(LAYOUT, size, count, seed=int(size_mib * 10))
    keys = [c.key for c in chunks]
    frame = codec.encoded_size(chunks[0])
    frame_gb = frame * count / 1e9
    batches = [range(i, i + batch) for i in range(0, count, batch)]
    tier = open_tier(f"{server.url}?pool=4", TierContext(chunk_bytes=size))  # as an engine opens it
    # The tier's own cut of one batch over its connections, for SET (by frame bytes) and
    # GET (by the chunk size it was told): redis-py gets the same parallelism.
    cuts = {
        "set": spread(list(range(batch)), batch * frame, tier.pool),
        "get": spread(list(range(batch)), batch * tier.chunk_bytes, tier.pool),
    }
    client = redis.Redis(port=server.port)  # one pooled connection per pipeline in flight
    threads = ThreadPoolExecutor(tier.pool)

    def lmtier_set() -> None:
        for b in batches:
            tier.put(chunks[b.start : b.stop])

    def lmtier_get() -> None:
        for b in batches:
            got = tier.get(keys[b.start : b.stop])
            for chunk in got:
                assert chunk is not None and chunk.verify()
            release_all(got)

    def redis_py_set_part(positions: range) -> None:
        pipe = client.pipeline(transaction=False)
        for i in positions:
            pipe.set(tier._rkey(keys[i]), codec.encode(chunks[i]))
        assert all(pipe.execute())

    def redis_py_get_part(positions: range) -> None:
        pipe = client.pipeline(transaction=False)
        for i in positions:
            pipe.get(tier._rkey(keys[i]))
        for i, value in zip(positions, pipe.execute(), strict=True):
            codec.decode(value, key=keys[i])  # verifies the payload's checksum

    def redis_py(op: str, part_of: Callable[[range], None]) -> Callable[[], None]:
        def run_batches() -> None:
            for b in batches:
                parts = [b[p[0] : p[-1] + 1] for p in cuts[op]]
                if len(parts) == 1:
                    part_of(parts[0])
                else:
                    list(threads.map(part_of, parts))

        return run_batches

    redis_py_set, redis_py_get = redis_py("set", redis_py_set_part), redis_py("get", redis_py_get_part)
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
            py = {"set": frame_gb / timed(redis_py_set), "get": frame_gb / timed(redis_py_get)}
            for name, rates in (("redis_benchmark", ref), ("lmtier", lm), ("redis_py", py)):
                rates["set+get"] = 1 / (1 / rates["set"] + 1 / rates["get"])  # store, then load back
                for op, rate in rates.items():
                    samples.setdefault(f"{name}_{op}", []).append(rate)
    finally:
        tier.close()
        client.close()
        threads.shutdown()

    def paired(op: str, other: str) -> float:
        return statistics.median(a / b for a, b in zip(samples[f"lmtier_{op}"], samples[f"{other}_{op}"], strict=True))

    def best(name: str, op: str) -> float:
        return max(samples[f"{name}_{op}"])

    return [
        {
            "chunk_mib": size_mib,
            "op": op,
            "connections": max(len(cuts["set"]), len(cuts["get"])) if op == "set+get" else len(cuts[op]),
            "redis_benchmark_gbps": best("redis_benchmark", op),
            "lmtier_gbps": best("lmtier", op),
            "redis_py_gbps": best("redis_py", op),
            "lmtier_over_redis_benchmark": best("lmtier", op) / best("redis_benchmark", op),
            "lmtier_over_redis_py": best("lmtier", op) / best("redis_py", op),
            "paired_median_over_redis_benchmark": paired(op, "redis_benchmark"),
            "paired_median_over_redis_py": paired(op, "redis_py"),
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
        "| chunk | op | connections | redis-benchmark -c 4 GB/s | lmtier GB/s | redis-py pipeline GB/s "
        "| lmtier / redis-benchmark | lmtier / redis-py | paired median / redis-benchmark | paired median / redis-py |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['chunk_mib']:g} MiB | {r['op'].upper()} | {r['connections']} | {r['redis_benchmark_gbps']:.2f} "
            f"| {r['lmtier_gbps']:.2f} | {r['redis_py_gbps']:.2f} "
            f"| {r['lmtier_over_redis_benchmark']:.2f} | {r['lmtier_over_redis_py']:.2f} "
            f"| {r['paired_median_over_redis_benchmark']:.2f} | {r['paired_median_over_redis_py']:.2f} |"
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
    emit(report, table(report), args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

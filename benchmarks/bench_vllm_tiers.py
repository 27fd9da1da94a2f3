"""Every tier inside the engine, measured as the engine sees it: a KV-heavy model's hit.

A second instance's hit, from the scheduler's lookup to the last byte in the paged cache,
is all that a shared tier is for. The tier benchmarks time the tiers alone; this times
the engine's whole path, per tier, against vLLM's own resident prefix hit of the same
prompt (the floor: no cache can serve a hit faster than the engine that already holds the
KV), on a model whose KV is large next to its compute (``--layers 24`` of ``--kv-heads 8``
of 64: 48 KiB per token, 192 MiB per 4,096-token document, each followed by a 64-token
question), where moving the bytes is most of a hit.

One run, real vLLM engines (the CPU build), one tiny random-weight Llama:

- ``prefix``: vLLM's prefix cache; each document, then a second question on it: the floor.
- ``a``: lmtier over host memory, disk, Redis, a cache server and an object store
  (SeaweedFS's S3 gateway on loopback), written through; the second question on each
  document is the **memory** hit (same engine).
- ``b_disk``, ``b_redis``, ``b_server``, ``b_s3``, ``b_memory_disk``: new instances over
  one tier each (memory + disk for the last), asking a third question: the cross-instance hits.
- ``disk_floor``: the prefix hit plus ``dd``'s O_DIRECT read of the same bytes.
- ``memory_floor``: the prefix hit plus one ``memcpy`` (``np.copyto``, warm buffers) of the
  same bytes: no hit that moves them can be cheaper (lmtier's also verifies them, a hash
  pass of about the same cost, and scatters them into the engine's blocks).

Each row: the TTFT (median over the documents), its cost above the floor (TTFT minus the
prefix hit) and its ratio to the floor. Say what else ran: these are timings of a 2-core
machine, meaningful only when nothing else competes for it.

    python benchmarks/bench_vllm_tiers.py [--tokens 4096] [--docs 3] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from lmtier.kv.layout import KVLayout
from lmtier.testing.cache_server import ServerProcess
from lmtier.testing.engine import run_engine
from lmtier.testing.redis_server import RedisServer
from lmtier.testing.s3_server import S3_TEST_KEYS, S3Server
from lmtier.testing.tinymodel import build

BLOCK, QUESTION = 64, 64
OFF = {"lmtier": {"load": False, "save": False}}
TIERS = ("memory", "disk", "redis", "server", "s3", "memory_disk")


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(5, 500, n)]


def run(tokens: int, docs: int, layers: int, hidden: int, kv_heads: int, out_json: Path | None, tiers=TIERS) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="lmtier-tiers-"))
    atexit.register(shutil.rmtree, tmp, True)  # models, disks and logs of this run: gone with it
    model = str(build(tmp / "model", layers=layers, hidden=hidden, kv_heads=kv_heads))
    layout = KVLayout(layers, kv_heads, 64, "bfloat16")
    mib = layout.chunk_bytes(tokens) / 2**20
    if tokens % 256:
        raise SystemExit("--tokens must be a multiple of 256 (whole chunks)")
    base = {"model": model, "block_size": BLOCK, "max_model_len": tokens + 1024, "max_tokens": 1}
    hit_only = {"request": {"lmtier": {"save": False}}}  # a B instance stores nothing of its own

    def ask(q: int, **extra) -> list[dict]:
        """Question ``q`` on each document: a document of ``tokens`` (whole chunks, so that
        every tier and vLLM's prefix cache hit all of it) and a question after it."""
        return [
            {"name": f"q{q}-{d}", "prompts": [ids(tokens, 10 + d) + ids(QUESTION, 100 * q + d)], **extra}
            for d in range(docs)
        ]

    warm = [{"name": "warmup", "prompts": [ids(tokens, 7)], "request": OFF}]
    redis = RedisServer(tmp / "redis")
    server = ServerProcess(tmp, "--tier", "cpu://?size=2GiB", "--token", "bench=fleet")
    s3 = S3Server.start(tmp / "s3") if "s3" in tiers else None
    os.environ.update(S3_TEST_KEYS)  # the store's keys, where the engines' AWS chain reads them
    try:
        shared = {
            "disk": f"file://{tmp / 'disk'}?size=4GiB",
            "redis": redis.url,
            "server": f"grpc://{server.address}?token=bench",
            **({"s3": s3.url("bench", size="4GiB")} if s3 else {}),
        }
        every = ["cpu://?size=2GiB", *shared.values()]

        def engine(name: str, phases: list[dict], tiers: list[str] | None, **spec) -> dict:
            lmtier = {"tiers": tiers, "chunk_tokens": 0} if tiers else None
            return run_engine({**base, "lmtier": lmtier, "phases": phases, **spec}, tmp, name, timeout=1800)["results"]

        results = {
            "prefix": engine("prefix", warm + ask(1) + ask(2), None, prefix_caching=True),
            "a": engine("a", warm + ask(1, settle=True) + ask(2), every),
        }
        instances = {"disk": [shared["disk"]], "redis": [shared["redis"]], "server": [shared["server"]],
                     "s3": [shared.get("s3")], "memory_disk": ["cpu://?size=2GiB", shared["disk"]]}  # fmt: skip
        for tier in (t for t in tiers if t in instances):
            results[f"b_{tier}"] = engine(f"b_{tier}", warm + ask(3, **hit_only), instances[tier])
    finally:
        server.stop()
        redis.stop()
        if s3:
            s3.stop()

    def ttft(config: str, q: int) -> float:
        return statistics.median(results[config][f"q{q}-{d}"][0]["seconds"] for d in range(docs))

    def cached(config: str, q: int) -> int:
        return min(results[config][f"q{q}-{d}"][0]["cached"] for d in range(docs))

    floor = ttft("prefix", 2)
    from bench_vllm_ttft import dd_read_seconds

    dd = dd_read_seconds(tmp / "dd", cached("a", 2) * layout.chunk_bytes(1))
    copy = memcpy_seconds(cached("a", 2) * layout.chunk_bytes(1))
    where = {"memory": ("a", 2), "disk": ("b_disk", 3), "redis": ("b_redis", 3), "server": ("b_server", 3),
             "s3": ("b_s3", 3), "memory_disk": ("b_memory_disk", 3)}  # fmt: skip
    rows = []
    for tier in (t for t in TIERS if t in tiers):
        config, q = where[tier]
        t = ttft(config, q)
        rows.append(
            {
                "tier": tier,
                "ttft": t,
                "cached_tokens": cached(config, q),
                "over_floor_s": t - floor,
                "ratio": t / floor,
            }
        )
    report = {
        "tokens": tokens,
        "kv_mib_per_prompt": mib,
        "kv_bytes_per_token": layout.chunk_bytes(1),
        "vllm_prefix_hit": floor,
        "prefix_cached_tokens": cached("prefix", 2),
        "dd_read_seconds": dd,
        "disk_floor": floor + dd,
        "memcpy_seconds": copy,
        "memory_floor": floor + copy,
        "no_cache_first_request": ttft("prefix", 1),
        "rows": rows,
    }
    print(json.dumps(report, indent=2))
    print()
    print(f"KV of {report['kv_bytes_per_token'] // 1024} KiB per token: {mib:.0f} MiB per {tokens}-token prompt")
    print()
    print("| served by | TTFT (s) | cached tokens | cost above vLLM's prefix hit (s) | ratio to it |")
    print("|---|---:|---:|---:|---:|")
    print(f"| vLLM resident prefix hit (floor) | {floor:.3f} | {report['prefix_cached_tokens']} | 0 | 1.00 |")
    disk_floor = floor + dd
    print(f"| prefix hit + dd O_DIRECT read (disk floor) | {disk_floor:.3f} | | {dd:.3f} | {disk_floor / floor:.2f} |")
    print(f"| prefix hit + memcpy (memory floor) | {floor + copy:.3f} | | {copy:.3f} | {(floor + copy) / floor:.2f} |")
    for r in rows:
        t, n, over, ratio = r["ttft"], r["cached_tokens"], r["over_floor_s"], r["ratio"]
        print(f"| lmtier {r['tier']} | {t:.3f} | {n} | {over:+.3f} | {ratio:.2f} |")
    if out_json:
        out_json.write_text(json.dumps(report, indent=2) + "\n")
    return report


def memcpy_seconds(nbytes: int) -> float:
    """One ``np.copyto`` of ``nbytes`` between buffers already mapped (best of five)."""
    from common import best

    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    return best(lambda: np.copyto(dst, src), 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--docs", type=int, default=3)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument(
        "--tiers",
        nargs="+",
        choices=TIERS,
        default=list(TIERS),
        help="the hits to time (memory: the first engine's own; the rest: a new instance each)",
    )
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    run(args.tokens, args.docs, args.layers, args.hidden, args.kv_heads, args.json_out, tuple(args.tiers))


if __name__ == "__main__":
    main()

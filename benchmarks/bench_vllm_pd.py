"""Prefill/decode disaggregation through lmtier, timed on the CPU build of vLLM.

One run, real engines, one tiny random-weight Llama, a real Redis as the shared tier:

- **The producer's prefill** (``kv_role: kv_producer``, memory + Redis), at each prompt
  length, three kinds of request interleaved in the same engine (a paired comparison the
  machine's drift cannot skew), each ``max_tokens=1``:
  ``no_store`` asks lmtier not to store (``{"lmtier": {"save": false}}``): the engine's
  own prefill, the reference; ``hold`` is what a router that forwards nothing gets (the
  step holds its output until the prompt's chunks are in Redis); ``forwarded`` carries
  ``do_remote_decode`` (the answer leaves at once, the writes follow in the background).
  Background writes settle (untimed) after each request.
- **What the hold can cost**: the time to write a prompt's KV to memory and Redis as a
  producer does (``TieredStore.put_all``), measured alone against the same Redis. On this
  CPU the prefill's compute dwarfs it; on a GPU it is what a held step waits for.
- **The decode instance's TTFT** (``kv_consumer`` over Redis, vLLM's prefix cache on): the
  same prompts, their KV loaded from Redis, against the same prompts asked again in that
  engine (vLLM's own prefix hit: what a colocated engine that had computed the prompt
  itself would pay).

Targets: the producer's ``hold`` <= 1.10x ``no_store``; the decode TTFT <= 1.2x the
prefix hit. Prints JSON and a Markdown table.

    python benchmarks/bench_vllm_pd.py [--lengths 2048 8192] [--docs 3] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import tempfile
from pathlib import Path

import numpy as np

from lmtier.kv.layout import KVLayout
from lmtier.testing.engine import compare_answers, run_engine
from lmtier.testing.redis_server import RedisServer
from lmtier.testing.tinymodel import build

BLOCK, QUESTION, CHUNK = 64, 64, 256
NO_STORE = {"lmtier": {"save": False}}
FORWARDED = {"do_remote_decode": True}


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(5, 500, n)]


def run(lengths: list[int], docs: int, layers: int, hidden: int, kv_heads: int, out_json: Path | None) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="lmtier-pd-"))
    atexit.register(shutil.rmtree, tmp, True)
    model = str(build(tmp / "model", layers=layers, hidden=hidden, kv_heads=kv_heads))
    layout = KVLayout(layers, kv_heads, 64, "bfloat16")
    base = {"model": model, "block_size": BLOCK, "max_model_len": max(lengths) + 512, "max_tokens": 1}

    def prompt(kind: str, length: int, d: int) -> list[int]:
        seed = {"no_store": 1, "hold": 2, "forwarded": 3}[kind]
        return ids(length - QUESTION, 1000 * seed + 10 * d + length) + ids(QUESTION, 7 + d)

    kinds = {"no_store": NO_STORE, "hold": None, "forwarded": FORWARDED}
    produce = [{"name": "warmup", "prompts": [ids(512, 5)], "request": NO_STORE}]
    for length in lengths:
        for d in range(docs):
            for kind, request in kinds.items():
                produce.append(
                    {"name": f"{kind}-{length}-{d}", "prompts": [prompt(kind, length, d)], "request": request,
                     "settle": True}
                )  # fmt: skip
    decode_phases = [{"name": "warmup", "prompts": [ids(512, 6)]}]
    for again in ("decode", "own"):
        for length in lengths:
            for d in range(docs):
                decode_phases.append({"name": f"{again}-{length}-{d}", "prompts": [prompt("hold", length, d)]})
    full = [{"name": "warmup", "prompts": [ids(512, 6)]}] + [
        {"name": f"full-{length}-{d}", "prompts": [prompt("hold", length, d)]}
        for length in lengths
        for d in range(docs)
    ]
    redis = RedisServer(tmp / "redis")
    try:
        lmtier = {"chunk_tokens": CHUNK}
        print("producer ...", flush=True)
        producer = run_engine(
            {**base, "kv_role": "kv_producer", "lmtier": {**lmtier, "tiers": ["cpu://?size=2GiB", redis.url]},
             "phases": produce},
            tmp, "producer", timeout=3600,
        )["results"]  # fmt: skip
        print("decode instance ...", flush=True)
        decode = run_engine(
            {**base, "kv_role": "kv_consumer", "lmtier": {**lmtier, "tiers": [redis.url]}, "prefix_caching": True,
             "phases": decode_phases},
            tmp, "decode", timeout=3600,
        )["results"]  # fmt: skip
        print("reference: full prefills, no cache ...", flush=True)
        reference = run_engine({**base, "phases": full}, tmp, "full", timeout=3600)["results"]
        writes = {n: write_seconds(layout, n, redis.url) for n in lengths}
    finally:
        redis.stop()

    def median(results: dict, kind: str, length: int) -> float:
        return statistics.median(results[f"{kind}-{length}-{d}"][0]["seconds"] for d in range(docs))

    rows = []
    for length in lengths:
        outs = [decode[f"decode-{length}-{d}"][0] for d in range(docs)]
        own = [decode[f"own-{length}-{d}"][0] for d in range(docs)]
        problems, exact = compare_answers(outs, own, [reference[f"full-{length}-{d}"][0] for d in range(docs)])
        rows.append(
            {
                "tokens": length,
                "kv_mib": layout.chunk_bytes(length) / 2**20,
                "producer_no_store": median(producer, "no_store", length),
                "producer_hold": median(producer, "hold", length),
                "producer_forwarded": median(producer, "forwarded", length),
                "write_s": writes[length],
                "decode_lmtier": median(decode, "decode", length),
                "decode_cached_tokens": min(o["cached"] for o in outs),
                "vllm_prefix_hit": median(decode, "own", length),
                "full_prefill": median(reference, "full", length),
                "answers_exact": exact,
                "answer_problems": problems,
            }
        )
    for r in rows:
        r["hold_ratio"] = r["producer_hold"] / r["producer_no_store"]
        r["forwarded_ratio"] = r["producer_forwarded"] / r["producer_no_store"]
        r["decode_ratio"] = r["decode_lmtier"] / r["vllm_prefix_hit"]
        r["write_share"] = r["write_s"] / r["producer_no_store"]
    report = {"kv_bytes_per_token": layout.chunk_bytes(1), "docs": docs, "rows": rows}
    print(json.dumps(report, indent=2))
    print()
    print(f"KV of {report['kv_bytes_per_token'] // 1024} KiB per token; medians over {docs} prompts per length")
    print()
    print("| tokens | producer, no store (s) | hold (s) | ratio | forwarded (s) | ratio | its KV's write (s) "
          "| decode, lmtier hit (s) | cached | vLLM prefix hit (s) | ratio | full prefill (s) |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['tokens']} | {r['producer_no_store']:.3f} | {r['producer_hold']:.3f} | {r['hold_ratio']:.2f} "
            f"| {r['producer_forwarded']:.3f} | {r['forwarded_ratio']:.2f} | {r['write_s']:.3f} "
            f"| {r['decode_lmtier']:.3f} "
            f"| {r['decode_cached_tokens']} | {r['vllm_prefix_hit']:.3f} | {r['decode_ratio']:.2f} "
            f"| {r['full_prefill']:.3f} |"
        )
    for r in rows:
        for problem in r["answer_problems"]:
            print(f"  {r['tokens']} tokens: {problem}")
    if out_json:
        out_json.write_text(json.dumps(report, indent=2) + "\n")
    return report


def write_seconds(layout: KVLayout, tokens: int, url: str) -> float:
    """What a hold can cost at most for a prompt of ``tokens``: writing its KV, in chunks,
    to memory and Redis as a producer does (``TieredStore.put_all``), best of three."""
    from lmtier.kv.chunk import Chunk
    from lmtier.store.tiered import TieredStore

    from common import best

    rng = np.random.default_rng(tokens)
    data = rng.integers(0, 256, (tokens // CHUNK, *layout.byte_shape(CHUNK)), dtype=np.uint8)
    with TieredStore.open(["cpu://?size=1GiB", url]) as store:

        def write() -> None:
            chunks = [Chunk(rng.bytes(16), layout, d) for d in data]  # new keys: a write every time
            assert store.put_all(chunks)

        return best(write, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--docs", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    report = run(args.lengths, args.docs, args.layers, args.hidden, args.kv_heads, args.json_out)
    if any(r["answer_problems"] for r in report["rows"]):
        raise SystemExit("the decode instance's answers differ from their references")


if __name__ == "__main__":
    main()

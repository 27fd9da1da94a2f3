"""Time to first token with and without lmtier, on the CPU build of vLLM.

All in one run, with one small random-weight Llama (built offline), single-process
engines, and for each prompt length:

- ``no_cache``: vLLM without lmtier and without its prefix cache: the full prefill.
- ``vllm_prefix_hit``: vLLM's own prefix cache, the document already resident in the same
  engine: the physical floor for a cache hit.
- ``lmtier_store``: the first request through an engine with lmtier: what storing costs.
  Its reference, ``lmtier_no_store``, is a request in the same engine, interleaved with
  the storing ones, that asks lmtier not to store (``kv_transfer_params``): a paired
  comparison that the machine's drift cannot skew. Background saves settle (untimed)
  after each request of both kinds, so neither absorbs the other's background work.
- ``lmtier_cpu_hit``: a second question on the same document, same engine (vLLM's prefix
  cache off, so the KV comes from lmtier's host-memory tier).
- ``lmtier_disk_hit``: a third question in a new engine process: the KV comes from disk.
  ``disk_floor`` is the prefix hit plus the time ``dd`` takes, in the same run, to read
  that many bytes from the same disk with O_DIRECT: no disk hit can be faster.

The disk hits' answers are checked against vLLM's own prefix-cache hits of the same
prompts (bit for bit wherever both cached as many tokens) and against full prefills
(greedy tokens, logprobs within ``lmtier.testing.engine.LOGPROB_TOLERANCE``).

Workloads: long documents (a document plus a question) and a multi-round chat (each
round's prompt is the previous prompt, its answer and a new question; the last round is
timed). TTFT is the time of a one-token generate call, the median over a few documents.
Also: throughput on prompts that never repeat, with and without lmtier (best of three
passes in each engine), and the same in one engine with passes alternating between
lmtier on and off for their requests, each pass timed until its saves have landed: with
the default save policy (``always``: every chunk stored), and in another engine with
``save_policy=reuse`` over a memory tier of half a pass (so that every pass evicts the
chunks of the one before, which the policy then writes down or not).

Prints JSON and a Markdown table and writes a PNG plot.

    python benchmarks/bench_vllm_ttft.py [--lengths 2048 8192] [--docs 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from lmtier.config import resolve_chunk_tokens
from lmtier.kv.layout import KVLayout
from lmtier.testing.engine import compare_answers, run_engine
from lmtier.testing.tinymodel import build

BLOCK, QUESTION = 64, 64


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(5, 500, n)]


def engine(tmp: Path, name: str, spec: dict) -> dict:
    return run_engine(spec, tmp, name, timeout=1800)["results"]


def run(
    lengths: list[int], docs: int, out_dir: Path, layers: int, hidden: int, throughput_prompts: int, chunk: int = 0
) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="lmtier-ttft-"))
    atexit.register(shutil.rmtree, tmp, True)  # models, disks and logs of this run: gone with it
    model = str(build(tmp / "model", layers=layers, hidden=hidden))
    disk = tmp / "disk"
    lmtier = {"tiers": ["cpu://?size=4GiB", f"file://{disk}?size=16GiB"], "chunk_tokens": chunk}
    token_bytes = KVLayout(layers, 2, 64, "bfloat16").chunk_bytes(1)
    # save_policy=reuse writes down what memory lets go: a memory tier holding half of one
    # pass of the throughput prompts makes every pass evict (and write back) the one before,
    # so that the row measures the policy's writes, not memory alone
    reuse_memory = max(64 << 20, throughput_prompts * 1024 * token_bytes // 2)
    reuse_tiers = [f"cpu://?size={reuse_memory}", f"file://{tmp / 'disk-reuse'}?size=16GiB"]
    chunk = resolve_chunk_tokens(chunk, BLOCK, token_bytes)
    base = {"model": model, "block_size": BLOCK, "max_model_len": max(lengths) + 1024, "max_tokens": 1}

    def doc(length: int, d: int) -> list[int]:
        return ids(length - QUESTION, 1000 * length + d)

    def question(length: int, d: int, q: int) -> list[int]:
        return ids(QUESTION, 7 + 1000 * length + 10 * d + q)

    def ask(tag: str, q: int, **phase) -> list[dict]:
        return [
            {"name": f"{tag}-{n}-{d}", "prompts": [doc(n, d) + question(n, d, q)], **phase}
            for n in lengths
            for d in range(docs)
        ]

    def store_pairs() -> list[dict]:
        """Storing requests interleaved with same-sized ones that ask lmtier not to store."""
        phases = []
        for n in lengths:
            for d in range(docs):
                private = ids(n, 50_000 + 1000 * n + d)
                phases.append({"name": f"nostore-{n}-{d}", "prompts": [private], "request": NO_STORE, "settle": True})
                phases.append({"name": f"q1-{n}-{d}", "prompts": [doc(n, d) + question(n, d, 1)], "settle": True})
        return phases

    def chat(tag: str, settle: bool) -> list[dict]:
        return [
            {
                "name": f"{tag}-chat-{n}",
                "settle": settle,
                "chat": {"first": ids(n // 3, 5 + n), "questions": [ids(n // 3 - 32, 6 + n), ids(n // 3 - 32, 7 + n)]},
            }
            for n in lengths
        ]

    no_reuse = [
        {
            "name": f"throughput-{k}",
            "max_tokens": 16,
            "prompts": [ids(1024, 90_000 + 100 * k + i) for i in range(throughput_prompts)],
        }
        for k in range(3)
    ]
    # The same in one engine, passes alternating between lmtier on and lmtier off for their
    # requests (other prompts each pass), each pass timed until its saves have landed: a
    # comparison that the drift between engines started minutes apart cannot skew.
    paired = [
        {
            "name": f"paired-{mode}-{k}",
            "max_tokens": 16,
            "prompts": [ids(1024, 95_000 + 1000 * k + 100 * (mode == "on") + i) for i in range(throughput_prompts)],
            "drain": True,
            **({} if mode == "on" else {"request": OFF}),
        }
        for k in range(3)
        for mode in ("off", "on")
    ]
    # Every engine first serves one unrelated prompt of each length, lmtier switched off
    # for it: the engine's own first-time costs at a new context length are not a cache's.
    warm = [
        {"name": f"warmup-{n}", "prompts": [ids(n, 123 + n)], "request": {"lmtier": {"load": False, "save": False}}}
        for n in lengths
    ]
    results = {
        "none": engine(
            tmp, "none", {**base, "phases": warm + ask("q1", 1) + chat("c", True) + no_reuse + ask("q3", 3)}
        ),
        "prefix": engine(
            tmp,
            "prefix",
            {
                **base,
                "prefix_caching": True,
                "phases": warm + ask("q1", 1) + ask("q2", 2) + chat("c", True) + ask("q3", 3),
            },
        ),
        "lmtier_a": engine(
            tmp,
            "lmtier_a",
            {
                **base,
                "lmtier": lmtier,
                "phases": warm + store_pairs() + ask("q2", 2) + chat("c", True) + no_reuse + paired,
            },
        ),
        "lmtier_b": engine(
            tmp, "lmtier_b", {**base, "lmtier": lmtier, "phases": warm + ask("q3", 3) + chat("c", True)}
        ),
        # the same paired passes under save_policy=reuse (the default stores every chunk),
        # over a directory of its own: engine A's saves of the same prompts must not hit
        "lmtier_reuse": engine(
            tmp,
            "lmtier_reuse",
            {**base, "lmtier": {**lmtier, "tiers": reuse_tiers, "save_policy": "reuse"}, "phases": warm + paired},
        ),
    }

    def ttft(config: str, tag: str, n: int) -> float:
        return statistics.median(results[config][f"{tag}-{n}-{d}"][0]["seconds"] for d in range(docs))

    def cached(config: str, tag: str, n: int) -> int:
        return min(results[config][f"{tag}-{n}-{d}"][0]["cached"] for d in range(docs))

    read_seconds = {n: dd_read_seconds(tmp / "dd", cached("lmtier_b", "q3", n) * token_bytes) for n in lengths}
    table = []
    for n in lengths:
        row = {
            "prompt_tokens": n,
            "no_cache": ttft("none", "q1", n),
            "vllm_prefix_hit": ttft("prefix", "q2", n),
            "lmtier_store": ttft("lmtier_a", "q1", n),
            "lmtier_no_store": ttft("lmtier_a", "nostore", n),
            "lmtier_cpu_hit": ttft("lmtier_a", "q2", n),
            "lmtier_disk_hit": ttft("lmtier_b", "q3", n),
            "cached_tokens": {
                "vllm_prefix_hit": cached("prefix", "q2", n),
                "lmtier_cpu_hit": cached("lmtier_a", "q2", n),
                "lmtier_disk_hit": cached("lmtier_b", "q3", n),
            },
            "chat_last_round": {
                c: results[c][f"c-chat-{n}"][-1]["seconds"] for c in ("none", "prefix", "lmtier_a", "lmtier_b")
            },
        }
        # B's disk hits against vLLM's own prefix-cache hits of the same prompts (bit for bit
        # where both cached as many tokens) and full prefills (greedy tokens, tolerance).
        problems, exact = compare_answers(
            *([results[c][f"q3-{n}-{d}"][0] for d in range(docs)] for c in ("lmtier_b", "prefix", "none"))
        )
        row["answers"] = {"requests": docs, "bit_for_bit": exact, "problems": problems}
        row["disk_read_seconds_dd"] = read_seconds[n]
        row["disk_floor"] = row["vllm_prefix_hit"] + read_seconds[n]
        row["disk_hit_over_prefix_hit"] = row["lmtier_disk_hit"] / row["vllm_prefix_hit"]
        row["disk_hit_over_floor"] = row["lmtier_disk_hit"] / row["disk_floor"]
        row["store_overhead"] = row["lmtier_store"] / row["lmtier_no_store"] - 1
        row["store_over_no_cache_engine"] = row["lmtier_store"] / row["no_cache"] - 1
        row["speedup_disk_hit"] = row["no_cache"] / row["lmtier_disk_hit"]
        table.append(row)
    tokens = throughput_prompts * (1024 + 16)

    def best_throughput(config: str) -> float:
        return max(tokens / results[config][f"throughput-{k}"][0]["seconds"] for k in range(3))

    throughput = {
        "without_lmtier_tokens_per_s": best_throughput("none"),
        "with_lmtier_tokens_per_s": best_throughput("lmtier_a"),
    }
    throughput["ratio"] = throughput["with_lmtier_tokens_per_s"] / throughput["without_lmtier_tokens_per_s"]
    for key, config in (("paired", "lmtier_a"), ("paired_reuse", "lmtier_reuse")):
        passes = results[config]
        on, off = (max(tokens / passes[f"paired-{mode}-{k}"][0]["seconds"] for k in range(3)) for mode in ("on", "off"))
        throughput[key] = {"lmtier_on_tokens_per_s": on, "lmtier_off_tokens_per_s": off, "ratio": on / off}
    report = {
        "benchmark": "vllm_ttft",
        "model": {"layers": layers, "hidden": hidden, "kv_heads": 2, "head_dim": 64, "dtype": "bfloat16"},
        "chunk_tokens": chunk,
        "docs": docs,
        "rows": table,
        "no_reuse_throughput": throughput,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(report, out_dir / "ttft.png")
    return report


NO_STORE = {"lmtier": {"save": False}}
OFF = {"lmtier": {"load": False, "save": False}}


def dd_read_seconds(path: Path, nbytes: int) -> float:
    """Seconds ``dd`` takes to read ``nbytes`` with O_DIRECT from a file it wrote on the
    same disk (best of three): the disk's own time for a disk hit's bytes."""
    import subprocess
    import time

    count = max(1, -(-nbytes // (1 << 20)))
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={count}", "oflag=direct", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"], check=True, capture_output=True)
        best = min(best, time.perf_counter() - start)
    path.unlink()
    return best


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    lengths = [r["prompt_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in (
        ("no_cache", "no cache (full prefill)"),
        ("lmtier_store", "lmtier, storing"),
        ("lmtier_disk_hit", "lmtier hit from disk (new instance)"),
        ("lmtier_cpu_hit", "lmtier hit from memory"),
        ("vllm_prefix_hit", "vLLM prefix cache, resident"),
    ):
        ax.plot(lengths, [r[key] * 1000 for r in rows], marker="o", label=label)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (ms)")
    ax.set_yscale("log")
    ax.set_xticks(lengths)
    ax.set_title("TTFT, vLLM CPU build, small random Llama")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def answers(a: dict) -> str:
    if a["problems"]:
        return "DIFFERENT: " + "; ".join(a["problems"])
    return f"identical ({a['bit_for_bit']}/{a['requests']} bit for bit with vLLM's prefix hit)"


def markdown(report: dict) -> str:
    lines = [
        "| prompt tokens | no cache | vLLM prefix hit | lmtier storing | same engine, not storing "
        "| lmtier memory hit | lmtier disk hit | disk floor (prefix hit + dd read) "
        "| disk hit / prefix hit | disk hit / floor | storing overhead | disk hits' answers |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["rows"]:
        ms = {
            k: f"{r[k] * 1000:.0f} ms"
            for k in (
                "no_cache",
                "vllm_prefix_hit",
                "lmtier_store",
                "lmtier_no_store",
                "lmtier_cpu_hit",
                "lmtier_disk_hit",
                "disk_floor",
            )
        }
        lines.append(
            f"| {r['prompt_tokens']} | {ms['no_cache']} | {ms['vllm_prefix_hit']} | {ms['lmtier_store']} "
            f"| {ms['lmtier_no_store']} | {ms['lmtier_cpu_hit']} | {ms['lmtier_disk_hit']} | {ms['disk_floor']} "
            f"| {r['disk_hit_over_prefix_hit']:.2f}x | {r['disk_hit_over_floor']:.2f}x "
            f"| {r['store_overhead'] * 100:+.1f}% | {answers(r['answers'])} |"
        )
    t = report["no_reuse_throughput"]
    lines.append("")
    lines.append(
        f"No reuse: {t['with_lmtier_tokens_per_s']:.0f} tokens/s with lmtier, "
        f"{t['without_lmtier_tokens_per_s']:.0f} without ({t['ratio']:.2f}x, two engines); in one engine, "
        f"passes alternating, saves landed within each pass: {t['paired']['lmtier_on_tokens_per_s']:.0f} "
        f"with lmtier on, {t['paired']['lmtier_off_tokens_per_s']:.0f} off ({t['paired']['ratio']:.2f}x); the same "
        f"under save_policy=reuse: {t['paired_reuse']['ratio']:.2f}x."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--throughput-prompts", type=int, default=16)
    parser.add_argument(
        "--chunk-tokens", type=int, default=0, help="lmtier's chunk size (default 0: automatic, as in production)"
    )
    parser.add_argument("--out", default="benchmarks/results", help="where the JSON and the PNG go")
    args = parser.parse_args(argv)
    out = Path(args.out)
    report = run(args.lengths, args.docs, out, args.layers, args.hidden, args.throughput_prompts, args.chunk_tokens)
    text = json.dumps(report, indent=2)
    (out / "ttft.json").write_text(text + "\n")
    print(text)
    print()
    print(markdown(report))
    print(f"\nplot: {out / 'ttft.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time to first token with and without lmtier, on the CPU build of vLLM.

All in one run, with one small random-weight Llama (built offline), single-process
engines, and for each prompt length:

- ``no_cache``: vLLM without lmtier and without its prefix cache: the full prefill.
- ``vllm_prefix_hit``: vLLM's own prefix cache, the document already resident in the same
  engine: the physical floor for a cache hit.
- ``lmtier_store``: the first request through an engine with lmtier: what storing costs.
- ``lmtier_cpu_hit``: a second question on the same document, same engine (vLLM's prefix
  cache off, so the KV comes from lmtier's host-memory tier).
- ``lmtier_disk_hit``: a third question in a new engine process: the KV comes from disk.

Workloads: long documents (a document plus a question) and a multi-round chat (each
round's prompt is the previous prompt, its answer and a new question; the last round is
timed). TTFT is the time of a one-token generate call, the median over a few documents.
Also: throughput on prompts that never repeat, with and without lmtier.

Prints JSON and a Markdown table and writes a PNG plot.

    python benchmarks/bench_vllm_ttft.py [--lengths 2048 8192] [--docs 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from lmtier.enginerun import run_engine
from lmtier.tinymodel import build

BLOCK, QUESTION = 64, 64


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(5, 500, n)]


def engine(tmp: Path, name: str, spec: dict) -> dict:
    return run_engine(spec, tmp, name, timeout=1800)["results"]


def run(
    lengths: list[int], docs: int, out_dir: Path, layers: int, hidden: int, throughput_prompts: int, chunk: int = 256
) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="lmtier-ttft-"))
    model = str(build(tmp / "model", layers=layers, hidden=hidden))
    disk = tmp / "disk"
    lmtier = {"tiers": ["cpu://?size=4GiB", f"file://{disk}?size=16GiB"], "chunk_tokens": chunk}
    base = {"model": model, "block_size": BLOCK, "max_model_len": max(lengths) + 1024, "max_tokens": 1}

    def doc(length: int, d: int) -> list[int]:
        return ids(length - QUESTION, 1000 * length + d)

    def question(length: int, d: int, q: int) -> list[int]:
        return ids(QUESTION, 7 + 1000 * length + 10 * d + q)

    def ask(tag: str, q: int) -> list[dict]:
        return [
            {"name": f"{tag}-{n}-{d}", "prompts": [doc(n, d) + question(n, d, q)]} for n in lengths for d in range(docs)
        ]

    def chat(tag: str) -> list[dict]:
        return [
            {
                "name": f"{tag}-chat-{n}",
                "chat": {"first": ids(n // 3, 5 + n), "questions": [ids(n // 3 - 32, 6 + n), ids(n // 3 - 32, 7 + n)]},
            }
            for n in lengths
        ]

    no_reuse = [
        {"name": "throughput", "max_tokens": 16, "prompts": [ids(1024, 90_000 + i) for i in range(throughput_prompts)]}
    ]
    warm = [{"name": "warmup", "prompts": [ids(512, 123)]}]
    results = {
        "none": engine(tmp, "none", {**base, "phases": warm + ask("q1", 1) + chat("c") + no_reuse}),
        "prefix": engine(
            tmp, "prefix", {**base, "prefix_caching": True, "phases": warm + ask("q1", 1) + ask("q2", 2) + chat("c")}
        ),
        "lmtier_a": engine(
            tmp,
            "lmtier_a",
            {
                **base,
                "lmtier": lmtier,
                "phases": warm + ask("q1", 1) + [{"flush": True}] + ask("q2", 2) + chat("c") + no_reuse,
            },
        ),
        "lmtier_b": engine(tmp, "lmtier_b", {**base, "lmtier": lmtier, "phases": warm + ask("q3", 3) + chat("c")}),
    }

    def ttft(config: str, tag: str, n: int) -> float:
        return statistics.median(results[config][f"{tag}-{n}-{d}"][0]["seconds"] for d in range(docs))

    def cached(config: str, tag: str, n: int) -> int:
        return min(results[config][f"{tag}-{n}-{d}"][0]["cached"] for d in range(docs))

    table = []
    for n in lengths:
        row = {
            "prompt_tokens": n,
            "no_cache": ttft("none", "q1", n),
            "vllm_prefix_hit": ttft("prefix", "q2", n),
            "lmtier_store": ttft("lmtier_a", "q1", n),
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
        row["disk_hit_over_prefix_hit"] = row["lmtier_disk_hit"] / row["vllm_prefix_hit"]
        row["store_overhead"] = row["lmtier_store"] / row["no_cache"] - 1
        row["speedup_disk_hit"] = row["no_cache"] / row["lmtier_disk_hit"]
        table.append(row)
    tokens = throughput_prompts * (1024 + 16)
    throughput = {
        "without_lmtier_tokens_per_s": tokens / results["none"]["throughput"][0]["seconds"],
        "with_lmtier_tokens_per_s": tokens / results["lmtier_a"]["throughput"][0]["seconds"],
    }
    throughput["ratio"] = throughput["with_lmtier_tokens_per_s"] / throughput["without_lmtier_tokens_per_s"]
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


def markdown(report: dict) -> str:
    lines = [
        "| prompt tokens | no cache | vLLM prefix hit | lmtier storing | lmtier memory hit | lmtier disk hit "
        "| disk hit / prefix hit | storing overhead |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        ms = {
            k: f"{r[k] * 1000:.0f} ms"
            for k in ("no_cache", "vllm_prefix_hit", "lmtier_store", "lmtier_cpu_hit", "lmtier_disk_hit")
        }
        lines.append(
            f"| {r['prompt_tokens']} | {ms['no_cache']} | {ms['vllm_prefix_hit']} | {ms['lmtier_store']} "
            f"| {ms['lmtier_cpu_hit']} | {ms['lmtier_disk_hit']} | {r['disk_hit_over_prefix_hit']:.2f}x "
            f"| {r['store_overhead'] * 100:+.1f}% |"
        )
    t = report["no_reuse_throughput"]
    lines.append("")
    lines.append(
        f"No reuse: {t['with_lmtier_tokens_per_s']:.0f} tokens/s with lmtier, "
        f"{t['without_lmtier_tokens_per_s']:.0f} without ({t['ratio']:.2f}x)."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--docs", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--throughput-prompts", type=int, default=16)
    parser.add_argument("--chunk-tokens", type=int, default=256, help="lmtier's chunk size (default 256)")
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

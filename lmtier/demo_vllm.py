"""``lmtier demo``: two vLLM engines in two processes, one prefill per document.

A small random-weight Llama is built offline. Instance A (one engine process) answers
several questions about each of a few long documents: the first question per document
pays for the prefill and lmtier stores the document's KV (host memory, then a disk
directory); later questions load it. Instance B, a new engine process on the same disk
directory, answers new questions about the same documents: it loads the documents' KV
from disk instead of prefilling them. A third engine without lmtier answers B's questions
too, to show that B's answers are identical, and to time a prefill with no cache at all.

Prints a TTFT table and writes a PNG plot.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from lmtier.enginerun import run_engine
from lmtier.tinymodel import build

QUESTION = 64


def _ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(5, 500, n)]


def _engine(tmp: Path, name: str, spec: dict) -> dict:
    print(f"  starting engine {name} ...", flush=True)
    return run_engine(spec, tmp, name)["results"]


def run_vllm_demo(
    out_dir: str = "lmtier-demo",
    docs: int = 3,
    doc_tokens: int = 4096,
    questions: int = 3,
    directory: str | None = None,
) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lmtier-demo-", dir=directory) as tmp_name:
        tmp = Path(tmp_name)
        print("building a small random-weight Llama (8 layers, bf16) ...", flush=True)
        # 4 query heads: with this shape vLLM's CPU attention gives the same bits whether the
        # context was computed or cached, so B can be compared with a no-cache run bit for bit
        # (with 8 heads even vLLM's own prefix-cache hit moves logprobs by ~1e-2).
        model = str(build(tmp / "model", layers=8, hidden=256))
        disk = tmp / "disk"
        lmtier = {"tiers": ["cpu://?size=2GiB", f"file://{disk}?size=8GiB"]}
        base = {"model": model, "block_size": 64, "max_model_len": doc_tokens + 512, "max_tokens": 16}
        documents = [_ids(doc_tokens, 100 + d) for d in range(docs)]

        def asks(tag: str, first_q: int, count: int) -> list[dict]:
            return [
                {"name": f"{tag}-{d}-{q}", "prompts": [documents[d] + _ids(QUESTION, 1000 * d + q)]}
                for d in range(docs)
                for q in range(first_q, first_q + count)
            ]

        warm = [{"name": "warmup", "prompts": [_ids(256, 7)]}]
        print(f"instance A: {docs} documents of {doc_tokens} tokens, {questions} questions each", flush=True)
        a = _engine(tmp, "A", {**base, "lmtier": lmtier, "phases": warm + asks("a", 0, questions)})
        print("instance B: a new process, new questions about the same documents", flush=True)
        b = _engine(tmp, "B", {**base, "lmtier": lmtier, "phases": warm + asks("b", questions, questions)})
        print("reference: an engine without lmtier answers B's questions", flush=True)
        ref = _engine(tmp, "reference", {**base, "phases": warm + asks("b", questions, questions)})

    def pick(results: dict, tag: str, qs: range) -> list[dict]:
        return [results[f"{tag}-{d}-{q}"][0] for d in range(docs) for q in qs]

    rows = {
        "no cache (engine without lmtier)": pick(ref, "b", range(questions, 2 * questions)),
        "A, first question (prefill, stored)": pick(a, "a", range(0, 1)),
        "A, later questions (lmtier memory hit)": pick(a, "a", range(1, questions)),
        "B, new instance (lmtier disk hit)": pick(b, "b", range(questions, 2 * questions)),
    }
    print("\n| requests | median TTFT | cached tokens (median) | answers identical to no cache |")
    print("|---|---:|---:|---|")
    same = all(
        x["tokens"] == y["tokens"] and x["logprobs"] == y["logprobs"]
        for x, y in zip(
            rows["B, new instance (lmtier disk hit)"], rows["no cache (engine without lmtier)"], strict=True
        )
    )
    medians = {}
    for label, outs in rows.items():
        medians[label] = statistics.median(o["seconds"] for o in outs)
        cached = statistics.median(o["cached"] for o in outs)
        identical = str(same) if label.startswith("B") else ""
        print(f"| {label} | {medians[label] * 1000:.0f} ms | {cached:.0f} of {outs[0]['prompt_len']} | {identical} |")
    speedup = medians["no cache (engine without lmtier)"] / medians["B, new instance (lmtier disk hit)"]
    print(f"\nB's time to first token is {speedup:.1f}x shorter than a full prefill.")
    _plot(medians, out / "ttft.png")
    (out / "ttft.json").write_text(json.dumps({k: v for k, v in medians.items()}, indent=2) + "\n")
    print(f"plot: {out / 'ttft.png'}")
    b_cached = all(o["cached"] >= doc_tokens // 256 * 256 - 256 for o in rows["B, new instance (lmtier disk hit)"])
    ok = same and b_cached
    print("\ndemo", "passed" if ok else "FAILED")
    return 0 if ok else 1


def _plot(medians: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(medians)
    fig, ax = plt.subplots(figsize=(8, 3.8))
    ax.barh(range(len(labels)), [medians[k] * 1000 for k in labels], color=["#999", "#c77", "#7a7", "#47c"])
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("median time to first token (ms)")
    ax.set_title("lmtier demo: vLLM (CPU build), small random Llama")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

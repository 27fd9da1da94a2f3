"""``lmtier demo``: two vLLM engines in two processes, one prefill per document.

A small random-weight Llama is built offline. Instance A (one engine process) answers
several questions about each of a few long documents: the first question per document
pays for the prefill and lmtier stores the document's KV (host memory, then a disk
directory); later questions load it. Instance B, a new engine process on the same disk
directory, answers new questions about the same documents: it loads the documents' KV
from disk instead of prefilling them. A third engine without lmtier answers B's questions
too, to show that B's answers are identical, and to time a prefill with no cache at all.

Prints a TTFT table and writes a PNG plot (with matplotlib; without it, the figures as JSON).
It needs vLLM (and so torch): ``lmtier demo`` checks that first.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from lmtier.config.schema import resolve_chunk_tokens
from lmtier.kv.layout import KVLayout
from lmtier.testing.engine import LOGPROB_TOLERANCE, compare_answers, run_engine
from lmtier.testing.tinymodel import build

QUESTION = 64
BLOCK = 64
OFF = {"lmtier": {"load": False, "save": False}}


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
        model = str(build(tmp / "model", layers=8, hidden=256))
        disk = tmp / "disk"
        lmtier = {"tiers": ["cpu://?size=2GiB", f"file://{disk}?size=8GiB"]}
        base = {"model": model, "block_size": BLOCK, "max_model_len": doc_tokens + 512, "max_tokens": 16}
        documents = [_ids(doc_tokens, 100 + d) for d in range(docs)]

        def asks(tag: str, first_q: int, count: int, **phase) -> list[dict]:
            return [
                {"name": f"{tag}-{d}-{q}", "prompts": [documents[d] + _ids(QUESTION, 1000 * d + q)], **phase}
                for d in range(docs)
                for q in range(first_q, first_q + count)
            ]

        warm = [{"name": "warmup", "prompts": [_ids(256, 7)], "request": OFF}]
        print(f"instance A: {docs} documents of {doc_tokens} tokens, {questions} questions each", flush=True)
        a = _engine(tmp, "A", {**base, "lmtier": lmtier, "phases": warm + asks("a", 0, questions)})
        print("instance B: a new process, new questions about the same documents", flush=True)
        b = _engine(tmp, "B", {**base, "lmtier": lmtier, "phases": warm + asks("b", questions, questions)})
        print("reference: vLLM's own prefix cache, then full prefills, in the same configuration", flush=True)
        reference = {
            **base,
            "lmtier": {"tiers": ["cpu://?size=64MiB"]},
            "prefix_caching": True,
            "phases": warm
            + asks("a", 0, questions, request=OFF)
            + asks("b", questions, questions, request=OFF)
            + asks("full", questions, questions, request=OFF, read_prefix_cache=False),
        }
        ref = _engine(tmp, "reference", reference)

    def pick(results: dict, tag: str, qs: range) -> list[dict]:
        return [results[f"{tag}-{d}-{q}"][0] for d in range(docs) for q in qs]

    later = range(questions, 2 * questions)
    rows = {
        "no cache (full prefill)": pick(ref, "full", later),
        "vLLM's own prefix cache (same engine)": pick(ref, "b", later),
        "A, first question (prefill, stored)": pick(a, "a", range(0, 1)),
        "A, later questions (lmtier memory hit)": pick(a, "a", range(1, questions)),
        "B, new instance (lmtier disk hit)": pick(b, "b", later),
    }
    hits = rows["B, new instance (lmtier disk hit)"]
    problems, exact = compare_answers(
        hits, rows["vLLM's own prefix cache (same engine)"], rows["no cache (full prefill)"]
    )
    medians = print_ttft_table(rows)
    print(
        f"\nB's answers: {exact} of {len(hits)} compared bit for bit with vLLM's own prefix-cache hits "
        f"(the others cached another number of tokens), all with full prefills (greedy tokens up to a near "
        f"tie, logprobs within {LOGPROB_TOLERANCE}): {'as they must be' if not problems else 'DIFFERENT'}"
    )
    for problem in problems:
        print("  ", problem)
    speedup = medians["no cache (full prefill)"] / medians["B, new instance (lmtier disk hit)"]
    if speedup >= 1:
        print(f"\nB's time to first token is {speedup:.1f}x shorter than a full prefill.")
    else:
        print(f"\nB's time to first token is {1 / speedup:.1f}x longer than a full prefill (a busy machine?).")
    (out / "ttft.json").write_text(json.dumps({k: v for k, v in medians.items()}, indent=2) + "\n")
    if importlib.util.find_spec("matplotlib") is None:  # a nicety: the table above has the figures
        print(f"plot skipped: matplotlib is not installed (pip install matplotlib); figures: {out / 'ttft.json'}")
    else:
        _plot(medians, out / "ttft.png", hits[0]["prompt_len"], docs)
        print(f"plot: {out / 'ttft.png'}")
    # B must have loaded every whole chunk of its document (lmtier's automatic chunk size for
    # this model and block), and at least one answer must have been compared bit for bit.
    chunk = resolve_chunk_tokens(0, BLOCK, KVLayout(8, 2, 64, "bfloat16").chunk_bytes(1))
    want = [min(doc_tokens // chunk * chunk, (o["prompt_len"] - 1) // BLOCK * BLOCK) for o in hits]
    b_cached = [o["cached"] for o in hits] == want and (doc_tokens < chunk or exact > 0)
    if not b_cached:
        print(f"B cached {[o['cached'] for o in hits]} tokens, expected {want}; {exact} compared bit for bit")
    ok = not problems and b_cached
    print("\ndemo", "passed" if ok else "FAILED")
    return 0 if ok else 1


def print_ttft_table(rows: dict[str, list[dict]]) -> dict[str, float]:
    """Print each row's median TTFT and cached tokens as a Markdown table; the medians."""
    print("\n| requests | median TTFT | cached tokens (median) |")
    print("|---|---:|---:|")
    medians = {}
    for label, outs in rows.items():
        medians[label] = statistics.median(o["seconds"] for o in outs)
        cached = statistics.median(o["cached"] for o in outs)
        print(f"| {label} | {medians[label] * 1000:.0f} ms | {cached:.0f} of {outs[0]['prompt_len']} |")
    return medians


def _plot(medians: dict[str, float], path: Path, prompt_tokens: int, docs: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(medians)
    fig, ax = plt.subplots(figsize=(9, 4.2))
    values = [medians[k] * 1000 for k in labels]
    bars = ax.barh(range(len(labels)), values, color=["#999", "#bb8", "#c77", "#7a7", "#47c"])
    ax.bar_label(bars, labels=[f"{v:.0f} ms" for v in values], padding=3)
    ax.set_xlim(0, max(values) * 1.18)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("median time to first token (ms)")
    ax.set_title(f"lmtier demo: vLLM (CPU build), small random Llama\nprompts of {prompt_tokens} tokens, {docs} docs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""``lmtier demo``: two vLLM engines in two processes, one prefill per document.

A small random-weight Llama is built offline. Instance A (one engine process) answers
several questions about each of a few long documents: the first question per document
pays for the prefill and lmtier stores the document's KV (host memory, then a disk
directory); later questions load it from memory. Instance B, a new engine process with
only the disk directory as its tier, answers new questions about the same documents: it
loads the documents' KV from disk instead of prefilling them. A third engine, without
lmtier, answers B's questions too: from vLLM's own prefix cache and with full prefills,
the reference B's answers must equal and the times B's are compared with.

Time to first token is timed as a one-token request: the prefill and the first token, no
decoding (each answer compared is a request of its own, 16 tokens). Every row but A's
first questions is measured twice, and the machine's noise is the spread between the two
rounds of the same full prefills. A row whose two rounds disagree beyond that noise, or
a row of A's first questions (full prefills, plus a store) far from the full prefills, is
flagged, and the headline is said to be unreliable on that run.

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
ANSWER = 16  # tokens of each answer compared
MIN_TOLERANCE = 0.25  # rounds of a row may differ this much even on a quiet machine (relative)
NO_CACHE = "no cache (full prefill)"
A_FIRST = "A, first question (prefill, stored)"
B_HIT = "B, new instance (lmtier disk hit)"


def _ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(5, 500, n)]


def _engine(tmp: Path, name: str, spec: dict, connectors: dict) -> dict:
    """Run one engine; record which lmtier connector it loaded (None: it ran without one)."""
    print(f"  starting engine {name} ...", flush=True)
    result = run_engine(spec, tmp, name)
    connectors[name] = result["connector"]
    return result["results"]


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
        disk = f"file://{tmp / 'disk'}?size=8GiB"
        base = {"model": model, "block_size": BLOCK, "max_model_len": doc_tokens + 512, "max_tokens": 1}
        documents = [_ids(doc_tokens, 100 + d) for d in range(docs)]

        def asks(tag: str, qs: range, **phase) -> list[dict]:
            return [
                {"name": f"{tag}-{d}-{q}", "prompts": [documents[d] + _ids(QUESTION, 1000 * d + q)], **phase}
                for d in range(docs)
                for q in qs
            ]

        first, later, theirs = range(0, questions), range(1, questions), range(questions, 2 * questions)
        # Untimed: a prompt twice, so that an engine's first store and first load (its copy
        # paths' first use) are not one of the rows' samples.
        warm = [
            {"name": "warmup", "prompts": [_ids(512, 7)], "settle": True},
            {"name": "warm-hit", "prompts": [_ids(512, 7)]},
        ]
        print(f"instance A: {docs} documents of {doc_tokens} tokens, {questions} questions each", flush=True)
        a_spec = {
            "lmtier": {"tiers": ["cpu://?size=2GiB", disk]},
            "phases": warm + asks("a", first, settle=True) + asks("a2", later),  # settle: stores land, untimed
        }
        connectors: dict[str, str | None] = {}
        a = _engine(tmp, "A", {**base, **a_spec}, connectors)
        print("instance B: a new process on the disk directory alone, new questions about the same documents")
        b_phases = warm + asks("b", theirs) + asks("b2", theirs) + asks("b-answer", theirs, max_tokens=ANSWER)
        b = _engine(tmp, "B", {**base, "lmtier": {"tiers": [disk]}, "phases": b_phases}, connectors)
        print("reference: vLLM without lmtier, its own prefix cache, then full prefills", flush=True)
        full = {"read_prefix_cache": False}
        ref_phases = (
            warm + asks("seen", first) + asks("pc", theirs) + asks("pc2", theirs) + asks("full", theirs, **full)
        )
        ref_phases += asks("full2", theirs, **full) + asks("pc-answer", theirs, max_tokens=ANSWER)
        ref_phases += asks("full-answer", theirs, max_tokens=ANSWER, **full)
        ref_spec = {**base, "lmtier": None, "prefix_caching": True, "phases": ref_phases}
        ref = _engine(tmp, "reference", ref_spec, connectors)

    def pick(results: dict, tag: str, qs: range) -> list[dict]:
        return [results[f"{tag}-{d}-{q}"][0] for d in range(docs) for q in qs]

    rows = {  # label -> the rounds of its requests (one round: measured once)
        NO_CACHE: [pick(ref, "full", theirs), pick(ref, "full2", theirs)],
        "vLLM's own prefix cache (same engine)": [pick(ref, "pc", theirs), pick(ref, "pc2", theirs)],
        A_FIRST: [pick(a, "a", range(0, 1))],
        "A, later questions (lmtier memory hit)": [pick(a, "a", later), pick(a, "a2", later)],
        B_HIT: [pick(b, "b", theirs), pick(b, "b2", theirs)],
    }
    answers = pick(b, "b-answer", theirs)
    problems, exact = compare_answers(answers, pick(ref, "pc-answer", theirs), pick(ref, "full-answer", theirs))
    noise = measured_noise(rows[NO_CACHE])
    medians, flagged = print_ttft_table(rows, noise)
    print(
        f"\nB's answers: {exact} of {len(answers)} compared bit for bit with vLLM's own prefix-cache hits in an "
        f"engine without lmtier (the others cached another number of tokens), all with its full prefills (greedy "
        f"tokens up to a near tie, logprobs within {LOGPROB_TOLERANCE}): "
        f"{'as they must be' if not problems else 'DIFFERENT'}"
    )
    for problem in problems:
        print("  ", problem)
    speedup = medians[NO_CACHE] / medians[B_HIT]
    headline = (
        f"B's time to first token is {speedup:.1f}x shorter than a full prefill"
        if speedup >= 1
        else f"B's time to first token is {1 / speedup:.1f}x longer than a full prefill (a busy machine?)"
    )
    if flagged:
        print(
            f"\n{headline}; NOT RELIABLE on this run: {', '.join(flagged)} disagreed beyond this machine's noise "
            f"({noise:.0%} between two rounds of the same full prefills). Run it again on a quieter machine."
        )
    else:
        print(f"\n{headline} (every row steady within this machine's noise, {noise:.0%}).")
    report = {
        "ttft_median_s": medians,
        "noise": noise,
        "flagged": flagged,
        "tokens_per_timed_request": sorted({len(o["tokens"]) for r in rows.values() for o in r[0]}),
        "connector": connectors,  # the lmtier connector each engine loaded (None: none)
    }
    (out / "ttft.json").write_text(json.dumps(report, indent=2) + "\n")
    if importlib.util.find_spec("matplotlib") is None:  # a nicety: the table above has the figures
        print(f"plot skipped: matplotlib is not installed (pip install matplotlib); figures: {out / 'ttft.json'}")
    else:
        _plot(medians, out / "ttft.png", answers[0]["prompt_len"], docs)
        print(f"plot: {out / 'ttft.png'}")
    # B must have loaded every whole chunk of its document (lmtier's automatic chunk size for
    # this model and block), and at least one answer must have been compared bit for bit.
    chunk = resolve_chunk_tokens(0, BLOCK, KVLayout(8, 2, 64, "bfloat16").chunk_bytes(1))
    want = [min(doc_tokens // chunk * chunk, (o["prompt_len"] - 1) // BLOCK * BLOCK) for o in answers]
    b_cached = [o["cached"] for o in answers] == want and (doc_tokens < chunk or exact > 0)
    if not b_cached:
        print(f"B cached {[o['cached'] for o in answers]} tokens, expected {want}; {exact} compared bit for bit")
    ok = not problems and b_cached
    print("\ndemo", "passed" if ok else "FAILED")
    return 0 if ok else 1


def measured_noise(rounds: list[list[dict]]) -> float:
    """The machine's noise: the median relative difference between two rounds of the same
    requests (full prefills: the same work twice)."""
    gaps = [
        abs(x["seconds"] - y["seconds"]) / ((x["seconds"] + y["seconds"]) / 2) for x, y in zip(*rounds, strict=True)
    ]
    return statistics.median(gaps)


def _steady(rounds: list[list[dict]], tolerance: float) -> tuple[bool, str]:
    """Whether a row's two rounds agree within ``tolerance`` (relative), and the rounds' medians."""
    if len(rounds) < 2:
        return True, "once"
    m = [statistics.median(o["seconds"] for o in r) for r in rounds]
    return max(m) / min(m) - 1 <= tolerance, " / ".join(f"{x * 1000:.0f}" for x in m) + " ms"


def print_ttft_table(rows: dict[str, list[list[dict]]], noise: float) -> tuple[dict[str, float], list[str]]:
    """Print each row's median TTFT, its rounds and cached tokens as a Markdown table;
    returns the medians and the rows flagged: rounds that disagree beyond the noise, or A's
    first questions (full prefills and a store) far from the full prefills."""
    tolerance = max(3 * noise, MIN_TOLERANCE)
    print("\n| requests | median time to first token | its rounds | cached tokens (median) |")
    print("|---|---:|---:|---:|")
    medians, flagged = {}, []
    for label, rounds in rows.items():
        outs = [o for r in rounds for o in r]
        medians[label] = statistics.median(o["seconds"] for o in outs)
        steady, shown = _steady(rounds, tolerance)
        if label == A_FIRST and NO_CACHE in medians:  # the no-cache row's prefills and a store: not far from it
            ratio = medians[label] / medians[NO_CACHE]
            steady = 1 / (1 + tolerance) <= ratio <= 2 * (1 + tolerance)
            shown = f"{ratio:.2f}x the full prefills"
        if not steady:
            flagged.append(label)
        cached = statistics.median(o["cached"] for o in outs)
        mark = "" if steady else " (unsteady)"
        print(f"| {label}{mark} | {medians[label] * 1000:.0f} ms | {shown} | {cached:.0f} of {outs[0]['prompt_len']} |")
    return medians, flagged


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

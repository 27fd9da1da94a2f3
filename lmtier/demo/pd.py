"""``lmtier demo pd``: prefill/decode disaggregation with two ``vllm serve`` instances.

A small random-weight Llama is built offline and ``lmtier serve`` is started as the shared
tier (no server to start by hand). A prefill instance (``kv_role: kv_producer``) and a
decode instance (``kv_consumer``) are started side by side and kept up, with the
reference proxy (``lmtier.demo.pd_proxy``) in front. For each of a few long documents
(a document plus a question):

- through the proxy, as a router sends it: the prefill instance computes and stores the
  prompt, the decode instance loads it and answers;
- the same steps one by one, timed apart: the prefill instance's request (``max_tokens=1``),
  then the decode instance's, whose KV comes from lmtier;
- on the decode instance, the same prompt with a fresh ``cache_salt`` (nothing cached
  anywhere: a full prefill) and again as it is (vLLM's own prefix cache: the floor).

Prints a time-to-first-token table, checks the decode instance's answers against its own
prefix-cache hits and full prefills, and writes a PNG plot (with matplotlib).
"""

from __future__ import annotations

import json
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from lmtier.demo.pd_proxy import PDProxy
from lmtier.demo.vllm import _plot, print_ttft_table
from lmtier.testing.engine import LOGPROB_TOLERANCE, compare_answers
from lmtier.testing.tinymodel import build
from lmtier.testing.vllm_serve import BLOCK, VllmServer

QUESTION = 64
CHUNK = 256


def _ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(5, 500, n)]


def _timed(server: VllmServer, model: str, prompt: list[int], **fields) -> dict:
    t0 = time.perf_counter()
    answer = server.complete(model, prompt, max_tokens=1, **fields)
    answer["seconds"] = time.perf_counter() - t0
    answer["prompt_len"] = len(prompt)
    return answer


def run_pd_demo(
    out_dir: str = "lmtier-demo", docs: int = 3, doc_tokens: int = 4096, directory: str | None = None
) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict]] = {
        "prefill instance: computes and stores the prompt": [],
        "decode instance: the prompt's KV from lmtier": [],
        "decode instance: no cache (full prefill)": [],
        "decode instance: vLLM's own prefix cache": [],
        "end to end through the proxy (prefill + decode)": [],
    }
    with tempfile.TemporaryDirectory(prefix="lmtier-demo-pd-", dir=directory) as tmp_name:
        tmp = Path(tmp_name)
        print("building a small random-weight Llama (8 layers, bf16) ...", flush=True)
        model = str(build(tmp / "model", layers=8, hidden=256))
        print("starting lmtier serve (the shared tier) ...", flush=True)
        from lmtier.testing.cache_server import ServerProcess  # gRPC: loaded only for this demo

        server = ServerProcess(tmp, "--tier", "cpu://?size=2GiB")
        tier = f"grpc://{server.address}"
        engines = []
        try:
            print("starting the prefill and the decode instance (vllm serve) side by side ...", flush=True)
            common = {"chunk": CHUNK, "max_model_len": doc_tokens + 512}
            with ThreadPoolExecutor(2) as pool:
                p = pool.submit(
                    VllmServer, model, None, tmp / "prefill.log", tiers=["cpu://?size=1GiB", tier],
                    role="kv_producer", **common,
                )  # fmt: skip
                d = pool.submit(VllmServer, model, None, tmp / "decode.log", tiers=[tier], role="kv_consumer", **common)
                for future in (p, d):
                    engines.append(future.result())
            producer, decode = engines
            with PDProxy(producer.url, decode.url, forward=False) as proxy:
                warm = _ids(300, 1)
                decode.complete(model, warm, base=proxy.url, max_tokens=1)
                for doc in range(docs):
                    document = _ids(doc_tokens, 100 + doc)
                    routed = document + _ids(QUESTION, 1000 + doc)
                    t0 = time.perf_counter()
                    answer = decode.complete(model, routed, base=proxy.url, max_tokens=1)
                    answer.update(seconds=time.perf_counter() - t0, prompt_len=len(routed))
                    rows["end to end through the proxy (prefill + decode)"].append(answer)
                    prompt = document + _ids(QUESTION, 2000 + doc)
                    rows["prefill instance: computes and stores the prompt"].append(_timed(producer, model, prompt))
                    rows["decode instance: the prompt's KV from lmtier"].append(_timed(decode, model, prompt))
                    rows["decode instance: no cache (full prefill)"].append(
                        _timed(decode, model, prompt, cache_salt=uuid.uuid4().hex)
                    )
                    rows["decode instance: vLLM's own prefix cache"].append(_timed(decode, model, prompt))
                    print(f"  document {doc + 1} of {docs} done", flush=True)
        finally:
            for engine in engines:
                engine.stop()
            server.stop()
    return _report(rows, out, doc_tokens)


def _report(rows: dict[str, list[dict]], out: Path, doc_tokens: int) -> int:
    hits = rows["decode instance: the prompt's KV from lmtier"]
    problems, exact = compare_answers(
        hits, rows["decode instance: vLLM's own prefix cache"], rows["decode instance: no cache (full prefill)"]
    )
    medians, _ = print_ttft_table({label: [outs] for label, outs in rows.items()}, noise=0.0)  # measured once
    print(
        f"\nThe decode instance's answers: {exact} of {len(hits)} compared bit for bit with its own prefix-cache "
        f"hits, all with full prefills (greedy tokens, logprobs within {LOGPROB_TOLERANCE}): "
        f"{'as they must be' if not problems else 'DIFFERENT'}"
    )
    for problem in problems:
        print("  ", problem)
    full = medians["decode instance: no cache (full prefill)"]
    loaded = medians["decode instance: the prompt's KV from lmtier"]
    print(f"\nThe decode instance skipped the prefill: {full / loaded:.1f}x shorter than computing the prompt.")
    (out / "pd.json").write_text(json.dumps(medians, indent=2) + "\n")
    try:
        _plot(medians, out / "pd.png", hits[0]["prompt_len"], len(hits))
        print(f"plot: {out / 'pd.png'}")
    except ImportError:
        print(f"plot skipped: matplotlib is not installed; figures: {out / 'pd.json'}")
    want = (hits[0]["prompt_len"] - 1) // BLOCK * BLOCK // CHUNK * CHUNK
    skipped = all(o["cached"] >= want for o in hits) and want > 0
    if not skipped:
        print(f"the decode instance cached {[o['cached'] for o in hits]} tokens, expected at least {want}")
    ok = not problems and skipped
    print("\ndemo", "passed" if ok else "FAILED")
    return 0 if ok else 1

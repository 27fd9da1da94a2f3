"""CPU tier throughput against a same-run memory-copy reference.

Moves a working set of 2 MiB chunks (bigger than the CPU caches) through the CPU tier,
put then get, and the same bytes through plain ``np.copyto`` into a preallocated buffer
and back out. Both sides end with the bytes in a preallocated destination, as an engine
load would, and lmtier verifies every chunk's checksum on the way. Two pairs:

- ``cpu_tier`` against ``reference_copyto``: contiguous 2 MiB chunks through the tier.
- ``embedded_api`` (``put(tokens, kv)`` / ``get_into``) against ``reference_strided``: the
  chunks are token slices of whole-prompt tensors, copied in the same strided pattern.

Reported: GB/s of each and the ratio to its reference, best of several rounds, as JSON
and as a Markdown table.

    python benchmarks/bench_cpu_tier.py [--chunk-mib 2] [--working-set-mib 512] [--rounds 5]
"""

from __future__ import annotations

import argparse
import platform
import sys

import numpy as np

from lmtier.api import open_store
from lmtier.kv.chunk import Chunk, release_all
from lmtier.kv.keys import Namespace
from lmtier.kv.layout import KVLayout
from lmtier.tiers.base import TierContext
from lmtier.tiers.cpu import CpuTier

from common import best, emit

MiB = 1024**2


def _layout_for(chunk_bytes: int) -> tuple[KVLayout, int]:
    layout = KVLayout(num_layers=8, num_kv_heads=8, head_dim=64, dtype="bfloat16")  # 16 KiB per token
    tokens = chunk_bytes // layout.bytes_per_token
    if tokens * layout.bytes_per_token != chunk_bytes:
        raise SystemExit(f"chunk size must be a multiple of {layout.bytes_per_token} bytes")
    return layout, tokens


def run(chunk_mib: float = 2, working_set_mib: int = 512, rounds: int = 5, batch: int = 8) -> dict:
    chunk_bytes = int(chunk_mib * MiB)
    layout, chunk_tokens = _layout_for(chunk_bytes)
    n = max(batch, working_set_mib * MiB // chunk_bytes // batch * batch)
    total = n * chunk_bytes
    rng = np.random.default_rng(0)
    # Sources and destinations are preallocated and touched once, on both sides alike.
    sources = [rng.integers(0, 256, layout.byte_shape(chunk_tokens), dtype=np.uint8) for _ in range(n)]
    outs = [np.zeros_like(s) for s in sources]
    staging = np.zeros(total, dtype=np.uint8).reshape(n, *layout.byte_shape(chunk_tokens))

    def reference() -> None:
        for i in range(n):
            np.copyto(staging[i], sources[i])  # "put": into a preallocated slab
        for i in range(n):
            np.copyto(outs[i], staging[i])  # "get": out to the engine's buffer

    ns = Namespace(model="bench", layout=layout, chunk_tokens=chunk_tokens)
    keys = [i.to_bytes(16, "little") for i in range(n)]
    chunks = [Chunk(keys[i], layout, sources[i], namespace=ns.digest) for i in range(n)]
    tier = CpuTier(size=total, context=TierContext(chunk_bytes=chunk_bytes))
    tier.put(chunks)  # fault the slab in once, as a long-running tier would have
    tier.delete(keys)

    def lmtier_tier() -> None:
        for b in range(0, n, batch):
            tier.put(chunks[b : b + batch])
        for b in range(0, n, batch):
            got = tier.get(keys[b : b + batch])
            for i, chunk in enumerate(got):
                np.copyto(outs[b + i], chunk.data)
            release_all(got)
        tier.delete(keys)

    # The embedded API: put(tokens, kv) and get_into(tokens, out) over whole prompts.
    prompt_tokens = batch * chunk_tokens
    prompts = [rng.integers(0, 50_000, prompt_tokens) for _ in range(n // batch)]
    import torch

    kvs = [
        torch.from_numpy(rng.standard_normal(layout.tensor_shape(prompt_tokens), dtype=np.float32)).to(torch.bfloat16)
        for _ in prompts
    ]
    kv_outs = [torch.zeros_like(kv) for kv in kvs]
    store = open_store([f"cpu://?size={total}"], model="bench", layout=layout, chunk_tokens=chunk_tokens)

    def lmtier_api() -> None:
        for tokens, kv in zip(prompts, kvs, strict=True):
            store.put(tokens, kv)
        for tokens, out in zip(prompts, kv_outs, strict=True):
            store.get_into(tokens, out)
        store.store.delete([k for tokens in prompts for k in store.keys(tokens)])

    # The same bytes as the API moves, in the same pattern: each chunk is a token slice of
    # a prompt's [layers, 2, tokens, heads, dim] tensor, copied to a slot and back.
    kv_bytes = [kv.view(torch.uint8).numpy().reshape(layout.byte_shape(prompt_tokens)) for kv in kvs]
    out_bytes = [out.view(torch.uint8).numpy().reshape(layout.byte_shape(prompt_tokens)) for out in kv_outs]

    def reference_strided() -> None:
        for p in range(len(prompts)):
            for c in range(batch):
                np.copyto(staging[p * batch + c], kv_bytes[p][:, :, c * chunk_tokens : (c + 1) * chunk_tokens])
        for p in range(len(prompts)):
            for c in range(batch):
                np.copyto(out_bytes[p][:, :, c * chunk_tokens : (c + 1) * chunk_tokens], staging[p * batch + c])

    lmtier_api()  # warm: fault the slab in
    reference()  # ... and the references' buffers, alike (one timed round must not pay their faults)
    reference_strided()
    results = {}
    paths = (
        ("reference_copyto", reference),
        ("cpu_tier", lmtier_tier),
        ("reference_strided", reference_strided),
        ("embedded_api", lmtier_api),
    )
    for name, fn in paths:
        seconds = best(fn, rounds)
        results[name] = {"seconds": seconds, "gb_per_s": 2 * total / seconds / 1e9}
    lmtier_tier()
    lmtier_api()
    assert all(np.array_equal(outs[i], sources[i]) for i in range(n)), "benchmark read back wrong bytes"
    assert all(torch.equal(a, b) for a, b in zip(kv_outs, kvs, strict=True)), "API read back wrong bytes"
    tier.close()
    store.close()
    for name, ref in (("cpu_tier", "reference_copyto"), ("embedded_api", "reference_strided")):
        results[name]["reference"] = ref
        results[name]["ratio_to_reference"] = results[name]["gb_per_s"] / results[ref]["gb_per_s"]
    return {
        "benchmark": "cpu_tier_put_get",
        "chunk_bytes": chunk_bytes,
        "chunks": n,
        "working_set_bytes": total,
        "batch_chunks": batch,
        "rounds": rounds,
        "machine": {"python": platform.python_version(), "processor": platform.machine(), "cpus": _cpus()},
        "results": results,
    }


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def table(report: dict) -> str:
    lines = [
        f"CPU tier put+get, {report['chunks']} chunks of {report['chunk_bytes'] / MiB:g} MiB "
        f"({report['working_set_bytes'] / MiB:.0f} MiB working set), best of {report['rounds']}",
        "| path | GB/s (put+get bytes / time) | reference | ratio |",
        "|---|---:|---|---:|",
    ]
    for name, r in report["results"].items():
        ratio = f"{r['ratio_to_reference']:.2f}" if "reference" in r else ""
        lines.append(f"| {name} | {r['gb_per_s']:.2f} | {r.get('reference', '')} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk-mib", type=float, default=2)
    parser.add_argument("--working-set-mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8, help="chunks per put/get call (one prompt)")
    parser.add_argument("--json-out", help="also write the JSON report here")
    args = parser.parse_args(argv)
    report = run(args.chunk_mib, args.working_set_mib, args.rounds, args.batch)
    emit(report, table(report), args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Disk tier throughput against ``dd`` with O_DIRECT, and index rebuild time.

In one run, on one directory's filesystem:

- ``dd if=/dev/zero of=F bs=4M oflag=direct conv=fsync`` and ``dd if=F of=/dev/null
  bs=4M iflag=direct`` over the working set's bytes: the disk's sequential ceiling.
- lmtier writes the same bytes as 2 MiB chunks (``put`` in batches of ``--batch`` chunks, a
  prompt each: 32 chunks of 128 tokens is a 4k-token prompt),
  then ``os.sync()`` (as ``conv=fsync`` does), and reads them back cold (O_DIRECT: no page
  cache) with ``get``, each chunk verified and copied into a preallocated destination,
  as an engine load would.
- Index rebuild: a directory of N small chunk files whose index was lost is opened
  (every file adopted), then opened again with its index intact.

Prints JSON and a Markdown table with GB/s of each side and the ratio.

    python benchmarks/bench_disk_tier.py [--dir D] [--working-set-mib 1024] [--rebuild-chunks 100000]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from lmtier import codec
from lmtier.chunk import Chunk, release_all
from lmtier.layout import KVLayout
from lmtier.tiers.disk import DiskTier

from common import emit

MiB = 1024**2


def dd(args: list[str]) -> float:
    """Seconds dd reports for its copy."""
    run = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    match = re.search(r"copied, ([0-9.]+) s", run.stderr)
    if not match:
        raise RuntimeError(f"cannot read dd's output: {run.stderr}")
    return float(match.group(1))


def throughput(root: Path, working_set_mib: int, rounds: int, batch: int) -> dict:
    layout = KVLayout(num_layers=8, num_kv_heads=8, head_dim=64, dtype="bfloat16")  # 16 KiB per token
    chunk_tokens = 128  # 2 MiB chunks
    n = max(batch, working_set_mib * MiB // layout.chunk_bytes(chunk_tokens) // batch * batch)
    total = n * layout.chunk_bytes(chunk_tokens)
    rng = np.random.default_rng(0)
    sources = [rng.integers(0, 256, layout.byte_shape(chunk_tokens), dtype=np.uint8) for _ in range(n)]
    outs = [np.zeros_like(s) for s in sources]
    keys = [i.to_bytes(16, "little") for i in range(n)]

    root.mkdir(parents=True, exist_ok=True)
    ref = root / "dd.bin"
    count = total // (4 * MiB)

    def dd_write() -> float:
        return dd(["if=/dev/zero", f"of={ref}", "bs=4M", f"count={count}", "oflag=direct", "conv=fsync"])

    def dd_read() -> float:
        return dd([f"if={ref}", "of=/dev/null", "bs=4M", "iflag=direct"])

    tier = DiskTier(root / "tier", size=2 * total + 64 * MiB, o_direct=None)

    def lmtier_write() -> float:
        tier.delete(keys)
        chunks = [Chunk(keys[i], layout, sources[i], namespace=b"bench") for i in range(n)]
        t0 = time.perf_counter()
        for b in range(0, n, batch):
            tier.put(chunks[b : b + batch])
        os.sync()
        return time.perf_counter() - t0

    def drop_cache() -> None:
        if not tier.o_direct:  # through the page cache: drop it first so reads are cold
            for key in keys:
                fd = os.open(tier.files.path(key), os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)

    def lmtier_read() -> float:
        """``get``: every chunk read and its checksums verified, like dd reading to nowhere."""
        drop_cache()
        t0 = time.perf_counter()
        for b in range(0, n, batch):
            got = tier.get(keys[b : b + batch])
            if any(c is None or not c.verify() for c in got):
                raise RuntimeError("a chunk went missing")
            release_all(got)
        return time.perf_counter() - t0

    def lmtier_load() -> float:
        """``get`` and then a copy of each chunk into the engine's preallocated buffer."""
        drop_cache()
        t0 = time.perf_counter()
        for b in range(0, n, batch):
            got = tier.get(keys[b : b + batch])
            for i, chunk in enumerate(got):
                chunk.copy_to(outs[b + i])
            release_all(got)
        return time.perf_counter() - t0

    # Interleaved rounds, so that a disk whose speed drifts affects both sides alike.
    times: dict[str, list[float]] = {"dd_w": [], "lm_w": [], "dd_r": [], "lm_r": [], "lm_load": []}
    steps = (
        ("dd_w", dd_write),
        ("lm_w", lmtier_write),
        ("dd_r", dd_read),
        ("lm_r", lmtier_read),
        ("lm_load", lmtier_load),
    )
    for _ in range(rounds):
        for name, fn in steps:
            times[name].append(fn())
    ref.unlink()
    dd_w, lm_w, dd_r, lm_r = (min(times[k]) for k in ("dd_w", "lm_w", "dd_r", "lm_r"))
    # A shared disk's speed drifts by tens of percent within a minute: the ratio of each
    # round's adjacent pair (median over rounds) is steadier than a ratio of bests.
    pair_w = float(np.median([d / m for d, m in zip(times["dd_w"], times["lm_w"], strict=True)]))
    pair_r = float(np.median([d / m for d, m in zip(times["dd_r"], times["lm_r"], strict=True)]))
    assert all(np.array_equal(o, s) for o, s in zip(outs, sources, strict=True)), "read back wrong bytes"
    o_direct = tier.o_direct
    tier.close()
    return {
        "chunk_bytes": layout.chunk_bytes(chunk_tokens),
        "chunks": n,
        "working_set_bytes": total,
        "o_direct": o_direct,
        "batch_chunks": batch,
        "write": {
            "dd_gb_per_s": total / dd_w / 1e9,
            "lmtier_gb_per_s": total / lm_w / 1e9,
            "ratio_of_bests": dd_w / lm_w,
            "ratio": pair_w,
        },
        "read": {
            "dd_gb_per_s": total / dd_r / 1e9,
            "lmtier_gb_per_s": total / lm_r / 1e9,
            "ratio_of_bests": dd_r / lm_r,
            "ratio": pair_r,
        },
        "load_into_buffers": {
            "lmtier_gb_per_s": total / min(times["lm_load"]) / 1e9,
            "ratio_to_dd_read": float(np.median([d / m for d, m in zip(times["dd_r"], times["lm_load"], strict=True)])),
        },
        "rounds_seconds": times,
    }


def rebuild(root: Path, chunks: int) -> dict:
    """Time opening a directory of ``chunks`` files: index lost, then index intact."""
    layout = KVLayout(1, 1, 8, "float16")
    tier = DiskTier(root, size=1 << 40)
    tier.close()
    data = np.zeros(layout.byte_shape(4), dtype=np.uint8)
    for i in range(chunks):
        key = i.to_bytes(16, "little")
        frame = codec.encode(Chunk(key, layout, data, namespace=b"rebuild"))
        with open(tier.files.path(key), "wb") as f:
            f.write(frame)
    t0 = time.perf_counter()
    lost = DiskTier(root, size=1 << 40)
    cold = time.perf_counter() - t0
    assert lost.stats()["chunks"] == chunks
    lost.close()
    t0 = time.perf_counter()
    again = DiskTier(root, size=1 << 40)
    warm = time.perf_counter() - t0
    again.close()
    return {"chunks": chunks, "index_lost_seconds": cold, "index_intact_seconds": warm}


def table(report: dict) -> str:
    t = report["throughput"]
    r = report["rebuild"]
    lines = [
        f"Disk tier, {t['chunks']} chunks of {t['chunk_bytes'] / MiB:g} MiB ({t['working_set_bytes'] / MiB:.0f} MiB), "
        f"O_DIRECT {t['o_direct']}, best of {report['rounds']}",
        "| direction | dd GB/s (best) | lmtier GB/s (best) | ratio of bests | ratio (median of adjacent pairs) |",
        "|---|---:|---:|---:|---:|",
    ]
    for d in ("write", "read"):
        x = t[d]
        lines.append(
            f"| {d} | {x['dd_gb_per_s']:.2f} | {x['lmtier_gb_per_s']:.2f} | {x['ratio_of_bests']:.2f} "
            f"| {x['ratio']:.2f} |"
        )
    load = t["load_into_buffers"]
    lines.append(
        f"| read + copy into the engine's buffers | | {load['lmtier_gb_per_s']:.2f} | "
        f"| {load['ratio_to_dd_read']:.2f} |"
    )
    lines.append("")
    lines.append(
        f"Index rebuild, {r['chunks']:,} chunks: {r['index_lost_seconds']:.2f} s with the index lost, "
        f"{r['index_intact_seconds']:.2f} s with it intact"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", help="directory on the disk to measure (default: a temporary one)")
    parser.add_argument("--working-set-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rebuild-chunks", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=32, help="chunks per put / get call (one prompt)")
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="lmtier-disk-bench-", dir=args.dir))
    try:
        report = {
            "benchmark": "disk_tier",
            "rounds": args.rounds,
            "throughput": throughput(root / "t", args.working_set_mib, args.rounds, args.batch),
            "rebuild": rebuild(root / "r", args.rebuild_chunks),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    emit(report, table(report), args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

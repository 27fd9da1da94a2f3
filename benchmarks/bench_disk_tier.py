"""Disk tier throughput against ``dd`` with O_DIRECT, eviction under reuse, index rebuild.

One run measures every disk figure against the same disk (dd, the tier cold and warm, the
engine-sized batches, compaction, the rebuild) so that their ratios share one machine
state; the figures of the tier's own policies (compaction, the rebuild) are measured by
``disk_policy.py`` beside this file.

In one run, on one directory's filesystem:

- ``dd if=/dev/zero of=F bs=4M oflag=direct conv=fsync`` and ``dd if=F of=/dev/null
  bs=4M iflag=direct`` over the working set's bytes: the disk's sequential ceiling (and,
  for warm reads, ``dd`` of a file in the page cache).
- lmtier writes the same bytes as 2 MiB chunks (``put`` in batches of ``--batch`` chunks, a
  prompt each: 32 chunks of 128 tokens is a 4k-token prompt),
  then ``os.sync()`` (as ``conv=fsync`` does), and reads them back cold (the page cache
  dropped first) with ``get``, each chunk verified and copied into a preallocated
  destination, as an engine load would.
- The engine's pattern (``--engine-mib``): 256 KiB chunks, put and got 128 at a time (an
  8k-token prompt of 32 MiB), written, read back cold and read back warm (in the page
  cache, as a second engine instance on the host finds what the first wrote), for each
  ``o_direct`` setting of ``--engine-modes``.
- Eviction under reuse (``--compaction-requests``): hit ratio against bytes copied forward
  by compaction, for several copy credits (``space.COMPACT_RATIO``; inf: exact LRU).
- Index rebuild: a directory of N small chunks whose index was lost is opened
  (every segment scanned, every frame adopted), then opened again with its index intact.

Prints JSON and Markdown tables with GB/s of each side and the ratio.

    python benchmarks/bench_disk_tier.py [--dir D] [--working-set-mib 1024] [--engine-mib 1024]
        [--engine-modes auto,true,false] [--compaction-requests 3000] [--rebuild-chunks 100000]
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

from lmtier.kv.chunk import Chunk, release_all
from lmtier.kv.layout import KVLayout
from lmtier.tiers.disk import DiskTier

from common import emit
from disk_policy import compaction, rebuild

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
        drop_page_cache(tier.root)  # so that reads are cold, whatever went through the cache

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


def files_under(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]


def drop_page_cache(root: Path) -> None:
    """Evict ``root``'s files from the page cache (written back first), so reads are cold."""
    os.sync()
    for path in files_under(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fill_page_cache(root: Path) -> None:
    """Read ``root``'s files through the page cache, as a first engine instance leaves them."""
    scratch = bytearray(8 * MiB)
    for path in files_under(root):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(scratch):
                pass


def engine(root: Path, working_set_mib: int, rounds: int, modes: list[str]) -> dict:
    """The engine's pattern: 256 KiB chunks (64 tokens of 4 KiB), a put and a get of 128
    of them at a time (an 8k-token prompt, 32 MiB), written then read back cold (out of
    the page cache) and warm (in it: a second engine instance reading what the first
    wrote), each chunk verified and copied into the engine's buffer. dd moves the same
    bytes: O_DIRECT writes and cold reads, and reads of a file in the page cache for warm.
    """
    layout = KVLayout(num_layers=8, num_kv_heads=1, head_dim=128, dtype="bfloat16")  # 4 KiB per token
    chunk_tokens, batch = 64, 128
    chunk_bytes = layout.chunk_bytes(chunk_tokens)  # 256 KiB
    n = max(1, working_set_mib * MiB // (batch * chunk_bytes)) * batch
    total = n * chunk_bytes
    rng = np.random.default_rng(1)
    sources = rng.integers(0, 256, (n, *layout.byte_shape(chunk_tokens)), dtype=np.uint8)
    outs = np.zeros_like(sources)
    keys = [(1 << 64 | i).to_bytes(16, "little") for i in range(n)]
    root.mkdir(parents=True, exist_ok=True)
    ref = root / "dd.bin"
    count = total // (4 * MiB)

    def dd_write() -> float:
        return dd(["if=/dev/zero", f"of={ref}", "bs=4M", f"count={count}", "oflag=direct", "conv=fsync"])

    def dd_cold() -> float:
        return dd([f"if={ref}", "of=/dev/null", "bs=4M", "iflag=direct"])

    def dd_warm() -> float:
        fill_page_cache(ref)
        return dd([f"if={ref}", "of=/dev/null", "bs=4M"])

    times: dict[str, list[float]] = {"dd_w": [], "dd_cold": [], "dd_warm": []}

    def rounds_of(tier: DiskTier) -> dict[str, list[float]]:
        def write() -> float:
            tier.delete(keys)
            chunks = [Chunk(keys[i], layout, sources[i], namespace=b"engine") for i in range(n)]
            t0 = time.perf_counter()
            for b in range(0, n, batch):
                tier.put(chunks[b : b + batch])
            os.sync()
            return time.perf_counter() - t0

        def load() -> float:
            t0 = time.perf_counter()
            for b in range(0, n, batch):
                got = tier.get(keys[b : b + batch])
                for i, chunk in enumerate(got):
                    chunk.copy_to(outs[b + i])
                release_all(got)
            return time.perf_counter() - t0

        mine: dict[str, list[float]] = {"w": [], "cold": [], "warm": []}
        for _ in range(rounds):  # interleaved with dd, so that a drifting disk affects both alike
            times["dd_w"].append(dd_write())
            mine["w"].append(write())
            drop_page_cache(root)
            times["dd_cold"].append(dd_cold())
            mine["cold"].append(load())
            times["dd_warm"].append(dd_warm())
            fill_page_cache(tier.root)
            mine["warm"].append(load())
        if not np.array_equal(outs, sources):
            raise RuntimeError("read back wrong bytes")
        outs[:] = 0
        return mine

    results: dict[str, dict] = {}
    for mode in modes:
        tier = DiskTier(root / f"tier-{mode}", size=2 * total + 256 * MiB, o_direct=_o_direct(mode))
        results[mode] = {"o_direct": tier.o_direct, "seconds": rounds_of(tier)}
        tier.close()
    ref.unlink()

    def side(mine: list[float], ref_key: str) -> dict:
        pairs = [d / m for d, m in zip(times[ref_key][-len(mine) :], mine, strict=True)]
        return {
            "lmtier_gb_per_s": total / min(mine) / 1e9,
            "dd_gb_per_s": total / min(times[ref_key]) / 1e9,
            "ratio": float(np.median(pairs)),
        }

    out: dict = {"chunk_bytes": chunk_bytes, "batch_chunks": batch, "working_set_bytes": total, "modes": {}}
    for mode, r in results.items():
        s = r["seconds"]
        out["modes"][mode] = {
            "o_direct": r["o_direct"],
            "write": side(s["w"], "dd_w"),
            "cold_read": side(s["cold"], "dd_cold"),
            "warm_read": side(s["warm"], "dd_warm"),
            "rounds_seconds": s,
        }
    out["dd_rounds_seconds"] = times
    return out


def _o_direct(mode: str) -> bool | None:
    return {"auto": None, "true": True, "false": False}[mode]


def throughput_table(t: dict, rounds: int) -> list[str]:
    lines = [
        f"Disk tier, {t['chunks']} chunks of {t['chunk_bytes'] / MiB:g} MiB ({t['working_set_bytes'] / MiB:.0f} MiB), "
        f"O_DIRECT {t['o_direct']}, best of {rounds}",
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
    return lines


def engine_table(e: dict, rounds: int) -> list[str]:
    lines = [
        f"Engine pattern: {e['working_set_bytes'] / MiB:.0f} MiB as {e['chunk_bytes'] // 1024} KiB chunks, "
        f"put / get {e['batch_chunks']} at a time ({e['batch_chunks'] * e['chunk_bytes'] / MiB:g} MiB prompts), "
        f"each chunk verified and copied into the engine's buffer; best of {rounds}",
        "| o_direct | step | dd GB/s (best) | lmtier GB/s (best) | ratio (median of adjacent pairs) |",
        "|---|---|---:|---:|---:|",
    ]
    refs = {"write": "O_DIRECT write", "cold_read": "O_DIRECT read", "warm_read": "page-cache read"}
    for mode, m in e["modes"].items():
        for step, what in refs.items():
            x = m[step]
            lines.append(
                f"| {mode} | {step.replace('_', ' ')} (dd: {what}) | {x['dd_gb_per_s']:.2f} "
                f"| {x['lmtier_gb_per_s']:.2f} | {x['ratio']:.2f} |"
            )
    return lines


def table(report: dict) -> str:
    lines: list[str] = []
    if "throughput" in report:
        lines += [*throughput_table(report["throughput"], report["rounds"]), ""]
    if "engine" in report:
        lines += [*engine_table(report["engine"], report["rounds"]), ""]
    if "compaction" in report:
        c = report["compaction"]
        lines += [
            f"Eviction under reuse ({c['requests']} requests over {c['documents']} documents): copy credit "
            "(bytes compaction may copy forward per byte stored; inf: exact LRU)",
            "| credit | chunk hit ratio | bytes copied per byte stored | chunks evicted |",
            "|---:|---:|---:|---:|",
        ]
        for ratio, x in c["ratios"].items():
            lines.append(f"| {ratio} | {x['hit_ratio']:.3f} | {x['copied_per_stored_byte']:.3f} | {x['evictions']} |")
        lines.append("")
    r = report["rebuild"]
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
    parser.add_argument("--engine-mib", type=int, default=1024, help="engine pattern's working set (0: skip it)")
    parser.add_argument(
        "--engine-modes", default="auto", help="o_direct settings to run the engine pattern with, e.g. auto,true,false"
    )
    parser.add_argument("--skip-throughput", action="store_true", help="only the engine pattern and the rebuild")
    parser.add_argument("--compaction-requests", type=int, default=0, help="eviction workload's requests (0: skip)")
    parser.add_argument("--compaction-ratios", default="0,1,4,inf", help="compaction budgets to compare")
    parser.add_argument("--compaction-docs", type=int, default=400, help="documents the workload's prompts share")
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="lmtier-disk-bench-", dir=args.dir))
    try:
        report = {
            "benchmark": "disk_tier",
            "rounds": args.rounds,
        }
        if not args.skip_throughput:
            report["throughput"] = throughput(root / "t", args.working_set_mib, args.rounds, args.batch)
        if args.engine_mib:
            modes = args.engine_modes.split(",")
            report["engine"] = engine(root / "e", args.engine_mib, args.rounds, modes)
        if args.compaction_requests:
            ratios = [float(x) for x in args.compaction_ratios.split(",")]
            report["compaction"] = compaction(root / "c", args.compaction_requests, ratios, args.compaction_docs)
        report["rebuild"] = rebuild(root / "r", args.rebuild_chunks)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    emit(report, table(report), args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The disk tier's own costs, measured without ``dd``: part of ``bench_disk_tier.py``'s run.

    compaction(root, requests, ratios, docs) -> dict   eviction under reuse: the hit ratio
                                                        against the bytes compaction copies
                                                        forward, per copy credit
    rebuild(root, chunks) -> dict                      opening a directory of small chunks,
                                                        its index lost, then intact

The script runs as ``python benchmarks/bench_disk_tier.py``, so this module is importable
as ``disk_policy`` beside it.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from lmtier.kv import codec
from lmtier.kv.chunk import Chunk, release_all
from lmtier.kv.layout import KVLayout
from lmtier.tiers.disk import DiskTier, space

DEFAULT_RATIO = space.COMPACT_RATIO


def compaction(root: Path, requests: int, ratios: list[float], docs: int = 400) -> dict:
    """Eviction under a reuse workload, for several copy credits (how many bytes compaction
    may copy forward per byte stored; 0: never copy, evict more instead; inf: exact LRU). A tier of
    512 chunks in segments of 32; each request is a 16-chunk prompt whose first 4 to 12
    chunks are a document's (documents drawn Zipf-like, so some stay hot) and the rest its
    own; the engine looks the prompt up, loads the hit, and saves the prompt. Reports the
    chunk hit ratio and the bytes compaction copied per byte stored."""
    layout = KVLayout(1, 1, 64, "float16")  # 4 KiB chunks: the policy, not the disk, is measured
    tokens = 16
    rng = np.random.default_rng(7)
    weights = 1 / np.arange(1, docs + 1) ** 0.9
    weights /= weights.sum()
    plan = [(int(rng.choice(docs, p=weights)), int(rng.integers(4, 13))) for _ in range(requests)]
    data = np.zeros(layout.byte_shape(tokens), dtype=np.uint8)
    frame = -(-codec.encoded_size(Chunk(b"k" * 16, layout, data)) // 4096) * 4096  # stored size, padded
    out = {}
    for ratio in ratios:
        space.COMPACT_RATIO = ratio
        tier = DiskTier(root / f"c{ratio}", size=512 * frame, segment=32 * frame)
        hits = total = 0
        for i, (doc, shared) in enumerate(plan):
            keys = [doc.to_bytes(4, "little") + j.to_bytes(2, "little") for j in range(shared)]
            keys += [(1 << 40 | i).to_bytes(8, "little") + j.to_bytes(2, "little") for j in range(16 - shared)]
            held = tier.contains(keys)
            got = tier.get(keys[:held])
            release_all(got)
            hits, total = hits + held, total + len(keys)
            tier.put([Chunk(k, layout, data) for k in keys])
        stats = tier.stats()
        out[str(ratio)] = {
            "hit_ratio": hits / total,
            "copied_per_stored_byte": stats["compacted_bytes"] / (stats["stored"] * frame),
            "evictions": stats["evictions"],
        }
        tier.close()
    space.COMPACT_RATIO = DEFAULT_RATIO
    return {"requests": requests, "documents": docs, "ratios": out}


def rebuild(root: Path, chunks: int) -> dict:
    """Time opening a directory of ``chunks`` small chunks: index lost, then index intact."""
    layout = KVLayout(1, 1, 8, "float16")
    tier = DiskTier(root, size=1 << 40)
    data = np.zeros(layout.byte_shape(4), dtype=np.uint8)
    for start in range(0, chunks, 256):
        tier.put(
            [
                Chunk(i.to_bytes(16, "little"), layout, data, namespace=b"rebuild")
                for i in range(start, min(chunks, start + 256))
            ]
        )
    tier.close()
    for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
        (root / name).unlink(missing_ok=True)
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

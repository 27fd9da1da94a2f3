"""What every benchmark script shares: its chunks, its clock, its report.

    chunks_of(layout, size, count, seed) -> [Chunk]   random KV chunks of ``size`` bytes
    timed(fn) -> seconds                               one call, wall clock
    best(fn, rounds) -> seconds                        the fastest of ``rounds`` calls
    gbps(nbytes, seconds) -> float                     GB/s (10^9 bytes per second)
    emit(report, table, json_out)                      the JSON, a blank line, the table; the JSON to a file too

The scripts run as ``python benchmarks/NAME.py``, so this module is importable as
``common`` beside them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from lmtier.kv.chunk import Chunk
from lmtier.kv.layout import KVLayout


def chunks_of(layout: KVLayout, size: int, count: int, seed: int) -> list[Chunk]:
    """``count`` chunks of about ``size`` bytes each (at least one token), random keys and KV."""
    tokens = max(1, size // layout.bytes_per_token)
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (count, *layout.byte_shape(tokens)), dtype=np.uint8)
    return [Chunk(rng.bytes(16), layout, data[i]) for i in range(count)]


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def best(fn: Callable[[], object], rounds: int) -> float:
    return min(timed(fn) for _ in range(rounds))


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


def emit(report: dict, table: str, json_out: str | Path | None = None) -> None:
    text = json.dumps(report, indent=2)
    if json_out:
        Path(json_out).write_text(text + "\n")
    print(text)
    print()
    print(table)

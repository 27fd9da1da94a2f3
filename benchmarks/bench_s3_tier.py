"""The object-storage tier against awscrt's own S3 client at its best, same server, same run.

Starts its own SeaweedFS (``weed mini``, S3 gateway on loopback), then for each chunk size:

- ``awscrt``: the library alone, as its own best configuration moves the same objects: one
  ``S3Client``, every PUT (then every GET) of a batch in flight at once, the bodies plain
  bytes already encoded, GETs into one growing buffer each; the best of its client settings
  (event-loop threads 2 and 4) in each round.
- ``lmtier``: ``S3Tier.put`` of the batch (encoding each chunk's frame, bounded, counted),
  then ``get`` of it, every chunk read back and verified against its checksum.

Rounds interleave the two, so that drift in the machine hits both alike; reported: GB/s of
object bytes (best round of each), the median of the same-round ratios, and their spread
over rounds (min and max: a target met in some rounds only is not met), as JSON and as a
Markdown table. The server shares the machine's cores with the clients: the absolute
figures are a 2-core machine's, the ratios what the tier costs over the library.

    python benchmarks/bench_s3_tier.py [--sizes-mib 0.5 2 8] [--total-mib 128] [--rounds 5]
"""

from __future__ import annotations

import argparse
import io
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lmtier.kv import codec
from lmtier.kv.chunk import release_all
from lmtier.kv.layout import KVLayout
from lmtier.testing.s3_server import S3_TEST_KEYS, S3Server
from lmtier.tiers.base import TierContext, open_tier

from common import chunks_of, emit

MiB = 1 << 20
LAYOUT = KVLayout(num_layers=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")  # 64 KiB per token


class Library:
    """awscrt's S3 client on its own: the reference."""

    def __init__(self, endpoint: str, threads: int) -> None:
        from awscrt import auth, s3
        from awscrt import io as crt_io

        self.host = endpoint.split("://", 1)[1]
        loop = crt_io.EventLoopGroup(threads)
        boot = crt_io.ClientBootstrap(loop, crt_io.DefaultHostResolver(loop))
        self.client = s3.S3Client(
            bootstrap=boot,
            region="us-east-1",
            credential_provider=auth.AwsCredentialsProvider.new_default_chain(boot),
            tls_mode=s3.S3RequestTlsMode.DISABLED,
            part_size=8 * MiB,
            throughput_target_gbps=10,
        )
        self.s3 = s3

    def _request(self, method: str, key: str, body: bytes | None = None):
        from awscrt import http

        headers = [("host", self.host)] + ([("content-length", str(len(body)))] if body is not None else [])
        stream = io.BytesIO(body) if body is not None else None
        return http.HttpRequest(method, f"/lmtier/{key}", http.HttpHeaders(headers), stream)

    def put(self, items: list[tuple[str, bytes]]) -> None:
        kind = self.s3.S3RequestType.PUT_OBJECT
        started = [self.client.make_request(type=kind, request=self._request("PUT", k, b)) for k, b in items]
        for r in started:
            r.finished_future.result(60)

    def get(self, keys: list[str]) -> list[bytearray]:
        kind = self.s3.S3RequestType.GET_OBJECT
        bodies = [bytearray() for _ in keys]
        started = [
            self.client.make_request(
                type=kind, request=self._request("GET", k), on_body=lambda chunk, offset, b=b, **_: b.extend(chunk)
            )
            for k, b in zip(keys, bodies, strict=True)
        ]
        for r in started:
            r.finished_future.result(60)
        return bodies


def measure(server: S3Server, size_mib: float, total_mib: int, rounds: int, batch: int) -> dict:
    size = int(size_mib * MiB)
    count = max(batch, total_mib * MiB // size // batch * batch)
    chunks = chunks_of(LAYOUT, size, count, seed=int(size_mib * 10))
    frames = [codec.encode(c) for c in chunks]
    frame_gb = sum(len(f) for f in frames) / 1e9
    batches = [range(i, i + batch) for i in range(0, count, batch)]
    libraries = {threads: Library(server.endpoint, threads) for threads in (2, 4)}
    rows: dict[str, list[float]] = {"lib_put": [], "lib_get": [], "put": [], "get": []}
    for r in range(rounds):
        prefix = f"lib-{r}-{secrets.token_hex(3)}"
        best_put = best_get = float("inf")
        for threads, lib in libraries.items():
            names = [f"{prefix}-{threads}/{i}" for i in range(count)]
            t0 = time.perf_counter()
            for b in batches:
                lib.put([(names[i], frames[i]) for i in b])
            t1 = time.perf_counter()
            for b in batches:
                got = lib.get([names[i] for i in b])
                assert all(len(g) == len(frames[i]) for g, i in zip(got, b, strict=True))
            t2 = time.perf_counter()
            best_put, best_get = min(best_put, t1 - t0), min(best_get, t2 - t1)
        rows["lib_put"].append(frame_gb / best_put)
        rows["lib_get"].append(frame_gb / best_get)
        tier = open_tier(server.url(f"tier-{r}-{secrets.token_hex(3)}", size="8GiB", relist=0),
                         TierContext(chunk_bytes=chunks[0].nbytes))  # fmt: skip
        try:
            t0 = time.perf_counter()
            for b in batches:
                tier.put([chunks[i] for i in b])
            t1 = time.perf_counter()
            for b in batches:
                got = tier.get([chunks[i].key for i in b])
                for chunk in got:
                    chunk.verify()  # the checksum pass, as a load into the engine does it
                release_all(got)
            t2 = time.perf_counter()
            assert tier.stats()["stored"] == count and tier.stats()["corrupt"] == 0
        finally:
            tier.close()
        rows["put"].append(frame_gb / (t1 - t0))
        rows["get"].append(frame_gb / (t2 - t1))
    out = {"size_mib": size_mib, "objects": count, "batch": batch}
    for op in ("put", "get"):
        ratios = [a / b for a, b in zip(rows[op], rows[f"lib_{op}"], strict=True)]
        out[op] = {
            "lmtier_gbps": max(rows[op]),
            "awscrt_gbps": max(rows[f"lib_{op}"]),
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "rounds": len(ratios),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[0.5, 2, 8])
    parser.add_argument("--total-mib", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    os.environ.update(S3_TEST_KEYS)
    with tempfile.TemporaryDirectory(prefix="lmtier-s3-bench-") as tmp, S3Server.start(tmp) as server:
        rows = [measure(server, s, args.total_mib, args.rounds, args.batch) for s in args.sizes_mib]
    report = {"server": "seaweedfs (weed mini, loopback)", "rows": rows}
    lines = [
        "| chunk | op | lmtier GB/s | awscrt alone GB/s | ratio (median) | ratio min-max over rounds |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        for op in ("put", "get"):
            r = row[op]
            lines.append(
                f"| {row['size_mib']:g} MiB | {op.upper()} | {r['lmtier_gbps']:.3f} | {r['awscrt_gbps']:.3f} | "
                f"{r['ratio_median']:.2f} | {r['ratio_min']:.2f}-{r['ratio_max']:.2f} |"
            )
    emit(report, "\n".join(lines), args.json_out)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()

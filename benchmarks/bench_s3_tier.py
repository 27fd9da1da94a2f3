"""The object-storage tier against awscrt's own S3 client at its best, same server, same run.

Starts its own SeaweedFS (``weed mini``, S3 gateway on loopback), then for each chunk size:

- ``awscrt``: the library alone, as its own best configuration moves the same objects: one
  ``S3Client``, every PUT (then every GET) of a batch in flight at once, the bodies plain
  bytes already encoded, GETs into one growing buffer each; the better of its event-loop
  threads, 2 or 4, chosen by a batch each way first.
- ``lmtier``: ``S3Tier.put`` of the batch (encoding each chunk's frame, bounded, counted),
  then ``get`` of it, every chunk read back and verified against its checksum.

Batch by batch the two go back to back (which first alternates), so that drift in the
machine hits both alike; reported: GB/s of object bytes (best round of each), and each
round's ratio (the median over its batches of the tier's speed over the library's on the
same batch): their median and their spread over rounds (min and max: a target met in some
rounds only is not met), as JSON and as a Markdown table. The server shares the machine's
cores with the clients: the absolute figures are a 2-core machine's, the ratios what the
tier costs over the library.

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
from pathlib import Path

from lmtier.kv import codec
from lmtier.kv.chunk import release_all
from lmtier.kv.layout import KVLayout
from lmtier.testing.s3_server import S3_TEST_KEYS, S3Server
from lmtier.tiers.base import TierContext, open_tier

from common import chunks_of, emit, timed

MiB = 1 << 20
LAYOUT = KVLayout(num_layers=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")  # 64 KiB per token


class Library:
    """awscrt's S3 client on its own: the reference."""

    def __init__(self, endpoint: str, threads: int) -> None:
        from awscrt import auth, s3
        from awscrt import io as crt_io

        self.threads = threads
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
    """Per round: the library's PUTs and the tier's of each batch back to back (which goes
    first alternates), then their GETs alike, so that the machine's drift hits both within
    a batch; a round's ratio is the median over its batches of the tier's speed over the
    library's on the same batch (a stall of the server lands on one batch of one of them)."""
    size = int(size_mib * MiB)
    batch = max(1, min(batch, total_mib * MiB // size // 4))  # at least four batches a round: a median
    count = max(batch, total_mib * MiB // size // batch * batch)
    chunks = chunks_of(LAYOUT, size, count, seed=int(size_mib * 10))
    frames = [codec.encode(c) for c in chunks]
    frame_gb = sum(len(f) for f in frames) / 1e9
    batches = [range(i, i + batch) for i in range(0, count, batch)]
    lib = best_library(server, frames[:batch])
    rows: dict[str, list[float]] = {"lib_put": [], "lib_get": [], "put": [], "get": []}
    round_ratios: dict[str, list[float]] = {"put": [], "get": []}
    for r in range(rounds):
        names = [f"lib-{r}-{secrets.token_hex(3)}/{i}" for i in range(count)]
        tier = open_tier(server.url(f"tier-{r}-{secrets.token_hex(3)}", size="8GiB", relist=0),
                         TierContext(chunk_bytes=chunks[0].nbytes))  # fmt: skip
        spent = dict.fromkeys(rows, 0.0)
        pairs: dict[str, list[float]] = {"put": [], "get": []}  # the tier's GB/s over the library's, per batch
        try:
            for j, b in enumerate(batches):
                steps = [("lib_put", lambda b=b, n=names: lib.put([(n[i], frames[i]) for i in b])),
                         ("put", lambda b=b, t=tier: t.put([chunks[i] for i in b]))]  # fmt: skip
                took = {name: timed(step) for name, step in (steps if j % 2 == 0 else steps[::-1])}
                pairs["put"].append(took["lib_put"] / took["put"])
                for name, seconds in took.items():
                    spent[name] += seconds
            for j, b in enumerate(batches):
                steps = [("lib_get", lambda b=b, n=names: check(lib.get([n[i] for i in b]), [frames[i] for i in b])),
                         ("get", lambda b=b, t=tier: load(t, [chunks[i].key for i in b]))]  # fmt: skip
                took = {name: timed(step) for name, step in (steps if j % 2 == 0 else steps[::-1])}
                pairs["get"].append(took["lib_get"] / took["get"])
                for name, seconds in took.items():
                    spent[name] += seconds
            assert tier.stats()["stored"] == count and tier.stats()["corrupt"] == 0
        finally:
            tier.close()
        for name, seconds in spent.items():
            rows[name].append(frame_gb / seconds)
        for op, ratios in pairs.items():
            round_ratios[op].append(statistics.median(ratios))
    out = {"size_mib": size_mib, "objects": count, "batch": batch, "awscrt_threads": lib.threads}
    for op in ("put", "get"):
        ratios = round_ratios[op]
        out[op] = {
            "lmtier_gbps": max(rows[op]),
            "awscrt_gbps": max(rows[f"lib_{op}"]),
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "rounds": len(ratios),
        }
    return out


def best_library(server: S3Server, frames: list[bytes]) -> Library:
    """The library's better configuration (event-loop threads), by a batch each way."""
    timings = {}
    for threads in (2, 4):
        lib = Library(server.endpoint, threads)
        names = [f"warm-{threads}-{secrets.token_hex(3)}/{i}" for i in range(len(frames))]
        items = list(zip(names, frames, strict=True))
        timings[threads] = timed(lambda lib=lib, items=items: lib.put(items)) + timed(
            lambda lib=lib, names=names: lib.get(names)
        )
    return Library(server.endpoint, min(timings, key=timings.__getitem__))


def check(got: list[bytearray], frames: list[bytes]) -> None:
    assert all(len(g) == len(f) for g, f in zip(got, frames, strict=True))


def load(tier, keys: list[bytes]) -> None:
    got = tier.get(keys)
    for chunk in got:
        chunk.verify()  # the checksum pass, as a load into the engine does it
    release_all(got)


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

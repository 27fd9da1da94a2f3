"""The grpc:// tier against its references, same machine, same run.

Starts ``lmtier serve`` (memory tier only), a bare gRPC echo service in its own process,
and a ``redis-server``; then for each chunk size moves the same chunks through:

- ``echo``: the bare echo service: a client stream of N messages of the frame's wire size
  (PUT), a server stream of N such messages (GET). Python gRPC at its best, no cache.
- ``tcp``: the grpc:// tier with ``shm=off``: frames in gRPC messages.
- ``memcpy``: ``np.copyto`` of each chunk into a preallocated buffer: the bytes moved once.
- ``copyhash``: the same copy, then xxh3-64 of the copied bytes: the least a verified
  load (or a checked save) can cost, the reference of the shared-memory paths.
- ``shm``: the grpc:// tier through its shared-memory segment, gRPC for control only.
- ``redis``: the redis:// tier on the same host.

and, apart from any server, the messages themselves: the ``Pieces`` messages of those
chunks, as the tier sends them, written and parsed by ``lmtier.transport.pieces`` (by hand, views
instead of copies) and by the generated protobuf classes (``cache_pb2``,
``SerializeToString`` after joining the frame into the ``data`` field, ``FromString`` and
reading ``data``), on the same bytes: the hand-written codec must earn its place.

Calls carry ``--batch`` chunks each. Rows: PUT, a save of chunks new to the server (the
same bytes under new keys, deleted after each timing: a save of chunks it holds reads
nothing); GET, which ends with each chunk
delivered and verified against its checksum, ready for the engine to copy; LOAD, which
ends with the bytes in the engine's buffer (a tier's reader verifies as it copies; the
echo client copies each message it receives; ``memcpy`` is the bytes moved once); and
PUT+GET, the whole loop, ``1 / (1/put + 1/get)``.
The server runs with one tenant, so same-host GETs read chunks where they lie in its
memory (copied out and verified by the client in one pass). Rounds
interleave everything; reported: GB/s of chunk bytes (best round), ratios of the best
rounds (tcp / echo, shm / memcpy, each / redis) and the median of same-round ratios, as
JSON and a Markdown table; and the message codecs' GB/s and ratio per size (``pieces``).

    python benchmarks/bench_grpc_tier.py [--sizes-mib 0.25 2] [--total-mib 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import struct
import subprocess
import sys
import tempfile
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import xxhash

from lmtier.kv import codec
from lmtier.kv.chunk import Chunk, release_all
from lmtier.kv.layout import KVLayout
from lmtier.testing.cache_server import ServerProcess
from lmtier.testing.redis_server import RedisServer, free_port
from lmtier.tiers.base import TierContext, open_tier
from lmtier.transport.pieces import PIECE_BYTES, pack, piece, split, unpack
from lmtier.v1 import cache_pb2

from common import chunks_of, emit, timed

MiB = 1 << 20
LAYOUT = KVLayout(num_layers=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")  # 64 KiB per token


# -- the echo service (its own process) -----------------------------------------------------
def echo_server(port: int, host: str = "127.0.0.1") -> None:
    cache: dict[int, bytes] = {}

    def get(request: bytes, context):
        count, size = struct.unpack("<QQ", request)
        message = cache.get(size)
        if message is None:
            message = cache[size] = bytes(size)
        for _ in range(count):
            yield message

    def put(requests, context) -> bytes:
        n = sum(1 for _ in requests)
        return struct.pack("<Q", n)

    handler = grpc.method_handlers_generic_handler(
        "bench.Echo",
        {"Get": grpc.unary_stream_rpc_method_handler(get), "Put": grpc.stream_unary_rpc_method_handler(put)},
    )
    limit = 80 * MiB
    options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
    server = grpc.server(futures.ThreadPoolExecutor(16), options=options)
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"{host}:{port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


class Echo:
    def __init__(self) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--echo-server", str(self.port)], stdout=subprocess.PIPE, text=True
        )
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the echo service did not start")
        limit = 80 * MiB
        options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}", options=options)
        self.get = self.channel.unary_stream("/bench.Echo/Get")
        self.put = self.channel.stream_unary("/bench.Echo/Put")

    def close(self) -> None:
        self.channel.close()
        self.proc.kill()
        self.proc.wait()


# -- measuring --------------------------------------------------------------------------------
def measure_pieces(size_mib: float, chunks: list[Chunk], rounds: int) -> dict:
    """``lmtier.transport.pieces`` against the generated classes, writing and parsing the ``Pieces``
    messages of ``chunks`` (a frame per message, cut at ``PIECE_BYTES`` as the tier cuts it)."""
    pieces = []  # (key, frame size, offset, views) per message
    for chunk in chunks:
        parts = [memoryview(p).cast("B") for p in codec.encode_parts(chunk)]
        size = sum(len(p) for p in parts)
        for offset, views in split(parts, PIECE_BYTES):
            pieces.append((chunk.key if offset == 0 else b"", size if offset == 0 else 0, offset, views))

    def ours(key: bytes, size: int, offset: int, views: list[memoryview]) -> bytes:
        return pack(piece(key, size, offset, data=views))

    def protobuf(key: bytes, size: int, offset: int, views: list[memoryview]) -> bytes:
        one = cache_pb2.ChunkPiece(key=key, frame_size=size, offset=offset, data=b"".join(views))
        return cache_pb2.Pieces(pieces=[one]).SerializeToString()

    messages = [ours(*p) for p in pieces]
    if messages != [protobuf(*p) for p in pieces]:
        raise RuntimeError("lmtier.transport.pieces and cache_pb2 wrote different bytes")
    nbytes = sum(len(m) for m in messages)

    def ours_write() -> None:  # each message dropped once written, as the tier sends it
        for p in pieces:
            ours(*p)

    def protobuf_write() -> None:
        for p in pieces:
            protobuf(*p)

    def ours_parse() -> None:
        for m in messages:
            unpack(m)[0].data  # noqa: B018 (a view into the message)

    def protobuf_parse() -> None:
        for m in messages:
            cache_pb2.Pieces.FromString(m).pieces[0].data  # noqa: B018 (a copy)

    row = {"chunk_mib": size_mib, "messages": len(messages), "message_bytes": len(messages[0])}
    for op, by_hand, generated in (("write", ours_write, protobuf_write), ("parse", ours_parse, protobuf_parse)):
        best_ours = best_theirs = 0.0
        for _ in range(max(3, rounds)):  # interleaved, best of each
            best_ours = max(best_ours, nbytes / timed(by_hand) / 1e9)
            best_theirs = max(best_theirs, nbytes / timed(generated) / 1e9)
        row[op] = {
            "pieces_gbps": best_ours,
            "protobuf_gbps": best_theirs,
            "pieces_over_protobuf": best_ours / best_theirs,
        }
    return row


def measure(servers: dict, size_mib: float, total_mib: int, rounds: int, batch: int) -> tuple[list[dict], dict]:
    size = int(size_mib * MiB)
    count = max(batch, total_mib * MiB // size // batch * batch)
    chunks = chunks_of(LAYOUT, size, count, seed=int(size_mib * 100))
    pieces = measure_pieces(size_mib, chunks, rounds)
    keys = [c.key for c in chunks]
    nbytes = sum(c.nbytes for c in chunks)
    frame = codec.encoded_size(chunks[0])
    message = len(pack(piece(keys[0], frame, data=[bytes(frame)])))  # one chunk on the wire
    batches = [slice(i, i + batch) for i in range(0, count, batch)]
    dst = np.empty((batch, *chunks[0].data.shape), dtype=np.uint8)  # the engine's buffer
    echo: Echo = servers["echo"]
    slot_room = batch * (-(-(frame + 4096) // 65536) * 65536)
    context = TierContext(chunk_bytes=size)  # as an engine's connector gives it
    tiers = {
        "tcp": open_tier(f"grpc://{servers['lmtier'].address}?shm=off", context),
        "shm": open_tier(f"grpc://{servers['lmtier'].address}?shm=on&shm_size={4 * slot_room}", context),
        "redis": open_tier(servers["redis"].url, context),
    }

    rng = np.random.default_rng(size)

    def timed_save(tier) -> float:
        """A batched save of chunks new to the server (a save of chunks it holds reads
        nothing): the same bytes under new keys, deleted again after the timing so that
        the server's memory is as it was (the GETs read the chunks it held before)."""
        fresh = [Chunk(rng.bytes(16), c.layout, c.data) for c in chunks]
        seconds = timed(lambda: [tier.put(fresh[b]) for b in batches])
        tier.delete([c.key for c in fresh])
        return seconds

    def get(name, into_engine: bool = False):
        def run() -> None:
            for b in batches:
                got = tiers[name].get(keys[b])
                for i, chunk in enumerate(got):
                    if into_engine:
                        chunk.copy_to(dst[i])  # verified as it is copied
                    elif not chunk.verify():  # delivered and checked: ready for the engine's copy
                        raise RuntimeError("a chunk failed verification")
                release_all(got)

        return run

    def echo_put() -> None:
        payload = bytes(message)
        for b in batches:
            echo.put(iter([payload] * (b.stop - b.start)), timeout=600)

    def echo_get(into_engine: bool = False) -> None:
        for b in batches:
            for i, received in enumerate(echo.get(struct.pack("<QQ", b.stop - b.start, message), timeout=600)):
                if into_engine:
                    np.copyto(dst[i].reshape(-1), np.frombuffer(received, dtype=np.uint8, count=dst[i].size))

    sources = [np.ascontiguousarray(c.data) for c in chunks]

    def memcpy() -> None:
        for b in batches:
            for i, src in enumerate(sources[b]):
                np.copyto(dst[i], src)

    def copyhash() -> None:
        for b in batches:
            for i, src in enumerate(sources[b]):
                np.copyto(dst[i], src)
                xxhash.xxh3_64_intdigest(dst[i])

    samples: dict[str, list[float]] = {}
    try:
        for tier in tiers.values():  # steady state: the server holds the chunks once, untimed
            for b in batches:
                tier.put(chunks[b])
        for _ in range(rounds):
            copy_rate = nbytes / timed(memcpy) / 1e9
            hash_rate = nbytes / timed(copyhash) / 1e9
            rates = {
                "copyhash": {"put": hash_rate, "get": hash_rate, "load": hash_rate},
                "echo": {
                    "put": nbytes / timed(echo_put) / 1e9,
                    "get": nbytes / timed(echo_get) / 1e9,
                    "load": nbytes / timed(lambda: echo_get(True)) / 1e9,
                },
                "memcpy": {"put": copy_rate, "get": copy_rate, "load": copy_rate},
            }
            for name, tier in tiers.items():
                rates[name] = {
                    "put": nbytes / timed_save(tier) / 1e9,
                    "get": nbytes / timed(get(name)) / 1e9,
                    "load": nbytes / timed(get(name, True)) / 1e9,
                }
            for name, r in rates.items():
                r["put+get"] = 1 / (1 / r["put"] + 1 / r["get"])
                for op, rate in r.items():
                    samples.setdefault(f"{name}_{op}", []).append(rate)
        errors = {name: t.counts["errors"] for name, t in tiers.items() if hasattr(t, "counts")}
    finally:
        for tier in tiers.values():
            tier.close()
    if any(errors.values()):
        raise RuntimeError(f"tier calls failed during the benchmark: {errors}")

    def best(name: str, op: str) -> float:
        return max(samples[f"{name}_{op}"])

    def paired(a: str, b: str, op: str) -> float:
        return statistics.median(x / y for x, y in zip(samples[f"{a}_{op}"], samples[f"{b}_{op}"], strict=True))

    rows = []
    for op in ("put", "get", "load", "put+get"):
        row = {"chunk_mib": size_mib, "op": op, "message_bytes": message}
        for name in ("echo", "tcp", "memcpy", "copyhash", "shm", "redis"):
            row[f"{name}_gbps"] = best(name, op)
        for a, b in (("tcp", "echo"), ("shm", "memcpy"), ("shm", "copyhash"), ("tcp", "redis"), ("shm", "redis")):
            row[f"{a}_over_{b}"] = best(a, op) / best(b, op)
            row[f"paired_{a}_over_{b}"] = paired(a, b, op)
        row["samples"] = {k: v for k, v in samples.items() if k.endswith(f"_{op}")}
        rows.append(row)
    return rows, pieces


def run(sizes_mib: list[float], total_mib: int, rounds: int, batch: int) -> dict:
    rows, pieces = [], []
    with tempfile.TemporaryDirectory(prefix="lmtier-grpc-bench-") as tmp:
        servers = {"redis": RedisServer(Path(tmp), "--maxmemory", f"{4 * total_mib + 512}mb"), "echo": Echo()}
        try:
            for size_mib in sizes_mib:
                # Memory slots of the chunk size, as an operator would set for one model.
                servers["lmtier"] = ServerProcess(
                    Path(tmp),
                    "--tier",
                    f"cpu://?size={2 * total_mib + 64}MiB&slot={int(size_mib * MiB)}",
                    "--max-chunk",
                    "64MiB",
                    "--log-level",
                    "warning",
                )
                try:
                    measured, codecs = measure(servers, size_mib, total_mib, rounds, batch)
                    rows += measured
                    pieces.append(codecs)
                finally:
                    servers.pop("lmtier").stop()
        finally:
            servers["echo"].close()
            servers["redis"].stop()
    return {
        "benchmark": "grpc_tier",
        "total_mib": total_mib,
        "batch_chunks": batch,
        "rounds": rounds,
        "rows": rows,
        "pieces": pieces,
    }


def table(report: dict) -> str:
    lines = [
        "| chunk | op | echo GB/s | tcp GB/s | tcp / echo | memcpy GB/s | memcpy+xxh3 GB/s | shm GB/s "
        "| shm / memcpy | shm / memcpy+xxh3 | redis GB/s | tcp / redis | shm / redis | paired tcp / echo "
        "| paired shm / memcpy+xxh3 |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['chunk_mib']:g} MiB | {r['op'].upper()} | {r['echo_gbps']:.2f} | {r['tcp_gbps']:.2f} "
            f"| {r['tcp_over_echo']:.2f} | {r['memcpy_gbps']:.2f} | {r['copyhash_gbps']:.2f} | {r['shm_gbps']:.2f} "
            f"| {r['shm_over_memcpy']:.2f} | {r['shm_over_copyhash']:.2f} "
            f"| {r['redis_gbps']:.2f} | {r['tcp_over_redis']:.2f} | {r['shm_over_redis']:.2f} "
            f"| {r['paired_tcp_over_echo']:.2f} | {r['paired_shm_over_copyhash']:.2f} |"
        )
    lines += [
        "",
        "| chunk | message | op | lmtier.transport.pieces GB/s | protobuf GB/s | pieces / protobuf |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    for r in report["pieces"]:
        for op in ("write", "parse"):
            x = r[op]
            lines.append(
                f"| {r['chunk_mib']:g} MiB | {r['message_bytes']} B | {op} | {x['pieces_gbps']:.2f} "
                f"| {x['protobuf_gbps']:.2f} | {x['pieces_over_protobuf']:.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[0.25, 2])
    parser.add_argument("--total-mib", type=int, default=64, help="bytes moved per size, path and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="chunks per put / get call")
    parser.add_argument("--json-out", help="also write the JSON report here")
    parser.add_argument("--echo-server", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--echo-host", default="127.0.0.1", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.echo_server:
        echo_server(args.echo_server, args.echo_host)
        return 0
    report = run(args.sizes_mib, args.total_mib, args.rounds, args.batch)
    emit(report, table(report), args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

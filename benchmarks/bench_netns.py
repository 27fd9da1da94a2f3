"""The grpc:// tier across hosts: the server in one network namespace, the client in another,
one veth link between them shaped to ``--rate`` (``tc tbf``; ``lmtier.testing.netns``).

In the server's namespace: ``lmtier serve`` (memory tier), the bare gRPC echo service of
``bench_grpc_tier.py`` and a raw TCP endpoint (this script, ``--sink``). In the client's,
this script (``--client``) moves the same bytes, for each chunk size, through:

- ``tcp``: one raw TCP stream, ``recv_into`` a buffer (LOAD) or ``sendall`` from one (PUT):
  what the link carries at best from Python, the reference the tier must reach 0.8x of;
- ``echo``: the bare gRPC echo, messages of the frame's size (GET copied into the engine's
  buffer, as LOAD; PUT): the reference of 0.9x;
- ``tier``: the grpc:// tier (shared memory is off across hosts): LOAD is ``get`` of
  ``--batch`` chunks per call, each verified as it is copied into the engine's buffer;
  PUT is ``put`` of as many.

Reported: GB/s of chunk bytes (best round) and the ratios tier / tcp and tier / echo, as
JSON and a table. Needs root (namespaces); ``tests/test_netns.py`` runs a short one.

    python benchmarks/bench_netns.py [--sizes-mib 0.25 2] [--total-mib 64] [--rate 10gbit]
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np

from lmtier.kv.chunk import release_all
from lmtier.testing.netns import HostPair, unavailable
from lmtier.tiers.base import TierContext, open_tier

from common import chunks_of, emit, timed

MiB = 1 << 20
HERE = Path(__file__).resolve().parent
# inside the namespaces: free by construction (the server's data channel: 50552)
PORTS = {"lmtier": 50551, "echo": 50555, "sink": 50556}


# -- the raw TCP endpoint (server's namespace) ------------------------------------------------
def sink(host: str, port: int) -> None:
    """``G n``: send n bytes; ``P n``: take n bytes, answer one byte. One client at a time."""
    data = memoryview(bytearray(256 * MiB))
    listener = socket.create_server((host, port))
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while head := conn.recv(9, socket.MSG_WAITALL):
                op, n = head[:1], struct.unpack("<Q", head[1:])[0]
                if op == b"G":
                    for at in range(0, n, len(data)):
                        conn.sendall(data[: min(len(data), n - at)])
                else:
                    got = 0
                    while got < n:
                        got += conn.recv_into(data[: min(len(data), n - got)])
                    conn.sendall(b"k")


# -- the client (client's namespace) --------------------------------------------------------
def client(server: str, sizes_mib: list[float], total_mib: int, rounds: int, batch: int) -> dict:
    raw = socket.create_connection((server, PORTS["sink"]))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    limit = 80 * MiB
    options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
    channel = grpc.insecure_channel(f"{server}:{PORTS['echo']}", options=options)
    grpc.channel_ready_future(channel).result(timeout=60)
    echo = channel.unary_stream("/bench.Echo/Get"), channel.stream_unary("/bench.Echo/Put")
    try:
        rows = [row for size in sizes_mib for row in measure(server, raw, echo, size, total_mib, rounds, batch)]
    finally:
        channel.close()
        raw.close()
    return {"rows": rows}


def measure(server: str, raw: socket.socket, echo, size_mib: float, total_mib: int, rounds: int, batch: int):
    from bench_grpc_tier import LAYOUT

    size = int(size_mib * MiB)
    count = max(batch, total_mib * MiB // size // batch * batch)
    chunks = chunks_of(LAYOUT, size, count, seed=int(size_mib * 100) + 1)
    keys, nbytes = [c.key for c in chunks], sum(c.nbytes for c in chunks)
    batches = [slice(i, i + batch) for i in range(0, count, batch)]
    dst = np.empty((batch, *chunks[0].data.shape), dtype=np.uint8)  # the engine's buffer
    buffer = memoryview(bytearray(nbytes))
    tier = open_tier(f"grpc://{server}:{PORTS['lmtier']}?timeout=60", TierContext(chunk_bytes=size))
    frame = size + 4096
    payload = bytes(frame)
    echo_get, echo_put = echo

    def tcp_load() -> None:
        raw.sendall(b"G" + struct.pack("<Q", nbytes))
        got = 0
        while got < nbytes:
            got += raw.recv_into(buffer[got:])

    def tcp_put() -> None:
        raw.sendall(b"P" + struct.pack("<Q", nbytes))
        raw.sendall(buffer)
        raw.recv(1)

    def echo_load() -> None:
        for b in batches:
            n = b.stop - b.start
            for i, message in enumerate(echo_get(struct.pack("<QQ", n, frame), timeout=600)):
                np.copyto(dst[i].reshape(-1), np.frombuffer(message, dtype=np.uint8, count=dst[i].size))

    def echo_save() -> None:
        for b in batches:
            echo_put(iter([payload] * (b.stop - b.start)), timeout=600)

    def tier_load() -> None:
        for b in batches:
            got = tier.get(keys[b])
            try:
                for i, chunk in enumerate(got):
                    chunk.copy_to(dst[i])  # verified as it is copied
            finally:
                release_all(got)

    def tier_put() -> None:
        for b in batches:
            tier.put(chunks[b])

    try:
        tier_put()  # the server holds the chunks once, untimed
        if tier.contains(keys) != count:
            raise RuntimeError("the server did not keep every chunk: size its memory tier up")
        samples: dict[str, list[float]] = {}
        for _ in range(rounds):
            for name, fn in (("tcp_load", tcp_load), ("echo_load", echo_load), ("tier_load", tier_load),
                             ("tcp_put", tcp_put), ("echo_put", echo_save), ("tier_put", tier_put)):  # fmt: skip
                samples.setdefault(name, []).append(nbytes / timed(fn) / 1e9)
        counts = tier.counts
    finally:
        tier.close()
    if counts["errors"]:
        raise RuntimeError(f"{counts['errors']} tier calls failed")
    rows = []
    for op in ("load", "put"):
        best = {name: max(samples[f"{name}_{op}"]) for name in ("tcp", "echo", "tier")}
        rows.append({
            "chunk_mib": size_mib, "op": op, **{f"{k}_gbps": v for k, v in best.items()},
            "tier_over_tcp": best["tier"] / best["tcp"], "tier_over_echo": best["tier"] / best["echo"],
            "samples": {k: v for k, v in samples.items() if k.endswith(op)}, "tier_counts": counts,
        })  # fmt: skip
    return rows


# -- the parent -----------------------------------------------------------------------------
def run(sizes_mib: list[float], total_mib: int, rounds: int, batch: int, rate: str) -> dict:
    reason = unavailable()
    if reason:
        raise SystemExit(f"bench_netns: {reason}")
    memory = len(sizes_mib) * total_mib + 64  # every size's chunks held at once, in slots of the smallest
    slot = int(min(sizes_mib) * MiB)
    with HostPair(rate=rate) as net:
        py = sys.executable
        ip = net.server_ip
        tier = f"cpu://?size={memory}MiB&slot={slot}"
        lmtier = [py, "-m", "lmtier", "serve", "--host", ip, "--port", str(PORTS["lmtier"]), "--tier", tier,
                  "--max-chunk", "64MiB", "--no-shm", "--log-level", "warning"]  # fmt: skip
        net.run("server", lmtier, stdout=sys.stderr, stderr=sys.stderr)
        for what, argv in (("echo", [str(HERE / "bench_grpc_tier.py"), "--echo-server", str(PORTS["echo"]),
                                     "--echo-host", ip]),
                           ("sink", [str(HERE / "bench_netns.py"), "--sink", ip])):  # fmt: skip
            proc = net.run("server", [py, *argv], stdout=subprocess.PIPE, text=True)
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the {what} service did not start")
        wait_serving(net, ip)
        argv = [py, str(HERE / "bench_netns.py"), "--client", ip, "--sizes-mib", *map(str, sizes_mib),
                "--total-mib", str(total_mib), "--rounds", str(rounds), "--batch", str(batch)]  # fmt: skip
        done = net.call("client", argv, timeout=3600, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"the client failed:\n{done.stderr[-3000:]}")
        measured = json.loads(done.stdout)
    return {"benchmark": "netns", "rate": rate, "total_mib": total_mib, "batch_chunks": batch, "rounds": rounds,
            **measured}  # fmt: skip


def wait_serving(net: HostPair, ip: str, timeout: float = 60.0) -> None:
    """Until the cache server answers its health service from the client's side."""
    ready = "import sys, grpc; grpc.channel_ready_future(grpc.insecure_channel(sys.argv[1])).result(timeout=5)"
    probe = [sys.executable, "-c", ready, f"{ip}:{PORTS['lmtier']}"]
    deadline = time.monotonic() + timeout
    while net.call("client", probe, timeout=30, capture_output=True).returncode:
        if time.monotonic() > deadline:
            raise RuntimeError("the cache server did not become ready in its namespace")
        time.sleep(0.2)


def table(report: dict) -> str:
    lines = [
        f"Link: veth between two network namespaces, tc tbf at {report['rate']}",
        "",
        "| chunk | op | raw TCP GB/s | gRPC echo GB/s | tier GB/s | tier / TCP | tier / echo |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['chunk_mib']:g} MiB | {r['op'].upper()} | {r['tcp_gbps']:.2f} | {r['echo_gbps']:.2f} "
            f"| {r['tier_gbps']:.2f} | {r['tier_over_tcp']:.2f} | {r['tier_over_echo']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[0.25, 2])
    parser.add_argument("--total-mib", type=int, default=64, help="bytes moved per size, path and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="chunks per put / get call")
    parser.add_argument("--rate", default="10gbit", help="the link's rate (tc tbf), e.g. 10gbit, 25gbit")
    parser.add_argument("--json-out", help="also write the JSON report here")
    parser.add_argument("--sink", help=argparse.SUPPRESS)
    parser.add_argument("--client", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sink:
        sink(args.sink, PORTS["sink"])
        return 0
    if args.client:
        print(json.dumps(client(args.client, args.sizes_mib, args.total_mib, args.rounds, args.batch)))
        return 0
    report = run(args.sizes_mib, args.total_mib, args.rounds, args.batch, args.rate)
    emit(report, table(report), args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Sustained mixed load on one ``lmtier serve``: many client processes, bounded server.

    python benchmarks/load_server.py [--clients 8] [--duration 60] [--tenants 1 2] [--json-out FILE]

Starts a server with small tiers (so it evicts all the time), then ``--clients`` client
processes that for ``--duration`` seconds put prompts (sharing a few common prefixes, as
system prompts do), read them back, look them up, delete some, and now and then send a
request the server must refuse (a key of the wrong length, a frame over the size limit).
Half the clients use the shared-memory data plane, half plain gRPC. Every chunk read is
checked against the bytes its key implies. With two tenants (the default) the server is
a fleet's, and its shared memory is refused; with one (``--tenants 1``) it is a sidecar's,
and the shared-memory clients read its memory tier through its published directory.
Each client times its loads that found chunks (lookup, get, every chunk verified): p50
and p99 per client, the spread a server shared by many engines must keep small.

Meanwhile the parent samples the server's resident memory and its disk tier's accounted
bytes (through ``Stats``); once the clients are done it adds up the chunk files on disk,
which must match the accounting. It prints JSON and a table: calls per kind, bytes
moved, failures (anything other than a deliberate refusal, or a wrong byte), and peak
memory and disk against their bounds.
``tests/test_server_load.py`` runs it in CI and asserts on the figures.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CPU_BYTES = 64 * 1024**2
DISK_BYTES = 128 * 1024**2
MAX_CHUNK = 1024**2
WORKERS = 16
# What the server may hold beyond its tiers: idle receive and disk-read buffers (their
# pools' caps), frames in flight (a batch and a half-built frame per call), slack.
POOLS = (128 + 256) * 1024**2
IN_FLIGHT = WORKERS * (16 + 1) * MAX_CHUNK // 8


TOKENS = ("load-test-tenant-a-0123456789", "load-test-tenant-b-0123456789")
# A call is admitted before its request is read (lmtier.server.calls): while the tenant's
# clients hold its limit of calls (releases in flight count), even a malformed request is
# refused for that, and a client tries again. These are the words of those refusals.
ADMISSION = ("calls in flight", "call rate", "the server is busy")
ADMISSION_TRIES = 50


def not_admitted(exc) -> bool:
    import grpc

    return exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and any(w in (exc.details() or "") for w in ADMISSION)


def layout():
    from lmtier.kv.layout import KVLayout

    return KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16")  # 4 KiB per token


def namespace():
    from lmtier.kv.keys import Namespace

    return Namespace(model="load-test", layout=layout(), chunk_tokens=32)  # 128 KiB chunks


def kv_of(key: bytes, shape) -> np.ndarray:
    """The bytes a chunk must hold: its key, repeated (any mix-up between keys shows)."""
    size = int(np.prod(shape))
    return np.resize(np.frombuffer(key, dtype=np.uint8), size).reshape(shape)


# -- one client process -----------------------------------------------------------------------
def client(address: str, index: int, duration: float, shm: bool, tenants: int = 2) -> dict:
    import grpc

    from lmtier.errors import IntegrityError, TierError
    from lmtier.kv.chunk import Chunk, release_all
    from lmtier.tiers.base import open_tier
    from lmtier.transport.pieces import pack, piece
    from lmtier.v1 import cache_pb2

    ns = namespace()
    shape = ns.layout.byte_shape(ns.chunk_tokens)
    rng = random.Random(index)
    token = TOKENS[index % tenants]
    tier = open_tier(f"grpc://{address}?retries=0&timeout=30&shm={'on' if shm else 'off'}&token={token}")
    channel = grpc.insecure_channel(address)
    lookup = channel.unary_unary(
        "/lmtier.v1.CacheService/Lookup",
        cache_pb2.LookupRequest.SerializeToString,
        cache_pb2.LookupResponse.FromString,
    )
    put = channel.stream_unary("/lmtier.v1.CacheService/Put", None, cache_pb2.PutResponse.FromString)
    auth = (("authorization", f"Bearer {token}"),)
    prefixes = [[7000 + p] * (4 * ns.chunk_tokens) for p in range(4)]  # shared "system prompts"
    mine: deque[list[int]] = deque(maxlen=64)
    counts = {"put": 0, "get": 0, "lookup": 0, "delete": 0, "rejected": 0, "chunks_read": 0, "hits": 0,
              "misses_on_copy": 0, "not_admitted": 0}  # fmt: skip
    failures: list[str] = []
    moved = 0
    latencies: list[float] = []  # seconds per load that found chunks: lookup, get, every chunk verified
    served: list[float] = []  # those of them the server took part in (not all in its published directory)
    off_cpu: list[tuple[float, float]] = []  # directory-only loads: (seconds, of which this thread did not run)

    def chunks_of(tokens: list[int]) -> list[Chunk]:
        keys = ns.keys(tokens)
        return [Chunk(k, ns.layout, kv_of(k, shape), namespace=ns.digest) for k in keys]

    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        roll = rng.random()
        try:  # a failed tier call raises (an engine's store would make it a miss): a failure here
            if roll < 0.35 or not mine:
                tokens = rng.choice(prefixes) + [
                    rng.randrange(50_000) for _ in range(rng.randint(2, 8) * ns.chunk_tokens)
                ]
                chunks = chunks_of(tokens)
                tier.put(chunks)
                mine.append(tokens)
                counts["put"] += 1
                moved += sum(c.nbytes for c in chunks)
            elif roll < 0.80:
                tokens = rng.choice([*prefixes, *mine])
                keys = ns.keys(tokens)
                started, ran = time.perf_counter(), time.thread_time()
                read_before = tier.counts["directory_reads"]
                got = tier.get(keys[: tier.contains(keys)])
                copies = []
                for chunk in got:  # as an engine loads: a verified copy into its own memory
                    if chunk is None:
                        break
                    out = np.empty(shape, dtype=np.uint8)
                    try:
                        chunk.copy_to(out)
                    except IntegrityError:  # a miss (the server evicted it under a lock-free read)
                        counts["misses_on_copy"] += 1
                        break
                    copies.append(out)
                if copies:
                    latencies.append(time.perf_counter() - started)
                    if tier.counts["directory_reads"] - read_before < len(got):
                        served.append(latencies[-1])
                    else:  # no call, no I/O: time not on a CPU is time waiting for one
                        off_cpu.append((latencies[-1], latencies[-1] - (time.thread_time() - ran)))
                release_all(got)
                for key, out in zip(keys, copies, strict=False):
                    counts["hits"] += 1
                    moved += out.nbytes
                    if not np.array_equal(out, kv_of(key, shape)):  # what passed its check is the truth
                        failures.append(f"wrong bytes for {key.hex()[:12]}")
                counts["get"] += 1
                counts["chunks_read"] += len(got)
            elif roll < 0.90:
                tier.contains(ns.keys(rng.choice([*prefixes, *mine])))
                counts["lookup"] += 1
            elif roll < 0.95:
                tier.delete(ns.keys(mine.popleft()))
                counts["delete"] += 1
            else:  # a request the server must refuse, and nothing else
                short_key = rng.random() < 0.5
                want = grpc.StatusCode.INVALID_ARGUMENT if short_key else grpc.StatusCode.RESOURCE_EXHAUSTED
                for attempt in range(ADMISSION_TRIES):
                    try:
                        if short_key:
                            lookup(cache_pb2.LookupRequest(keys=[b"short"]), metadata=auth, timeout=30)
                        else:
                            frame = pack(piece(b"k" * 16, MAX_CHUNK + 1, data=[b"x" * 64]))
                            put(iter([frame]), metadata=auth, timeout=30)
                        failures.append("a bad request was accepted")
                    except grpc.RpcError as exc:
                        if not_admitted(exc) and attempt + 1 < ADMISSION_TRIES:
                            counts["not_admitted"] += 1  # the tenant at its limit: the request unread, again
                            time.sleep(0.01 * (attempt + 1))
                            continue
                        if exc.code() != want:
                            failures.append(f"bad request answered {exc.code()} ({exc.details()}) instead of {want}")
                    break
                counts["rejected"] += 1
        except TierError as exc:
            failures.append(f"a tier call failed: {exc}")
    if tier.counts["corrupt"]:  # damage, as opposed to a race with an eviction (directory_races)
        failures.append(f"{tier.counts['corrupt']} chunks failed their check")
    tier.close()
    channel.close()
    latencies.sort()
    served.sort()

    def quantile(q: float, of: list[float] = latencies) -> float:
        return round(of[min(len(of) - 1, int(q * len(of)))] * 1e3, 3) if of else 0.0

    load = {"loads": len(latencies), "p50_ms": quantile(0.50), "p99_ms": quantile(0.99), "shm": shm}
    load["p99_over_p50"] = round(load["p99_ms"] / load["p50_ms"], 2) if load["p50_ms"] else 0.0
    # where the spread comes from: loads the server took part in, against the rest
    load["served_loads"] = len(served)
    load["served_p50_ms"], load["served_p99_ms"] = quantile(0.50, served), quantile(0.99, served)
    direct = sorted(set(latencies) - set(served)) if served else latencies
    # the slowest 5% of the directory's loads: the share of their time spent off a CPU
    slowest = sorted(off_cpu, reverse=True)[: max(1, len(off_cpu) // 20)] if off_cpu else []
    load["slowest_off_cpu"] = round(sum(w for _, w in slowest) / sum(t for t, _ in slowest), 3) if slowest else 0.0
    load["directory_p50_ms"], load["directory_p99_ms"] = quantile(0.50, direct), quantile(0.99, direct)
    return {"counts": counts, "bytes": moved, "failures": failures[:20], "failed": len(failures), "load": load}


# -- the run ---------------------------------------------------------------------------------
def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def disk_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path / "segments"):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


def run_load(clients: int = 8, duration: float = 60.0, workdir: Path | None = None, tenants: int = 2) -> dict:
    from lmtier.testing.cache_server import ServerProcess
    from lmtier.tiers.base import open_tier

    tmp = Path(workdir or tempfile.mkdtemp(prefix="lmtier-load-"))
    if workdir is None:  # its own: the server's disk tier (128 MiB) gone with the process
        atexit.register(shutil.rmtree, tmp, True)
    disk = tmp / "disk"
    tokens = tmp / "tokens"
    tokens.write_text("".join(f"{TOKENS[i]}=tenant-{'ab'[i]}\n" for i in range(tenants)))
    tokens.chmod(0o600)
    server = ServerProcess(
        tmp,
        "--tier",
        f"cpu://?size={CPU_BYTES}&slot=128KiB",
        "--tier",
        f"file://{disk}?size={DISK_BYTES}",
        "--token-file",
        str(tokens),
        "--operator",
        "tenant-a",  # the watcher's Stats shows the tiers' use
        "--max-chunk",
        str(MAX_CHUNK),
        "--workers",
        str(WORKERS),
        "--log-level",
        "warning",
    )
    try:
        time.sleep(1.0)
        idle = rss(server.pid)
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--client", str(i), "--address", server.address]
                + ["--duration", str(duration), "--tenants", str(tenants)]
                + (["--shm"] if i % 2 else []),
                stdout=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )
            for i in range(clients)
        ]
        peak_rss = peak_disk = samples = 0
        watcher = open_tier(f"grpc://{server.address}?token={TOKENS[0]}&shm=off")
        while any(p.poll() is None for p in procs):
            peak_rss = max(peak_rss, rss(server.pid))
            peak_disk = max(peak_disk, watcher.stats()["server_tiers"][1]["used_bytes"])
            samples += 1
            time.sleep(0.5)
        # Once quiet (the server's queued writes done), the files must add up to the
        # accounting: read both until the accounting holds still around a look at the files.
        for _ in range(60):
            accounted = watcher.stats()["server_tiers"][1]["used_bytes"]
            on_disk = disk_bytes(disk)
            if accounted == on_disk == watcher.stats()["server_tiers"][1]["used_bytes"]:
                break
            time.sleep(0.25)
        watcher.close()
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=60)
            results.append(json.loads(out.strip().splitlines()[-1]) if p.returncode == 0 and out.strip() else None)
        alive = server.proc.poll() is None
    finally:
        server.stop()
    crashed = sum(r is None for r in results)
    done = [r for r in results if r is not None]
    counts: dict[str, int] = {}
    for r in done:
        for k, v in r["counts"].items():
            counts[k] = counts.get(k, 0) + v
    calls = sum(v for k, v in counts.items() if k in ("put", "get", "lookup", "delete", "rejected"))
    moved = sum(r["bytes"] for r in done)
    bound = idle + CPU_BYTES + POOLS + IN_FLIGHT
    per_client = [dict(r["load"], client=i) for i, r in enumerate(results) if r is not None]
    return {
        "clients": clients,
        "tenants": tenants,
        "duration_s": duration,
        "load_latency": per_client,
        "worst_p99_over_p50": max((c["p99_over_p50"] for c in per_client), default=0.0),
        "calls": calls,
        "calls_per_s": round(calls / duration, 1),
        "counts": counts,
        "gb_moved": round(moved / 1e9, 3),
        "gb_per_s": round(moved / 1e9 / duration, 3),
        "failed_calls": sum(r["failed"] for r in done) + crashed,
        "failures": ([f"{crashed} client(s) crashed"] if crashed else [])
        + [f for r in done for f in r["failures"]][:19],
        "client_crashes": crashed,
        "server_alive": alive,
        "rss_idle_mib": round(idle / 2**20, 1),
        "rss_peak_mib": round(peak_rss / 2**20, 1),
        "rss_bound_mib": round(bound / 2**20, 1),
        "disk_peak_mib": round(peak_disk / 2**20, 1),
        "disk_bound_mib": round(DISK_BYTES / 2**20, 1),
        "disk_files_mib": round(on_disk / 2**20, 1),
        "disk_files_match": on_disk == accounted,
        "samples": samples,
    }


def table(result: dict) -> str:
    rows = [
        ("clients x seconds", f"{result['clients']} x {result['duration_s']:.0f}"),
        ("calls (per second)", f"{result['calls']} ({result['calls_per_s']})"),
        ("by kind", ", ".join(f"{k} {v}" for k, v in result["counts"].items())),
        ("moved", f"{result['gb_moved']} GB ({result['gb_per_s']} GB/s)"),
        ("failed calls", str(result["failed_calls"])),
        ("server memory peak / bound", f"{result['rss_peak_mib']} / {result['rss_bound_mib']} MiB"),
        ("server disk peak / bound", f"{result['disk_peak_mib']} / {result['disk_bound_mib']} MiB"),
        ("chunk files at the end", f"{result['disk_files_mib']} MiB (match: {result['disk_files_match']})"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines += [
        "",
        "| client | data plane | loads | p50 (ms) | p99 (ms) | p99 / p50 "
        "| loads the server served: share, p50, p99 (ms) | loads from the directory alone: p50, p99 (ms) "
        "| the directory's slowest 5%: time off a CPU |",
        "|---:|---|---:|---:|---:|---:|---|---|---:|",
    ]
    for c in result["load_latency"]:
        plane = "shared memory" if c["shm"] else "data channel / gRPC"
        share = f"{c.get('served_loads', 0) / max(1, c['loads']):.0%}"
        direct = f"{c.get('directory_p50_ms', 0)}, {c.get('directory_p99_ms', 0)}" if c["shm"] else "-"
        lines.append(
            f"| {c['client']} | {plane} | {c['loads']} | {c['p50_ms']} | {c['p99_ms']} | {c['p99_over_p50']} "
            f"| {share}, {c.get('served_p50_ms', 0)}, {c.get('served_p99_ms', 0)} | {direct} "
            f"| {format(c.get('slowest_off_cpu', 0), '.0%') if c['shm'] else '-'} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--client", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument(
        "--tenants",
        type=int,
        nargs="+",
        default=[2],
        choices=(1, 2),
        help="tenants sharing the server, one run per value (one: the same-host directory)",
    )
    parser.add_argument("--json-out", help="also write the JSON report here")
    parser.add_argument("--shm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client is not None:
        print(json.dumps(client(args.address, args.client, args.duration, args.shm, args.tenants[0])))
        return 0
    runs = [run_load(args.clients, args.duration, tenants=t) for t in args.tenants]
    report = {"benchmark": "server_load", "runs": runs}
    print(json.dumps(report, indent=2))
    for result in runs:
        print(f"\n{result['tenants']} tenant(s)\n" + table(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    failed = [f"{r['tenants']} tenant(s): {r['failed_calls']} failed: {'; '.join(r['failures'][:3])}" for r in runs
              if r["failed_calls"]]  # fmt: skip
    if failed:  # the last line of the error, where benchmarks/run.py shows it
        print("\n".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

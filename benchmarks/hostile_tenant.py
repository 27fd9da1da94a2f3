"""One hostile tenant and one well-behaved tenant on one ``lmtier serve``.

    python benchmarks/hostile_tenant.py [--phase 10] [--json-out FILE]

Starts a real server (memory tier of 256 slots, 16 workers, two tenants from a token
file, ``--stall-timeout 2``, ``--max-call-rate-per-tenant 1000``). Alice, the
well-behaved tenant, stores 64 chunks (within her share) and then, for ``--phase``
seconds alone and ``--phase`` seconds beside the attacker, makes 200 Lookups and Gets of
them a second, timing each call (a 5 s deadline; a call that fails is counted, never
retried). The attacker, another process with Bob's token and none, runs every attack
of the availability suite at once, for the second phase:

- calls with no token or a wrong one that send only their headers (32 at a time, on
  several connections, held 2 s, again and again);
- Bob's own calls that send nothing after their headers (Lookups and Puts, 16 at a time),
  and Gets whose answers he never reads;
- Puts that end with a chunk of 0 tokens;
- ordinary valid Puts, as fast as he can, five times what the memory tier holds;
- Stats in a loop.

Prints JSON and a table: Alice's p50 and p99 latency alone and beside the attacker (the
target: p99 within 3x), her failed calls, and how many of her chunks she still finds.
``--nice`` runs the attacker's process at the lowest CPU priority, as a client on its own
host would be: what is then measured is the server's isolation, not the share of a small
machine's cores the attacker's own process takes from Alice's client.
``tests/test_availability_calls.py`` runs it (shorter) and asserts what is not a time.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ALICE, BOB = "alice-0123456789-well-behaved", "bob-0123456789-hostile"
SERVICE = "/lmtier.v1.CacheService/"
SLOT = 64 * 1024
RATE = 200  # Alice's calls per second


def chunks(seed: int, count: int):
    import numpy as np

    from lmtier.kv.chunk import Chunk
    from lmtier.kv.layout import KVLayout

    layout = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float16")  # 2 KiB per token
    rng = np.random.default_rng(seed)
    shape = layout.byte_shape(SLOT // layout.bytes_per_token)
    return [Chunk(rng.bytes(16), layout, rng.integers(0, 256, shape, dtype=np.uint8)) for _ in range(count)]


def put_messages(batch) -> list[bytes]:
    from lmtier.kv import codec
    from lmtier.transport.pieces import pack, piece

    return [pack(piece(c.key, len(f), data=[f])) for c in batch for f in [codec.encode(c)]]


def metadata(token: str | None) -> tuple:
    return (("authorization", f"Bearer {token}"),) if token else ()


# -- the attacker (its own process) ------------------------------------------------------------
ATTACKS = ("headers_only", "own_stalls", "unread_gets", "empty_puts", "flood", "stats")


def attack(address: str, duration: float, which: tuple[str, ...] = ATTACKS) -> None:
    import grpc
    import msgpack
    import xxhash

    from lmtier.kv import codec
    from lmtier.transport.pieces import pack, piece
    from lmtier.v1 import cache_pb2

    stop = time.monotonic() + duration
    options = [("grpc.use_local_subchannel_pool", 1)]

    def stalled(channel, method: str, token: str | None, n: int, hold: float) -> None:
        gate = threading.Event()

        def wait():
            gate.wait(hold)
            yield from ()

        fn = channel.stream_unary(SERVICE + method, None, lambda raw: raw)
        futures = [fn.future(wait(), metadata=metadata(token), timeout=hold + 10) for _ in range(n)]
        gate.wait(hold)
        gate.set()
        for f in futures:
            try:
                f.result()
            except grpc.RpcError:
                pass

    def headers_only() -> None:
        while time.monotonic() < stop:
            chans = [grpc.insecure_channel(address, options=options) for _ in range(4)]
            threads = [threading.Thread(target=stalled, args=(c, "Lookup", None if i % 2 else "guess", 8, 2.0))
                       for i, c in enumerate(chans)]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for c in chans:
                c.close()

    def own_stalls() -> None:
        while time.monotonic() < stop:
            chan = grpc.insecure_channel(address, options=options)
            threads = [threading.Thread(target=stalled, args=(chan, m, BOB, 8, 4.0)) for m in ("Lookup", "Put")]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            chan.close()

    def unread_gets() -> None:
        chan = grpc.insecure_channel(address, options=options)
        mine = chunks(900, 32)
        put = chan.stream_unary(SERVICE + "Put", None, cache_pb2.PutResponse.FromString)
        get = chan.unary_stream(SERVICE + "Get", cache_pb2.GetRequest.SerializeToString, None)
        try:
            put(iter(put_messages(mine)), metadata=metadata(BOB), timeout=30)
        except grpc.RpcError:
            pass
        while time.monotonic() < stop:
            calls = [
                get(cache_pb2.GetRequest(keys=[c.key for c in mine]), metadata=metadata(BOB), timeout=30)
                for _ in range(8)
            ]  # fmt: skip: never read
            time.sleep(3.0)
            for call in calls:
                call.cancel()
        chan.close()

    def empty_puts() -> None:
        chan = grpc.insecure_channel(address)
        put = chan.stream_unary(SERVICE + "Put", None, cache_pb2.PutResponse.FromString)
        seed = 1000
        while time.monotonic() < stop:
            seed += 1
            batch = chunks(seed, 15)
            like = batch[0]
            key = b"z" * 16
            fields = {"v": codec.FRAME_VERSION, "ns": b"", "key": key, "layout": like.layout.to_dict(), "tokens": 0,
                      "codec": codec.CODEC, "raw_len": 0}  # fmt: skip
            header = msgpack.packb(fields, use_bin_type=True)
            frame = codec._preamble(header, 0, xxhash.xxh3_64(b"").intdigest()) + header
            try:
                put(iter([*put_messages(batch), pack(piece(key, len(frame), data=[frame]))]), metadata=metadata(BOB),
                    timeout=10)  # fmt: skip
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        chan.close()

    def flood() -> None:
        chan = grpc.insecure_channel(address)
        put = chan.stream_unary(SERVICE + "Put", None, cache_pb2.PutResponse.FromString)
        made = chunks(5000, 32)  # made once: the attacker's own CPU goes to sending, not to random bytes
        n = 0
        while time.monotonic() < stop:
            n += 1
            batch = [c.view_as(n.to_bytes(8, "little") + c.key[8:]) for c in made]
            try:
                put(iter(put_messages(batch)), metadata=metadata(BOB), timeout=10)
            except grpc.RpcError:
                time.sleep(0.05)
        chan.close()

    def stats() -> None:
        chan = grpc.insecure_channel(address)
        fn = chan.unary_unary(SERVICE + "Stats", cache_pb2.StatsRequest.SerializeToString,
                              cache_pb2.StatsResponse.FromString)  # fmt: skip
        while time.monotonic() < stop:
            try:
                fn(cache_pb2.StatsRequest(), metadata=metadata(BOB), timeout=5)
            except grpc.RpcError:
                time.sleep(0.05)
        chan.close()

    kinds = {"headers_only": headers_only, "own_stalls": own_stalls, "unread_gets": unread_gets,
             "empty_puts": empty_puts, "flood": flood, "stats": stats}  # fmt: skip
    threads = [threading.Thread(target=kinds[name]) for name in which]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# -- the well-behaved tenant (this process) --------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """A process's CPU time so far (user + system), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU time of the whole machine so far, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def victim(address: str, phase: float, attacker: list[str], server_pid: int) -> dict:
    import grpc

    from lmtier.v1 import cache_pb2

    chan = grpc.insecure_channel(address)
    put = chan.stream_unary(SERVICE + "Put", None, cache_pb2.PutResponse.FromString)
    lookup = chan.unary_unary(SERVICE + "Lookup", cache_pb2.LookupRequest.SerializeToString,
                              cache_pb2.LookupResponse.FromString)  # fmt: skip
    get = chan.unary_stream(SERVICE + "Get", cache_pb2.GetRequest.SerializeToString, None)
    mine = chunks(7, 64)
    keys = [c.key for c in mine]
    stored = put(iter(put_messages(mine)), metadata=metadata(ALICE), timeout=30).stored

    def loop(seconds: float) -> dict:
        times, failed, hits = [], 0, []
        end = time.monotonic() + seconds
        i = 0
        next_at = time.monotonic()
        while time.monotonic() < end:
            i += 1
            next_at += 1 / RATE  # a steady rate, as an engine's lookups come: not as fast as it can
            time.sleep(max(0.0, next_at - time.monotonic()))
            start = time.perf_counter()
            try:
                if i % 2:
                    hits.append(lookup(cache_pb2.LookupRequest(keys=keys), metadata=metadata(ALICE), timeout=5).hits)
                else:
                    list(get(cache_pb2.GetRequest(keys=keys[(i * 4) % 64 : (i * 4) % 64 + 4]), metadata=metadata(ALICE),
                             timeout=5))  # fmt: skip
                times.append(time.perf_counter() - start)
            except grpc.RpcError:
                failed += 1
        times.sort()
        return {"calls": len(times) + failed, "failed": failed, "p50_ms": statistics.median(times) * 1e3,
                "p99_ms": times[min(len(times) - 1, int(len(times) * 0.99))] * 1e3,
                "hits_last": hits[-1] if hits else 0, "hits_min": min(hits) if hits else 0}  # fmt: skip

    def measured(seconds: float) -> dict:
        cpu0, (busy0, total0), t0 = cpu_seconds(server_pid), machine_busy(), time.monotonic()
        out = loop(seconds)
        cpu1, (busy1, total1), t1 = cpu_seconds(server_pid), machine_busy(), time.monotonic()
        out["server_cores"] = (cpu1 - cpu0) / (t1 - t0)  # of the machine's os.cpu_count()
        out["machine_busy"] = (busy1 - busy0) / max(1, total1 - total0)
        return out

    alone = measured(phase)
    proc = subprocess.Popen(attacker)
    time.sleep(min(2.0, phase / 4))  # the attack under way
    beside = measured(phase)
    proc.wait(timeout=phase * 4 + 60)
    chan.close()
    return {"stored": stored, "alone": alone, "beside": beside}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", type=float, default=10.0, help="seconds alone, then beside the attacker")
    parser.add_argument("--json-out")
    parser.add_argument("--attack", help=argparse.SUPPRESS)  # ADDRESS: run as the attacker
    parser.add_argument("--duration", type=float, default=10.0, help=argparse.SUPPRESS)
    parser.add_argument("--nice", action="store_true", help="run the attacker at the lowest CPU priority")
    parser.add_argument("--attacks", default=",".join(ATTACKS), help=f"which of {', '.join(ATTACKS)} (default: all)")
    args = parser.parse_args()
    if args.attack:
        if args.nice:
            os.nice(19)  # its own CPU is not the server's to share: in a fleet it runs on its own host
        attack(args.attack, args.duration, tuple(args.attacks.split(",")))
        return 0
    from lmtier.testing.cache_server import ServerProcess

    tmp = Path(tempfile.mkdtemp(prefix="lmtier-hostile-"))
    atexit.register(shutil.rmtree, tmp, True)  # the server's tiers and logs: gone with the process
    tokens = tmp / "tokens"
    tokens.write_text(f"{ALICE}=alice\n{BOB}=bob\n")
    tokens.chmod(0o600)
    server = ServerProcess(tmp, "--tier", f"cpu://?size={256 * SLOT}&slot={SLOT}", "--token-file", str(tokens),
                           "--workers", "16", "--stall-timeout", "2", "--max-call-rate-per-tenant", "1000", "--no-shm",
                           "--log-level", "warning")  # fmt: skip
    try:
        attacker = [sys.executable, __file__, "--attack", server.address, "--duration", str(args.phase + 2),
                    "--attacks", args.attacks, *(["--nice"] if args.nice else [])]  # fmt: skip
        result = victim(server.address, args.phase, attacker, server.pid)
        result["cpus"] = os.cpu_count()
        result["server_alive"] = server.proc.poll() is None
    finally:
        server.stop()
    a, b = result["alone"], result["beside"]
    result["p99_ratio"] = b["p99_ms"] / a["p99_ms"]
    result["target"] = "p99 beside the attacker <= 3x alone; no failed call; all 64 chunks kept"
    result["met"] = result["p99_ratio"] <= 3 and b["failed"] == 0 and b["hits_min"] == 64
    table = "\n".join([
        "| Alice's calls | calls | failed | p50 (ms) | p99 (ms) | her chunks | server cores | machine busy |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *(f"| {name} | {r['calls']} | {r['failed']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['hits_min']} of 64 "
          f"| {r['server_cores']:.2f} of {result['cpus']} | {r['machine_busy']:.0%} |"
          for name, r in (("alone", a), ("beside the attacker", b))),
        f"\np99 ratio {result['p99_ratio']:.2f}x (target <= 3x): {'met' if result['met'] else 'NOT met'}",
    ])  # fmt: skip
    text = json.dumps(result, indent=2)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    print(text)
    print()
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

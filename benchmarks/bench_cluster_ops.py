"""Redis Cluster under operations, with clients saving and loading all along.

A cluster of masters with one replica each (``lmtier.testing.redis_cluster``: each node on
a host of its own in a network namespace where the machine allows it), and ``--workers``
processes of lmtier's embedded API (``lmtier.open_store`` on the ``redis+cluster://`` tier
alone, as an engine would use it) loading prompts that share prefixes, checking every
loaded token's KV against what it must be, and saving what they missed. Beside them, with
``--redis-py``, one process does the same with redis-py's ``RedisCluster`` (values of the
same size, no check): the reference for how fast a client finds its way again.

Then, one after the other, what an operator does (``--events``):

- ``kill``: a master killed (no persistence: it comes back empty); its replica is promoted
- ``failover``: ``CLUSTER FAILOVER`` on a replica (planned: no write lost)
- ``reshard``: a third of the slots moved live from one master to another and back
  (``redis-cli --cluster reshard``; keys of a half-moved slot answer ASK)
- ``add``: a new master joins and a quarter of the slots move to it
- ``cut``: a master's host taken off the network (its replica is promoted), measured while
  it is away, then put back (it rejoins as a replica)
- ``maxmemory``: every master limited to half of what is stored, ``allkeys-lru``: chunks
  evicted in the middle of stored prefixes

For each, from the workers' records: loads and saves attempted, failed (a tier error or a
node that did not answer) and wrong (KV that differs from what was saved: must be 0); the
hit rate before; the time from the cluster being healthy again (every node agrees on live
masters for every slot, ``RedisCluster.healthy``) until the hits are back (no later load
finds less than 0.9x of what loads found before), against the target of 2x the node
timeout; the hit rate at the window's end; the p99 and the longest load while the event
lasted; each worker's threads and open files at most; for the events that are undone (a
killed node started again, a cut host back, the memory limit lifted) the hit rate in the
seconds after. Then reads from replicas (``replica_reads=true``) against reads from
masters only, on a read-only workload. JSON and a table.

    python benchmarks/bench_cluster_ops.py [--events kill failover ...] [--workers 2]
        [--node-timeout-ms 2000] [--redis-py] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from lmtier import metrics
from lmtier.kv.layout import KVLayout
from lmtier.testing.redis_cluster import RedisCluster
from lmtier.testing.redis_server import die_with_parent

from common import emit

EVENTS = ("kill", "failover", "reshard", "add", "cut", "maxmemory")
LAYOUT = KVLayout(num_layers=4, num_kv_heads=8, head_dim=64, dtype="float16")  # 128 KiB per 16-token chunk
CHUNK_TOKENS = 16
SETTLE_S = 3.0  # the rate before an event: its last seconds


# -- the prompts: shared system prefixes, each with documents behind it ----------------------
def prompts(systems: int = 4, docs: int = 6, chunks_each: int = 8) -> list[np.ndarray]:
    rng = np.random.default_rng(1234)
    n = chunks_each * CHUNK_TOKENS
    heads = [rng.integers(1, 30000, n) for _ in range(systems)]
    return [np.concatenate([h, rng.integers(1, 30000, n)]) for h in heads for _ in range(docs)]


def kv_of(tokens: np.ndarray) -> np.ndarray:
    """What the KV of ``tokens`` must be: a function of each token and its position only,
    so that two prompts with a common prefix have the same KV for it (as a model's)."""
    base = (tokens.astype(np.int64) * 7 + np.arange(len(tokens)) * 13) % 997
    grid = np.arange(LAYOUT.num_layers)[:, None, None, None, None] * 3 + np.arange(2)[None, :, None, None, None] * 5
    grid = grid + np.arange(LAYOUT.num_kv_heads)[None, None, None, :, None] * 11
    grid = grid + np.arange(LAYOUT.head_dim)[None, None, None, None, :]
    return ((base[None, None, :, None, None] + grid) % 1024).astype(np.float16)


# -- a worker: one process of the embedded API ----------------------------------------------
def worker(spec: dict[str, Any]) -> None:
    import lmtier

    store = lmtier.open_store(
        [spec["url"]], model="cluster-ops", layout=LAYOUT, chunk_tokens=CHUNK_TOKENS,
        load_deadline=spec["load_deadline"], write_queue=4,
    )  # fmt: skip
    all_prompts = prompts()
    rng = np.random.default_rng(spec["seed"])
    out = np.empty((LAYOUT.num_layers, 2, len(all_prompts[0]), LAYOUT.num_kv_heads, LAYOUT.head_dim), np.float16)
    errors = metrics.REGISTRY.get_sample_value
    tier = store.store.tiers[0].name

    def failures() -> float:
        return sum(errors(name, {"tier": tier, **labels}) or 0 for name, labels in (
            ("lmtier_tier_errors_total", {"op": "get"}), ("lmtier_tier_errors_total", {"op": "lookup"}),
            ("lmtier_tier_ops_total", {"op": "get", "result": "error"})))  # fmt: skip

    stop = Path(spec["stop"])
    with open(spec["out"], "w", buffering=1) as log:
        while not stop.exists():
            tokens = all_prompts[rng.integers(len(all_prompts))]
            want = kv_of(tokens)
            before = failures()
            t0 = time.time()
            got = store.get_into(tokens, out)
            load_s = time.time() - t0
            wrong = int(not np.array_equal(out[:, :, :got], want[:, :, :got]))
            failed = int(failures() > before)
            saved = save_failed = 0
            if got < len(tokens) and not spec["read_only"]:
                saved = 1
                save_failed = int(store.put(tokens, want) < len(tokens))
            fds = len(os.listdir("/proc/self/fd"))
            log.write(json.dumps([t0, got, len(tokens), round(load_s, 6), wrong, failed, saved, save_failed,
                                  threading.active_count(), fds]) + "\n")  # fmt: skip
            time.sleep(spec["pause"])
    store.close()


def redis_py_worker(spec: dict[str, Any]) -> None:
    """The same loop through redis-py's RedisCluster: GET of each chunk's key until a miss,
    SET of what was missing; values of the chunk's size (redis-py checks nothing)."""
    from redis.cluster import ClusterNode
    from redis.cluster import RedisCluster as PyCluster
    from redis.exceptions import RedisError

    seeds = [ClusterNode(*a.rsplit(":", 1)) for a in spec["url"].split("://", 1)[1].split("?")[0].split(",")]
    rc = PyCluster(startup_nodes=seeds, socket_timeout=spec["timeout"], socket_connect_timeout=spec["timeout"])
    rng = np.random.default_rng(spec["seed"])
    chunk = LAYOUT.chunk_bytes(CHUNK_TOKENS)
    all_prompts = prompts()
    stop = Path(spec["stop"])
    with open(spec["out"], "w", buffering=1) as log:
        while not stop.exists():
            p = int(rng.integers(len(all_prompts)))
            keys = [f"pyref:{p // 6}:{i}" if i < 8 else f"pyref:{p}:{i}" for i in range(16)]
            t0 = time.time()
            failed = 0
            try:
                values = rc.mget_nonatomic(keys)
            except RedisError:
                values, failed = [None] * 16, 1
            load_s = time.time() - t0
            got = next((i for i, v in enumerate(values) if v is None), 16)
            saved = save_failed = 0
            if got < 16 and not spec["read_only"]:
                saved = 1
                try:
                    rc.mset_nonatomic({k: bytes(chunk) for k in keys[got:]})
                except RedisError:
                    save_failed = 1
            log.write(json.dumps([t0, got * CHUNK_TOKENS, 16 * CHUNK_TOKENS, round(load_s, 6), 0, failed, saved,
                                  save_failed, threading.active_count(), 0]) + "\n")  # fmt: skip
            time.sleep(spec["pause"])


# -- the driver ------------------------------------------------------------------------------
class Workers:
    def __init__(
        self, workdir: Path, url: str, n: int, redis_py: bool, load_deadline: float, read_only: bool, pause: float
    ):
        import subprocess

        self.stop_file = workdir / "stop"
        self.stop_file.unlink(missing_ok=True)
        self.logs: dict[str, Path] = {}
        self.procs = []
        kinds = [f"lmtier-{i}" for i in range(n)] + (["redis-py"] if redis_py else [])
        for i, name in enumerate(kinds):
            spec = {"url": url, "seed": 100 + i, "out": str(workdir / f"{name}.jsonl"), "stop": str(self.stop_file),
                    "load_deadline": load_deadline, "pause": pause, "timeout": 1.0, "read_only": read_only,
                    "kind": name}  # fmt: skip
            (workdir / f"{name}.json").write_text(json.dumps(spec))
            self.logs[name] = Path(spec["out"])
            cmd = [sys.executable, __file__, "--worker", str(workdir / f"{name}.json")]
            err = open(workdir / f"{name}.err", "wb")  # noqa: SIM115 (the child's, kept open while it runs)
            self.procs.append(subprocess.Popen(die_with_parent(cmd), stdout=err, stderr=subprocess.STDOUT))

    def records(self, name: str) -> list[list]:
        path = self.logs[name]
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.endswith("]")]

    def wait_warm(self, timeout: float = 120) -> None:
        """Until every worker's loads of the last second hit fully."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            time.sleep(0.5)
            if all(_rate(self.records(n), time.time() - 1.5, time.time()) >= 0.98 for n in self.logs):
                return
        raise RuntimeError("the workers' hit rate did not settle")

    def close(self) -> None:
        self.stop_file.touch()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except Exception:
                p.kill()
        for name, p in zip(self.logs, self.procs, strict=True):
            if p.returncode:
                err = self.logs[name].with_suffix(".err")
                raise RuntimeError(f"worker {name} failed ({p.returncode}): {err.read_text()[-2000:]}")


def _rate(records: list[list], start: float, end: float) -> float:
    hit = total = 0
    for r in records:
        if start <= r[0] < end:
            hit, total = hit + r[1], total + r[2]
    return hit / total if total else float("nan")


def measure(records: list[list], t_event: float, t_healthy: float, t_end: float) -> dict[str, Any]:
    """One worker's figures for one event (times: wall clock, shared by the processes)."""
    before = _rate(records, t_event - SETTLE_S, t_event)
    short = [r[0] + r[3] for r in records if t_event <= r[0] < t_end and r[1] < 0.9 * before * r[2]]
    back = max(short, default=t_event)  # the end of the last load that found less than before
    during = [r for r in records if t_event <= r[0] < max(back, t_healthy)]
    window = [r for r in records if t_event <= r[0] < t_end]
    loads = sorted(r[3] for r in during) or [0.0]
    return {
        "loads": len(window),
        "loads_failed": sum(r[5] for r in window),
        "wrong": sum(r[4] for r in window),
        "saves": sum(r[6] for r in window),
        "saves_failed": sum(r[7] for r in window),
        "hit_rate_before": round(before, 4),
        "hit_rate_during": round(_rate(records, t_event, max(back, t_healthy)), 4),
        "loads_short": len(short),
        "hit_rate_after": round(_rate(records, t_end - SETTLE_S, t_end), 4),
        "back_after_healthy_s": round(max(0.0, back - t_healthy), 2),
        "back_after_event_s": round(back - t_event, 2),
        "load_p99_s": round(loads[min(len(loads) - 1, int(0.99 * len(loads)))], 4),
        "load_max_s": round(loads[-1], 4),
        "threads_max": max((r[8] for r in window), default=0),
        "fds_max": max((r[9] for r in window), default=0),
    }


def run_event(
    cluster: RedisCluster, workers: Workers, event: str, log=print, moved_slots: int | None = None
) -> dict[str, Any]:
    """Do ``event`` to the running cluster; returns when its effects are measured.
    ``moved_slots``: the slots a reshard moves (there and back) or a new master takes; by
    default a third and a quarter of them."""
    timeout_s = cluster.node_timeout_ms / 1000
    for _ in range(5):  # the event starts from the clients' normal level, not from a moment the
        workers.wait_warm()  # machine's other load slowed their loads past their deadline
        time.sleep(SETTLE_S)
        t_event = time.time()
        if all(_rate(workers.records(n), t_event - SETTLE_S, t_event) >= 0.95 for n in workers.logs):
            break
    masters = cluster.masters()
    victim = max(masters, key=cluster.slots_of)
    after = None  # what puts the cluster back as it was, once measured
    if event == "kill":
        cluster.kill(victim)
        after = lambda: cluster.restart(victim)  # noqa: E731 (it rejoins as a replica)
    elif event == "failover":
        cluster.failover(cluster.replica_of(victim))
    elif event == "reshard":
        other = next(m for m in masters if m is not victim)
        cluster.reshard(victim, other, moved_slots or 16384 // 3)
        cluster.wait_healthy(120)
        cluster.reshard(other, victim, moved_slots or 16384 // 3)
    elif event == "add":
        new = cluster.add_master()
        cluster.reshard(victim, new, moved_slots or 16384 // 4)
    elif event == "cut":
        cluster.cut(victim)  # measured while it is away; then it comes back, as a replica
        after = lambda: cluster.mend(victim)  # noqa: E731
    elif event == "maxmemory":
        used = max(int(m.call("INFO", "memory").split("used_memory:")[1].split()[0]) for m in masters)
        for m in masters:
            m.call("CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
            m.call("CONFIG", "SET", "maxmemory", str(used // 2))
        after = lambda: [m.call("CONFIG", "SET", "maxmemory", "0") for m in masters]  # noqa: E731
    else:
        raise ValueError(f"no such event {event!r}")
    at = cluster.wait_healthy(120)
    t_healthy = time.time() - (time.monotonic() - at)
    t_end = t_healthy + max(4 * timeout_s, 6.0)
    time.sleep(max(0.0, t_end - time.time()) + 0.5)
    figures = {name: measure(workers.records(name), t_event, t_healthy, t_end) for name in workers.logs}
    log(f"{event}: healthy after {t_healthy - t_event:.1f} s; " + "; ".join(
        f"{n} back {f['back_after_healthy_s']} s, wrong {f['wrong']}" for n, f in figures.items()))  # fmt: skip
    if after is not None:  # put back (a node restarted or reconnected, memory unlimited): hits stay
        after()
        cluster.wait_healthy(120)
        t0 = time.time()
        time.sleep(SETTLE_S)
        for name, f in figures.items():
            records = workers.records(name)
            f["hit_rate_after_restore"] = round(_rate(records, t0, time.time()), 4)
            f["wrong"] += sum(r[4] for r in records if r[0] >= t_end)
    return {"event": event, "where": cluster.where, "healthy_after_s": round(t_healthy - t_event, 2),
            "target_back_s": None if event == "maxmemory" else 2 * timeout_s, "clients": figures}  # fmt: skip


def replica_reads(workdir: Path, cluster: RedisCluster, seconds: float, pause: float = 0.02) -> dict[str, Any]:
    """Loads only (every prompt stored first), from masters only and then from replicas."""
    out = {}
    for mode in ("masters", "replicas"):
        url = cluster.url + ("?replica_reads=true" if mode == "replicas" else "")
        sub = workdir / f"reads-{mode}"
        sub.mkdir()
        workers = Workers(sub, url, 2, False, 0.0, False, pause)  # all hits once warm: reads only
        try:
            workers.wait_warm()
            t0 = time.time()
            time.sleep(seconds)
            t1 = time.time()
        finally:
            workers.close()
        recs = [r for n in workers.logs for r in workers.records(n) if t0 <= r[0] < t1]
        loads = sorted(r[3] for r in recs) or [0.0]
        out[mode] = {"loads_per_s": round(len(recs) / (t1 - t0), 1), "load_p50_s": round(loads[len(loads) // 2], 4),
                     "hit_rate": round(sum(r[1] for r in recs) / max(1, sum(r[2] for r in recs)), 4),
                     "wrong": sum(r[4] for r in recs)}  # fmt: skip
    out["ratio"] = round(out["replicas"]["loads_per_s"] / max(out["masters"]["loads_per_s"], 1e-9), 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker")
    ap.add_argument("--events", nargs="+", default=list(EVENTS), choices=EVENTS)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--node-timeout-ms", type=int, default=2000)
    ap.add_argument("--load-deadline", type=float, default=0.5)
    ap.add_argument("--redis-py", action="store_true")
    ap.add_argument("--reads-seconds", type=float, default=5.0, help="0: no replica-read comparison")
    ap.add_argument("--loopback", action="store_true", help="nodes on loopback ports, not hosts of their own")
    ap.add_argument("--pause", type=float, default=0.02, help="seconds a client waits between its loads")
    ap.add_argument("--moved-slots", type=int, help="slots a reshard moves (default: a third; a new master: a quarter)")
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        (redis_py_worker if spec["kind"] == "redis-py" else worker)(spec)
        return 0
    with tempfile.TemporaryDirectory(prefix="lmtier-cluster-ops-") as tmp:
        work = Path(tmp)
        cluster = RedisCluster(work / "nodes", masters=3, replicas=1, hosts=not args.loopback,
                               node_timeout_ms=args.node_timeout_ms)  # fmt: skip
        try:
            url = f"{cluster.url}?timeout=1&connect_timeout=0.5"
            workers = Workers(work, url, args.workers, args.redis_py, args.load_deadline, False, args.pause)
            try:
                say = lambda m: print(m, file=sys.stderr)  # noqa: E731
                events = [run_event(cluster, workers, e, say, args.moved_slots) for e in args.events]
            finally:
                workers.close()
            cluster.flush()
            reads = replica_reads(work, cluster, args.reads_seconds, args.pause) if args.reads_seconds else None
        finally:
            cluster.stop()
    report = {"where": cluster.where, "node_timeout_ms": args.node_timeout_ms, "load_deadline_s": args.load_deadline,
              "events": events, "replica_reads": reads}  # fmt: skip
    emit(report, table(report), args.json_out)
    return 0


def table(report: dict[str, Any]) -> str:
    lines = [f"Redis Cluster, 3 masters + 3 replicas on {report['where']}, node timeout {report['node_timeout_ms']} ms",
             "", "| event | client | loads | failed | wrong | saves | failed | hit before | healthy after (s) | "
             "hits back after healthy (s) | target (s) | hit after | after undone | load p99 (s) | longest (s) | "
             "threads | fds |", "|---|---|" + "---:|" * 15]  # fmt: skip
    for e in report["events"]:
        for name, f in e["clients"].items():
            lines.append(f"| {e['event']} | {name} | {f['loads']} | {f['loads_failed']} | {f['wrong']} | {f['saves']} "
                         f"| {f['saves_failed']} | {f['hit_rate_before']} | {e['healthy_after_s']} | "
                         f"{f['back_after_healthy_s']} | {e['target_back_s'] or '-'} | {f['hit_rate_after']} | "
                         f"{f.get('hit_rate_after_restore', '-')} | {f['load_p99_s']} "
                         f"| {f['load_max_s']} "
                         f"| {f['threads_max']} | {f['fds_max']} |")  # fmt: skip
    reads = report.get("replica_reads")
    if reads:
        lines += ["", "| reads from | loads/s | load p50 (s) | hit rate | wrong |", "|---|---:|---:|---:|---:|"]
        for mode in ("masters", "replicas"):
            r = reads[mode]
            lines.append(f"| {mode} | {r['loads_per_s']} | {r['load_p50_s']} | {r['hit_rate']} | {r['wrong']} |")
        lines.append(f"\nreplicas / masters: {reads['ratio']}x")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

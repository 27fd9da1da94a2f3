"""``lmtier serve`` as its own process: killed mid-run, restarted, stopped gracefully."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lmtier import metrics
from lmtier.errors import RetryableError
from lmtier.kv.chunk import release_all
from lmtier.store.tiered import TieredStore
from lmtier.testing.cache_server import ServerProcess
from lmtier.tiers.base import open_tier

from conftest import eventually, make_prompt

TIMEOUT, RETRIES = 2.0, 1


def server_args(disk) -> list[str]:
    return ["--tier", "cpu://?size=32MiB&slot=64KiB", "--tier", f"file://{disk}?size=256MiB"]


def on_server_disk(tier, n: int) -> bool:
    stats = tier.stats()
    return stats["server_tiers"][1]["chunks"] >= n


def served(store: TieredStore, prompt) -> bool:
    """Whether the store gives back every chunk of ``prompt``, byte for byte."""
    got = store.get(prompt.keys)
    try:
        return [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(len(prompt.keys))]
    finally:
        release_all(got)


def failed_calls(tier) -> float:
    """The store's count of ``tier``'s calls that failed, every operation."""
    return sum(s.value for m in metrics.TIER_ERRORS.collect() for s in m.samples
               if s.name.endswith("_total") and s.labels["tier"] == tier.name)  # fmt: skip


def test_killing_the_server_turns_calls_into_misses_until_it_is_back(tmp_path):
    server = ServerProcess(tmp_path, *server_args(tmp_path / "disk"))
    remote = open_tier(f"grpc://{server.address}?timeout={TIMEOUT}&retries={RETRIES}")
    memory = open_tier("cpu://?size=16MiB")
    store = TieredStore([memory, remote])  # what an engine runs
    breaker = store._breakers[id(remote)]
    try:
        stored = make_prompt(6, seed=1)
        store.put(stored.chunks())
        assert store.flush(30)
        assert eventually(lambda: on_server_disk(remote, 6), 60)

        failed = failed_calls(remote)
        server.kill()  # SIGKILL: no goodbye
        for step in range(5):
            unseen = make_prompt(4, seed=10 + step)  # not in the engine's own memory: asks the server
            assert store.lookup(unseen.keys) == 0
            assert store.get(unseen.keys) == []
            store.put(make_prompt(2, seed=20 + step).chunks())  # the background write fails quietly
        assert failed_calls(remote) > failed
        assert breaker.is_open  # later calls skip the dead server at once
        with pytest.raises(RetryableError):  # what the store turned into misses
            remote.contains(stored.keys)

        server.start()  # same port, same disk
        memory.delete(stored.keys)  # gone from the engine's own memory: only the server has them
        assert eventually(lambda: store.lookup(stored.keys) == 6, 30)
        assert served(store, stored)
        assert not breaker.is_open
    finally:
        store.close()
        server.kill()


def test_a_graceful_stop_finishes_writes_and_a_restart_serves_them(tmp_path):
    disk = tmp_path / "disk"
    server = ServerProcess(tmp_path, *server_args(disk))
    store = TieredStore([open_tier(f"grpc://{server.address}")])
    try:
        prompt = make_prompt(8, seed=3)
        store.put(prompt.chunks())
        assert server.stop() == 0  # SIGTERM right away: the disk writes are flushed first
        assert "shutting down" in server.log()
        server.start()
        assert eventually(lambda: store.lookup(prompt.keys) == 8, 30)
        assert served(store, prompt)
    finally:
        store.close()
        server.kill()


def stopped(pid: int) -> bool:
    """Every thread of the process has stopped (SIGSTOP is delivered asynchronously)."""
    tasks = Path(f"/proc/{pid}/task")
    return all((task / "stat").read_text().rsplit(")", 1)[1].split()[0] == "T" for task in tasks.iterdir())


def test_a_hung_server_costs_one_timeout_then_the_breaker_skips_it(tmp_path):
    """One timeout per call even with retries (a call that waited out its deadline is not
    made again), then none: the breaker skips the server until it answers again."""
    server = ServerProcess(tmp_path, *server_args(tmp_path / "disk"))
    # The calls' path: a hung server's published directory would still serve its memory
    # (alive, holding its lock, its chunks verified as read), with no call to time out.
    tier = open_tier(f"grpc://{server.address}?timeout=1&retries=2&directory=off")
    store = TieredStore([tier])
    skipped = metrics.TIER_OPS.labels(tier.name, "get", "skipped")
    try:
        prompt = make_prompt(3, seed=4)
        store.put(prompt.chunks())
        assert store.lookup(prompt.keys) == 3
        server.proc.send_signal(signal.SIGSTOP)  # alive, but answers nothing
        assert eventually(lambda: stopped(server.pid), 10)
        for _ in range(3):
            assert store.lookup(prompt.keys) == 0  # each waits out its deadline, then misses
        assert tier.counts["errors"] == 3 and store._breakers[id(tier)].is_open  # one try per call
        before = skipped._value.get()
        assert store.get(prompt.keys) == []
        assert skipped._value.get() == before + 1 and tier.counts["errors"] == 3  # not sent: no deadline to wait out
        server.proc.send_signal(signal.SIGCONT)
        assert eventually(lambda: store.lookup(prompt.keys) == 3, 30)
    finally:
        server.proc.send_signal(signal.SIGCONT)
        store.close()
        server.kill()


def test_a_server_whose_shared_tier_is_down_at_start_runs_serves_its_memory_and_is_not_ready(tmp_path):
    """Not ready (its probes write through every tier) but alive and answering, the
    unreachable tier reported, retried in the background."""
    from grpc_health.v1 import health_pb2

    from lmtier.testing.redis_server import free_port

    down = f"redis+cluster://127.0.0.1:{free_port()}?connect_timeout=0.2&timeout=0.2"
    server = ServerProcess(tmp_path, "--tier", "cpu://?size=32MiB&slot=64KiB", "--tier", down, start=False)
    server.start(ready=False)
    remote = open_tier(f"grpc://{server.address}?timeout={TIMEOUT}&retries={RETRIES}")
    try:
        stored = make_prompt(3, seed=4)
        remote.put(stored.chunks())
        assert remote.contains(stored.keys) == 3
        lower = remote.stats()["server_tiers"][1]
        assert lower["counters"]["unavailable"] == 1 and lower["chunks"] == 0
        assert server.log().count("cannot be opened now") == 1
        assert server.health() == health_pb2.HealthCheckResponse.NOT_SERVING
        assert server.proc.poll() is None
    finally:
        remote.close()
        server.stop()


def test_a_second_server_on_a_taken_port_is_a_clear_error_and_leaves_nothing_behind(tmp_path):
    """gRPC would share the port (SO_REUSEPORT) and the kernel would split the clients
    between two caches; a taken metrics port is refused the same way. Whatever the failed
    start made (its memory tier's shared-memory slab) is gone with it."""
    import subprocess
    import sys

    shm = tmp_path / "shm"
    shm.mkdir()
    first = ServerProcess(tmp_path, "--shm-dir", str(shm))
    try:
        held = sorted(shm.iterdir())
        assert held  # the first server's slab
        for flags, why in (
            (["--port", str(first.port)], "cannot listen on"),
            (["--host", "localhost", "--port", str(first.port)], "cannot listen on"),  # 127.0.0.1 and ::1
            (["--port", "0", "--metrics-port", str(first.port)], "cannot serve metrics on"),
        ):
            second = subprocess.run(
                [sys.executable, "-m", "lmtier", "serve", *flags, "--shm-dir", str(shm)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert second.returncode != 0 and why in second.stderr, second.stderr
            assert "Traceback" not in second.stderr and "listening" not in second.stdout
            assert sorted(shm.iterdir()) == held
        assert first.serving()
    finally:
        first.stop()
    assert list(shm.iterdir()) == []


def test_a_killed_servers_shared_memory_is_reclaimed_by_the_next_sweep(tmp_path):
    """SIGKILL leaves the server's slab behind; nothing holds its lock any more, so the
    sweep that every server runs removes it (and never a live server's)."""
    from lmtier.transport import shm

    segments = tmp_path / "shm"
    segments.mkdir()
    dead = ServerProcess(tmp_path, "--shm-dir", str(segments))
    left = set(segments.iterdir())
    assert left
    dead.kill()
    alive = ServerProcess(tmp_path, "--shm-dir", str(segments))
    try:
        assert shm.sweep(str(segments), min_age=0) == len(left)
        assert not left & set(segments.iterdir()) and list(segments.iterdir())  # the live one stays
        assert alive.serving()
    finally:
        alive.stop()
    assert list(segments.iterdir()) == []


def test_chained_servers_engine_sidecar_central_and_two_sidecars_share(tmp_path):
    """The natural deployment: a per-node sidecar (memory) over a shared central server.
    Sidecars become ready, what one sidecar's client stores reaches the central server,
    and a client of a second sidecar is served it; the sidecars' tenants stay apart."""
    central = ServerProcess(tmp_path, "--tier", "cpu://?size=64MiB&slot=64KiB", "--token", "node-secret=nodes")
    up = f"grpc://{central.address}?token=node-secret&timeout=5"
    tokens = ("--token", "alice-secret=alice", "--token", "bob-secret=bob")
    sidecars = [
        ServerProcess(tmp_path, "--tier", "cpu://?size=32MiB&slot=64KiB", "--tier", up, *tokens) for _ in range(2)
    ]  # ServerProcess waits until each is ready: its probe went through the central server
    clients = {
        (n, who): open_tier(f"grpc://{s.address}?token={who}-secret&timeout=5&retries={RETRIES}")
        for n, s in enumerate(sidecars)
        for who in ("alice", "bob")
    }
    try:
        prompt = make_prompt(4, seed=33)
        clients[0, "alice"].put(prompt.chunks())
        watcher = open_tier(up)
        assert eventually(lambda: watcher.stats()["chunks"] >= 4, 60)  # the write-through reached central
        watcher.close()
        got = clients[1, "alice"].get(prompt.keys)  # another node: from central, through its sidecar
        assert [c.tobytes() for c in got] == [c.tobytes() for c in prompt.chunks()]
        release_all(got)
        assert clients[1, "bob"].contains(prompt.keys) == 0  # alice's, even upstream
        assert clients[0, "bob"].contains(prompt.keys) == 0
    finally:
        for c in clients.values():
            c.close()
        for s in sidecars:
            s.stop()
        central.stop()


_PARENT = """
import sys, tempfile, time
from pathlib import Path
import grpc
from concurrent import futures
from lmtier.testing.cache_server import ServerProcess
from lmtier.testing.redis_server import RedisServer

busy = grpc.server(futures.ThreadPoolExecutor(2))  # gRPC's threads run while the servers start
busy.add_insecure_port("127.0.0.1:0")
busy.start()
work = Path(sys.argv[1])
servers = [ServerProcess(work, "--tier", "cpu://?size=16MiB") for _ in range(4)] + [RedisServer(work)]
print(" ".join(str(s.proc.pid) for s in servers), flush=True)
time.sleep(120)
"""


def test_servers_started_by_a_grpc_process_start_and_die_with_it(tmp_path):
    """The test servers start from a process whose gRPC threads run (a fork that ran Python
    before exec there once lost the server to a closed epoll descriptor), and a parent that
    is killed takes its servers with it."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline()
        assert line, "the parent process could not start its servers"
        pids = [int(p) for p in line.split()]
        assert all(Path(f"/proc/{pid}").exists() for pid in pids)
    finally:
        parent.kill()
        parent.wait(timeout=30)

    def gone(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    assert eventually(lambda: all(gone(pid) for pid in pids), 30), [p for p in pids if not gone(p)]

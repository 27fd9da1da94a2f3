"""Faults seen from the engine's side (the embedded API, which the engine adapters mirror):
each remote server killed and restarted mid-workload, a slow tier against a load deadline,
a full disk, a read-only or vanished disk directory, damaged bytes in every tier. For each:
the engine gets a shorter hit or none (it recomputes), never wrong KV and never an
exception; the error counters move; everything works again once the fault ends.

Real servers and real files throughout; the only injected parts are the operating-system
errors a test cannot cause for real as root (ENOSPC, EROFS).
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import threading

import numpy as np
import pytest
import torch

from lmtier import metrics
from lmtier.api import open_store
from lmtier.kv.layout import KVLayout
from lmtier.testing.cache_server import ServerProcess
from lmtier.testing.redis_server import RedisServer, cli
from lmtier.tiers.disk import files as disk_files

from conftest import disk_frames, eventually, flip_byte

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16")
CHUNK = 16


def prompt(n_chunks: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, n_chunks * CHUNK)
    kv = torch.from_numpy(rng.integers(-(2**15), 2**15, LAYOUT.tensor_shape(len(tokens)), dtype=np.int16))
    return tokens, kv.view(torch.float16)


def load(store, tokens) -> tuple[int, torch.Tensor]:
    """What the engine does on a hit: lookup, then load into its own buffer."""
    out = torch.zeros(LAYOUT.tensor_shape(len(tokens)), dtype=torch.float16)
    store.lookup(tokens)  # must not raise either
    return store.get_into(tokens, out), out


def assert_never_wrong(got: int, out: torch.Tensor, kv: torch.Tensor) -> None:
    """The loaded prefix is exactly the stored KV; nothing was written past it."""
    assert got % CHUNK == 0
    assert torch.equal(out[:, :, :got].view(torch.int16), kv[:, :, :got].view(torch.int16))
    assert not out[:, :, got:].view(torch.int16).any()


def counter(metric, **labels) -> float:
    return sum(
        s.value
        for m in metric.collect()
        for s in m.samples
        if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items())
    )


# ------------------------------------------------------------------------------------------
# Remote servers killed and restarted mid-workload
# ------------------------------------------------------------------------------------------
def stalled(port: int) -> bool:
    """Whether Redis on ``port`` leaves a PING unanswered for 0.2 s (busy in DEBUG SLEEP)."""
    with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
        sock.settimeout(0.2)
        sock.sendall(b"PING\r\n")
        try:
            return not sock.recv(16)
        except TimeoutError:
            return True


def test_redis_killed_mid_workload_is_misses_then_recovers(tmp_path):
    server = RedisServer(tmp_path)
    store = open_store([f"{server.url}?timeout=1&connect_timeout=1"], model="faults", layout=LAYOUT,
                       chunk_tokens=CHUNK)  # fmt: skip
    try:
        before = [prompt(4, seed=i) for i in range(3)]
        for tokens, kv in before:
            assert store.put(tokens, kv) == 4 * CHUNK
        store.flush()
        errors = counter(metrics.TIER_ERRORS, tier="redis")

        server.kill()
        for i in range(6):  # the workload goes on: loads are misses, stores are dropped
            tokens, kv = before[i % 3]
            got, out = load(store, tokens)
            assert got == 0
            assert_never_wrong(got, out, kv)
            store.put(*prompt(2, seed=100 + i))
        assert counter(metrics.TIER_ERRORS, tier="redis") > errors

        server.start()  # same port, empty: a restarted cache
        tokens, kv = prompt(4, seed=7)
        assert eventually(lambda: store.put(tokens, kv) == 4 * CHUNK)  # once the breaker lets a call through
        got, out = load(store, tokens)
        assert got == 4 * CHUNK
        assert_never_wrong(got, out, kv)
    finally:
        store.close()
        server.stop()


def test_cache_server_killed_mid_workload_is_misses_then_recovers(tmp_path):
    server = ServerProcess(tmp_path, "--tier", "cpu://?size=32MiB", "--tier", f"file://{tmp_path}/disk?size=64MiB")
    store = open_store([f"grpc://{server.address}?timeout=2&retries=1&shm=off"], model="faults", layout=LAYOUT,
                       chunk_tokens=CHUNK)  # fmt: skip
    try:
        tokens, kv = prompt(4, seed=11)
        assert store.put(tokens, kv) == 4 * CHUNK
        store.flush()
        assert eventually(
            lambda: (tmp_path / "disk" / "index.sqlite").exists() and len(disk_frames(tmp_path / "disk")) == 4
        )
        errors = counter(metrics.TIER_ERRORS, tier="grpc")
        server.kill()  # a crash: its disk keeps the chunks
        for i in range(4):
            got, out = load(store, tokens)
            assert got == 0
            assert_never_wrong(got, out, kv)
            store.put(*prompt(2, seed=200 + i))
        assert counter(metrics.TIER_ERRORS, tier="grpc") > errors  # the store saw the failures
        server.start()  # the disk tier brings the chunks back
        assert eventually(lambda: load(store, tokens)[0] == 4 * CHUNK)
        got, out = load(store, tokens)
        assert_never_wrong(got, out, kv)
    finally:
        store.close()
        server.stop()


# ------------------------------------------------------------------------------------------
# A slow tier against the load deadline
# ------------------------------------------------------------------------------------------
def test_a_slow_tier_costs_at_most_the_load_deadline_then_recovers(tmp_path):
    server = RedisServer(tmp_path, "--enable-debug-command", "yes")
    store = open_store([f"{server.url}?timeout=30"], model="faults", layout=LAYOUT, chunk_tokens=CHUNK,
                       load_deadline=0.5)  # fmt: skip
    try:
        tokens, kv = prompt(8, seed=21)
        assert store.put(tokens, kv) == 8 * CHUNK
        store.flush()
        late = metrics.LOAD_DEADLINES._value.get()
        slept = threading.Event()

        def stall() -> None:  # the server itself stops answering for 5 s
            cli(server.port, "DEBUG", "SLEEP", "5", timeout=20)
            slept.set()

        staller = threading.Thread(target=stall)
        staller.start()
        assert eventually(lambda: stalled(server.port))  # Redis is inside DEBUG SLEEP now
        out = torch.zeros(LAYOUT.tensor_shape(len(tokens)), dtype=torch.float16)
        got = store.get_into(tokens, out)
        assert not slept.is_set(), "the load waited for the slow tier instead of giving up at its deadline"
        assert got == 0  # nothing arrived in time: the engine recomputes
        assert_never_wrong(got, out, kv)
        assert metrics.LOAD_DEADLINES._value.get() == late + 1
        staller.join()
        got, out = load(store, tokens)  # the tier is fast again
        assert got == 8 * CHUNK
        assert_never_wrong(got, out, kv)
    finally:
        store.close()
        server.stop()


# ------------------------------------------------------------------------------------------
# The disk: full, read-only, vanished
# ------------------------------------------------------------------------------------------
def failing_write(code: int):
    """Fault injection: every write into a segment fails as a full or read-only disk does."""

    def fake(fd, buffers, offset, *args):
        raise OSError(code, os.strerror(code))

    return fake


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS], ids=["full", "read-only"])
def test_a_full_or_read_only_disk_drops_writes_and_keeps_serving(tmp_path, monkeypatch, code):
    store = open_store(["cpu://?size=1MiB", f"file://{tmp_path}/disk?size=64MiB"], model="faults", layout=LAYOUT,
                       chunk_tokens=CHUNK, save_policy="always")  # fmt: skip
    try:
        kept, kept_kv = prompt(2, seed=31)
        store.put(kept, kept_kv)
        store.flush()
        disk = store.store.tiers[1]
        errors = disk.stats()["write_errors"]

        monkeypatch.setattr(disk_files.os, "pwritev", failing_write(code))
        tokens, kv = prompt(2, seed=32)
        assert store.put(tokens, kv) == 2 * CHUNK  # memory holds it; the disk write fails quietly
        store.flush()
        assert disk.stats()["write_errors"] > errors
        assert disk.contains(store.keys(tokens)) == 0
        got, out = load(store, kept)  # what the disk already had is still served
        assert got == 2 * CHUNK
        assert_never_wrong(got, out, kept_kv)

        monkeypatch.undo()  # the disk has room / is writable again
        fresh, fresh_kv = prompt(2, seed=33)
        store.put(fresh, fresh_kv)
        store.flush()
        assert disk.contains(store.keys(fresh)) == 2
    finally:
        store.close()


def test_a_vanished_disk_directory_is_misses_then_recreated(tmp_path):
    root = tmp_path / "disk"
    store = open_store([f"file://{root}?size=64MiB"], model="faults", layout=LAYOUT, chunk_tokens=CHUNK)
    try:
        tokens, kv = prompt(3, seed=41)
        assert store.put(tokens, kv) == 3 * CHUNK
        shutil.rmtree(root)
        got, out = load(store, tokens)
        assert got == 0
        assert_never_wrong(got, out, kv)
        store.put(*prompt(1, seed=42))  # the first write after the loss: fails, no exception

        again, again_kv = prompt(3, seed=43)
        assert eventually(lambda: store.put(again, again_kv) == 3 * CHUNK)  # the directory is rebuilt
        got, out = load(store, again)
        assert got == 3 * CHUNK
        assert_never_wrong(got, out, again_kv)
    finally:
        store.close()


# ------------------------------------------------------------------------------------------
# Damaged bytes in every tier
# ------------------------------------------------------------------------------------------
def damage_file(store, key: bytes) -> None:
    path, offset, length = store.store.tiers[0].locate(key)
    flip_byte(path, offset + length - 50)


def damage_redis_value(store, key: bytes) -> None:
    tier = store.store.tiers[0]
    node = tier._node_for(tier._rkey(key))

    def work(conn):
        value = bytearray(conn.call(b"GET", tier._rkey(key)))
        value[-50] ^= 0x01
        conn.call(b"SET", tier._rkey(key), bytes(value))

    node.run(work)


@pytest.mark.parametrize("where", ["file", "redis", "grpc"])
def test_a_damaged_chunk_in_any_tier_ends_the_hit_before_it(tmp_path, where):
    servers = []
    if where == "file":
        url = f"file://{tmp_path}/disk?size=64MiB"
    elif where == "redis":
        servers.append(RedisServer(tmp_path))
        url = servers[0].url
    else:
        # the server keeps chunks on disk; a damaged file there reaches the client in the
        # Get stream, and the client's own check refuses it
        servers.append(ServerProcess(tmp_path, "--tier", f"file://{tmp_path}/server-disk?size=64MiB"))
        url = f"grpc://{servers[0].address}?shm=off"
    store = open_store([url], model="faults", layout=LAYOUT, chunk_tokens=CHUNK)
    try:
        tokens, kv = prompt(4, seed=51)
        assert store.put(tokens, kv) == 4 * CHUNK
        store.flush()
        third = store.keys(tokens)[2]
        if where == "file":
            damage_file(store, third)
        elif where == "redis":
            damage_redis_value(store, third)
        else:
            found = [f for k, f in disk_frames(tmp_path / "server-disk").items() if third.hex() in k.hex()]
            assert len(found) == 1
            path, offset, length = found[0]
            flip_byte(path, offset + length - 50)
        got, out = load(store, tokens)
        assert got == 2 * CHUNK  # the two chunks before the damage, nothing after
        assert_never_wrong(got, out, kv)
        assert store.lookup(tokens) == 2 * CHUNK  # the damaged copy is gone
        store.put(tokens, kv)  # recomputed and stored again
        store.flush()
        got, out = load(store, tokens)
        assert got == 4 * CHUNK
        assert_never_wrong(got, out, kv)
    finally:
        store.close()
        for s in servers:
            s.stop()

"""Engines fork their workers: every tier, and the store over them, must keep working in
the parent and in a child forked after both had used them (no shared sockets, no dead
threads, no locks held by a thread that is not there)."""

from __future__ import annotations

import os
import time
import traceback

import pytest

from lmtier.kv.chunk import release_all
from lmtier.store.tiered import TieredStore
from lmtier.testing.cache_server import ServerProcess
from lmtier.testing.redis_cluster import RedisCluster
from lmtier.testing.redis_server import RedisServer
from lmtier.tiers.base import open_tier

from conftest import make_prompt


@pytest.fixture(scope="module")
def shared_tiers(tmp_path_factory):
    """One URL per kind of shared tier, each backed by a real server or directory."""
    tmp = tmp_path_factory.mktemp("fork")
    redis, cluster = RedisServer(tmp / "redis"), RedisCluster(tmp / "cluster")
    server = ServerProcess(tmp, "--tier", "cpu://?size=32MiB&slot=64KiB")
    yield {
        "file": f"file://{tmp / 'disk'}?size=64MiB",
        "redis": redis.url,
        "redis+cluster": cluster.url,
        "grpc": f"grpc://{server.address}?timeout=5",
    }
    server.stop()
    cluster.stop()
    redis.stop()


def same(tier, prompt) -> bool:
    got = tier.get(prompt.keys)
    try:
        return [c and c.tobytes() for c in got] == [c.tobytes() for c in prompt.chunks()]
    finally:
        release_all([c for c in got if c is not None])


def used(store: TieredStore, shared, prompt) -> bool:
    """Store through the store, read back from the shared tier itself."""
    store.put(prompt.chunks())
    return store.flush(30) and same(shared, prompt)


@pytest.mark.parametrize("kind", ["file", "redis", "redis+cluster", "grpc"])
def test_a_store_works_in_the_parent_and_in_a_forked_child(shared_tiers, kind, tmp_path):
    shared = open_tier(shared_tiers[kind])
    store = TieredStore([open_tier("cpu://?size=16MiB"), shared])
    before, in_child, in_parent = (make_prompt(3, seed=s) for s in (31, 32, 33))
    try:
        assert used(store, shared, before)
        report = tmp_path / "child.txt"
        pid = os.fork()
        if pid == 0:  # the child: report, then leave without running the parent's cleanup
            code = 1
            try:
                ok = same(shared, before) and used(store, shared, in_child) and store.lookup(before.keys) == 3
                report.write_text("ok" if ok else "wrong answers in the child")
                code = 0 if ok else 1
            except BaseException:
                report.write_text(traceback.format_exc())
            finally:
                os._exit(code)
        assert used(store, shared, in_parent)  # the parent goes on meanwhile
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail(f"the forked child hung using the {kind} tier")
        assert os.waitstatus_to_exitcode(done[1]) == 0, report.read_text() if report.exists() else "no report"
        assert same(shared, in_child) and same(shared, in_parent) and same(shared, before)
    finally:
        store.close()

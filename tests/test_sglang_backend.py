"""lmtier as SGLang's HiCache L3, against the real SGLang package (0.5.23, CPU): backends
made by SGLang's own StorageBackendFactory, SGLang's real host pools in every page layout,
MHA and MLA, every lmtier tier, two processes sharing, and damaged or missing chunks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lmtier.config import ServerConfig
from lmtier.errors import ConfigError
from lmtier.server import create_server
from lmtier.testing.redis_server import RedisServer

import sglang_env
from conftest import flip_byte
from sglang_env import alloc, backend, page_keys, token_kv

HERE = Path(__file__).parent
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
POOLS = [("mha", lay) for lay in MHA_LAYOUTS] + [("mla", lay) for lay in MLA_LAYOUTS]
PAGE = 4


@pytest.fixture(scope="module", autouse=True)
def _sglang():
    sglang_env.use()
    yield
    sglang_env.unuse()


# ------------------------------------------------------------------------------------------
# Round trips on every layout, both interfaces
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "layout"), POOLS)
def test_zero_copy_round_trip_through_the_host_pool(tmp_path, kind, layout):
    from lmtier.connectors.sglang import LMTierStorage

    storage, pool = backend([f"file://{tmp_path}/l3?size=64MiB"], mla=kind == "mla", layout=layout)
    assert isinstance(storage, LMTierStorage)
    keys = page_keys(6)
    src = alloc(pool, 6)
    sglang_env.fill_random(pool, src, seed=1)
    written = sglang_env.page_bytes(pool, src)

    assert storage.batch_set_v1(keys, src) == [True] * 6
    storage.store.flush()
    assert storage.batch_exists(keys) == 6
    assert storage.batch_exists([*keys[:3], page_keys(1, seed=9)[0], *keys[4:]]) == 3

    dst = alloc(pool, 6)
    assert storage.batch_get_v1(keys, dst) == [True] * 6
    assert sglang_env.page_bytes(pool, dst) == written
    # a fresh backend (a restarted engine) over the same directory reads the same pages
    storage.close()
    again, _ = backend([f"file://{tmp_path}/l3?size=64MiB"], mla=kind == "mla", layout=layout, pool=pool)
    dst2 = alloc(pool, 6)
    assert again.batch_get_v1(keys, dst2) == [True] * 6
    assert sglang_env.page_bytes(pool, dst2) == written
    again.close()


@pytest.mark.parametrize(("kind", "layout"), [("mha", "layer_first"), ("mha", "page_first"), ("mla", "page_first")])
def test_legacy_interface_round_trip_with_flat_pages(kind, layout):
    """Without "interface_v1" SGLang copies pages out with get_data_page and back with
    set_from_flat_data_page around batch_set / batch_get: the same, through flat pages."""
    storage, pool = backend(["cpu://?size=16MiB"], mla=kind == "mla", layout=layout, interface_v1=0)
    keys = page_keys(3, seed=2)
    src = alloc(pool, 3)
    sglang_env.fill_random(pool, src, seed=2)
    written = sglang_env.page_bytes(pool, src)
    values = [pool.get_data_page(int(src[i * PAGE])) for i in range(3)]
    assert storage.batch_set(keys, values) is True
    assert storage.exists(keys[0]) and not storage.exists(page_keys(1, seed=8)[0])

    targets = [pool.get_dummy_flat_data_page() for _ in keys]
    got = storage.batch_get(keys, targets)
    assert all(g is not None for g in got)
    dst = alloc(pool, 3)
    for i, page in enumerate(got):
        pool.set_from_flat_data_page(int(dst[i * PAGE]), page)
    assert sglang_env.page_bytes(pool, dst) == written
    # single-key forms
    one = storage.get(keys[1], pool.get_dummy_flat_data_page())
    assert torch.equal(one.view(torch.int16), values[1].view(torch.int16))
    assert storage.set(page_keys(1, seed=7)[0], values[2]) is True
    assert storage.get(page_keys(1, seed=6)[0]) is None
    storage.close()


@pytest.mark.parametrize(("kind", "src_layout", "dst_layout"), [
    ("mha", "page_first", "layer_first"),
    ("mha", "layer_first", "page_first"),
    ("mla", "page_first", "layer_first"),
])  # fmt: skip
def test_a_page_written_from_one_layout_reads_back_into_another(tmp_path, kind, src_layout, dst_layout):
    url = f"file://{tmp_path}/l3?size=64MiB"
    writer, wpool = backend([url], mla=kind == "mla", layout=src_layout)
    keys = page_keys(4, seed=3)
    src = alloc(wpool, 4)
    sglang_env.fill_random(wpool, src, seed=3)
    assert all(writer.batch_set_v1(keys, src))
    writer.close()

    reader, rpool = backend([url], mla=kind == "mla", layout=dst_layout)
    dst = alloc(rpool, 4)
    assert reader.batch_get_v1(keys, dst) == [True] * 4
    a, b = token_kv(wpool, src), token_kv(rpool, dst)
    assert a.shape == b.shape
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    reader.close()


# ------------------------------------------------------------------------------------------
# Every tier
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cache_server():
    server, port = create_server(ServerConfig(port=0, tiers=("cpu://?size=64MiB",)))
    yield f"grpc://127.0.0.1:{port}"
    server.stop(0)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("tier", ["cpu", "disk", "redis", "redis-cluster", "grpc", "s3"])
def test_every_tier_serves_as_the_l3(request, tmp_path, tier):
    url = {
        "cpu": lambda: "cpu://?size=16MiB",
        "disk": lambda: f"file://{tmp_path}/l3?size=64MiB",
        "redis": lambda: request.getfixturevalue("redis_server").url,
        "redis-cluster": lambda: request.getfixturevalue("redis_cluster").url,
        "grpc": lambda: request.getfixturevalue("cache_server"),
        "s3": lambda: request.getfixturevalue("s3_server").url(f"sglang-{tmp_path.name}", relist=0),
    }[tier]()
    for kind in ("mha", "mla"):
        storage, pool = backend([url], mla=kind == "mla")
        keys = page_keys(5, seed=hash(tier) % 1000 + (kind == "mla"))
        src = alloc(pool, 5)
        sglang_env.fill_random(pool, src, seed=4)
        assert all(storage.batch_set_v1(keys, src))
        storage.store.flush()
        assert storage.batch_exists(keys) == 5
        dst = alloc(pool, 5)
        assert storage.batch_get_v1(keys, dst) == [True] * 5
        assert sglang_env.page_bytes(pool, dst) == sglang_env.page_bytes(pool, src)
        storage.close()


def test_an_instance_loads_what_another_instances_sidecar_holds_through_peers(redis_server, tmp_path):
    """Two SGLang instances, each with its sidecar: the second reads the first's pages
    through a ``peers://`` tier (found in the fleet's index, with the peers' read-only
    token) into its own host pool, byte for byte; a peer's page of another model's layout
    is a miss there, and the second instance's saves never reach the first's sidecar."""
    import numpy as np

    from lmtier.kv.chunk import Chunk
    from lmtier.tiers.base import open_tier

    redis_server.call("FLUSHALL")
    writer, peer = "sgl-writer-secret-0123456", "sgl-peer-secret-012345678"
    servers = []
    for _ in range(2):
        port = _free_port()
        srv, _ = create_server(ServerConfig(port=port, tiers=("cpu://?size=64MiB",), shm_dir="",
                                            tokens=((writer, "fleet"),), peer_tokens=((peer, "fleet"),),
                                            peer_index=redis_server.url, advertise=f"127.0.0.1:{port}"))  # fmt: skip
        srv.address = f"127.0.0.1:{port}"
        servers.append(srv)
    members = ",".join(s.address for s in servers)

    def tiers(i: int) -> list[str]:
        own = servers[i].address
        return ["cpu://?size=16MiB", f"grpc://{own}?token={writer}&shm=off",
                f"peers://?index={redis_server.url}&members={members}&advertise={own}&token={peer}"
                "&tenant=fleet&timeout=2"]  # fmt: skip

    try:
        first, pool = backend(tiers(0))
        keys = page_keys(5, seed=31)
        src = alloc(pool, 5)
        sglang_env.fill_random(pool, src, seed=31)
        assert all(first.batch_set_v1(keys, src))
        first.store.flush()
        second, pool2 = backend(tiers(1), layout="layer_first")  # another host layout
        deadline = time.monotonic() + 10
        while second.batch_exists(keys) < 5 and time.monotonic() < deadline:  # the sidecar announces
            time.sleep(0.05)
        dst = alloc(pool2, 5)
        assert second.batch_get_v1(keys, dst) == [True] * 5
        assert torch.equal(token_kv(pool, src).view(torch.int16), token_kv(pool2, dst).view(torch.int16))
        assert second.store.tiers[2].counts["hits"] == 5  # from the peer
        second.batch_set_v1(page_keys(2, seed=32), alloc(pool2, 2))
        second.store.flush()
        assert servers[0].service.store.tiers[0].stats()["chunks"] == 5  # nothing written to the holder

        # the holder's sidecar serves a chunk of another model's layout under a key the
        # second instance asks for: a miss there, nothing lands in its pool
        mla, _ = backend(["cpu://?size=16MiB"], mla=True)
        key = page_keys(1, seed=33)
        zeros = np.zeros(mla.layout.byte_shape(mla.namespace.chunk_tokens), np.uint8)
        foreign = Chunk(second._keys(key)[0], mla.layout, zeros, namespace=second.namespace.digest)
        planted = open_tier(f"grpc://{servers[0].address}?token={writer}&shm=off")
        planted.put([foreign])
        planted.close()
        deadline = time.monotonic() + 10
        while second.store.tiers[2].contains(second._keys(key)) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert second.store.tiers[2].contains(second._keys(key)) == 1  # the peer offers it
        assert second.batch_get_v1(key, alloc(pool2, 1)) == [False]
        mla.close()
        second.close()
        first.close()
    finally:
        for srv in servers:
            srv.stop(0)


# ------------------------------------------------------------------------------------------
# Namespaces, ranks, MLA's single writer
# ------------------------------------------------------------------------------------------
def test_pages_never_cross_models_ranks_or_salts(tmp_path):
    url = f"file://{tmp_path}/l3?size=64MiB"
    storage, pool = backend([url], tp_rank=0, tp_size=2)
    keys = page_keys(3, seed=5)
    src = alloc(pool, 3)
    sglang_env.fill_random(pool, src, seed=5)
    assert all(storage.batch_set_v1(keys, src))
    storage.store.flush()
    assert storage.batch_exists(keys) == 3
    for other in ({"model": "other-model"}, {"tp_rank": 1}, {"salt": "tenant-b"}):
        them, _ = backend([url], pool=pool, **{"tp_rank": 0, "tp_size": 2, **other})
        assert them.batch_exists(keys) == 0, other
        assert them.batch_get_v1(keys, alloc(pool, 3)) == [False] * 3
        them.close()
    storage.close()


def test_mla_rank_zero_writes_and_every_rank_reads(tmp_path):
    url = f"file://{tmp_path}/l3?size=64MiB"
    rank1, pool1 = backend([url], mla=True, tp_rank=1, tp_size=2)
    keys = page_keys(3, seed=6)
    src = alloc(pool1, 3)
    sglang_env.fill_random(pool1, src, seed=6)
    assert rank1.batch_set_v1(keys, src) == [True] * 3  # not its job: nothing is stored
    assert rank1.batch_exists(keys) == 0

    rank0, pool0 = backend([url], mla=True, tp_rank=0, tp_size=2)
    src0 = alloc(pool0, 3)
    sglang_env.fill_random(pool0, src0, seed=6)
    assert rank0.batch_set_v1(keys, src0) == [True] * 3
    rank0.store.flush()
    dst = alloc(pool1, 3)
    assert rank1.batch_exists(keys) == 3
    assert rank1.batch_get_v1(keys, dst) == [True] * 3
    assert sglang_env.page_bytes(pool1, dst) == sglang_env.page_bytes(pool0, src0)
    rank0.close()
    rank1.close()


# ------------------------------------------------------------------------------------------
# Damaged, missing, bad input: misses, never exceptions
# ------------------------------------------------------------------------------------------
def test_corrupted_or_missing_chunks_are_misses(tmp_path):
    root = tmp_path / "l3"
    storage, pool = backend([f"file://{root}?size=64MiB"])
    keys = page_keys(4, seed=7)
    src = alloc(pool, 4)
    sglang_env.fill_random(pool, src, seed=7)
    assert all(storage.batch_set_v1(keys, src))
    storage.store.flush()
    storage.close()

    # a fresh backend, so nothing is in memory: every read comes from the files
    storage, _ = backend([f"file://{root}?size=64MiB"], pool=pool)
    disk = storage.store.tiers[0]
    path, offset, length = disk.locate(storage._keys([keys[2]])[0])
    flip_byte(path, offset + length - 100, 0xFF)  # one payload byte
    dst = alloc(pool, 4)
    sglang_env.fill_random(pool, dst, seed=70)
    untouched = sglang_env.page_bytes(pool, dst)
    assert storage.batch_get_v1(keys, dst) == [True, True, False, False]
    got = sglang_env.page_bytes(pool, dst)
    assert got[:2] == sglang_env.page_bytes(pool, src)[:2]
    assert got[3] == untouched[3]  # nothing written past the damaged page
    assert storage.batch_exists(keys) == 2  # the damaged chunk is gone
    assert storage.get(keys[2]) is None

    path, offset, _ = disk.locate(storage._keys([keys[1]])[0])
    os.truncate(path, offset)  # its bytes (and what follows them) vanished
    assert storage.batch_get_v1(keys[:2], alloc(pool, 2)) == [True, False]
    storage.close()


def test_dead_tiers_and_bad_arguments_are_misses_not_exceptions(tmp_path):
    node = RedisServer(tmp_path / "redis")
    try:
        storage, pool = backend([node.url])
        keys = page_keys(2, seed=8)
        src = alloc(pool, 2)
        sglang_env.fill_random(pool, src, seed=8)
        assert all(storage.batch_set_v1(keys, src))
        node.kill()
        assert storage.batch_exists(keys) == 0
        assert storage.batch_get_v1(keys, alloc(pool, 2)) == [False, False]
        assert storage.batch_set_v1(keys, src) == [False, False]
        assert storage.batch_get(keys) == [None, None]
        storage.close()
    finally:
        node.stop()

    storage, pool = backend(["cpu://?size=16MiB"])
    keys = page_keys(2, seed=9)
    beyond = torch.arange(10**6, 10**6 + 2 * PAGE)
    assert storage.batch_set_v1(keys, beyond) == [False, False]
    assert storage.batch_get_v1(keys, beyond) == [False, False]
    assert storage.batch_set(keys, [torch.zeros(3)]) is False  # wrong count and size
    assert storage.batch_set(keys[:1], [torch.zeros(3, dtype=torch.bfloat16)]) is False
    assert storage.batch_get(keys[:1], [torch.zeros(3)]) == [None]
    assert storage.batch_exists([]) == 0 and storage.batch_get_v1([], beyond[:0]) == []
    storage.close()


def test_bad_configuration_is_refused_at_attach(tmp_path):
    with pytest.raises(ConfigError, match="unknown storage extra-config"):
        backend(["cpu://?size=16MiB"], colour="blue")
    with pytest.raises(ConfigError):
        backend(["nosuch://x"])
    with pytest.raises(ConfigError, match="min_tokens is not available under SGLang"):
        backend(["cpu://?size=16MiB"], save_policy="min_tokens", min_tokens=512)


def test_unregistered_backend_misses_and_stats(tmp_path):
    from sglang.srt.observability.metrics_collector import StorageMetrics

    from lmtier.connectors.sglang import LMTierStorage

    config = sglang_env.storage_config(mla=False, page_first=True, extra={"tiers": ["cpu://?size=1MiB"]})
    bare = LMTierStorage(config, {})
    assert bare.batch_exists(page_keys(2)) == 0
    assert bare.batch_get_v1(page_keys(2), torch.arange(8)) == [False, False]
    assert isinstance(bare.get_stats(), StorageMetrics)

    storage, pool = backend(["cpu://?size=16MiB"])
    keys = page_keys(3, seed=10)
    src = alloc(pool, 3)
    assert all(storage.batch_set_v1(keys, src))
    assert storage.batch_get_v1(keys, alloc(pool, 3)) == [True] * 3
    metrics = storage.get_stats()
    assert metrics.backup_pgs == [3] and metrics.prefetch_pgs == [3]
    assert storage.get_stats().prefetch_pgs == []  # since the last call
    counts = storage.stats()["pages"]
    assert counts["stored"] == 3 and counts["loaded"] == 3

    storage.clear()
    assert storage.batch_exists(keys) == 0
    storage.close()


def test_storage_metrics_keep_the_latest_samples_when_sglang_never_asks(monkeypatch):
    """Without --enable-storage-metrics SGLang never calls get_stats: the samples stay bounded."""
    from lmtier.connectors.sglang import storage as backend_module

    monkeypatch.setattr(backend_module, "METRIC_SAMPLES", 5)
    storage, pool = backend(["cpu://?size=16MiB"])
    keys = page_keys(2, seed=12)
    src, dst = alloc(pool, 2), alloc(pool, 2)
    for _ in range(12):
        assert all(storage.batch_set_v1(keys, src))
        assert storage.batch_get_v1(keys, dst) == [True, True]
    metrics = storage.get_stats()
    assert len(metrics.backup_pgs) == len(metrics.prefetch_pgs) == 5
    storage.close()


# ------------------------------------------------------------------------------------------
# Two processes
# ------------------------------------------------------------------------------------------
def run_worker(*args: str) -> list[dict]:
    """tests/sglang_worker.py's lines, one per job."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(HERE / "sglang_worker.py"), *args], capture_output=True, text=True, env=env, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


KINDS = ("mha", "mla")


@pytest.fixture(scope="module")
def two_processes(redis_server, tmp_path_factory):
    """One process stores pages of each kind through a disk tier and Redis; another, with
    another host layout, reads them back (two processes for both kinds: SGLang's import
    is most of their time)."""
    redis_server.call("FLUSHALL")
    tmp = tmp_path_factory.mktemp("pages")
    urls = {kind: f"file://{tmp}/{kind}?size=64MiB,{redis_server.url}" for kind in KINDS}
    wrote = run_worker("set", *(a for kind in KINDS for a in (urls[kind], kind, "page_first", "11")))
    read = run_worker("get", *(a for kind in KINDS for a in (urls[kind], kind, "layer_first", "11")))
    return dict(zip(KINDS, wrote, strict=True)), dict(zip(KINDS, read, strict=True))


@pytest.mark.parametrize("kind", KINDS)
def test_two_processes_share_pages(two_processes, kind):
    """One process stores pages through a disk tier and Redis; another, with another host
    layout, reads them through each tier alone."""
    wrote, read = (by_kind[kind] for by_kind in two_processes)
    assert wrote["results"] == [True] * 8
    assert [t["exists"] for t in read["tiers"]] == [8, 8]  # the disk, then Redis
    for tier in read["tiers"]:
        assert tier["exists"] == 8
        assert tier["results"] == [True] * 8
        assert tier["canonical_sha256"] == wrote["canonical_sha256"]

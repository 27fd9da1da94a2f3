"""Shared test vocabulary: small layouts, prompts with real keys and random KV bytes."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from lmtier.kv.chunk import Chunk
from lmtier.kv.keys import Namespace
from lmtier.kv.layout import KVLayout
from lmtier.testing.s3_server import S3_TEST_KEYS

# Helper modules whose asserts are the tests' own: pytest shows their values on failure.
pytest.register_assert_rewrite("manifests", "tier_contract")

# tests/gpu needs a CUDA device: `make gpu-check` runs it (LMTIER_GPU_CHECK=1); the CPU
# suite collects it only to keep it importable (test_gpu_check.py).
collect_ignore = [] if os.environ.get("LMTIER_GPU_CHECK") else ["gpu"]

# The tests' vLLM engines (lmtier.testing.engine.run_engine, in the tests and in the short
# benchmarks they run) are forked from one process per worker that imported vLLM once: a
# core's ten seconds saved per engine (lmtier/testing/enginefork.py). ENGINE_FORKS=0
# starts each fresh.
os.environ.setdefault("ENGINE_FORKS", "1")

# The keys of the suite's S3 servers (lmtier.testing.s3_server), where the AWS chain reads
# them: in this process, and so in every engine and server the tests start. Set, not
# defaulted: a developer's own AWS keys never reach a test.
os.environ.update(S3_TEST_KEYS)
os.environ.pop("AWS_SESSION_TOKEN", None)
os.environ.pop("AWS_PROFILE", None)

# The longest test files, longest first (the 30 slowest of a run say which): under
# `pytest -n N --dist loadfile` (make test, make check) each file goes whole to one worker,
# in collection order, so these start first and no worker is left alone with one at the end.
LONGEST_FIRST = (
    "test_demo_and_bench.py",
    "test_vllm_engine.py",
    "test_redis_cluster_ops.py",
    "test_vllm_pd_engines.py",
    "test_vllm_http.py",
    "test_vllm_stop.py",
    "test_vllm_hybrid.py",
    "test_vllm_config.py",
    "test_vllm_events.py",
    "test_sglang_backend.py",
    "test_imports.py",
    "test_server_load.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


# Seconds per test file and per worker (setup, call and teardown summed), printed after the
# 30 slowest tests: what LONGEST_FIRST and the suite's time budget are judged by.
_FILE_SECONDS: dict[str, float] = {}
_WORKER_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration
    node = getattr(report, "node", None)  # the worker that ran it, under pytest-xdist
    worker = getattr(getattr(node, "gateway", None), "id", "main")
    _WORKER_SECONDS[worker] = _WORKER_SECONDS.get(worker, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    if not _FILE_SECONDS:
        return
    write = terminalreporter.write_line
    terminalreporter.section("slowest 15 files")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:15]:
        write(f"{seconds:8.1f}s {path}")
    write("per worker: " + ", ".join(f"{w} {s:.0f}s" for w, s in sorted(_WORKER_SECONDS.items())))


# Small enough to make many chunks per test, large enough to span several pages.
SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16")
CHUNK_TOKENS = 16


class Prompt:
    """Token ids, their chunk keys under a namespace, and random KV bytes for them."""

    def __init__(self, namespace: Namespace, tokens: np.ndarray, seed: int) -> None:
        self.namespace = namespace
        self.tokens = tokens
        self.keys = namespace.keys(tokens)
        layout = namespace.layout
        rng = np.random.default_rng(seed)
        # [layers, kv_factor, tokens, row_bytes]: the canonical layout as bytes
        self.kv = rng.integers(0, 256, layout.byte_shape(len(tokens)), dtype=np.uint8)

    def chunks(self, start: int = 0, stop: int | None = None) -> list[Chunk]:
        size = self.namespace.chunk_tokens
        stop = len(self.keys) if stop is None else stop
        return [
            Chunk(
                self.keys[i],
                self.namespace.layout,
                self.kv[:, :, i * size : (i + 1) * size],
                namespace=self.namespace.digest,
            )
            for i in range(start, stop)
        ]

    def chunk_bytes(self, i: int) -> bytes:
        size = self.namespace.chunk_tokens
        return np.ascontiguousarray(self.kv[:, :, i * size : (i + 1) * size]).tobytes()


def make_namespace(layout: KVLayout = SMALL, chunk_tokens: int = CHUNK_TOKENS, **kw) -> Namespace:
    return Namespace(model=kw.pop("model", "test-model"), layout=layout, chunk_tokens=chunk_tokens, **kw)


def make_prompt(
    n_chunks: int,
    seed: int = 0,
    namespace: Namespace | None = None,
    shared_with: Prompt | None = None,
    shared_chunks: int = 0,
) -> Prompt:
    """A prompt of ``n_chunks`` full chunks; optionally sharing its first chunks with another."""
    namespace = namespace or make_namespace()
    rng = np.random.default_rng(seed + 1_000_000)
    tokens = rng.integers(0, 50_000, n_chunks * namespace.chunk_tokens).astype(np.int32)
    if shared_with is not None:
        n = shared_chunks * namespace.chunk_tokens
        tokens[:n] = shared_with.tokens[:n]
    prompt = Prompt(namespace, tokens, seed)
    if shared_with is not None:
        prompt.kv[:, :, :n] = shared_with.kv[:, :, :n]
    return prompt


@pytest.fixture
def prompt() -> Prompt:
    return make_prompt(8)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real redis-server for a test module (each test flushes what it needs)."""
    from lmtier.testing.redis_server import RedisServer

    node = RedisServer(tmp_path_factory.mktemp("redis"))
    yield node
    node.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """A real three-master Redis Cluster for a test module."""
    from lmtier.testing.redis_cluster import RedisCluster

    cluster = RedisCluster(tmp_path_factory.mktemp("cluster"))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def s3_server(request, tmp_path_factory):
    """A real S3-compatible store for a test module (parametrize it ``indirect`` for rclone's
    dialect too). Its keys are the suite's own, set in the environment above."""
    from lmtier.testing.s3_server import S3Server

    kind = getattr(request, "param", "seaweedfs")
    server = S3Server.start(tmp_path_factory.mktemp(kind), kind=kind)
    yield server
    server.stop()


def assert_served_then_promoted(store, hot, p: Prompt) -> None:
    """``store.get`` hands back every chunk of ``p`` as it was stored, and the background
    promotion then puts them all in ``hot``, the faster tier."""
    from lmtier.kv.chunk import release_all

    chunks = store.get(p.keys)
    assert [c.tobytes() for c in chunks] == [p.chunk_bytes(i) for i in range(len(p.keys))]
    release_all(chunks)
    assert store.flush()  # promotion runs in the background
    assert hot.contains(p.keys) == len(p.keys)


def eventually(condition, seconds: float = 30.0) -> bool:
    """Whether ``condition()`` turns true within ``seconds`` (polled every 0.1 s)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "100"))  # `make fuzz` raises it


def fuzz(scale: int = 1) -> settings:
    """Hypothesis settings for a fuzzing target: ``scale`` x FUZZ_EXAMPLES examples, no
    per-example deadline (a shared 2-core machine: time per example is not the point)."""
    return settings(
        max_examples=FUZZ_EXAMPLES * scale,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )


def disk_frames(directory) -> dict[bytes, tuple[str, int, int]]:
    """Every chunk frame of a disk tier's directory: key -> (segment path, offset, length)."""
    from lmtier.tiers.disk import DiskTier

    tier = DiskTier(directory, size=1 << 50)
    try:
        listed = tier.keys(b"")  # a tier's listing, not a dict's keys
        return {key: tier.locate(key) for key in listed}
    finally:
        tier.close()


def flip_byte(path, offset: int, mask: int = 0x01) -> None:
    """Damage one byte of a file in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))

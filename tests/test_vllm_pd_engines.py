"""Prefill/decode disaggregation with real engines side by side: a producer and a consumer
``vllm serve`` (CPU build) kept up together, over a real Redis, a real ``lmtier serve``
and a real object store (SeaweedFS), driven through the reference proxy
(``lmtier.demo.pd_proxy``) by a real HTTP client, both ways routers work (parameters
forwarded or not); the server and the object store as one fleet's two shared tiers, the
second carrying the hand-offs once the first is gone.

For every prompt length at the boundaries (block - 1, block, block + 1, a chunk, a chunk
+ 1, chunk multiples, a tail) the decode instance's cached tokens cover the prompt up to
its partial tail (lmtier stores whole chunks; the engine computes the rest and at least
the last token), and its answer equals the decode instance's own prefix-cache hit bit for
bit where both cached as many tokens, and a full prefill by greedy tokens.

Then, on the Redis pair: the producer's writes slowed by 0.3 s (a TCP link that holds its
bytes), a hand-off whose chunks arrive past the decode instance's deadline, two requests
for one prompt at once, a consumer that computes a prompt no producer saw, the producer
killed after it answered, Redis stopped."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from lmtier.demo.pd_proxy import PDProxy
from lmtier.testing.cache_server import ServerProcess
from lmtier.testing.engine import compare_answers
from lmtier.testing.s3_server import S3Server
from lmtier.testing.slow_link import SlowLink
from lmtier.testing.tinymodel import build
from lmtier.testing.vllm_serve import BLOCK, CHUNK, VllmServer

from conftest import eventually

pytestmark = pytest.mark.engine  # every test here starts vLLM engines: `make check` leaves them out

LENGTHS = (BLOCK - 1, BLOCK, BLOCK + 1, CHUNK, CHUNK + 1, 3 * CHUNK, 3 * CHUNK + 65)
GRPC_LENGTHS = (BLOCK + 1, CHUNK + 1, 3 * CHUNK)


def prompt(length: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(5, 500, length)]


def expected_cached(length: int) -> int:
    """What the decode instance loads: whole chunks, never past the last whole block
    before the last token (the engine computes that token)."""
    return min(length // CHUNK * CHUNK, (length - 1) // BLOCK * BLOCK)


def side_by_side(model: str, tmp_path, producer_tiers: list[str], consumer_tiers: list[str], name: str):
    """The producer and the consumer, started together and both kept up, each with its
    worker in the engine core's process (as on one GPU)."""
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(
            VllmServer, model, None, tmp_path / f"{name}-prefill.log", tiers=producer_tiers, role="kv_producer",
            handoff_timeout=30, worker_in_core=True,
        )  # fmt: skip
        d = pool.submit(
            VllmServer, model, None, tmp_path / f"{name}-decode.log", tiers=consumer_tiers, role="kv_consumer",
            handoff_timeout=2, worker_in_core=True,
        )  # fmt: skip
        return p.result(), d.result()


def check_lengths(model, producer, decode, lengths, seed) -> None:
    """Every boundary length through the proxy, both router contracts."""
    got, hits, full = [], [], []
    for forward in (False, True):
        with PDProxy(producer.url, decode.url, forward=forward) as proxy:
            for i, length in enumerate(lengths):
                p = prompt(length, seed + 100 * forward + i)
                answer = decode.complete(model, p, base=proxy.url)
                assert answer["cached"] == expected_cached(length), (forward, length, answer["cached"])
                got.append(answer)
                hits.append(decode.complete(model, p))  # the decode instance's own prefix cache
                full.append(producer.complete(model, p, cache_salt=uuid.uuid4().hex))  # a full prefill
            assert proxy.prefills == len(lengths) and proxy.failed_prefills == 0
    problems, exact = compare_answers(got, hits, full)
    assert not problems, problems
    assert exact >= len(lengths)  # wherever lmtier's hit and vLLM's own are the same tokens


@pytest.mark.timeout(2400)
def test_prefill_and_decode_instances_over_redis(tmp_path, redis_server):
    model = str(build(tmp_path / "model"))
    redis_server.call("FLUSHALL")
    link = SlowLink(redis_server.port)
    slow_redis = f"redis://127.0.0.1:{link.port}"
    producer, decode = side_by_side(model, tmp_path, ["cpu://?size=256MiB", slow_redis], [redis_server.url], "redis")
    try:
        check_lengths(model, producer, decode, LENGTHS, seed=1000)

        # The producer's writes slowed: the answer still means the KV is readable.
        link.delay = 0.3
        for forward in (False, True):
            with PDProxy(producer.url, decode.url, forward=forward) as proxy:
                p = prompt(449, 2000 + forward)
                assert decode.complete(model, p, base=proxy.url)["cached"] == 384, forward

        # Past the decode instance's deadline (2 s): it recomputes, and answers correctly.
        link.delay = 3.0
        p = prompt(449, 2100)
        with PDProxy(producer.url, decode.url, forward=True) as proxy:
            late = decode.complete(model, p, base=proxy.url)
        link.delay = 0.0
        assert late["cached"] < 384
        full = producer.complete(model, p, cache_salt=uuid.uuid4().hex)
        problems, _ = compare_answers([late], [full], [full])
        assert not problems, problems

        # Two requests for one prompt at once.
        p = prompt(449, 2200)
        with PDProxy(producer.url, decode.url, forward=True) as proxy, ThreadPoolExecutor(2) as pool:
            both = list(pool.map(lambda _: decode.complete(model, p, base=proxy.url), range(2)))
        full = producer.complete(model, p, cache_salt=uuid.uuid4().hex)
        problems, _ = compare_answers(both, [full, full], [full, full])
        assert not problems, problems

        # A consumer stores nothing; a producer never loads.
        keys = int(redis_server.call("DBSIZE"))
        decode.complete(model, prompt(449, 2300))
        assert int(redis_server.call("DBSIZE")) == keys
        assert producer.metric("vllm:external_prefix_cache_hits_total") == 0

        # The producer killed right after it answered: its KV is the shared tier's.
        p = prompt(449, 2400)
        reference = decode.complete(model, p, cache_salt=uuid.uuid4().hex)  # (cache_salt: its own, apart)
        producer.complete(model, p, max_tokens=1)  # the prefill, as the proxy asks for it
        producer.kill(signal.SIGKILL)
        after = decode.complete(model, p)
        assert after["cached"] == 384
        problems, _ = compare_answers([after], [reference], [reference])
        assert not problems, problems

        # Redis stopped: the decode instance computes, answers correctly, does not hang.
        p = prompt(449, 2500)
        reference = decode.complete(model, p, cache_salt=uuid.uuid4().hex)
        redis_server.stop()
        down = decode.complete(model, p, cache_salt=uuid.uuid4().hex)
        assert down["cached"] == 0
        problems, _ = compare_answers([down], [reference], [reference])
        assert not problems, problems
    finally:
        for server in (producer, decode):
            server.stop()
        link.close()
        if redis_server.proc.poll() is not None:
            redis_server.start()


@pytest.mark.timeout(2400)
def test_prefill_and_decode_instances_over_the_cache_server_then_the_object_store_behind_it(tmp_path):
    """A fleet with a fast shared tier and a durable one behind it: both instances name
    the cache server first and an object store (SeaweedFS) after it. The hand-off goes
    through the server; once the server is gone, through the object store, with every
    answer still right."""
    model = str(build(tmp_path / "model"))
    server = ServerProcess(tmp_path, "--tier", "cpu://?size=512MiB")
    s3 = S3Server.start(tmp_path / "s3")
    tier, store = f"grpc://{server.address}", s3.url("pd", size="1GiB")
    producer, decode = side_by_side(model, tmp_path, ["cpu://?size=256MiB", tier, store], [tier, store], "grpc")
    try:
        check_lengths(model, producer, decode, GRPC_LENGTHS, seed=3000)
        # Where users look: the hand-offs on the decode instance's own /metrics (vLLM's),
        # and the decode instance's loads in the server's counts, the ones it read straight
        # from the server's published memory on this host included.
        assert eventually(lambda: decode.metric("vllm:lmtier_handoffs_total", result="ready") >= 1)
        assert decode.metric("vllm:lmtier_handoffs_total", result="late") == 0

        def memory() -> dict:
            out = subprocess.run([sys.executable, "-m", "lmtier", "stats", "--server", tier, "--json"],
                                 capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
            return json.loads(out.stdout)["tiers"][0]["counters"]

        loaded = decode.metric("vllm:lmtier_tier_reads_total", result="hits")
        assert loaded > 0 and eventually(lambda: memory()["hits"] >= loaded)
        assert memory()["directory_reads"] > 0
        # the producer wrote through to the object store too, as requests a bill counts
        assert producer.metric("vllm:lmtier_object_store_requests_total", kind="put") > 0
        gets = decode.metric("vllm:lmtier_object_store_requests_total", kind="get")

        server.stop()  # the fast tier gone: the object store carries the hand-offs
        check_lengths(model, producer, decode, GRPC_LENGTHS, seed=5000)
        assert decode.metric("vllm:lmtier_object_store_requests_total", kind="get") > gets
        assert decode.metric("vllm:lmtier_handoffs_total", result="late") == 0
    finally:
        for s in (producer, decode):
            s.stop()
        server.stop()
        s3.stop()


def multi(role: str, tiers: list[str], storage, **extra) -> dict:
    """vLLM's MultiConnector: lmtier in ``role`` first, vLLM's ExampleConnector (a shared
    directory) beside it."""
    return {
        "kv_connector": "MultiConnector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "LMTierConnector",
                    "kv_connector_module_path": "lmtier.connectors.vllm",
                    "kv_role": role,
                    "kv_connector_extra_config": {"tiers": tiers, "chunk_tokens": CHUNK, **extra},
                },
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(storage)},
                },
            ]
        },
    }


@pytest.mark.timeout(1800)
def test_inside_vllms_multiconnector_beside_another_connector(tmp_path, redis_server):
    """lmtier's kv_transfer_params pass through MultiConnector without a clash (the proxy
    forwards them), its hand-off still waits there, and a hit from either connector
    answers correctly: lmtier's (listed first), and the other's once Redis has lost the
    prompt."""
    model = str(build(tmp_path / "model"))
    redis_server.call("FLUSHALL")
    storage = tmp_path / "example-storage"
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(
            VllmServer, model, None, tmp_path / "multi-prefill.log",
            transfer=multi("kv_producer", ["cpu://?size=256MiB", redis_server.url], storage, handoff_timeout=30),
            worker_in_core=True,
        )  # fmt: skip
        d = pool.submit(
            VllmServer, model, None, tmp_path / "multi-decode.log",
            transfer=multi("kv_consumer", [redis_server.url], storage, handoff_timeout=5), worker_in_core=True,
        )  # fmt: skip
        producer, decode = p.result(), d.result()
    try:
        got, full = [], []
        with PDProxy(producer.url, decode.url, forward=True) as proxy:
            p1 = prompt(449, 4000)
            got.append(decode.complete(model, p1, base=proxy.url))
            assert got[-1]["cached"] == 384  # lmtier's hit, through MultiConnector
            full.append(producer.complete(model, p1, cache_salt=uuid.uuid4().hex))
            assert proxy.failed_prefills == 0
        p2 = prompt(449, 4001)
        producer.complete(model, p2, max_tokens=1)  # the prefill: both connectors store it
        redis_server.call("FLUSHALL")  # lmtier has lost it; the other connector has not
        asked = [*p2, 7]  # ExampleConnector finds a prompt by all but its last token (the prefill's)
        got.append(decode.complete(model, asked))
        assert got[-1]["cached"] == 448  # the other connector's hit (whole blocks before the last token)
        full.append(producer.complete(model, asked, cache_salt=uuid.uuid4().hex))
        problems, _ = compare_answers(got, full, full)
        assert not problems, problems
    finally:
        producer.stop()
        decode.stop()

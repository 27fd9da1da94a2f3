"""The fleet's memory as one cache, with parts nobody here wrote: two real ``vllm serve``
instances (CPU build) kept up side by side, each with its own sidecar (``lmtier serve``)
that announces what it holds in the fleet's index (a real redis-server) and lets the
other instance read it with a peer's read-only token; ``vllm-router`` (the prebuilt
binary from the package index) in front of them.

- Found by lmtier: a prompt one instance computed is loaded by the other from the
  holder's sidecar, with no shared tier at all, and answers as the holder's own
  prefix-cache hit does, bit for bit.
- The router's prefill/decode mode: the prompt goes to one instance with ``max_tokens=1``,
  its ``kv_transfer_params`` (lmtier's hand-off and ``remote_kv_source``, its sidecar) go
  verbatim to the other, which pulls the prompt from that sidecar.
- The router's ``kv_aware`` policy fed by both instances' KV event streams: lmtier's
  memory tier is announced as the instance's host memory (in the engine's blocks, which
  the router counts in), and a repeated prefix that vLLM's own cache has let go goes to
  the instance whose lmtier still holds it.
"""

from __future__ import annotations

import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from vllm.distributed.kv_events import BlockStored

from lmtier.testing.cache_server import ServerProcess
from lmtier.testing.redis_server import RedisServer, free_port
from lmtier.testing.router import Router
from lmtier.testing.tinymodel import build
from lmtier.testing.vllm_serve import BLOCK, CHUNK, VllmServer

from test_vllm_events import Subscriber

pytestmark = pytest.mark.engine

WRITER, PEER = "fleet-writer-token-0123456789", "fleet-peer-token-0123456789"


def prompt(length: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(5, 500, length)]


class Fleet:
    """Redis, two sidecars, two engines (each with its own sidecar and the other's as a
    peer), their KV event streams."""

    def __init__(self, tmp) -> None:
        self.model = str(build(tmp / "model"))
        self.redis = RedisServer(tmp)
        (tmp / "tokens").write_text(f"{WRITER}=fleet\n")
        (tmp / "peers").write_text(f"{PEER}=fleet\n")
        os.chmod(tmp / "tokens", 0o600)
        os.chmod(tmp / "peers", 0o600)
        ports = [free_port(), free_port()]
        members = ",".join(f"127.0.0.1:{p}" for p in ports)
        flags = ["--tier", "cpu://?size=256MiB", "--token-file", str(tmp / "tokens"),
                 "--peer-token-file", str(tmp / "peers"), "--peer-index", self.redis.url]  # fmt: skip
        self.sidecars = [ServerProcess(tmp, *flags, "--advertise", f"127.0.0.1:{p}", port=p) for p in ports]
        self.events = [free_port(), free_port()]

        def engine(i: int) -> VllmServer:
            tiers = [
                "cpu://?size=64MiB",
                f"grpc://127.0.0.1:{ports[i]}?token={WRITER}",
                f"peers://?index={self.redis.url}&members={members}&advertise=127.0.0.1:{ports[i]}&token={PEER}"
                "&tenant=fleet&timeout=5",
            ]
            events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.events[i]}",
                      "topic": ""}  # fmt: skip
            args = ("--kv-events-config", json.dumps(events), "--num-gpu-blocks-override", "40")
            return VllmServer(self.model, None, tmp / f"engine-{i}.log", tiers=tiers, handoff_timeout=30, args=args,
                              event_relay=self.redis.url)  # fmt: skip

        with ThreadPoolExecutor(2) as pool:
            self.engines = list(pool.map(engine, range(2)))

    def reads(self, i: int, tier: str) -> float:
        return self.engines[i].metric("vllm:lmtier_tier_reads_total", tier=tier, result="hits")

    def stop(self) -> None:
        for e in self.engines:
            e.stop()
        for s in self.sidecars:
            s.stop()
        self.redis.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    fleet = Fleet(tmp_path_factory.mktemp("fleet"))
    yield fleet
    fleet.stop()


def test_an_instance_loads_a_prompt_another_computed_from_that_ones_sidecar(fleet):
    a, b = fleet.engines
    p = prompt(3 * CHUNK + 40, seed=1)
    first = a.complete(fleet.model, p)
    assert first["cached"] == 0
    held = a.complete(fleet.model, p)  # the holder's own prefix-cache hit: the reference
    time.sleep(1.0)  # the sidecar announces what it stored within a fraction of a second
    got = b.complete(fleet.model, p)
    assert got["cached"] == 3 * CHUNK  # whole chunks, from the peer
    assert fleet.reads(1, "peers") >= 3
    assert (got["tokens"], got["logprobs"]) == (held["tokens"], held["logprobs"])  # bit for bit
    # the chunks it loaded now live in its own tiers: asked again, no peer is needed
    peer_reads = fleet.reads(1, "peers")
    again = b.complete(fleet.model, p)
    assert again["tokens"] == held["tokens"] and fleet.reads(1, "peers") == peer_reads


def test_vllm_routers_prefill_decode_mode_pulls_the_prompt_from_the_prefill_instances_sidecar(fleet, tmp_path):
    a, b = fleet.engines
    router = Router(tmp_path / "router.log", "--vllm-pd-disaggregation", "--prefill", a.url, "--decode", b.url,
                    "--policy", "round_robin")  # fmt: skip
    try:
        p = prompt(2 * CHUNK + BLOCK + 7, seed=2)
        before = fleet.reads(1, "peers")
        body = {"model": fleet.model, "prompt": p, "max_tokens": 8, "temperature": 0, "logprobs": 2}
        answer = router.post("/v1/completions", body)
        routed = answer["choices"][0]["logprobs"]
        assert fleet.reads(1, "peers") - before >= 2  # the decode instance pulled both chunks
        direct = a.complete(fleet.model, p)  # the prefill instance's own prefix-cache hit
        assert routed["tokens"] == direct["tokens"]
    finally:
        router.stop()


def kv_aware(fleet, log, *flags: str) -> Router:
    a, b = fleet.engines
    sources = [f"{e.url}=tcp://127.0.0.1:{port}" for e, port in zip(fleet.engines, fleet.events, strict=True)]
    return Router(log, "--worker-urls", a.url, b.url, "--policy", "kv_aware", "--kv-event-source", sources[0],
                  "--kv-event-source", sources[1], "--kv-event-block-size", str(BLOCK), "--kv-event-model",
                  fleet.model, *flags)  # fmt: skip


def served(fleet) -> list[float]:
    return [e.metric("vllm:request_success_total") for e in fleet.engines]


def decisions(log) -> list[tuple[str, int]]:
    """The router's KV prefix decisions from its debug log: (worker, credited prefix tokens)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text())
    found = re.findall(r'KV prefix decision .*?worker="?([^" ]+)"? .*?credited_prefix_tokens=(\d+)', text)
    return [(worker, int(tokens)) for worker, tokens in found]


def test_vllm_routers_kv_aware_policy_credits_lmtiers_memory_as_host_memory_and_sends_the_prefix_there(fleet, tmp_path):
    """vLLM's own cache forgets a prompt (other prompts take its blocks); lmtier's memory
    tier still holds it and says so in the instance's event stream, as host memory. The
    router credits it at its host rate (0.8 of the prefix) and sends a repeat of the prefix
    to the holder, which loads it from lmtier."""
    log = tmp_path / "router.log"
    router = kv_aware(fleet, log, "--log-level", "debug")
    try:
        p = prompt(4 * CHUNK + 10, seed=3)
        before = served(fleet)
        router.post("/v1/completions", {"model": fleet.model, "prompt": p, "max_tokens": 1, "temperature": 0})
        after = served(fleet)
        holder = next(i for i in range(2) if after[i] > before[i])
        engine = fleet.engines[holder]
        for seed in range(3):  # vLLM's cache (40 blocks) evicts the prompt's 9 for these
            engine.complete(fleet.model, prompt(15 * BLOCK, seed=100 + seed), max_tokens=1)
        time.sleep(1.0)  # the events reach the router
        memory_reads = fleet.reads(holder, "cpu")
        again = router.post("/v1/completions", {"model": fleet.model, "prompt": p[: 4 * CHUNK] + prompt(20, seed=4),
                                                "max_tokens": 1, "temperature": 0})  # fmt: skip
        assert served(fleet)[holder] == after[holder] + 4  # the three fillers and the repeat
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * CHUNK
        assert fleet.reads(holder, "cpu") - memory_reads >= 4  # from lmtier's memory, not vLLM's cache
    finally:
        router.stop()
    worker, credited = decisions(log)[-1]
    assert worker == engine.url and credited == int(0.8 * 4 * CHUNK)  # the host rate, not 0.6 external


def test_a_chunk_in_a_shared_tier_is_credited_to_every_instance_that_can_load_it(fleet, tmp_path):
    """Instance 0 computes a prompt: its chunks land in its sidecar, which instance 1 reads
    as a peer. Instance 1's event stream announces them too (relayed through the fleet's
    Redis), so a router that knows only instance 1 credits it with the prefix (at its
    external rate) and instance 1 loads it."""
    a, b = fleet.engines
    log = tmp_path / "router.log"
    source = f"{b.url}=tcp://127.0.0.1:{fleet.events[1]}"
    flags = ["--kv-event-block-size", str(BLOCK), "--kv-event-model", fleet.model, "--log-level", "debug"]
    router = Router(log, "--worker-urls", b.url, "--policy", "kv_aware", "--kv-event-source", source, *flags)
    events = Subscriber(fleet.events[1], topic=b"")
    try:
        time.sleep(1.0)  # subscribed
        p = prompt(4 * CHUNK + 10, seed=5)
        a.complete(fleet.model, p, max_tokens=1)
        # the relay carries instance 0's events to instance 1, which announces them at its
        # next step: steps until its stream (which the router reads too) names p's chunks
        deadline, step = time.monotonic() + 120, 0
        while not any(isinstance(e, BlockStored) and list(e.token_ids[:BLOCK]) == p[:BLOCK] for e in events.events()):
            assert time.monotonic() < deadline, "instance 1 never announced instance 0's chunks"
            b.complete(fleet.model, prompt(70, seed=600 + step), max_tokens=1)
            step += 1
            time.sleep(0.5)
        time.sleep(1.0)  # the router has read what this subscriber read
        answer = router.post("/v1/completions", {"model": fleet.model, "prompt": p[: 4 * CHUNK] + prompt(20, seed=7),
                                                 "max_tokens": 1, "temperature": 0})  # fmt: skip
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * CHUNK  # from instance 0's sidecar
    finally:
        router.stop()
        events.close()
    worker, credited = decisions(log)[-1]
    assert worker == b.url and credited == int(0.6 * 4 * CHUNK)  # a shared tier's chunk: the external rate

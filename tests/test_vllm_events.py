"""lmtier's tiers in vLLM's KV event stream: real engines with ``KVEventsConfig`` (ZMQ),
a real subscriber decoding every batch with vLLM's own event classes, a real cache server
as the tier two instances share.

Instance A stores a prompt (memory and the shared server), then a larger one that evicts
it from its small memory tier; instance B, a second engine, reads the prompt back from
the shared server and stores one chunk more. What the stream must say: each stored
chunk's tokens (rebuilding the prompt's full chunks), the evictions, the shared tier
marked shared alike from both instances, and never a block size the tiers cannot serve.
"""

from __future__ import annotations

import threading
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from lmtier.testing.cache_server import ServerProcess
from lmtier.testing.engine import run_engine
from lmtier.testing.redis_server import free_port
from lmtier.testing.tinymodel import build

pytestmark = pytest.mark.engine  # every test here starts vLLM engines: `make check` leaves them out

CHUNK, BLOCK = 128, 64
PER = CHUNK // BLOCK  # engine blocks per chunk: the events count in the engine's blocks
CHUNK_BYTES = 4 * 2 * 256 * CHUNK  # the tiny model: layers x kv heads x 256 bytes per token
OFF = {"lmtier": {"load": False, "save": False}}


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(5, 500, n)]


class Subscriber:
    """vLLM's KV event stream, as a router reads it: every batch, decoded."""

    def __init__(self, port: int, topic: bytes = b"kv") -> None:
        self.batches: list[KVEventBatch] = []
        self._stop = threading.Event()
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.connect(f"tcp://127.0.0.1:{port}")
        self._socket.setsockopt(zmq.SUBSCRIBE, topic)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(100):
                _topic, _seq, payload = self._socket.recv_multipart()
                self.batches.append(self._decoder.decode(payload))

    def events(self) -> list:
        """Every event decoded so far."""
        return [e for b in list(self.batches) for e in b.events]

    def close(self) -> list:
        self._stop.set()
        self._thread.join()
        self._socket.close(linger=0)
        return [e for b in self.batches for e in b.events]


def instance(tmp: Path, model: str, name: str, server: ServerProcess, phases: list) -> list:
    """One engine over ``phases`` (each followed by a step that publishes what landed); the
    events lmtier published for it."""
    port = free_port()
    subscriber = Subscriber(port)
    tick = {"prompts": [ids(20, 99)], "max_tokens": 1, "request": OFF}
    steps = []
    for phase in phases:
        steps += [{**phase, "settle": True}, {**tick, "name": f"{phase['name']}:tick"}]
    spec = {
        "model": model,
        "block_size": BLOCK,
        "kv_events": f"tcp://*:{port}",
        "lmtier": {"tiers": [f"cpu://?size={4 * CHUNK_BYTES}", f"grpc://{server.address}"], "chunk_tokens": CHUNK},
        "phases": steps,
    }
    try:
        run_engine(spec, tmp, name, timeout=600)
    finally:
        events = subscriber.close()
    # vLLM's own GPU events aside: lmtier's are of its tiers' media, in chunks
    return [e for e in events if getattr(e, "medium", None) in ("CPU", "STORAGE")]


def stored(events: list, locality: str) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored) and e.locality == locality]


def hashes(events: list) -> list[bytes]:
    return [h for e in events for h in e.block_hashes]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(build(tmp_path_factory.mktemp("model")))


def test_events_describe_what_lands_in_and_leaves_each_tier(tmp_path, model):
    first, big = ids(3 * CHUNK + 50, 1), ids(5 * CHUNK + 10, 2)
    server = ServerProcess(tmp_path, "--tier", "cpu://?size=64MiB")
    try:
        phases_a = [{"name": "first", "prompts": [first]}, {"name": "big", "prompts": [big]}]
        a = instance(tmp_path, model, "a", server, phases_a)
        again = first[: 3 * CHUNK] + ids(CHUNK + 5, 3)
        b = instance(tmp_path, model, "b", server, [{"name": "again", "prompts": [again]}])
    finally:
        server.stop()

    for e in a + b:  # whole chunks only, in the engine's blocks (a router counts in those)
        if isinstance(e, BlockStored):
            assert e.block_size == BLOCK and len(e.token_ids) == BLOCK * len(e.block_hashes), e
            assert len(e.block_hashes) % PER == 0, e

    # A, memory: the first prompt's three full chunks, rebuilt from the events' tokens alone
    local = stored(a, "LOCAL")
    # this instance's own host memory: no owner (routers credit it to this stream's instance)
    assert {e.medium for e in local} == {"CPU"} and {e.ownership for e in local} == {None}
    first_event = local[0]
    assert first_event.token_ids == first[: 3 * CHUNK] and first_event.parent_block_hash is None
    first_keys = first_event.block_hashes
    assert len(first_keys) == 3 * PER and len(set(first_keys)) == 3 * PER
    # a chunk's blocks: its key and the block's place in it
    chunks = [first_keys[i : i + PER] for i in range(0, len(first_keys), PER)]
    assert all(len({h[:-2] for h in blocks}) == 1 for blocks in chunks)
    assert len({blocks[0][:-2] for blocks in chunks}) == 3

    # A, the shared server: the same chunks, marked as a tier every instance reaches
    shared_a = stored(a, "REMOTE")
    owner = f"lmtier:grpc://{server.address}"
    assert shared_a and {e.ownership for e in shared_a} == {owner} and {e.medium for e in shared_a} == {"CPU"}
    assert shared_a[0].block_hashes == first_keys and shared_a[0].token_ids == first[: 3 * CHUNK]

    # A, memory: the big prompt evicted the first one (four chunks fit)
    removed = [e for e in a if isinstance(e, BlockRemoved)]
    assert removed and {e.medium for e in removed} == {"CPU"} and {e.locality for e in removed} == {"LOCAL"}
    assert set(first_keys) <= set(hashes(removed))
    big_keys = hashes([e for e in local if e.token_ids[:CHUNK] == big[:CHUNK]])
    assert big_keys and not set(big_keys) & set(hashes(removed))  # only what left

    # B: the chunks it read from the shared server landed in its memory; the chunk it
    # computed went to both, chained to A's; its shared-tier events carry A's marking
    local_b, shared_b = stored(b, "LOCAL"), stored(b, "REMOTE")
    assert hashes(local_b)[: 3 * PER] == first_keys
    assert local_b[0].token_ids[: 3 * CHUNK] == first[: 3 * CHUNK]
    assert shared_b and {e.ownership for e in shared_b} == {owner}
    assert {e.ownership for e in local_b} == {None}  # B's memory: B's own stream's
    new = [e for e in shared_b if first_keys[-1] == e.parent_block_hash]
    assert new and new[0].block_hashes[0] not in first_keys
    assert not set(hashes(shared_b)) & set(first_keys)  # B never stored what the server held

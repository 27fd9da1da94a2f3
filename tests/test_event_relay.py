"""The event relay (connectors/vllm/relay.py) through a real redis-server: one instance's
shared-tier events reach the others of its model, never itself, never another model's;
what arrives is bounded and a malformed message is dropped. The router's side of it is in
tests/test_vllm_router.py."""

from __future__ import annotations

import time

import msgpack
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from lmtier.connectors.vllm.relay import QUEUE, EventRelay, channel

from conftest import eventually

OWNER = "lmtier:redis://cache:6379"


def stored(locality: str, key: bytes = b"k" * 18) -> BlockStored:
    return BlockStored(block_hashes=[key], parent_block_hash=None, token_ids=list(range(4)), block_size=4,
                       lora_id=None, medium="CPU", lora_name=None, group_idx=0, kv_cache_spec_kind=None,
                       kv_cache_spec_sliding_window=None, locality=locality, ownership=OWNER)  # fmt: skip


def test_shared_tier_events_reach_the_other_instances_of_the_model_only(redis_server):
    a, b = EventRelay(redis_server.url, b"model-a"), EventRelay(redis_server.url, b"model-a")
    other = EventRelay(redis_server.url, b"model-b")
    try:
        time.sleep(0.5)  # subscribed
        removed = BlockRemoved(block_hashes=[b"r" * 18], medium="CPU", group_idx=0, locality="REMOTE",
                               ownership="lmtier:redis://cache:6379")  # fmt: skip
        a.publish([stored("LOCAL", b"l" * 18), stored("REMOTE"), removed])  # its own memory stays its own
        got: list = []
        assert eventually(lambda: bool(got.extend(b.take()) or len(got) == 2), 5)
        assert got == [stored("REMOTE"), removed]
        assert a.take() == [] and other.take() == []  # not back to itself, not to another model
    finally:
        for relay in (a, b, other):
            relay.close()


def test_what_arrives_is_bounded_and_a_malformed_message_is_dropped(redis_server):
    import redis

    relay = EventRelay(redis_server.url, b"model-c")
    publisher = redis.Redis.from_url(redis_server.url)
    try:
        time.sleep(0.5)
        name = channel(b"model-c")
        publisher.publish(name, b"\xc1 not msgpack")
        publisher.publish(name, msgpack.packb([b"x" * 8, [["stored", {"locality": "LOCAL"}]]]))  # not shared
        publisher.publish(name, msgpack.packb([b"x" * 8, [["bogus", {"locality": "REMOTE"}]]]))
        assert eventually(lambda: relay.dropped == 3, 5)
        assert relay.take() == []
        sender = EventRelay(redis_server.url, b"model-c")
        sender.publish([stored("REMOTE", i.to_bytes(18, "big")) for i in range(QUEUE + 64)])  # in messages of 64
        assert eventually(lambda: relay.dropped == 3 + 64, 10)
        held = relay.take()
        assert len(held) == QUEUE and held[-1] == stored("REMOTE", (QUEUE + 63).to_bytes(18, "big"))  # the newest
        sender.close()
        # a value of a type vLLM's events do not carry is refused, not announced: one such
        # event would make vLLM's publisher drop the whole step's batch, this instance's own too
        bad = {"block_hashes": 7, "parent_block_hash": None, "token_ids": [], "block_size": "four", "medium": "CPU",
               "group_idx": 0, "kv_cache_spec_kind": None, "kv_cache_spec_sliding_window": None,
               "locality": "REMOTE", "ownership": None}  # fmt: skip
        publisher.publish(name, msgpack.packb([b"y" * 8, [["stored", bad]]]))
        stamp = msgpack.packb([b"y" * 8, [["removed", {"block_hashes": [msgpack.Timestamp(1)], "medium": "CPU",
                               "group_idx": 0, "locality": "REMOTE", "ownership": None}]]], datetime=False)  # fmt: skip
        publisher.publish(name, stamp)
        publisher.publish(name, b"\x91" * (300 << 10))  # over the size: not even decoded
        assert eventually(lambda: relay.dropped == 3 + 64 + 3, 5) and relay.take() == []
    finally:
        relay.close()
        publisher.close()

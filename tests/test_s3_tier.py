"""The object-storage tier against real S3-compatible servers: SeaweedFS (``weed mini``) and
rclone's S3 gateway (a second dialect), each started by the ``s3_server`` fixture."""

from __future__ import annotations

import logging
import os
import secrets
import threading

import numpy as np
import pytest

from lmtier.errors import ConfigError
from lmtier.kv import codec
from lmtier.kv.chunk import release_all
from lmtier.tiers.base import open_tier
from lmtier.tiers.s3 import S3Tier
from lmtier.tiers.s3.learn import Learner

from conftest import SMALL, eventually, make_namespace, make_prompt
from tier_contract import CHUNK_BYTES, EvictingTierContract

pytestmark = pytest.mark.parametrize("s3_server", ["seaweedfs", "rclone"], indirect=True)


def frame_bytes(chunk_bytes: int = CHUNK_BYTES) -> int:
    """An object's size for a chunk of ``chunk_bytes`` of payload (SMALL layout)."""
    prompt = make_prompt(1, namespace=make_namespace())
    return codec.encoded_size(prompt.chunks()[0]) - CHUNK_BYTES + chunk_bytes


def open_s3(server, prefix: str = "", **options) -> S3Tier:
    options.setdefault("relist", 0)
    return open_tier(server.url(prefix or f"t-{secrets.token_hex(4)}", **options))  # type: ignore[return-value]


def raw(tier: S3Tier, key: bytes) -> bytes:
    reply = tier.remote.get([tier._name(key)], [1 << 20], 64 << 20)[0]
    assert reply.ok, reply
    data = bytes(reply.body[: reply.length])
    tier._buffers.release(reply.body)
    return data


def overwrite(tier: S3Tier, key: bytes, data: bytes) -> None:
    assert tier.remote.put([(tier._name(key), [data], len(data))])[0].ok


class TestS3Tier(EvictingTierContract):
    @pytest.fixture(autouse=True)
    def _server(self, s3_server):
        self.server = s3_server

    def make_tier(self, capacity_chunks, chunk_bytes):
        return open_s3(self.server, size=capacity_chunks * frame_bytes(chunk_bytes))

    def corrupt(self, tier, key):
        data = bytearray(raw(tier, key))
        data[-1] ^= 0x01  # the payload's last byte
        overwrite(tier, key, bytes(data))


# -- what a bucket may hold that is not a chunk it can serve -------------------------------
def test_truncated_foreign_and_misplaced_objects_are_misses_and_deleted(s3_server, prompt):
    tier = open_s3(s3_server, max_object="1MiB")
    try:
        tier.put(prompt.chunks())
        overwrite(tier, prompt.keys[5], os.urandom(3 << 20))  # larger than any chunk: cut off, not read
        assert tier.get(prompt.keys[5:6]) == [None]
        frame = raw(tier, prompt.keys[0])
        overwrite(tier, prompt.keys[0], frame[: len(frame) // 2])  # a killed writer's half
        overwrite(tier, prompt.keys[1], b"not a chunk at all")  # another program's object
        overwrite(tier, prompt.keys[2], raw(tier, prompt.keys[3]))  # another key's frame
        overwrite(tier, prompt.keys[4], b"")  # an empty object
        got = tier.get(prompt.keys[:5])
        assert got[:3] == [None, None, None] and got[4] is None
        assert got[3] is not None and got[3].tobytes() == prompt.chunk_bytes(3)
        release_all(got)
        assert tier.stats()["corrupt"] == 5
        assert tier.remote.head([tier._name(k) for k in prompt.keys[:3]])[0].missing  # deleted
    finally:
        tier.close()


def test_a_payload_flipped_in_the_bucket_fails_its_check_when_read(s3_server, prompt):
    tier = open_s3(s3_server)
    try:
        tier.put(prompt.chunks(0, 1))
        data = bytearray(raw(tier, prompt.keys[0]))
        data[len(data) // 2] ^= 0x80
        overwrite(tier, prompt.keys[0], bytes(data))
        chunks = tier.get(prompt.keys[:1])
        with pytest.raises(Exception, match="checksum"):
            chunks[0].tobytes()
        release_all(chunks)
        assert eventually(lambda: tier.remote.head([tier._name(prompt.keys[0])])[0].missing, 10)
    finally:
        tier.close()


def test_the_same_key_written_by_two_writers_at_once_leaves_one_whole_frame(s3_server):
    prefix = f"race-{secrets.token_hex(4)}"
    a, b = open_s3(s3_server, prefix), open_s3(s3_server, prefix)
    one = make_prompt(4, seed=1)
    other = make_prompt(4, seed=1)
    other.kv = np.random.default_rng(9).integers(0, 256, other.kv.shape, dtype=np.uint8)  # same keys, other bytes
    try:
        for _ in range(3):
            threads = [threading.Thread(target=t.put, args=(p.chunks(),)) for t, p in ((a, one), (b, other))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            reader = open_s3(s3_server, prefix)
            got = reader.get(one.keys)
            for i, chunk in enumerate(got):
                assert chunk is not None
                assert chunk.tobytes() in (one.chunk_bytes(i), other.chunk_bytes(i))
            release_all(got)
            reader.close()
            a.delete(one.keys)
    finally:
        a.close()
        b.close()


# -- bound, restart, sharing -----------------------------------------------------------
def test_a_restarted_tier_learns_the_bucket_and_serves_it(s3_server):
    prefix = f"restart-{secrets.token_hex(4)}"
    first = open_s3(s3_server, prefix)
    prompts = [make_prompt(3, seed=s) for s in range(4)]
    for p in prompts:
        first.put(p.chunks())
    first.close()
    second = open_s3(s3_server, prefix)
    try:
        assert eventually(lambda: second.stats()["listings"] == 1, 20)
        stats = second.stats()
        assert stats["chunks"] == 12 and stats["used_bytes"] == 12 * frame_bytes()
        before = second.stats()["requests_head"]
        assert all(second.contains(p.keys) == 3 for p in prompts)
        assert second.stats()["requests_head"] == before  # known from the listing: no request
        got = second.get(prompts[2].keys)
        assert [c.tobytes() for c in got] == [prompts[2].chunk_bytes(i) for i in range(3)]
        release_all(got)
    finally:
        second.close()


def test_a_restart_with_a_smaller_size_deletes_the_oldest_down_to_it(s3_server):
    prefix = f"shrink-{secrets.token_hex(4)}"
    first = open_s3(s3_server, prefix)
    prompts = [make_prompt(2, seed=s) for s in range(5)]
    for p in prompts:
        first.put(p.chunks())
    first.close()
    smaller = open_s3(s3_server, prefix, size=4 * frame_bytes())
    try:
        assert eventually(lambda: smaller.stats()["listings"] == 1, 20)
        assert smaller.stats()["chunks"] <= 4
        listed = smaller.keys()
        assert len(listed) <= 4 and smaller.stats()["used_bytes"] <= 4 * frame_bytes()
    finally:
        smaller.close()


def test_a_second_instance_finds_what_the_first_stored_and_the_bound_is_shared(s3_server):
    prefix = f"shared-{secrets.token_hex(4)}"
    size = 6 * frame_bytes()
    a, b = open_s3(s3_server, prefix, size=size), open_s3(s3_server, prefix, size=size)
    try:
        p = make_prompt(4, seed=3)
        a.put(p.chunks())
        assert b.contains(p.keys) == 4  # HEADs: b has listed nothing of it
        got = b.get(p.keys)
        assert [c.tobytes() for c in got] == [p.chunk_bytes(i) for i in range(4)]
        release_all(got)
        b.put(make_prompt(4, seed=4).chunks())  # b knows a's 4 and its own 4: deletes down to 6
        assert len(b.keys()) <= 6
    finally:
        a.close()
        b.close()


def test_listings_that_lag_keep_what_was_just_written(s3_server):
    """A key a listing does not show yet is kept; gone from two listings, it is forgotten."""
    prefix = f"lag-{secrets.token_hex(4)}"
    tier = open_s3(s3_server, prefix)
    try:
        assert eventually(lambda: tier.stats()["listings"] == 1, 20)
        p = make_prompt(2, seed=5)
        tier.put(p.chunks())
        other = open_s3(s3_server, prefix)
        other.delete(p.keys[1:])  # another writer deletes one behind this tier's back
        other.close()
        tier.learner.step()  # one listing: the deleted key is not forgotten yet (it may lag)
        assert p.keys[1] in tier.held
        tier.learner.step()
        assert p.keys[1] not in tier.held and p.keys[0] in tier.held
    finally:
        tier.close()


# -- configuration ---------------------------------------------------------------------
def test_credentials_never_show_and_bad_urls_say_why(s3_server, caplog):
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    with pytest.raises(ConfigError, match="no credentials"):
        open_tier(f"s3://key:{secret}@bucket/p")
    with pytest.raises(ConfigError, match="part_size"):
        open_s3(s3_server, part_size="1MiB")
    with pytest.raises(ConfigError, match="addressing"):
        open_s3(s3_server, addressing="sideways")
    with pytest.raises(ConfigError, match="endpoint"):
        open_s3(s3_server, endpoint="ftp://host")
    with pytest.raises(ConfigError, match="no credentials") as refused:
        open_tier(f"s3://lmtier/p?endpoint=http://key:{secret}@127.0.0.1:{s3_server.port}")
    assert secret not in str(refused.value)
    with pytest.raises(ConfigError, match="unknown option") as unknown:
        open_s3(s3_server, aws_secret_access_key=secret)  # a mistake: refused, the value not shown
    assert secret not in str(unknown.value)
    caplog.set_level(logging.DEBUG)
    tier = open_s3(s3_server)
    try:
        tier.put(make_prompt(2).chunks())
        text = repr(tier.stats()) + caplog.text + repr(tier)
        assert secret not in text and os.environ["AWS_ACCESS_KEY_ID"] not in text
    finally:
        tier.close()


def test_a_chunk_larger_than_a_part_goes_up_in_parts_and_comes_back_whole(s3_server):
    layout = SMALL.__class__(num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16")
    ns = make_namespace(layout=layout, chunk_tokens=256)  # 8 MiB of payload: two 5 MiB parts
    p = make_prompt(1, namespace=ns)
    tier = open_s3(s3_server, part_size="5MiB")
    try:
        tier.put(p.chunks())
        assert tier.stats()["stored"] == 1
        got = tier.get(p.keys)
        assert got[0].tobytes() == p.chunk_bytes(0)
        release_all(got)
    finally:
        tier.close()


def test_two_writers_of_one_prefix_keep_about_its_size_between_them(s3_server):
    """B stores a new prompt and deletes A's older one to stay within the size; A's next
    listing shows B's as new: A deletes what it still counted of its own (gone already),
    never B's."""
    prefix = f"two-{secrets.token_hex(4)}"
    size = 12 * frame_bytes()
    a, b = open_s3(s3_server, prefix, size=size), open_s3(s3_server, prefix, size=size)
    try:
        old = [make_prompt(4, seed=s) for s in range(3)]
        for p in old:
            a.put(p.chunks())
        b.learner.step()  # B learns A's twelve
        new = [make_prompt(4, seed=10 + s) for s in range(3)]
        for p in new:
            b.put(p.chunks())  # and deletes them, oldest first, to make room
        for _ in range(2):
            a.learner.step()
        assert all(b.contains(p.keys) == 4 for p in new)  # B's twelve are still there
        assert len(a.keys()) == 12 and a.stats()["used_bytes"] <= size
    finally:
        a.close()
        b.close()


def test_a_listing_too_large_for_one_pass_goes_on_where_it_stopped(s3_server):
    prefix = f"pages-{secrets.token_hex(4)}"
    first = open_s3(s3_server, prefix)
    for s in range(4):
        first.put(make_prompt(3, seed=s).chunks())
    first.close()
    tier = open_s3(s3_server, prefix, list_timeout="0.000001")  # one page a pass
    try:
        tier.remote.page_keys = 5
        passes = Learner(tier)  # the test's own, taken one pass at a time
        whole = [passes.step() for _ in range(3)]
        assert whole == [False, False, True] and tier.stats()["chunks"] == 12
    finally:
        tier.close()


def test_a_prefix_servers_would_rewrite_is_refused(s3_server):
    for prefix in ("a//b", "c/./d", "e/../f", "g h", "i?j"):
        with pytest.raises(ConfigError, match="segments"):
            S3Tier("lmtier", prefix, endpoint=s3_server.endpoint, relist=0)


def test_a_batch_larger_than_the_size_stores_its_first_chunks_only(s3_server):
    tier = open_s3(s3_server, size=3 * frame_bytes())
    p = make_prompt(5, seed=21)
    try:
        tier.put(p.chunks())
        assert tier.contains(p.keys) == 3 and len(tier.keys()) == 3
        assert tier.stats()["used_bytes"] <= 3 * frame_bytes()
    finally:
        tier.close()

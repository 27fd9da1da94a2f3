"""The published directory (lmtier.transport.directory): a one-tenant server's memory tier read by
same-host clients with no call. Real servers on port 0, real shared memory in tmp_path."""

from __future__ import annotations

import os
import struct

import grpc
import numpy as np
import pytest

from lmtier import metrics
from lmtier.config import ServerConfig
from lmtier.errors import ChecksumError, LmtierError
from lmtier.kv import codec
from lmtier.kv.chunk import release_all
from lmtier.server import create_server
from lmtier.server.auth import PROBE_TAG, tenant_tag
from lmtier.tiers.base import open_tier
from lmtier.tiers.grpc.published import _checked_length
from lmtier.transport import directory
from lmtier.transport.directory import DirectoryReader, DirectoryWriter
from lmtier.transport.shm import SegmentUnavailable
from lmtier.v1 import cache_pb2

from conftest import eventually, make_prompt
from grpc_servers import SERVICE, code_of, flip_a_stored_byte, read_back, start

SLOT = 8192  # one chunk of make_prompt's layout per slot


def directory_reads() -> float:
    return metrics.SERVER_REGISTRY.get_sample_value("lmtier_server_directory_reads_total") or 0


@pytest.fixture
def one_tenant(tmp_path):
    srv, port = start(tiers=(f"cpu://?size={16 * SLOT}&slot={SLOT}",), shm_dir=str(tmp_path))
    srv.url = f"grpc://127.0.0.1:{port}?shm=on&shm_dir={tmp_path}"
    srv.address = f"127.0.0.1:{port}"
    yield srv
    srv.stop(0)


def test_a_same_host_client_reads_the_memory_tier_with_no_get(one_tenant, monkeypatch):
    tier = open_tier(one_tenant.url)
    prompt = make_prompt(4, seed=71)
    tier.put(prompt.chunks())
    gets = []
    real_get = one_tenant.service.Get
    monkeypatch.setattr(one_tenant.service, "Get", lambda *a: gets.append(1) or real_get(*a))
    before = directory_reads()
    try:
        assert tier.contains(prompt.keys) == 4
        got = tier.get(prompt.keys)
        assert not got[0].data.flags.writeable  # the server's memory, read-only
        assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(4)]  # verified as read
        release_all(got)
        assert tier.counts["directory_reads"] == 4 and not gets
        assert one_tenant.service.leases.held == 0  # nothing lent: nothing to release
        assert eventually(lambda: directory_reads() == before + 4)  # reported, as used (the first read is due)
    finally:
        tier.close()


def test_what_the_directory_lacks_comes_through_a_get(one_tenant):
    tier = open_tier(one_tenant.url)
    prompt = make_prompt(4, seed=72)
    tier.put(prompt.chunks())
    one_tenant.service.published.writer.withdraw(prompt.keys[2])  # as for a set that was full
    try:
        got = tier.get(prompt.keys)
        assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(4)]
        assert tier.counts["directory_reads"] == 2
        release_all(got)
        assert tier.contains(prompt.keys) == 4  # the directory's two, then a Lookup
    finally:
        tier.close()


def test_reads_make_chunks_recent_so_the_server_evicts_the_unread(one_tenant):
    tier = open_tier(one_tenant.url)
    old, other = make_prompt(6, seed=73), make_prompt(6, seed=74)
    try:
        tier.put(old.chunks())
        tier.put(other.chunks())
        before = directory_reads()
        release_all(tier.get(old.keys))  # through the directory: the server hears of it by the next write
        tier.put(make_prompt(6, seed=75).chunks())  # 18 chunks in 16 slots: two must go
        assert directory_reads() == before + 6
        assert tier.contains(old.keys) == 6
        assert tier.contains(other.keys) < 6
    finally:
        tier.close()


def test_a_chunk_evicted_while_it_is_read_is_a_miss_not_damage(one_tenant):
    tier = open_tier(one_tenant.url)
    prompt = make_prompt(4, seed=76)
    tier.put(prompt.chunks())
    try:
        got = tier.get(prompt.keys)
        tier.delete(prompt.keys[1:])  # the slots go to other chunks before the engine copies
        tier.put(make_prompt(16, seed=77).chunks())
        good = [c.verify() for c in got]
        assert not any(good[1:])  # their slots hold other chunks now: caught by the checksum
        assert all(got[i].tobytes() == prompt.chunk_bytes(i) for i in range(4) if good[i])  # never wrong
        assert tier.counts["directory_races"] == good.count(False)
        assert tier.counts["corrupt"] == 0  # a race, not damage: nothing deleted for it
        release_all(got)
    finally:
        tier.close()


def test_damage_in_the_servers_memory_is_a_miss_and_is_deleted(one_tenant):
    tier = open_tier(one_tenant.url)
    prompt = make_prompt(4, seed=78)
    tier.put(prompt.chunks())
    flip_a_stored_byte(one_tenant, "default", prompt.keys[1])
    try:
        got = tier.get(prompt.keys)
        assert got[0].tobytes() == prompt.chunk_bytes(0)
        with pytest.raises(ChecksumError):
            got[1].tobytes()  # found by the reader before the engine sees a byte
        release_all(got)
        assert tier.counts["corrupt"] == 1
        assert tier.contains(prompt.keys) == 1  # the server's copy is gone, and unpublished
    finally:
        tier.close()


def test_a_restarted_server_is_followed_to_its_new_directory(tmp_path):
    srv, port = start(tiers=(f"cpu://?size={16 * SLOT}&slot={SLOT}",), shm_dir=str(tmp_path))
    tier = open_tier(f"grpc://127.0.0.1:{port}?shm=on&shm_dir={tmp_path}&timeout=2")
    prompt = make_prompt(3, seed=79)
    try:
        tier.put(prompt.chunks())
        release_all(tier.get(prompt.keys))
        first = tier.memory.published.name
        srv.stop(0)  # its directory says so: no server stands behind it
        assert tier.memory.published is None
        assert not os.path.exists(tmp_path / first)
        srv, _ = create_server(
            ServerConfig(port=port, tiers=(f"cpu://?size={16 * SLOT}&slot={SLOT}",), shm_dir=str(tmp_path))
        )
        tier.directory._ask_after = 0.0
        assert not any(tier.get(prompt.keys))  # the new server holds nothing
        tier.put(prompt.chunks())
        got = tier.get(prompt.keys)
        assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(3)]
        release_all(got)
        assert tier.memory.published.name not in ("", first)
    finally:
        tier.close()
        srv.stop(0)


def test_a_server_with_several_tenants_publishes_nothing(tmp_path):
    srv, port = start(shm_dir=str(tmp_path), tokens=(("a-secret", "a"), ("b-secret", "b")))
    try:
        assert srv.service.published is None
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        call = channel.unary_unary(
            SERVICE + "Directory",
            cache_pb2.DirectoryRequest.SerializeToString,
            cache_pb2.DirectoryResponse.FromString,
        )
        answer = call(cache_pb2.DirectoryRequest(), metadata=(("authorization", "Bearer a-secret"),), timeout=5)
        assert answer.segment == ""
        assert code_of(lambda: call(cache_pb2.DirectoryRequest(), timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
        channel.close()
        assert not [n for n in os.listdir(tmp_path) if n.startswith("lmtier-")]
    finally:
        srv.stop(0)


def test_the_directory_names_only_the_tenants_chunks_under_its_own_keys(one_tenant, tmp_path):
    """Not the readiness probe's chunks; keys without the tenant's tag; bad keys refused."""
    tier = open_tier(one_tenant.url)
    prompt = make_prompt(2, seed=80)
    tier.put(prompt.chunks())
    try:
        reader = DirectoryReader(str(tmp_path), one_tenant.service.published.name)
        entry = reader.find(prompt.keys[0])
        assert entry is not None
        assert (
            codec.read_header(entry.head, reader.payload(entry, codec.payload_length(entry.head)))[0].key
            == (prompt.keys[0])
        )
        assert reader.find(tenant_tag("default") + prompt.keys[0]) is None
        assert one_tenant.probe()  # the readiness probe stores and reads its own chunk
        assert len(one_tenant.service.published.writer) == 2
        assert not any(k.startswith(PROBE_TAG) for k in one_tenant.service.published.writer._where)
        channel = grpc.insecure_channel(one_tenant.address)
        call = channel.unary_unary(SERVICE + "Directory", None, cache_pb2.DirectoryResponse.FromString)
        bad = cache_pb2.DirectoryRequest(read=[b"short"]).SerializeToString()
        assert code_of(lambda: call(bad, timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
        assert code_of(lambda: call(b"\xff\xff", timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
        channel.close()
    finally:
        tier.close()


def test_a_reader_keeps_no_entry_being_written_or_rewritten(tmp_path):
    writer = DirectoryWriter(str(tmp_path), "lmtier-" + "0" * 32, 8, SLOT, 5.0)
    try:
        with pytest.raises(SegmentUnavailable):  # the slab it names is not there: nothing to read
            DirectoryReader(str(tmp_path), writer.name)
    finally:
        writer.close()
    # A writer mid-way: an odd seq hides the way; a changed seq marks what was found.
    owner = DirectoryWriter(str(tmp_path), "lmtier-" + "1" * 32, 4, 4096, 5.0)
    slab = tmp_path / ("lmtier-" + "1" * 32)
    slab.write_bytes(bytes(4 * 4096))
    try:
        key = os.urandom(16)
        assert owner.publish(key, 2, b"head")
        reader = DirectoryReader(str(tmp_path), owner.name)
        entry = reader.find(key)
        assert entry is not None and entry.slot == 2 and entry.head == b"head" and reader.fresh
        way = owner._where[key]
        struct.pack_into("<Q", owner._map, way, entry.seq + 1)  # odd: being written
        assert reader.find(key) is None and reader.moved(entry)
        struct.pack_into("<Q", owner._map, way, entry.seq)
        owner.withdraw(key)
        assert reader.find(key) is None and reader.moved(entry)
        assert not owner.publish(key, 9, b"head")  # no such slot
        assert not owner.publish(key, 1, bytes(directory.HEAD_BYTES + 1))
    finally:
        owner.close()
    assert not reader.fresh  # closed: no server stands behind it


def test_a_stopped_servers_memory_is_let_go_and_a_disk_tier_writes_what_was_read(tmp_path):
    """A directory read's verified copy stays page-aligned (O_DIRECT writes it where it
    lies); once the server stops, the client maps none of its memory any more."""
    (tmp_path / "shm").mkdir()
    srv, port = start(tiers=(f"cpu://?size={16 * SLOT}&slot={SLOT}",), shm_dir=str(tmp_path / "shm"))
    tier = open_tier(f"grpc://127.0.0.1:{port}?shm=on&shm_dir={tmp_path / 'shm'}&timeout=2")
    disk = open_tier(f"file://{tmp_path / 'disk'}?size=16MiB&o_direct=true")
    prompt = make_prompt(3, seed=83)
    try:
        tier.put(prompt.chunks())
        got = tier.get(prompt.keys)
        assert tier.counts["directory_reads"] == 3
        disk.put(got)
        assert read_back(disk, prompt.keys) == [prompt.chunk_bytes(i) for i in range(3)]
        release_all(got)
        srv.stop(0)
        assert tier.memory.published is None and tier.memory._directory is None
    finally:
        tier.close()
        disk.close()
        srv.stop(0)


def test_a_chunk_larger_than_a_slot_lies_in_one_run_and_is_published(tmp_path):
    srv, port = start(tiers=(f"cpu://?size={16 * SLOT}&slot={SLOT // 2}",), shm_dir=str(tmp_path))
    tier = open_tier(f"grpc://127.0.0.1:{port}?shm=on&shm_dir={tmp_path}")
    prompt = make_prompt(4, seed=81)  # chunks of two slots each
    try:
        tier.put(prompt.chunks())
        got = tier.get(prompt.keys)
        assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(4)]
        assert tier.counts["directory_reads"] == 4  # each in consecutive slots: published
        release_all(got)
    finally:
        tier.close()
        srv.stop(0)


def test_warm_maps_the_published_chunks_pages_ahead_of_the_first_load(tmp_path):
    """A new engine's first hit maps no pages on its path: ``warm`` maps those of every
    chunk published then, in the background, and only those (chunks of two slots here)."""
    srv, port = start(tiers=(f"cpu://?size={16 * SLOT}&slot={SLOT // 2}",), shm_dir=str(tmp_path))
    url = f"grpc://127.0.0.1:{port}?shm=on&shm_dir={tmp_path}"
    first, second = open_tier(url), open_tier(url)
    prompt = make_prompt(3, seed=85)
    try:
        first.put(prompt.chunks())
        second.warm()
        assert eventually(lambda: second.counts["directory_warmed_bytes"] == 3 * SLOT)
        reader = second.memory.published
        assert reader is not None and sum(reader._mapped) == 6  # three chunks' runs, no free slot
        second.warm()  # once per directory
        got = second.get(prompt.keys)
        assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(3)]
        assert second.counts["directory_reads"] == 3 and second.counts["directory_warmed_bytes"] == 3 * SLOT
        release_all(got)
    finally:
        first.close()
        second.close()
        srv.stop(0)


def test_warming_skips_entries_being_written_and_heads_it_cannot_read(tmp_path):
    owner = DirectoryWriter(str(tmp_path), "lmtier-" + "2" * 32, 4, 4096, 5.0)
    (tmp_path / ("lmtier-" + "2" * 32)).write_bytes(bytes(4 * 4096))
    try:
        keys = [os.urandom(16) for _ in range(3)]
        for slot, key in enumerate(keys, 1):
            assert owner.publish(key, slot, b"head%d" % slot)
        struct.pack_into("<Q", owner._map, owner._where[keys[0]], 1)  # odd: being written
        reader = DirectoryReader(str(tmp_path), owner.name)

        def length_of(head: bytes) -> int:
            if head == b"head3":
                raise ValueError("not a frame")
            return 4096 * 9 if head == b"head2" else 100  # a length past the slab's end stops there

        assert reader.populate(length_of, 4096) == 4096  # a length past the limit: mapped up to it
        assert list(reader._mapped) == [0, 0, 1, 0]
        assert reader.populate(length_of, 1 << 30, stop=lambda: True) == 0
        assert reader.populate(length_of, 1 << 30) == 4096  # slot 3, the slab's last: newly mapped only
        assert list(reader._mapped) == [0, 0, 1, 1]
        assert reader.populate(length_of, 1 << 30) == 0  # already mapped
        for garbage in (b"head2", bytes(64), b"\xff" * 64):  # what the tier's own check refuses
            with pytest.raises(LmtierError):
                _checked_length(garbage)
    finally:
        owner.close()


def test_what_is_checked_is_what_is_used_when_the_server_may_reuse_the_memory(one_tenant):
    """A chunk read through the directory holds no lease: a layer-by-layer check passes
    only if the entry did not move before the last layer was copied (here it moves after
    every layer hashed fine: the copy may have read other bytes); ``verify`` keeps a copy
    of its own; a verified copy-out leaves the chunk unverified for the next reader."""
    tier = open_tier(one_tenant.url)
    prompt = make_prompt(3, seed=82)
    tier.put(prompt.chunks())
    try:
        first, second, third = tier.get(prompt.keys)
        check = first.layer_check()
        for layer in range(first.layout.num_layers):
            check(layer)
        one_tenant.service.published.writer.withdraw(prompt.keys[0])  # as an eviction does, before reuse
        assert not check.passed()
        assert tier.counts["directory_races"] == 1 and tier.counts["corrupt"] == 0

        assert second.verify() and second.data.flags.writeable  # its own memory now
        assert second.tobytes() == prompt.chunk_bytes(1)

        out = np.empty(third.data.shape, dtype=np.uint8)
        third.copy_to(out)
        assert out.tobytes() == prompt.chunk_bytes(2) and not third.verified
        release_all([first, second, third])
    finally:
        tier.close()

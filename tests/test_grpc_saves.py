"""Saves through shared memory: a one-tenant server reads a client's frame from the
client's segment straight into its memory tier's slots and checks it there. Real servers
on port 0, real segments in tmp_path; raw calls where a test needs a frame no well-behaved
client would send, and a fuzzing target (hypothesis) for whatever bytes the segment holds."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmtier.config import ServerConfig
from lmtier.kv import codec
from lmtier.kv.chunk import Chunk, release_all
from lmtier.server import create_server
from lmtier.server.auth import tenant_tag
from lmtier.tiers.base import open_tier
from lmtier.transport.pieces import Region, pack, piece
from lmtier.transport.shm import Segment
from lmtier.v1 import cache_pb2

from conftest import eventually, fuzz, make_prompt
from grpc_servers import SERVICE, code_of, read_back, start

SLOT = 8192  # one chunk of make_prompt's layout per slot
TAG = tenant_tag("default")
FUZZ = fuzz()
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.RESOURCE_EXHAUSTED}
PROMPT = make_prompt(4, seed=901)
KNOWN = {key: PROMPT.chunk_bytes(i) for i, key in enumerate(PROMPT.keys)}
FRAMES = [codec.encode(c) for c in PROMPT.chunks()]


@pytest.fixture
def one_tenant(tmp_path):
    srv, port = start(tiers=(f"cpu://?size={16 * SLOT}&slot={SLOT}",), shm_dir=str(tmp_path))
    srv.url = f"grpc://127.0.0.1:{port}?shm=on&shm_dir={tmp_path}&data=false"  # saves through the segment
    srv.address = f"127.0.0.1:{port}"
    srv.shm_dir = str(tmp_path)
    yield srv
    srv.stop(0)


def buffers_taken(srv, monkeypatch) -> list[int]:
    """Every pooled receive buffer the server takes from now on (the usual way's copy)."""
    taken: list[int] = []
    real = srv.service.buffers.acquire
    monkeypatch.setattr(srv.service.buffers, "acquire", lambda n: taken.append(n) or real(n))
    return taken


def put_raw(srv, messages) -> cache_pb2.PutResponse:
    with grpc.insecure_channel(srv.address) as channel:
        call = channel.stream_unary(SERVICE + "Put", None, cache_pb2.PutResponse.FromString)
        return call(iter(messages), timeout=10)


def landed_in_segment(segment: Segment, chunk, slot: int = 0, align: int = 0) -> bytes:
    """The chunk's frame written into the client's ``slot``; its piece, as a client sends it."""
    n = codec.encode_into(chunk, segment.view(slot), align=align)
    return pack(piece(chunk.key, n, region=Region(segment.name, segment.offset(slot), n)))


def test_a_save_is_read_into_the_memory_tier_where_it_stays(one_tenant, monkeypatch):
    taken = buffers_taken(one_tenant, monkeypatch)
    tier = open_tier(one_tenant.url)
    plain = open_tier(one_tenant.url.replace("shm=on", "shm=off"))
    prompt = make_prompt(6, seed=91)
    try:
        tier.put(prompt.chunks())
        assert taken == []  # no receive buffer: straight into the tier's slots
        cpu = one_tenant.store.tiers[0]
        assert cpu.contains([TAG + k for k in prompt.keys]) == 6
        assert cpu.stats()["stored"] == 6
        # the same bytes through every path: the directory, and a Get over TCP
        assert read_back(tier, prompt.keys) == [prompt.chunk_bytes(i) for i in range(6)]
        assert tier.counts["directory_reads"] == 6
        assert read_back(plain, prompt.keys) == [prompt.chunk_bytes(i) for i in range(6)]
    finally:
        tier.close()
        plain.close()


def test_a_batch_keeps_its_first_chunk_the_most_recent(one_tenant):
    tier = open_tier(one_tenant.url)
    first, second, third = make_prompt(8, seed=92), make_prompt(8, seed=93), make_prompt(4, seed=90)
    try:
        tier.put(first.chunks())
        tier.put(second.chunks())
        tier.put(third.chunks())  # the tier holds 16: four of `first` must go
        cpu = one_tenant.store.tiers[0]
        kept = [cpu.contains([TAG + k]) for k in first.keys]
        assert kept == [1] * 4 + [0] * 4  # the prefix's head stays, its tail goes first
    finally:
        tier.close()


def test_a_damaged_save_is_refused_and_leaves_no_slot_taken(one_tenant, tmp_path):
    segment = Segment(str(tmp_path), 1 << 20, 64 << 10)
    chunk, good = make_prompt(2, seed=94).chunks()
    message = landed_in_segment(segment, chunk)
    segment.view(0)[codec.encoded_size(chunk) - 7] ^= 0x10  # a payload byte, after the client's hash
    cpu = one_tenant.store.tiers[0]
    try:
        with pytest.raises(grpc.RpcError) as failed:
            put_raw(one_tenant, [message, landed_in_segment(segment, good, slot=1)])
        assert failed.value.code() == grpc.StatusCode.DATA_LOSS
        assert cpu.contains([TAG + chunk.key]) == 0 and cpu.used_bytes == SLOT  # only the good one
        assert cpu.stats()["corrupt"] == 0  # refused before it was ever readable
    finally:
        segment.close()


def test_a_save_of_a_chunk_held_already_reads_nothing_and_keeps_the_good_bytes(one_tenant, tmp_path, monkeypatch):
    tier = open_tier(one_tenant.url)
    prompt = make_prompt(1, seed=95)
    tier.put(prompt.chunks())
    segment = Segment(str(tmp_path), 1 << 20, 64 << 10)
    message = landed_in_segment(segment, prompt.chunks()[0])
    segment.view(0)[codec.encoded_size(prompt.chunks()[0]) - 7] ^= 0x10
    taken = buffers_taken(one_tenant, monkeypatch)
    try:
        assert put_raw(one_tenant, [message]).stored == 1  # the server holds it: nothing to read
        assert taken == []
        assert read_back(tier, prompt.keys) == [prompt.chunk_bytes(0)]
    finally:
        tier.close()
        segment.close()


def test_a_call_that_fails_keeps_the_whole_chunks_it_landed_and_loses_no_one_elses(one_tenant, tmp_path):
    """A call that breaks after some chunks landed: those, whole and checked, are stored as
    any other (taking them back out would delete a chunk another call was told is stored,
    which found it held meanwhile); the broken piece leaves nothing."""
    segment, other = Segment(str(tmp_path), 1 << 20, 64 << 10), Segment(str(tmp_path), 1 << 20, 64 << 10)
    prompt = make_prompt(3, seed=96)
    messages = [landed_in_segment(segment, c, slot=i) for i, c in enumerate(prompt.chunks())]
    cpu = one_tenant.store.tiers[0]
    landed, go = threading.Event(), threading.Event()

    def first_call():
        yield from messages
        landed.wait(10)  # held here: another client saves the same first chunk
        go.wait(10)
        yield pack(piece(b"\x01" * 16, 10, region=Region(segment.name, 0, 4)))  # not a whole frame

    failed: list = []
    thread = threading.Thread(target=lambda: failed.append(code_of(lambda: put_raw(one_tenant, first_call()))))
    thread.start()
    try:
        assert eventually(lambda: cpu.contains([TAG + prompt.keys[0]]) == 1)
        landed.set()
        assert put_raw(one_tenant, [landed_in_segment(other, prompt.chunks()[0])]).stored == 1  # told: stored
        go.set()
        thread.join(20)
        assert failed == [grpc.StatusCode.INVALID_ARGUMENT]
        assert cpu.contains([TAG + k for k in prompt.keys]) == 3  # kept, the other caller's among them
        assert cpu.used_bytes == 3 * SLOT and cpu.stats()["stored"] == 3
        tier = open_tier(one_tenant.url)
        assert read_back(tier, prompt.keys) == [prompt.chunk_bytes(i) for i in range(3)]
        tier.close()
    finally:
        landed.set()
        go.set()
        segment.close()
        other.close()


def test_a_save_whose_region_runs_past_the_segment_evicts_nothing(tmp_path, monkeypatch):
    """Memory is set aside (evicting) only for a region that lies in the client's segment."""
    srv, port = start(tiers=(f"cpu://?size={4 * SLOT}&slot={SLOT}",), shm_dir=str(tmp_path))
    srv.address = f"127.0.0.1:{port}"
    cpu = srv.store.tiers[0]
    tier = open_tier(f"grpc://127.0.0.1:{port}?shm=on&shm_dir={tmp_path}&data=false")
    held = make_prompt(4, seed=88)
    layout = held.namespace.layout
    tokens = 3 * held.namespace.chunk_tokens  # three slots' worth
    big = Chunk(b"\x07" * 16, layout, np.random.default_rng(3).integers(0, 256, layout.byte_shape(tokens), np.uint8))
    frame = codec.encode(big)
    segment = Segment(str(tmp_path), 8192, 8192)  # room for the frame's head, not for its payload
    try:
        tier.put(held.chunks())  # the tier is full
        segment.view(0)[:4096] = np.frombuffer(frame[:4096], dtype=np.uint8)
        message = pack(piece(big.key, len(frame), region=Region(segment.name, 0, len(frame))))
        assert code_of(lambda: put_raw(srv, [message])) == grpc.StatusCode.FAILED_PRECONDITION
        assert cpu.contains([TAG + k for k in held.keys]) == 4 and cpu.stats()["evictions"] == 0
    finally:
        tier.close()
        segment.close()
        srv.stop(0)


@pytest.mark.parametrize(
    "spoil",
    ["key", "header", "padded"],
)
def test_frames_the_landing_cannot_take_go_the_usual_way_with_its_answers(one_tenant, tmp_path, spoil):
    """A frame whose header does not check or names another key is refused in the usual
    way's words; one whose header is longer than the first read is stored the usual way."""
    segment = Segment(str(tmp_path), 1 << 20, 64 << 10)
    chunk = make_prompt(1, seed=97).chunks()[0]
    try:
        if spoil == "padded":  # a header padded past the first read: stored all the same
            message = landed_in_segment(segment, chunk, align=16384)
            assert codec.header_length(segment.view(0)) > 4096
            assert put_raw(one_tenant, [message]).stored == 1
            tier = open_tier(one_tenant.url)
            assert read_back(tier, [chunk.key]) == [chunk.tobytes()]
            tier.close()
            return
        message = landed_in_segment(segment, chunk)
        if spoil == "key":
            n = codec.encoded_size(chunk)
            message = pack(piece(b"\x02" * 16, n, region=Region(segment.name, 0, n)))
        else:
            segment.view(0)[codec.PREAMBLE.size + 3] ^= 0x01
        failed = code_of(lambda: put_raw(one_tenant, [message]))
        assert failed in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DATA_LOSS)
        assert one_tenant.store.tiers[0].used_bytes == 0
    finally:
        segment.close()


def test_a_chunk_larger_than_a_slot_lands_in_a_run_of_slots(tmp_path, monkeypatch):
    srv, port = start(tiers=(f"cpu://?size={16 * SLOT}&slot={SLOT // 2}",), shm_dir=str(tmp_path))
    srv.address = f"127.0.0.1:{port}"
    taken = buffers_taken(srv, monkeypatch)
    tier = open_tier(f"grpc://127.0.0.1:{port}?shm=on&shm_dir={tmp_path}&data=false")
    prompt = make_prompt(3, seed=98)  # chunks of two slots each
    try:
        tier.put(prompt.chunks())
        assert taken == []
        got = tier.get(prompt.keys)
        assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(3)]
        assert tier.counts["directory_reads"] == 3
        release_all(got)
    finally:
        tier.close()
        srv.stop(0)


def test_a_landed_save_reaches_the_disk_tier_below(tmp_path):
    (tmp_path / "shm").mkdir()
    srv, port = start(
        tiers=(f"cpu://?size={4 * SLOT}&slot={SLOT}", f"file://{tmp_path / 'disk'}?size=4MiB"),
        shm_dir=str(tmp_path / "shm"),
    )
    tier = open_tier(f"grpc://127.0.0.1:{port}?shm=on&shm_dir={tmp_path / 'shm'}&data=false")
    prompt = make_prompt(8, seed=99)  # twice what memory holds
    disk = srv.store.tiers[1]
    try:
        tier.put(prompt.chunks()[:4])
        assert eventually(lambda: disk.contains([TAG + k for k in prompt.keys[:4]]) == 4)
        tier.put(prompt.chunks()[4:])  # memory lets the first four go: the disk has them
        assert eventually(lambda: disk.contains([TAG + k for k in prompt.keys]) == 8)
        assert read_back(tier, prompt.keys) == [prompt.chunk_bytes(i) for i in range(8)]
    finally:
        tier.close()
        srv.stop(0)


def test_a_one_tenant_server_lands_only_whole_good_frames_whatever_the_segment_holds(tmp_path):
    """A one-tenant server reads a save's frame from the client's segment straight into its
    memory tier: any bytes there (a frame with bytes flipped anywhere, cut short, named by
    another key) are refused with a status or stored only when whole and good, and no slot
    is ever left taken."""
    (tmp_path / "shm").mkdir()
    config = ServerConfig(port=0, tiers=("cpu://?size=1MiB&slot=8KiB",), shm_dir=str(tmp_path / "shm"))
    server, port = create_server(config)
    cpu, tag = server.store.tiers[0], TAG
    segment = Segment(str(tmp_path / "shm"), 1 << 20, 64 << 10)
    view = memoryview(segment.map)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    put = channel.stream_unary(SERVICE + "Put", None, cache_pb2.PutResponse.FromString)
    flips = st.lists(st.tuples(st.integers(0, len(FRAMES[0]) - 1), st.integers(1, 255)), max_size=3)

    @FUZZ
    @given(
        which=st.integers(0, len(FRAMES) - 1),
        flipped=flips,
        cut=st.sampled_from([0, 0, 1, 100, len(FRAMES[0]) - 40]),
        named=st.sampled_from(["own", "other", "random"]),
        random_key=st.binary(min_size=16, max_size=16),
    )
    def run(which, flipped, cut, named, random_key):
        frame = bytearray(FRAMES[which])
        for at, bits in flipped:
            frame[at] ^= bits
        view[: len(frame)] = frame
        key = {"own": PROMPT.keys[which], "other": PROMPT.keys[(which + 1) % 4], "random": random_key}[named]
        n = len(frame) - cut
        try:
            stored = put(iter([pack(piece(key, n, region=Region(segment.name, 0, n)))]), timeout=30).stored
        except grpc.RpcError as exc:
            assert exc.code() in ALLOWED, exc
            stored = 0
        good = bytes(frame) == FRAMES[which] and not cut and named == "own"  # two flips may cancel out
        assert stored == int(good)
        for k, truth in KNOWN.items():
            (got,) = cpu.get([tag + k])
            if got is not None:
                assert got.verify() and got.tobytes() == truth
                got.release()
        assert not cpu.contains([tag + random_key])  # nothing is stored under a key its frame does not name
        cpu.delete(list(cpu.keys()))
        assert cpu.used_bytes == 0 and not cpu.keys()  # no slot left taken

    try:
        run()
    finally:
        channel.close()
        segment.close()
        server.stop(0)

"""The grpc:// tier's shared memory against real cache servers on port 0: the fallback to
plain gRPC where the server cannot see a segment, a client killed mid-transfer, segments
swept, kept and grown, and a one-tenant server lending its memory (leases released,
reaped, and seen before a write), never a server with several tenants.

The contract, tenants and TLS are in test_grpc_tier_contract.py; bad input, failures,
readiness and health in test_grpc_tier_faults.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from lmtier.kv.chunk import release_all
from lmtier.server.auth import tenant_tag
from lmtier.tiers.base import open_tier
from lmtier.transport import shm

from conftest import eventually, make_prompt
from grpc_servers import (
    read_back,
    start,
    tenants_server,
)


@pytest.fixture(scope="module")
def server():
    srv = tenants_server()
    yield srv
    srv.stop(0)


# -- shared memory -------------------------------------------------------------------------------
def test_a_server_that_cannot_see_the_segment_falls_back_to_plain_grpc(tmp_path):
    elsewhere = tmp_path / "another-hosts-shm"
    elsewhere.mkdir()
    srv, port = start(shm_dir=str(elsewhere))
    tier = open_tier(f"grpc://127.0.0.1:{port}?shm=on")
    try:
        prompt = make_prompt(4, seed=49)
        tier.put(prompt.chunks())
        assert read_back(tier, prompt.keys) == [prompt.chunk_bytes(i) for i in range(4)]
        stats = tier.stats()
        assert stats["shm_fallbacks"] == 1 and stats["shm"] is None and stats["errors"] == 0
    finally:
        tier.close()
        srv.stop(0)


_DYING_CLIENT = """
import os, sys, time
sys.path.insert(0, {tests!r})
from conftest import make_prompt
from lmtier.kv import codec
from lmtier.transport.shm import Segment
from lmtier.transport.pieces import Region, pack, piece
import grpc
segment = Segment({shm_dir!r}, 1 << 20, 256 << 10)
chunk = make_prompt(1, seed=50).chunks()[0]
frame = codec.encode(chunk)
n = codec.encode_into(chunk, segment.view(0))

def pieces():
    yield pack(piece(chunk.key, n, region=Region(segment.name, 0, n)))  # one whole chunk
    yield pack(piece(b"\\x01" * 16, len(frame), data=[frame[:100]]))  # half of the next
    print(segment.name, flush=True)
    time.sleep(600)  # killed here

channel = grpc.insecure_channel({address!r})
channel.stream_unary("/lmtier.v1.CacheService/Put", None, None)(pieces())
"""


def test_a_client_killed_mid_transfer_leaves_nothing_behind(tmp_path):
    srv, port = start(shm_dir=str(tmp_path))
    script = _DYING_CLIENT.format(tests=os.path.dirname(__file__), shm_dir=str(tmp_path), address=f"127.0.0.1:{port}")
    client = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        name = client.stdout.readline().strip()
        assert name.startswith("lmtier-")
        deadline = time.monotonic() + 30
        while srv.service.buffers.outstanding == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # the half-built frame is in a receive buffer now
        client.send_signal(signal.SIGKILL)
        client.wait(timeout=10)
        deadline = time.monotonic() + 30
        while srv.service.buffers.outstanding and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.service.buffers.outstanding == 0  # the unfinished frame's buffer came back
        # the whole chunk, read into memory and checked, is kept; nothing of the half one
        chunk = make_prompt(1, seed=50).chunks()[0]
        assert srv.service.tenant_keys(tenant_tag("default")) == [tenant_tag("default") + chunk.key]
        assert (tmp_path / name).exists()
        assert shm.sweep(str(tmp_path), min_age=0) == 1  # nobody holds the dead client's segment
        assert not (tmp_path / name).exists()
    finally:
        client.kill()
        srv.stop(0)


def test_a_swept_segment_is_closed_at_once(tmp_path):
    """The server keeps a client's segment open while it sends chunks; once the segment is
    swept (its client died), pruning closes it, instead of keeping its memory until 64
    newer segments push it out."""
    segment = shm.Segment(str(tmp_path), 1 << 20, 64 << 10)
    maps = shm.SegmentFiles(str(tmp_path))
    maps.read_into(segment.name, 0, 4096, bytearray(4096))
    assert maps.prune() == 0 and len(maps) == 1  # still there: kept
    os.unlink(segment.path)  # what sweep does to a dead client's segment
    assert maps.prune() == 1 and len(maps) == 0
    segment.close()


def test_sweep_leaves_the_segments_of_live_clients_alone(tmp_path):
    segment = shm.Segment(str(tmp_path), 1 << 20, 64 << 10)
    try:
        assert shm.sweep(str(tmp_path), min_age=0) == 0
        assert os.path.exists(segment.path)
    finally:
        segment.close()
    assert not os.path.exists(segment.path)


def test_a_growing_segment_reserves_its_memory_as_its_slots_are_taken(tmp_path, monkeypatch):
    """A client's segment reserves its first step at once and the next ones as slots run
    low, on a thread of its own: every slot handed out lies in reserved memory."""
    monkeypatch.setattr(shm.segment, "GROW_STEP", 256 << 10)  # 4 slots a step
    segment = shm.Segment(str(tmp_path), 1 << 20, 64 << 10, grow=True)
    try:
        assert os.stat(segment.path).st_blocks * 512 == 256 << 10  # one step, of a 1 MiB segment
        taken = []
        for _ in range(40):  # the grower catches up in the background
            slot = segment.acquire()
            if slot is not None:
                taken.append(slot)
                assert os.stat(segment.path).st_blocks * 512 >= (slot + 1) * (64 << 10)
            if len(taken) == 16:
                break
            time.sleep(0.05)
        assert sorted(taken) == list(range(16))
        assert segment.acquire() is None  # all 16 in use
    finally:
        segment.close()
    assert not os.path.exists(segment.path)


def test_a_single_tenant_server_lends_its_memory_until_the_client_lets_go(tmp_path):
    srv, port = start(tiers=("cpu://?size=16MiB&slot=64KiB",), shm_dir=str(tmp_path))
    tier = open_tier(f"grpc://127.0.0.1:{port}?shm=on&shm_dir={tmp_path}&directory=off")
    try:
        assert srv.zero_copy and srv.service.shared is not None
        prompt = make_prompt(4, seed=54)
        tier.put(prompt.chunks())
        got = tier.get(prompt.keys)
        assert srv.service.leases.held == 4 * prompt.chunks()[0].nbytes  # read in place, held for us
        assert not got[0].data.flags.writeable  # a read-only view of the server's memory
        assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(4)]
        release_all(got[:3])
        assert srv.service.leases.held > 0  # one chunk is still out
        release_all(got[3:])
        assert eventually(lambda: srv.service.leases.held == 0)  # Release reached the server

        got = tier.get(prompt.keys)  # a client that dies holding chunks: reaped once it is gone
        assert srv.service.leases.held > 0
        tier.memory.close()  # its segment's lock goes with it, as when the process dies
        srv.service.leases.reap()
        assert srv.service.leases.held == 0
        release_all(got)
    finally:
        tier.close()
        srv.stop(0)


def test_a_write_follows_the_releases_sent_before_it(tmp_path, monkeypatch):
    """Chunks let go, then a write: the server sees the release first (a slow one made
    slower here), so it may evict them in recency order, never around chunks it would
    still count as lent (whose successors would be stranded)."""
    srv, port = start(tiers=("cpu://?size=16MiB&slot=64KiB",), shm_dir=str(tmp_path))
    tier = open_tier(f"grpc://127.0.0.1:{port}?shm=on&shm_dir={tmp_path}&directory=off")
    release, put, lent_at_put = srv.service.leases.release, srv.store.put, []

    def slow_release(*args):
        time.sleep(0.1)
        release(*args)

    def put_seen(chunks):
        lent_at_put.append(srv.service.leases.held)
        return put(chunks)

    monkeypatch.setattr(srv.service.leases, "release", slow_release)
    monkeypatch.setattr(srv.store, "put", put_seen)
    try:
        first, second = make_prompt(4, seed=55), make_prompt(2, seed=56)
        tier.put(first.chunks())
        got = tier.get(first.keys)
        assert srv.service.leases.held > 0
        release_all(got)
        tier.put(second.chunks())
        assert lent_at_put == [0, 0]
    finally:
        tier.close()
        srv.stop(0)


def test_a_server_with_several_tenants_never_lends_its_memory(server):
    assert not server.zero_copy and server.service.shared is None

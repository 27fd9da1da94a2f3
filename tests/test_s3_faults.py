"""The object-storage tier when the bucket misbehaves: throttling, slow and cut responses, a
server gone, an upload cut short. Each is a miss or a retry within the deadline, counted,
never wrong KV and never an exception out of the store. Faults come from a proxy in front
of a real SeaweedFS (tests/s3_faults.py). And virtual-hosted addressing, which needs a
host name of the bucket's own: made to resolve in a mount namespace."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from lmtier.errors import TierError
from lmtier.kv.chunk import release_all
from lmtier.store.tiered import TieredStore
from lmtier.tiers.base import open_tier

from conftest import SMALL, make_namespace, make_prompt
from s3_faults import FaultProxy


@pytest.fixture
def proxy(s3_server):
    with FaultProxy(s3_server.port) as p:
        yield p


def through(server, proxy, prefix: str = "", **options):
    """A tier whose requests go through ``proxy`` (its endpoint), on ``prefix`` (a fresh one)."""
    prefix = prefix or f"f-{secrets.token_hex(4)}"
    return open_tier(server.url(prefix, relist=0, **options).replace(server.endpoint, proxy.endpoint))


def stored(server, chunks) -> str:
    """A fresh prefix that holds ``chunks``, written straight to the server (the faults are
    for the reads: a loaded machine's slow write must not meet a test's tight deadline)."""
    prefix = f"f-{secrets.token_hex(4)}"
    with open_tier(server.url(prefix, relist=0)) as tier:
        tier.put(chunks)
    return prefix


def test_throttling_is_retried_within_the_deadline(s3_server, proxy, prompt):
    tier = through(s3_server, proxy)
    try:
        proxy.throttle = 3
        tier.put(prompt.chunks())
        assert proxy.throttled == 3 and tier.stats()["stored"] == 8  # retried, all landed
        proxy.throttle = 2
        got = tier.get(prompt.keys)
        assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(8)]
        release_all(got)
    finally:
        tier.close()


def test_throttling_that_outlasts_the_deadline_is_a_counted_miss(s3_server, proxy, prompt):
    prefix = stored(s3_server, prompt.chunks())
    proxy.throttle = 10_000
    with TieredStore([through(s3_server, proxy, prefix, timeout=1)]) as store:
        assert store.get(prompt.keys) == []  # misses, not an exception
        stats = store.tiers[0].stats()
    assert stats["throttled"] + stats["timeouts"] > 0
    proxy.throttle = 0
    with through(s3_server, proxy, prefix) as tier:
        got = tier.get(prompt.keys)  # the objects were never harmed
        assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(8)]
        release_all(got)


def test_throttling_past_the_clients_retries_is_counted_as_throttling(s3_server, proxy, prompt):
    tier = through(s3_server, proxy, timeout=60)  # awscrt gives up first: a SlowDown answer, no timeout
    try:
        tier.put(prompt.chunks(0, 1))
        proxy.throttle = 10_000
        with pytest.raises(TierError, match="SLOW_DOWN"):
            tier.get(prompt.keys[:1])
        assert proxy.throttled > 1  # retried
        stats = tier.stats()
        assert stats["throttled"] == 1 and stats["timeouts"] == stats["errors"] == 0
    finally:
        tier.close()


def test_a_lookup_has_one_deadline_however_long_the_prompt(s3_server, proxy):
    p = make_prompt(64, seed=3)  # four windows of HEADs, all present
    reader = through(s3_server, proxy, stored(s3_server, p.chunks()), timeout=2)
    proxy.delay = 1.5  # each HEAD answered after 1.5 s: the second window meets the deadline
    with TieredStore([reader]) as store:  # nor does the store ask it again for the rest
        assert store.lookup(p.keys) == 16  # what the first window found stands
    assert proxy.requests["HEAD"] <= 32  # and no third window was sent
    assert reader.stats()["timeouts"] == 16


def test_a_slow_bucket_is_a_miss_at_the_deadline(s3_server, proxy, prompt):
    prefix = stored(s3_server, prompt.chunks())
    proxy.delay = 4.0
    with through(s3_server, proxy, prefix, timeout=1) as tier:
        with pytest.raises(TierError, match="no answer"):
            tier.get(prompt.keys[:2])
        assert tier.stats()["timeouts"] == 2
    with TieredStore([through(s3_server, proxy, prefix, timeout=1)]) as store:
        assert store.get(prompt.keys) == []
    proxy.delay = 0
    with through(s3_server, proxy, prefix) as tier:
        got = tier.get(prompt.keys)
        assert all(c is not None for c in got)
        release_all(got)


def test_a_response_cut_mid_object_is_never_a_chunk(s3_server, proxy):
    big = make_namespace(layout=SMALL.__class__(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16"))
    p = make_prompt(4, namespace=big)  # 32 KiB chunks: a cut lands inside the payload
    tier = through(s3_server, proxy, stored(s3_server, p.chunks()), timeout=2)
    try:
        proxy.cut_after = 20_000
        got = tier.get(p.keys)
        assert got == [None] * 4 or all(c is None for c in got)
        assert tier.stats()["corrupt"] == 0  # never taken for a damaged object: nothing deleted
        proxy.cut_after = None
        got = tier.get(p.keys)
        assert [c.tobytes() for c in got] == [p.chunk_bytes(i) for i in range(4)]
        release_all(got)
    except TierError:
        pass  # every request of the batch cut: the store counts the tier down, the same miss
    finally:
        tier.close()


def test_a_server_that_goes_away_loses_nothing_and_comes_back(s3_server, proxy, prompt):
    prefix = stored(s3_server, prompt.chunks())
    tier = through(s3_server, proxy, prefix, timeout=2, connect_timeout=0.5)
    try:
        with TieredStore([tier]) as store:
            assert store.lookup(prompt.keys) == 8
            proxy.down = True
            results = []

            def use() -> None:
                results.append(store.get(make_prompt(3, seed=7).keys))  # not known: requests fail
                store.put(make_prompt(2, seed=8).chunks())  # dropped, not raised
                results.append("put")

            worker = threading.Thread(target=use)
            worker.start()
            worker.join(60)  # a hang detector, far above the 2 s timeouts, not a speed claim
            assert not worker.is_alive() and results == [[], "put"]
            proxy.down = False
        with TieredStore([through(s3_server, proxy, prefix)]) as store:
            got = store.get(prompt.keys)
            assert [c.tobytes() for c in got] == [prompt.chunk_bytes(i) for i in range(8)]
            release_all(got)
    finally:
        tier.close()


def test_an_upload_cut_short_leaves_no_object(s3_server, proxy):
    layout = SMALL.__class__(num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16")
    p = make_prompt(1, namespace=make_namespace(layout=layout, chunk_tokens=256))  # 8 MiB: multipart
    tier = through(s3_server, proxy, timeout=3, part_size="5MiB")
    try:
        proxy.down = True  # the writer's connections die: as if it were killed mid-upload
        try:
            tier.put(p.chunks())
        except TierError:
            pass
        proxy.down = False
        assert tier.contains(p.keys) == 0 and tier.get(p.keys) == [None]
        assert tier.stats()["chunks"] == 0  # not counted as held
    finally:
        tier.close()


VIRTUAL_HOSTED = """
import os, sys
sys.path.insert(0, sys.argv[2])
from lmtier.kv.chunk import release_all
from lmtier.tiers.base import open_tier
from conftest import make_prompt
tier = open_tier(sys.argv[1])
p = make_prompt(3, seed=11)
tier.put(p.chunks())
got = tier.get(p.keys)
assert [c.tobytes() for c in got] == [p.chunk_bytes(i) for i in range(3)], "bytes differ"
release_all(got)
print("served", tier.stats()["stored"], tier.remote.host)
tier.close()
"""


def _mount_namespaces() -> bool:
    """Whether this machine lets a process make a mount namespace of its own (root, and a
    container that allows it)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.skipif(not _mount_namespaces(), reason="no mount namespaces here (root and unshare -m)")
def test_virtual_hosted_addressing_against_a_real_server(tmp_path):
    """``bucket.host`` names the bucket: a host name that resolves only in a mount namespace
    of its own, where /etc/hosts says so (SeaweedFS answers for its domain)."""
    from lmtier.testing.s3_server import S3Server

    domain = "s3.lmtier.test"
    server = S3Server.start(tmp_path / "vh", domain=domain)
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost {domain} lmtier.{domain}\n")
    url = f"s3://lmtier/vh?endpoint=http://{domain}:{server.port}&addressing=virtual&relist=0"
    script = tmp_path / "vh.py"
    script.write_text(VIRTUAL_HOSTED)
    here = str(Path(__file__).resolve().parent)
    inner = f"mount --bind {hosts} /etc/hosts && exec {sys.executable} {script} '{url}' {here}"
    try:
        run = subprocess.run(["unshare", "-m", "sh", "-c", inner], capture_output=True, text=True, timeout=120)
    finally:
        server.stop()
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["served", "3", f"lmtier.{domain}:{server.port}"]


def test_what_a_listing_teaches_is_bounded_in_count_and_ordered_by_age():
    """A listing of many tiny objects named like chunks (a server gone wrong, or another
    program) cannot grow the index past its count; another writer's new objects go behind
    what the tier knows, older ones in front."""
    from lmtier.tiers.s3.index import Held

    held = Held(capacity=1 << 30, max_entries=4)
    held.add([b"mine"], [100])
    held.learn([(b"old1", 1, 10.0), (b"old2", 1, 20.0), (b"new1", 1, 200.0), (b"new2", 1, 300.0)], 1, 100.0)
    assert list(held.sizes) == [b"old1", b"old2", b"mine", b"new1", b"new2"]
    assert held.victims(0) == [b"old1"]  # five known, four allowed
    assert held.victims(0, new=2) == [b"old1", b"old2", b"mine"]

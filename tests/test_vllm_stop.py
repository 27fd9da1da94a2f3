"""A ``vllm serve`` that stops without grace keeps what lmtier saved seconds before.

Pods are stopped and rolled every day. ``vllm serve``'s default ``--shutdown-timeout`` of
0 ends the workers at once on SIGTERM, before any shutdown flush of theirs can run, and a
node that dies (or ``kill -9``) runs nothing at all. So nothing lmtier has taken on may
wait for a graceful stop: with ``save_policy=reuse`` (write-back, where memory holds chunks
the lower tiers do not have) the store writes down within seconds what memory holds
(lmtier.store's checkpoint), while the engine runs.

Each run: three requests, then a wait (bounded) until the disk holds all of their chunks
while the server keeps running; one more request, then the stop at once. What the disk
held must still be there, every chunk verified; how much of the last request made it is
measured and printed (it had under the checkpoint's interval to land).
"""

from __future__ import annotations

import signal

import numpy as np
import pytest

from lmtier.testing.tinymodel import build
from lmtier.testing.vllm_serve import CHUNK, VllmServer
from lmtier.tiers.disk import DiskTier

from conftest import eventually

pytestmark = pytest.mark.engine  # every test here starts vLLM engines: `make check` leaves them out

PROMPT_TOKENS = 1060  # 8 whole chunks of 128


def ids(seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(5, 500, PROMPT_TOKENS)]


def verified_chunks(disk) -> int:
    """Chunks the disk tier holds whose bytes pass their checksum."""
    tier = DiskTier(disk, size=1 << 40)
    try:
        keys = tier.keys(b"")
        good = 0
        for start in range(0, len(keys), 16):
            chunks = tier.get(keys[start : start + 16])
            good += sum(1 for c in chunks if c is not None and c.verify())
            for c in chunks:
                if c is not None:
                    c.release()
        return good
    finally:
        tier.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(build(tmp_path_factory.mktemp("model")))


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm-defaults", "kill-9"])
def test_a_server_stopped_without_grace_keeps_what_it_saved_seconds_before(model, tmp_path, signum, capsys):
    disk = tmp_path / "disk"
    server = VllmServer(model, disk, tmp_path / "serve.log", save_policy="reuse")
    try:
        for seed in range(3):
            server.complete(model, ids(seed))
        before = 3 * (PROMPT_TOKENS // CHUNK)
        # while the server runs, nothing evicted and nothing closed: memory is written down
        landed = eventually(lambda: verified_chunks(disk) >= before, seconds=120)
        server.complete(model, ids(99))
        server.kill(signum)  # vllm serve's defaults on SIGTERM (--shutdown-timeout 0), or kill -9
    finally:
        server.stop()
    assert landed, f"the disk held {verified_chunks(disk)} of {before} chunks while the server ran"
    after = verified_chunks(disk)
    assert after >= before  # nothing that had landed was lost or damaged by the stop
    with capsys.disabled():
        print(f"\n{signal.Signals(signum).name}: of the last request's 8 chunks, saved just before the stop, "
              f"{after - before} reached the disk; the 24 saved seconds before were all kept")  # fmt: skip

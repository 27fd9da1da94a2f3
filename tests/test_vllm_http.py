"""vLLM's OpenAI-compatible HTTP server with lmtier, as the README runs it (`vllm serve`
from the project's venv): two server processes, one after the other, over one disk tier,
and a real HTTP client sending each the same long prompt.

The second server loads the prompt's KV from lmtier (its `cached_tokens`, vLLM's
`external_prefix_cache_hits` metric) and answers exactly as the first server did from
its own prefix cache at the same number of cached tokens (bit for bit), and as the first
server's full prefill by greedy tokens (up to a near tie; see lmtier.testing.engine)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from lmtier.testing.engine import compare_answers
from lmtier.testing.tinymodel import build
from lmtier.testing.vllm_serve import BLOCK, CHUNK, VllmServer  # noqa: F401  (BLOCK: for other tests)

from conftest import disk_frames

pytestmark = pytest.mark.engine  # every test here starts vLLM engines: `make check` leaves them out

# 1060 tokens: lmtier holds 8 whole chunks (1024 tokens) of it, and vLLM's own prefix
# cache hits the same 1024 (whole blocks before the last token): the same computation.
PROMPT = [int(x) for x in np.random.default_rng(7).integers(5, 500, 1060)]


@pytest.mark.timeout(1500)
def test_two_vllm_http_servers_share_a_prompt_through_one_disk_tier(tmp_path):
    model = str(build(tmp_path / "model"))
    disk = tmp_path / "disk"
    first = VllmServer(model, disk, tmp_path / "first.log")
    try:
        computed = first.complete(model, PROMPT)
        own_hit = first.complete(model, PROMPT)  # vLLM's own prefix cache
    finally:
        first.stop()  # its saves are on disk once it has stopped
    assert computed["cached"] == 0 and own_hit["cached"] == 1024
    assert len(disk_frames(disk)) >= 8
    second = VllmServer(model, disk, tmp_path / "second.log")
    try:
        loaded = second.complete(model, PROMPT)
        external = second.metric("vllm:external_prefix_cache_hits_total")
        # lmtier's own figures in vLLM's /metrics (the connector's stats hooks), reported
        # by the engine on its next stats interval
        deadline = time.monotonic() + 30
        while second.metric("vllm:lmtier_tokens_total", result="loaded") < 1024 and time.monotonic() < deadline:
            time.sleep(0.5)
        lmtier_loaded = second.metric("vllm:lmtier_tokens_total", result="loaded")
        disk_hits = second.metric("vllm:lmtier_tier_reads_total", tier="disk", result="hits")
        by_source = second.metric("vllm:prompt_tokens_cached_by_source_total", source="disk")
    finally:
        second.stop()
    assert loaded["cached"] == 1024 and external == 1024
    assert lmtier_loaded == 1024 and disk_hits == 1024 // CHUNK and by_source == 1024
    problems, exact = compare_answers([loaded], [own_hit], [computed])
    assert not problems and exact == 1, problems
    assert "lmtier: vllm connector: tiers" in (tmp_path / "second.log").read_text()

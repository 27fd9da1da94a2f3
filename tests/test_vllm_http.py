"""vLLM's OpenAI-compatible HTTP server with lmtier, as the README runs it (`vllm serve`
from the project's venv): two server processes, one after the other, over one disk tier,
and a real HTTP client sending each the same long prompt.

The second server loads the prompt's KV from lmtier (its `cached_tokens`, vLLM's
`external_prefix_cache_hits` metric) and answers exactly as the first server did from
its own prefix cache at the same number of cached tokens (bit for bit), and as the first
server's full prefill by greedy tokens (up to a near tie; see lmtier.testing.engine)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from lmtier.testing.engine import compare_answers
from lmtier.testing.redis_server import free_port
from lmtier.testing.tinymodel import build

from conftest import disk_frames

CHUNK, BLOCK = 128, 64
# 1060 tokens: lmtier holds 8 whole chunks (1024 tokens) of it, and vLLM's own prefix
# cache hits the same 1024 (whole blocks before the last token): the same computation.
PROMPT = [int(x) for x in np.random.default_rng(7).integers(5, 500, 1060)]


class VllmServer:
    """``vllm serve`` as a user runs it (its own process group: ``kill(signal)`` reaches the
    engine core and the workers too), with lmtier's ``extra`` settings over a memory and a
    disk tier."""

    def __init__(
        self,
        model: str,
        disk: Path | None,
        log: Path,
        *,
        tiers: list[str] | None = None,
        role: str = "kv_both",
        **extra,
    ) -> None:
        self.port = free_port()
        transfer = {
            "kv_connector": "LMTierConnector",
            "kv_connector_module_path": "lmtier.connectors.vllm",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "tiers": tiers or ["cpu://?size=256MiB", f"file://{disk}?size=1GiB"],
                "chunk_tokens": CHUNK,
                **extra,
            },
        }
        cmd = [str(Path(sys.executable).parent / "vllm"), "serve", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--kv-transfer-config", json.dumps(transfer), "--dtype", "bfloat16",
               "--block-size", str(BLOCK), "--max-model-len", "2048", "--max-num-seqs", "2", "--enforce-eager",
               "--enable-prompt-tokens-details"]  # fmt: skip
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
        self.log = log
        self.proc = subprocess.Popen(
            cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        deadline = time.monotonic() + 420
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"vllm serve did not come up:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).status == 200
        except OSError:
            return False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def complete(self, model: str, prompt: list[int], base: str | None = None, **fields) -> dict:
        """One greedy completion (from ``base``, e.g. a proxy in front; ``fields``: more of
        the request's body); the output in lmtier.testing.engine's form."""
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 2, **fields}
        request = urllib.request.Request(
            f"{base or self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        answer = json.loads(urllib.request.urlopen(request, timeout=300).read())
        (choice,) = answer["choices"]
        logprobs = choice["logprobs"]
        margins = []
        for top in logprobs["top_logprobs"]:
            best = sorted(top.values(), reverse=True)
            margins.append(best[0] - best[1] if len(best) > 1 else float("inf"))
        return {
            "tokens": logprobs["tokens"],
            "logprobs": logprobs["token_logprobs"],
            "margins": margins,
            "cached": (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "prompt": hash(tuple(prompt)),
            "kv_transfer_params": answer.get("kv_transfer_params"),
        }

    def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels``."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10).read().decode()
        total = 0.0
        for found, value in re.findall(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", text, re.M):
            if all(f'{k}="{v}"' in found for k, v in labels.items()):
                total += float(value)
        return total

    def kill(self, signum: int) -> None:
        """``signum`` to every process of the server (``kill -9`` of a pod's processes), and
        wait for the server process to end."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signum)
            self.proc.wait(timeout=120)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


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

"""``vllm serve`` (the CPU build) in a child process, for tests, benchmarks and the demo:
started on a free port, ready when ``/health`` answers, asked for greedy completions with
logprobs, stopped gracefully or killed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from lmtier.testing.redis_server import free_port

CHUNK, BLOCK = 128, 64


class VllmServer:
    """``vllm serve`` as a user runs it (its own process group: ``kill(signal)`` reaches the
    engine core and the workers too), with lmtier's ``extra`` settings over a memory and a
    disk tier, or over ``tiers`` in ``role``, or any ``transfer`` (a whole
    ``--kv-transfer-config``); ``args``: more of ``vllm serve``'s flags, ``env``: more of
    its environment.

    ``worker_in_core``: the model's worker in the engine core's process, as ``vllm serve``
    runs one GPU (vLLM's one-process executor), instead of the process of its own that the
    CPU build starts by default (its multiprocess executor, a second import of vLLM and
    torch: a core's half-minute per server on a loaded 2-core machine)."""

    def __init__(
        self,
        model: str,
        disk: Path | None,
        log: Path,
        *,
        tiers: list[str] | None = None,
        role: str = "kv_both",
        transfer: dict | None = None,
        block: int = BLOCK,
        chunk: int = CHUNK,
        max_model_len: int = 2048,
        args: tuple[str, ...] = (),
        env: dict | None = None,
        worker_in_core: bool = False,
        **extra,
    ) -> None:
        self.port = free_port()
        transfer = transfer or {
            "kv_connector": "LMTierConnector",
            "kv_connector_module_path": "lmtier.connectors.vllm",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "tiers": tiers or ["cpu://?size=256MiB", f"file://{disk}?size=1GiB"],
                "chunk_tokens": chunk,
                **extra,
            },
        }
        cmd = [str(Path(sys.executable).parent / "vllm"), "serve", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--kv-transfer-config", json.dumps(transfer), "--dtype", "bfloat16",
               "--block-size", str(block), "--max-model-len", str(max_model_len), "--max-num-seqs", "2",
               "--enforce-eager", "--enable-prompt-tokens-details", *args]  # fmt: skip
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
        if worker_in_core:  # the CPU build keeps its one-process executor only with this off
            cmd += ["--distributed-executor-backend", "uni"]
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.log = log
        self.proc = subprocess.Popen(
            cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        deadline = time.monotonic() + 420
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vllm serve did not come up:\n{log.read_text()[-4000:]}")
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

    def ttft(self, model: str, prompt: list[int], max_tokens: int = 1) -> float:
        """Seconds to the first streamed token of a greedy completion."""
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        request = urllib.request.Request(f"{self.url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=300) as answer:
            for line in answer:
                if line.startswith(b"data: ") and b'"text"' in line:
                    first = time.perf_counter() - started
                    answer.read()
                    return first
        raise RuntimeError("no token streamed")

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

"""``vllm-router`` (the prebuilt binary from the package index) in a child process, for
tests and the fleet demo: started on free ports, ready once ``/health`` answers and every
worker it was given is healthy, stopped with it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from lmtier.testing.redis_server import die_with_parent, free_port


def router_binary() -> str:
    found = Path(sys.executable).parent / "vllm-router"
    return str(found) if found.exists() else (shutil.which("vllm-router") or "vllm-router")


class Router:
    def __init__(self, log: Path, *args: str, timeout: float = 60.0) -> None:
        self.port = free_port()
        self.log = log
        cmd = [router_binary(), "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-port",
               str(free_port()), "--log-level", "info", *args]  # fmt: skip
        self.proc = subprocess.Popen(die_with_parent(cmd), stdout=log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vllm-router did not come up:\n{log.read_text()[-4000:]}")
            time.sleep(0.3)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def post(self, path: str, body: dict, timeout: float = 300) -> dict:
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return json.loads(answer.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

"""``lmtier serve`` in a child process, for tests, benchmarks and the demo: started on a free
port, ready when its gRPC health service says so, stopped gracefully or killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

from lmtier.server.health import SERVING, check
from lmtier.testing.redis_server import die_with_parent, free_port


class ServerProcess:
    def __init__(
        self, workdir: Path, *args: str, port: int | None = None, start: bool = True, env: dict | None = None
    ) -> None:
        self.env = dict(env or {})
        self.port = port or free_port()
        self.dir = Path(workdir) / f"lmtier-serve-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.args = args
        self.proc: subprocess.Popen | None = None
        if start:
            self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else -1

    def start(self, timeout: float = 60.0, ready: bool = True) -> None:
        """Start and wait until the server is ready (or, with ``ready=False``, answers at all)."""
        cmd = [sys.executable, "-m", "lmtier", "serve", "--port", str(self.port), *self.args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        with open(self.dir / "server.log", "ab") as log:
            self.proc = subprocess.Popen(
                die_with_parent(cmd), stdout=log, stderr=subprocess.STDOUT, cwd=self.dir, env=env
            )
        deadline = time.monotonic() + timeout
        while (self.health() != SERVING) if ready else self.health() is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"lmtier serve on port {self.port} did not become ready:\n{self.log()[-3000:]}")
            time.sleep(0.1)

    def serving(self) -> bool:
        """Whether the health service answers SERVING (plaintext servers only)."""
        return self.health() == SERVING

    def health(self) -> int | None:
        """The health service's status; None when the server does not answer."""
        with grpc.insecure_channel(self.address) as channel:
            return check(channel, timeout=1)

    def log(self) -> str:
        path = self.dir / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (graceful shutdown); returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

"""Throwaway Redis servers for tests and benchmarks: single nodes and clusters.

``redis-server`` and ``redis-cli`` come from the system (``scripts/setup-system.sh``
installs them on Debian). Servers run without persistence in a directory of the caller's,
on free loopback ports, until ``stop``.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster: bool = False) -> int:
    """A free loopback port; for a cluster node, one whose bus port (+10000) is free too."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 50000)
        if _free(port) and (not cluster or _free(port + 10000)):
            return port


def cli(port: int, *args: str, timeout: float = 10, tls: tuple[str, ...] = ()) -> str:
    run = subprocess.run(
        ["redis-cli", "-p", str(port), *tls, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    return run.stdout.strip()


# Runs in the child instead of a ``preexec_fn``: Python code between fork and exec in a
# process with gRPC's threads can meet a lock or an event-engine thread that gRPC's fork
# handlers restart in the child (and whose epoll descriptor the child then closes: "epoll_wait
# error: Bad file descriptor" in the server's log, and no server). A fresh interpreter sets
# the signal, checks its parent is still the one that started it, and execs the command.
_GUARD = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)  # the parent is already gone\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def die_with_parent(cmd: list[str]) -> list[str]:
    """``cmd``, started so that it is killed when this process dies (Linux): a test run that
    is killed leaves no server behind."""
    return [sys.executable, "-S", "-c", _GUARD, str(os.getpid()), *cmd]


class RedisServer:
    """One ``redis-server``; with ``certificates`` (from ``lmtier.testing.certs``) it speaks
    TLS only, on its port."""

    def __init__(
        self, workdir: Path, *config: str, port: int | None = None, certificates: dict[str, str] | None = None
    ) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed: run scripts/setup-system.sh (make test does)")
        self.port = port or free_port(cluster="--cluster-enabled" in config)
        self.dir = workdir / f"redis-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config = config
        self.certificates = certificates
        self.tls_cli: tuple[str, ...] = ("--tls", "--cacert", certificates["ca.crt"]) if certificates else ()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        if self.certificates:
            return f"rediss://127.0.0.1:{self.port}?tls_ca={self.certificates['ca.crt']}"
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        ports = ["--port", str(self.port)]
        if self.certificates:
            c = self.certificates
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", c["server.crt"]]
            ports += ["--tls-key-file", c["server.key"], "--tls-ca-cert-file", c["ca.crt"], "--tls-auth-clients", "no"]
        args = ["redis-server", *ports, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(self.dir), *self.config]
        with open(self.dir / "server.log", "ab") as log:
            self.proc = subprocess.Popen(die_with_parent(args), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while cli(self.port, "PING", tls=self.tls_cli) not in ("PONG", "NOAUTH Authentication required."):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                tail = (self.dir / "server.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{tail}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        self.kill()

    def call(self, *args: str) -> str:
        return cli(self.port, *args, tls=self.tls_cli)


class RedisCluster:
    """Three masters, no replicas, every slot assigned."""

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        self.nodes: list[RedisServer] = []
        try:
            self._create(workdir, masters)
        except BaseException:
            self.stop()
            raise

    def _create(self, workdir: Path, masters: int) -> None:
        for _ in range(masters):
            self.nodes.append(RedisServer(workdir, "--cluster-enabled", "yes", "--cluster-node-timeout", "2000"))
        for node in self.nodes:  # each node keeps its cluster state in its own directory
            node.call("CONFIG", "SET", "cluster-require-full-coverage", "no")
        hosts = [f"127.0.0.1:{n.port}" for n in self.nodes]
        run = subprocess.run(
            ["redis-cli", "--cluster", "create", *hosts, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if run.returncode:
            raise RuntimeError(f"redis-cli --cluster create failed: {run.stdout[-2000:]} {run.stderr[-2000:]}")
        deadline = time.monotonic() + 30
        while not all("cluster_state:ok" in n.call("CLUSTER", "INFO") for n in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not become ready")
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def flush(self) -> None:
        for node in self.nodes:
            node.call("FLUSHALL")

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()

"""Throwaway Redis servers for tests and benchmarks (clusters: ``lmtier.testing.redis_cluster``).

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


def _ephemeral_start() -> int:
    """The first port the kernel hands out to outgoing connections (32768 by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(cluster: bool = False) -> int:
    """A free loopback port; for a cluster node, one whose bus port (+10000) is free too.
    Both lie below the kernel's range for outgoing connections, so that a connection made
    between this check and the server's start (a client's, on the same machine) cannot take
    one of them."""
    top = max(_ephemeral_start(), 12000) - (10000 if cluster else 0)
    rng = random.Random()
    while True:
        port = rng.randrange(max(1024, top - 12000), top)
        if _free(port) and (not cluster or _free(port + 10000)):
            return port


def cli(port: int, *args: str, timeout: float = 10, tls: tuple[str, ...] = (), host: str = "127.0.0.1") -> str:
    run = subprocess.run(
        ["redis-cli", "-h", host, "-p", str(port), *tls, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
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
    TLS only, on its port. ``host``: the address it binds (on loopback by default);
    ``wrap``: a command it runs under (``ip netns exec NS``: on a host of its own)."""

    def __init__(
        self,
        workdir: Path,
        *config: str,
        port: int | None = None,
        certificates: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        wrap: tuple[str, ...] = (),
    ) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed: run scripts/setup-system.sh (make test does)")
        self.host, self.wrap = host, wrap
        self.port = port or free_port(cluster="--cluster-enabled" in config)
        self.dir = workdir / (f"redis-{self.port}" if host == "127.0.0.1" else f"redis-{host}-{self.port}")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config = config
        self.certificates = certificates
        self.tls_cli: tuple[str, ...] = ("--tls", "--cacert", certificates["ca.crt"]) if certificates else ()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        if self.certificates:
            return f"rediss://{self.host}:{self.port}?tls_ca={self.certificates['ca.crt']}"
        return f"redis://{self.host}:{self.port}"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        ports = ["--port", str(self.port)]
        if self.certificates:
            c = self.certificates
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", c["server.crt"]]
            ports += ["--tls-key-file", c["server.key"], "--tls-ca-cert-file", c["ca.crt"], "--tls-auth-clients", "no"]
        args = [*self.wrap, "redis-server", *ports, "--bind", self.host, "--save", "", "--appendonly", "no"]
        args += ["--dir", str(self.dir), *self.config]
        if self.host != "127.0.0.1":  # on a host of its own (a test's namespace), reached from outside it
            args += ["--protected-mode", "no"]
        with open(self.dir / "server.log", "ab") as log:
            self.proc = subprocess.Popen(die_with_parent(args), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while self.call("PING") not in ("PONG", "NOAUTH Authentication required."):
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

    def call(self, *args: str, timeout: float = 10) -> str:
        return cli(self.port, *args, tls=self.tls_cli, host=self.host, timeout=timeout)

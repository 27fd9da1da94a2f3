"""Engines forked from a process that has imported vLLM already: where a test or a short
benchmark starts engine after engine, each starts in seconds instead of spending ten or
more (a core's worth) importing vLLM again.

    ENGINE_FORKS=1           ``run_engine`` forks the engines it is given no environment
                             of their own for (tests/conftest.py sets it)

Only the tests set it: the benchmarks' full runs, the demo as a user runs it and anything
a user times start every engine as a fresh process. A forked engine is the same engine
(its answers are those of a fresh process, bit for bit): what the server holds is vLLM's
modules, imported and untouched; each engine's configuration, its connector and its
threads begin in the fork, as in a fresh process.

The server, one per process that runs engines (started at its first engine, ended with
it or when it sees its parent gone)::

    python -m lmtier.testing.enginefork SOCKET

takes one engine per connection: a JSON line {"argv": [SPEC, RESULT], "log": path,
"cwd": dir, "env": {...}}; it answers {"pid": n} once it forked and {"status": code} once
that engine's process ended (its stderr in "log", as a fresh process's would be).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

FLAG = "ENGINE_FORKS"
# What a process imported at its start depends on: a caller whose value differs from the
# server's gets a fresh process instead.
_IMPORT_ENV = ("PYTHONPATH", "PYTHONHOME", "LD_PRELOAD", "VLLM_PLUGINS", "VLLM_TARGET_DEVICE")


def _imports() -> dict:
    """What this process's imports depend on: its import-path variables and its directory
    (the first entry of a ``python -m`` process's path)."""
    return {**{k: os.environ.get(k) for k in _IMPORT_ENV}, "cwd": os.getcwd()}


def wanted(env: dict | None) -> bool:
    """Whether an engine run with ``env`` (None: this process's) may be forked."""
    return env is None and os.environ.get(FLAG) == "1"


class _Server:
    """This process's fork server, started on first use."""

    _lock = threading.Lock()
    _current: _Server | None = None

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="lmtier-forks-")
        self.path = os.path.join(self.dir, "s")
        self.env = _imports()
        log = os.path.join(self.dir, "log")
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lmtier.testing.enginefork", self.path],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        atexit.register(self.stop)
        deadline = time.monotonic() + 300
        while not os.path.exists(self.path):  # it appears once vLLM is imported
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = Path(log).read_text(errors="replace")[-3000:]
                self.stop()
                raise RuntimeError(f"the engine fork server did not start:\n{tail}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    @classmethod
    def get(cls) -> _Server:
        with cls._lock:
            if cls._current is None or cls._current.proc.poll() is not None or cls._current.env != _imports():
                if cls._current is not None:
                    cls._current.stop()
                cls._current = cls()
            return cls._current


def run(argv: list[str], log: Path, timeout: float | None) -> tuple[int, str]:
    """Run ``python -m lmtier.testing.engine *argv`` as a fork of this process's server;
    returns its exit status and its stderr. Past ``timeout`` the engine is killed and
    ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` does."""
    server = _Server.get()
    request = {"argv": argv, "log": str(log), "cwd": os.getcwd(), "env": dict(os.environ)}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(server.path)
        conn.sendall(json.dumps(request).encode() + b"\n")
        lines = conn.makefile("r")
        pid = json.loads(lines.readline())["pid"]
        conn.settimeout(timeout)
        try:
            line = lines.readline()
        except TimeoutError:
            os.kill(pid, 9)
            raise subprocess.TimeoutExpired(["lmtier.testing.engine", *argv], timeout) from None
    if not line:
        raise RuntimeError("the engine fork server ended while an engine ran")
    return json.loads(line)["status"], log.read_text(errors="replace")


# -- the server ------------------------------------------------------------------------------------
def _child(request: dict, inherited: list[socket.socket]) -> None:
    """In the fork: become the engine process the request describes. It ends as a fresh
    process does, by leaving the interpreter (``SystemExit``, which nothing on the way out
    of ``serve`` catches): its pools told to stop, its threads joined, its ``atexit`` run."""
    for sock in inherited:  # the server's, not the engine's
        sock.close()
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        with open(os.devnull, "rb") as null, open(request["log"], "wb") as log, open(os.devnull, "wb") as out:
            os.dup2(null.fileno(), 0)
            os.dup2(out.fileno(), 1)  # as a fresh run's: its stdout is not the log
            os.dup2(log.fileno(), 2)
        sys.argv = ["lmtier.testing.engine", *request["argv"]]
        runpy.run_module("lmtier.testing.engine", run_name="__main__", alter_sys=True)  # as ``-m`` runs it
    except Exception:
        import traceback

        traceback.print_exc()
        sys.exit(1)
    sys.exit(0)


def serve(path: str) -> None:
    """Import vLLM, then fork an engine per connection until the parent is gone."""
    from vllm import LLM, SamplingParams  # noqa: F401  (what every engine imports first)

    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(16)
    os.rename(path + ".new", path)  # the caller connects once it exists
    running: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        readable, _, _ = select.select([listener], [], [], 0.2)
        if readable:
            conn, _ = listener.accept()
            with conn.makefile("rb") as lines:
                request = json.loads(lines.readline())
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the engine: it leaves from here
                _child(request, [listener, conn, *running.values()])
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            running[pid] = conn
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = running.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass  # the caller gave up on it (a timeout)
                conn.close()
    for pid in running:  # the parent is gone: so are its engines
        os.kill(pid, 9)


if __name__ == "__main__":
    serve(sys.argv[1])

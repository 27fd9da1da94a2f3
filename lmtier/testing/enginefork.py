"""Engines forked from a process that has imported vLLM already: where a test starts
engine after engine, each starts in seconds instead of spending ten or more (a core's
worth) importing vLLM again.

    ENGINE_FORKS=1           ``run_engine`` forks the engines it is given no environment
                             of their own for (tests/conftest.py sets it)

Only the tests set it: the benchmarks' full runs, the demo as a user runs it and anything
a user times start every engine as a fresh process. A forked engine runs the same code on
the same inputs as a fresh one (tests/test_engine_forks.py compares their answers bit for
bit): the server imported vLLM and nothing else, and each engine's configuration, its
connector, its threads and its children begin in the fork. What it inherits instead of
making: the modules, the environment variables the import read (the server's start
environment: a caller whose environment differs in one of them gets a fresh process), the
import's own additions to the environment, and the process's umask,
limits and hash seed. Threads the import started (torch's) are not in the fork.

The server, one per calling process (started at its first engine; it ends when the caller
does, kills its engines then, and removes its socket's directory)::

    python -m lmtier.testing.enginefork SOCKET CALLER_PID

takes one engine per connection: a JSON line {"argv": [SPEC, RESULT], "log": path,
"cwd": dir, "env": {...}}; it answers {"pid": n} once it forked and {"status": code} once
that engine's process ended (its stderr in "log", as a fresh process's would be). The
engine lives as long as its connection: a caller that closes it, or stops writing to it
(``shutdown``), has the engine and its children killed.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

FLAG = "ENGINE_FORKS"
# Environment variables read when a module is imported (the interpreter's own, the
# loader's, Hugging Face's, torch's, vLLM's logging and platform): a caller whose values
# differ from the server's start environment gets a fresh process. The others (vLLM's
# VLLM_*, lmtier's, the ones vLLM itself sets as it configures an engine in-process) are
# read as they are used, in the fork.
_READ_AT_IMPORT = (
    "PYTHON", "LD_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH_", "TOKENIZERS_",
    "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_", "VLLM_PLUGINS", "VLLM_TARGET_DEVICE", "VLLM_USE_MODELSCOPE",
)  # fmt: skip
_START_S = 300  # the server's import of vLLM, on a loaded machine
_KILL_S = 30  # an engine killed: its status back within this


def _fingerprint() -> dict:
    """What this process's imports depend on: its variables read at import, and its
    directory (the first entry of a ``python -m`` process's path)."""
    return {"env": {k: v for k, v in os.environ.items() if k.startswith(_READ_AT_IMPORT)}, "cwd": os.getcwd()}


def wanted(env: dict | None) -> bool:
    """Whether an engine run with ``env`` (None: this process's) may be forked."""
    return env is None and os.environ.get(FLAG) == "1"


class _Server:
    """This process's fork server, started on first use."""

    _lock = threading.Lock()
    _current: _Server | None = None

    def __init__(self) -> None:
        self.owner = os.getpid()
        self.fingerprint = _fingerprint()
        self.dir = tempfile.mkdtemp(prefix="lmtier-forks-")
        self.path = os.path.join(self.dir, "s")
        self.log = os.path.join(self.dir, "log")
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lmtier.testing.enginefork", self.path, str(self.owner)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        atexit.register(self.stop)
        deadline = time.monotonic() + _START_S
        while not os.path.exists(self.path):  # it appears once vLLM is imported
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.tail()
                self.stop()
                raise RuntimeError(f"the engine fork server did not start:\n{tail}")
            time.sleep(0.05)

    def tail(self) -> str:
        try:
            return Path(self.log).read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Ends the server (its engines with it); only the process that started it does."""
        if os.getpid() != self.owner:
            return  # a process forked from the caller: the server is not its own
        if self.proc.poll() is None:
            self.proc.terminate()  # it kills its engines, then leaves
            try:
                self.proc.wait(timeout=_KILL_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    @classmethod
    def get(cls) -> _Server | None:
        """This process's server, started if need be; None where this process's environment
        is not the one its server started with (that engine starts fresh)."""
        with cls._lock:
            server = cls._current
            if server is not None and (server.owner != os.getpid() or server.proc.poll() is not None):
                server = cls._current = None  # inherited through a fork, or ended
            if server is None:
                server = cls._current = cls()
            return server if server.fingerprint == _fingerprint() else None


def run(argv: list[str], log: Path, timeout: float | None) -> tuple[int, str] | None:
    """Run ``python -m lmtier.testing.engine *argv`` as a fork of this process's server;
    returns its exit status and its stderr, or None where it cannot be forked (start it
    fresh). Past ``timeout`` the engine is killed and ``subprocess.TimeoutExpired`` raised,
    as ``subprocess.run`` does; whatever else stops the caller (an interrupt, a test's
    own timeout) closes the connection, and the server kills the engine."""
    server = _Server.get()
    if server is None:
        return None
    deadline = None if timeout is None else time.monotonic() + timeout
    request = {"argv": argv, "log": str(log), "cwd": os.getcwd(), "env": dict(os.environ)}
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(server.path)
            conn.sendall(json.dumps(request).encode() + b"\n")
            lines = conn.makefile("r")
            try:
                conn.settimeout(None if deadline is None else max(0.0, deadline - time.monotonic()))
                json.loads(lines.readline())["pid"]
                line = lines.readline()
            except TimeoutError:
                conn.shutdown(socket.SHUT_WR)  # the server kills it, says so and closes
                conn.settimeout(_KILL_S)
                with contextlib.suppress(OSError):
                    while conn.recv(4096):
                        pass
                error = subprocess.TimeoutExpired(["lmtier.testing.engine", *argv], timeout)
                error.stderr = log.read_text(errors="replace") if log.exists() else ""
                raise error from None
    except (OSError, ValueError, KeyError) as exc:
        raise RuntimeError(f"the engine fork server failed ({exc!r}):\n{server.tail()}") from None
    if not line:
        raise RuntimeError(f"the engine fork server ended while an engine ran:\n{server.tail()}")
    if not log.exists():  # it failed before it could open its log
        raise RuntimeError(f"the forked engine did not start:\n{server.tail()}")
    return json.loads(line)["status"], log.read_text(errors="replace")


# -- the server ------------------------------------------------------------------------------------
def _child(request: dict, imported: dict, inherited: list[socket.socket]) -> None:
    """In the fork: become the engine process the request describes. It ends as a fresh
    process does, by leaving the interpreter (``SystemExit``, which nothing on the way out
    of ``serve`` catches): its pools told to stop, its threads joined, its ``atexit`` run."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.setpgid(0, 0)  # its children (vLLM's engine core, its workers) go with it
    for sock in inherited:  # the server's, not the engine's
        sock.close()
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update({**imported, **request["env"]})
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


def _kill(pid: int) -> None:
    """An engine and its children (its process group)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def serve(path: str, caller: int) -> None:
    """Import vLLM, then fork an engine per connection while the caller lives."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # as lmtier.testing.engine sets it before its import
    before = dict(os.environ)
    from vllm import LLM, SamplingParams  # noqa: F401  (what every engine imports first)

    imported = {k: v for k, v in os.environ.items() if before.get(k) != v}  # what the import set
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(16)
    os.rename(path + ".new", path)  # the caller connects once it exists
    running: dict[int, socket.socket] = {}  # engine pid -> its caller's connection
    killed: set[int] = set()  # engines whose caller stopped listening, not yet reaped
    me = os.getpid()
    try:
        while os.getppid() == caller:
            watched = {conn.fileno(): pid for pid, conn in running.items() if pid not in killed}
            readable, _, _ = select.select([listener, *(running[pid] for pid in watched.values())], [], [], 0.2)
            for sock in readable:
                if sock is listener:
                    _start(listener, running, imported)
                else:  # a caller closed or shut down its side: its engine goes
                    pid = watched[sock.fileno()]
                    _kill(pid)
                    killed.add(pid)
            _reap(running)
            killed &= running.keys()  # (the reaped ones are gone from both)
    finally:  # the caller is gone, or told the server to stop: so are its engines
        if os.getpid() == me:  # (not an engine, leaving the interpreter through here)
            for pid in running:
                _kill(pid)
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def _start(listener: socket.socket, running: dict, imported: dict) -> None:
    """One request: read it (within seconds), fork its engine, say its pid. A bad or
    vanished caller costs its own connection, never the server or the others' engines."""
    conn, _ = listener.accept()
    try:
        conn.settimeout(10)
        with conn.makefile("rb") as lines:
            request = json.loads(lines.readline())
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the engine: it leaves from here
            _child(request, imported, [listener, conn, *running.values()])
        with contextlib.suppress(OSError):  # its own group, before anyone may kill it (the child does the same)
            os.setpgid(pid, pid)
        running[pid] = conn
        conn.settimeout(None)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"enginefork: a request failed: {exc!r}", flush=True)
        if conn not in running.values():
            conn.close()


def _reap(running: dict) -> None:
    """Engines that ended: their status to their callers."""
    while running:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = running.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            except OSError:
                pass  # the caller is gone
            conn.close()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))

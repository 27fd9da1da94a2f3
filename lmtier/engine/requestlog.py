"""The request log: each request an engine sees, as ``lmtier plan`` reads it back
(``log:PATH``, lmtier/plan/traces.py), so that a fleet can be planned on its own traffic.

    RequestLog(path, max_bytes)
      .write(tokens, keys)    one line: {"t": seconds since the epoch, "tokens": N, "chunk_tokens": C,
                              "chunks": [hex, ...]}; ``t`` never before the line above it
                              (the wall clock may step back: a plan needs arrival order)
      .close()

A line names the prompt's full chunks by their keys (hashes of the tokens and the model's
namespace: no token and no text leaves the engine). Bounded: past ``max_bytes / 2`` the
file is renamed ``PATH.1`` (replacing the one before) and a new one begun, so the two
hold at most ``max_bytes``. Lines are buffered and flushed once a second by a thread of the
log's own (a request's line is in the file within a second, an idle engine's last one
too), and at ``close`` (the connector's shutdown, or the interpreter's exit: a process
killed outright loses at most its last second). A line a crash or a full disk cut short
is removed when the next engine opens the file. A write or flush that fails (a full disk,
a directory gone) turns the log off with one warning: the engine never fails because of
it. One process writes one file: with vLLM's data parallelism each rank writes
``PATH.dpN`` (the connector adds it).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import stat
import threading
import time
import weakref
from collections.abc import Sequence

from lmtier.errors import ConfigError

log = logging.getLogger(__name__)

FLUSH_S = 1.0
MAX_CUT = 16 << 20  # bytes searched back for the last whole line of a log a crash cut
_OPEN: weakref.WeakSet = weakref.WeakSet()  # flushed at the interpreter's exit


@atexit.register
def _close_all() -> None:
    for open_log in list(_OPEN):
        open_log.close()


def _cut_tail(path: str) -> None:
    """A line a crash or a full disk cut short ends the file: it goes, so that this
    engine's lines start on a line of their own and the log stays readable."""
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return
            f.seek(max(0, size - MAX_CUT))
            tail = f.read()
            if tail.endswith(b"\n"):
                return
            keep = size - len(tail) + tail.rfind(b"\n") + 1  # rfind -1: nothing whole in reach
            f.truncate(keep)
    except FileNotFoundError:
        return


class RequestLog:
    def __init__(self, path: str, max_bytes: int, chunk_tokens: int = 0) -> None:
        self.path, self.max_bytes, self.chunk_tokens = path, max(4096, max_bytes), chunk_tokens
        self._lock = threading.Lock()
        try:
            if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the engine
                raise ConfigError(f"request_log {path} is not a regular file")
            _cut_tail(path)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (kept open: one line a request)
        except OSError as exc:
            raise ConfigError(f"request_log {path} cannot be written: {exc}") from None
        self._size = self._file.tell()
        self._dirty = False  # lines written since the last flush
        self._last_t = 0.0
        self._too_long = 0  # lines over half of max_bytes, left out
        self.on = True
        self._closed = threading.Event()
        _OPEN.add(self)
        threading.Thread(target=self._flusher, name="lmtier-request-log", daemon=True).start()

    def write(self, tokens: int, keys: Sequence[bytes]) -> None:
        if not self.on:
            return
        try:
            with self._lock:
                if not self.on:  # closed meanwhile
                    return
                self._last_t = max(self._last_t, round(time.time(), 3))
                record = {"t": self._last_t, "tokens": tokens, "chunk_tokens": self.chunk_tokens or None,
                          "chunks": [k.hex() for k in keys]}  # fmt: skip
                line = json.dumps(record) + "\n"
                if len(line) > self.max_bytes // 2:  # would rotate at every such line, past the bound
                    self._too_long += 1
                    if self._too_long == 1:
                        log.warning("lmtier: a request's line (%d bytes) is over half of request_log_bytes: "
                                    "such lines are left out of %s", len(line), self.path)  # fmt: skip
                    return
                if self._size + len(line) > self.max_bytes // 2:
                    self._rotate()
                self._file.write(line)
                self._size += len(line)
                self._dirty = True
        except (OSError, ValueError) as exc:
            self._off(exc)

    def _off(self, exc: Exception) -> None:
        self.on = False
        log.warning("lmtier: the request log %s failed (%s): it is off until the engine restarts", self.path, exc)

    def _flush(self) -> None:
        with self._lock:
            if not (self.on and self._dirty):
                return
            try:
                self._file.flush()
                self._dirty = False
            except (OSError, ValueError) as exc:
                self._off(exc)

    def _flusher(self) -> None:
        while not self._closed.wait(FLUSH_S):
            self._flush()

    def _rotate(self) -> None:
        self._file.close()
        os.replace(self.path, self.path + ".1")
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._size = 0

    def close(self) -> None:
        """Flush what is buffered and close (the connector's shutdown, or the interpreter's
        exit); idempotent."""
        self._closed.set()
        _OPEN.discard(self)
        self._flush()
        with self._lock:
            try:
                self._file.close()
            except OSError:
                pass
            self.on = False

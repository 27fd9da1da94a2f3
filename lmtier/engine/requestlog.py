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
too), and at ``close`` (the connector's shutdown); a write or flush that fails (a full
disk, a directory gone) turns the log off with one warning: the engine never fails
because of it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence

from lmtier.errors import ConfigError

log = logging.getLogger(__name__)

FLUSH_S = 1.0


class RequestLog:
    def __init__(self, path: str, max_bytes: int, chunk_tokens: int = 0) -> None:
        self.path, self.max_bytes, self.chunk_tokens = path, max(4096, max_bytes), chunk_tokens
        self._lock = threading.Lock()
        try:
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (kept open: one line a request)
        except OSError as exc:
            raise ConfigError(f"request_log {path} cannot be written: {exc}") from None
        self._size = self._file.tell()
        self._dirty = False  # lines written since the last flush
        self._last_t = 0.0
        self.on = True
        self._closed = threading.Event()
        threading.Thread(target=self._flusher, name="lmtier-request-log", daemon=True).start()

    def write(self, tokens: int, keys: Sequence[bytes]) -> None:
        if not self.on:
            return
        try:
            with self._lock:
                self._last_t = max(self._last_t, round(time.time(), 3))
                record = {"t": self._last_t, "tokens": tokens, "chunk_tokens": self.chunk_tokens or None,
                          "chunks": [k.hex() for k in keys]}  # fmt: skip
                line = json.dumps(record) + "\n"
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
        """Flush what is buffered and close (the connector's shutdown); idempotent."""
        self._closed.set()
        self._flush()
        with self._lock:
            try:
                self._file.close()
            except OSError:
                pass
            self.on = False

"""The cache server's metrics port: ``/metrics``, ``/healthz`` and ``/readyz`` over plain
HTTP, bounded against whoever can reach it, since the kubelet's probes ask it whether to
keep the pod.

    MetricsHTTPServer(address, handler)     at most MAX_CONNECTIONS at once, more closed
                                            as they arrive
    metrics_handler(server) -> handler      the three paths, answered from ``server``

A connection has ``REQUEST_DEADLINE_S`` in all to send its request line and headers, and
``MAX_REQUEST_BYTES`` of them (every read is given what is left of the deadline, so a
client trickling a byte at a time is cut off as one that sends nothing is); probes and
Prometheus send a few hundred bytes at once. A client that resets its connection costs a
debug line, not a traceback; a process out of descriptors waits a moment before its next
``accept`` instead of spinning on it.
"""

from __future__ import annotations

import errno
import io
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lmtier import metrics

log = logging.getLogger(__name__)

REQUEST_DEADLINE_S = 5.0  # a request line and its headers, in all
MAX_REQUEST_BYTES = 16 * 1024  # ... and at most this many bytes of them
ACCEPT_PAUSE_S = 0.1  # out of descriptors: the wait before the next accept


class MetricsHTTPServer(ThreadingHTTPServer):
    """The metrics port's HTTP server, bounded: at most ``MAX_CONNECTIONS`` connections at
    once (more are closed as they arrive), each closed after ``TIMEOUT_S`` without a
    request or ``REQUEST_DEADLINE_S`` without a whole one, so that idle or trickling
    connections cannot take the threads and descriptors the server needs (Prometheus and
    the kubelet open one at a time)."""

    MAX_CONNECTIONS = 64
    TIMEOUT_S = 2.0
    daemon_threads = True
    request_queue_size = 128  # the listen backlog (socketserver's default is 5)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(self.MAX_CONNECTIONS)

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return super().get_request()
        except OSError as exc:  # socketserver skips this connection and selects again at once
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                time.sleep(ACCEPT_PAUSE_S)
            raise

    def process_request(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
        """A client that reset or broke its connection: one debug line (socketserver's
        default prints a traceback to stderr for each, past the logging's levels)."""
        log.debug("metrics port: a connection from %s ended in error", client_address, exc_info=True)


class _Deadline(io.RawIOBase):
    """A connection's reads, each given what is left of one deadline, and a byte budget."""

    def __init__(self, sock: socket.socket, seconds: float, budget: int) -> None:
        self._sock, self._until, self._left = sock, time.monotonic() + seconds, budget

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self._until - time.monotonic()
        if remaining <= 0 or self._left <= 0:
            raise TimeoutError("the request took too long or is too large")
        self._sock.settimeout(min(remaining, MetricsHTTPServer.TIMEOUT_S))
        view = memoryview(buffer)[: self._left]
        n = self._sock.recv_into(view)
        self._left -= n
        return n


def metrics_handler(server: Any) -> type[BaseHTTPRequestHandler]:
    """The handler of ``server``'s metrics port (``server.metrics_allowed`` guards
    ``/metrics``; ``server.ready`` answers ``/readyz``)."""

    class Handler(BaseHTTPRequestHandler):
        timeout = MetricsHTTPServer.TIMEOUT_S  # a connection that sends nothing is closed

        def setup(self) -> None:
            super().setup()
            raw = _Deadline(self.connection, REQUEST_DEADLINE_S, MAX_REQUEST_BYTES)
            self.rfile = io.BufferedReader(raw, 4096)  # type: ignore[assignment]

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics" and not server.metrics_allowed(self.headers.get("Authorization", "")):
                self._send(401, b"/metrics needs the metrics token: Authorization: Bearer <metrics_token>\n")
            elif path == "/metrics":
                body = generate_latest(metrics.REGISTRY) + generate_latest(metrics.SERVER_REGISTRY)
                self._send(200, body, CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                self._send(200, b"ok\n")
            elif path == "/readyz":
                ok = server.ready
                self._send(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
            else:
                self._send(404, b"not found: try /metrics, /healthz or /readyz\n")

        def _send(self, code: int, body: bytes, kind: str = "text/plain; charset=utf-8") -> None:
            self.connection.settimeout(MetricsHTTPServer.TIMEOUT_S)  # the answer: a reader that stalls is cut off
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # scrapes every few seconds: not worth a log line
            pass

    return Handler

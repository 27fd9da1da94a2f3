"""Connections to one Redis server: how to reach it, a bounded pool, a backoff.

    Settings                         frozen: what a connection needs (timeouts, TLS,
                                     credentials, database, pool size, a name for metrics)
    connect(settings, host, port, path) -> Stream
                                     TCP (or a unix socket), TLS, AUTH, SELECT
    Node(settings, host, port, path) one server
        .run(work) -> work(stream)     on a pooled connection; a broken one is dropped,
                                       the node backs off and ``Closed`` propagates
        .down() -> bool                backing off after a failure
        .close()

A node that starts failing is logged once (and once when it answers again), not per call.

Nothing here knows the tier: it hands down a ``Settings``.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmtier import metrics
from lmtier.tiers.redis.resp import Closed, ReplyError, Stream

log = logging.getLogger(__name__)

MAX_BACKOFF = 30.0  # seconds a failed node is skipped at most (the wait doubles up to it)


@dataclass(frozen=True)
class Settings:
    timeout: float = 2.0  # seconds without progress on one call before it fails
    connect_timeout: float = 1.0  # seconds to connect and finish the TLS handshake
    pool: int = 4  # connections per node at most
    user: bytes = b""  # AUTH user (Redis 6 ACLs); empty: the default user
    password: bytes = field(default=b"", repr=False)  # AUTH password; empty: no AUTH
    db: int = 0  # SELECT on connect when not 0
    tls: ssl.SSLContext | None = None  # None: plain TCP
    readonly: bool = False  # READONLY on connect: a cluster replica serves reads of its master's slots
    max_backoff: float = MAX_BACKOFF  # a failed node is skipped at most this long (a cluster's: less)
    name: str = "redis"  # the tier's name, for metrics


def connect(settings: Settings, host: str = "", port: int = 0, path: str = "") -> Stream:
    """A ready connection: connected, TLS set up, authenticated, on its database."""
    peer = path or f"{host}:{port}"
    try:
        if path:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(settings.connect_timeout)
            sock.connect(path)
        else:
            sock = socket.create_connection((host, port), timeout=settings.connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if settings.tls is not None:
            sock = settings.tls.wrap_socket(sock, server_hostname=host or None)
    except OSError as exc:
        raise Closed(f"cannot connect to {peer}: {exc}") from exc
    sock.settimeout(settings.timeout)
    stream = Stream(sock, peer)
    setup = []
    if settings.password:
        auth = [settings.user, settings.password] if settings.user else [settings.password]
        setup.append([b"AUTH", *auth])
    if settings.db:
        setup.append([b"SELECT", str(settings.db).encode()])
    if settings.readonly:
        setup.append([b"READONLY"])
    for args in setup:
        answer = stream.call(*args)
        if isinstance(answer, ReplyError):
            stream.close()
            raise Closed(f"{peer} refused {args[0].decode()}: {answer}")
    return stream


class Node:
    """One Redis server: a bounded pool of connections and a backoff when it is down."""

    def __init__(self, settings: Settings, host: str = "", port: int = 0, path: str = "") -> None:
        self.settings, self.host, self.port, self.path = settings, host, port, path
        self._fresh()

    def _fresh(self) -> None:
        """An empty pool for this process. After ``fork`` the parent's connections are not
        ours to use (their bytes would interleave with the parent's), and its locks may
        have been held by a thread that does not exist here."""
        self._idle: list[Stream] = []
        self._lock = threading.Lock()
        self._permits = threading.BoundedSemaphore(self.settings.pool)
        self._down_until = 0.0
        self._backoff = 0.0
        self._pid = os.getpid()

    def __str__(self) -> str:
        return self.path or f"{self.host}:{self.port}"

    def down(self) -> bool:
        return time.monotonic() < self._down_until

    def run(self, work: Callable[[Stream], Any]) -> Any:
        """Run ``work`` on a pooled connection; a broken connection is dropped, the node
        backs off, and ``Closed`` propagates."""
        if self._pid != os.getpid():
            self._fresh()  # the parent's sockets are dropped here without a word to Redis
        if self.down():
            raise Closed(f"{self} is backing off after a failure")
        timeout = self.settings.timeout
        if not self._permits.acquire(timeout=timeout):
            raise Closed(f"{self}: no free connection within {timeout} s")
        conn = None
        try:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                conn = connect(self.settings, self.host, self.port, self.path)
            conn.begin(timeout)
            result = work(conn)
            with self._lock:
                self._idle.append(conn)
            conn = None
            if self._backoff:
                log.info("redis tier %s: %s answers again", self.settings.name, self)
            self._backoff = 0.0
            return result
        except Closed as exc:
            if not self._backoff:  # said once when it starts failing, not per call or chunk
                log.warning("redis tier %s: %s failed (%s); its keys miss while it backs off", self.settings.name,
                            self, exc)  # fmt: skip
            self._backoff = min(self.settings.max_backoff, max(0.1, 2 * self._backoff))
            self._down_until = time.monotonic() + self._backoff
            metrics.TIER_ERRORS.labels(self.settings.name, "connection").inc()
            raise
        finally:
            if conn is not None:
                conn.close()
            self._permits.release()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

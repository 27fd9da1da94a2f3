"""``DataChannel``: a grpc tier's loads and saves through the server's bulk data channel
(the wire: ``lmtier.transport.datachannel``; the server: ``lmtier.server.data``).

    DataChannel(host, open_data, ssl_context, server_name, buffers, on_corrupt, tier, timeout)
        .get(keys) -> list[Chunk | None] | None    None: not through this channel, use gRPC
        .put(chunks) -> int | None                 chunks stored; None likewise

For a server on another host (no shared memory): a ticket from the server's ``OpenData``
call opens a connection of its own, kept for the next loads (at most ``KEEP`` idle ones).
Each frame is read into one pooled buffer and checked as gRPC's are (``codec.decode``:
key, layout, header checksum), its payload hashed as it arrives (``codec.PayloadHash``:
while the bytes are in cache and the link is what the reader waits for).

Saves send each chunk's frame from where the chunk lies (its head, then its payload: one
``sendmsg``), all of a batch before the one answer.

The channel only ever makes loads and saves faster: where the server runs none (an older server:
UNIMPLEMENTED; one without: FAILED_PRECONDITION), its port cannot be reached, it refuses
the connection or a request, or the connection breaks, the load or save goes through
gRPC's ``Get`` or ``Put`` (counted as ``data_fallbacks``), and the channel is tried again only after
``RETRY_S`` (``BROKEN_S`` after a refusal or a broken connection). A client that asked
for TLS never sends over a channel without it.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc

from lmtier.buffers import BufferPool
from lmtier.errors import IntegrityError, LmtierError, TierError
from lmtier.kv import codec
from lmtier.kv.chunk import Chunk, release_all
from lmtier.transport.datachannel import (
    END,
    ERROR,
    FRAME,
    HELLO,
    ITEM,
    MAX_ERROR,
    PUT,
    REQUEST,
    Closed,
    encode_request,
    recv_exact,
    send_parts,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

KEEP = 2  # idle connections kept (the server closes idle ones for others when it runs short)
RETRY_S = 60.0  # after a server that runs none, or cannot be reached
BROKEN_S = 1.0  # after a refusal (the server's limits) or a broken connection
CONNECT_S = 2.0
MAX_FRAME = 1 << 30  # where the chunk size is not known
FRAME_SLACK = 1 << 20  # a frame's header and more, beyond a known chunk size
MIN_RATE = 100e6  # bytes/s: a load's deadline grows by the bytes its frames announce at this rate


class Deadline:
    """When a load must be over: ``arm`` gives a socket what is left (``socket.timeout``
    once nothing is), ``extend`` moves it later."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def extend(self, seconds: float) -> None:
        self.at += seconds

    def arm(self, sock: socket.socket) -> None:
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError("the load's deadline passed")
        sock.settimeout(left)


class Unusable(Exception):
    """This load cannot go through the channel (the reason is the message); the channel
    is not tried again for ``pause`` seconds."""

    def __init__(self, message: str, pause: float = RETRY_S) -> None:
        super().__init__(message)
        self.pause = pause


class DataChannel:
    def __init__(
        self,
        host: str,
        open_data: Callable[[], object],
        ssl_context: Callable[[], ssl.SSLContext] | None,
        server_name: str,
        buffers: BufferPool,
        on_corrupt: Callable[[bytes], None],
        tier: str,
        timeout: float,
        max_frame: int = MAX_FRAME,
    ) -> None:
        self.host, self.max_frame = host, max_frame
        self._open_data, self._ssl_context = open_data, ssl_context
        self.server_name = server_name or host
        self._buffers, self._on_corrupt, self.tier, self.timeout = buffers, on_corrupt, tier, timeout
        self._idle: list[socket.socket] = []
        self._off_until = 0.0
        self._lock = threading.Lock()
        self._opening = threading.Lock()
        self._pid = os.getpid()
        self.fallbacks = 0

    def get(self, keys: Sequence[bytes]) -> list[Chunk | None] | None:
        return self._exchange(lambda sock: self._load(sock, keys))

    def put(self, chunks: Sequence[Chunk]) -> int | None:
        """Chunks stored (or held already) of ``chunks``; None: not through this channel."""
        try:
            frames = [codec.encode_parts(c) for c in chunks]
        except IntegrityError:  # a chunk damaged here: gRPC's path says so in its own words
            return None
        return self._exchange(lambda sock: self._save(sock, frames))

    def _exchange(self, fn: Callable[[socket.socket], T]) -> T | None:
        if time.monotonic() < self._off_until:
            return None
        for reused in (True, False):  # a kept connection the server closed meanwhile: once more, new
            try:
                sock = self._connection(reused)
                if sock is None:
                    continue
                return fn(sock)
            except Unusable as exc:
                self._off(str(exc), exc.pause)
                return None
            except TimeoutError as exc:  # a server that stalls or trickles: no second try through gRPC
                self._off(f"timed out: {exc}", BROKEN_S)
                raise TierError(f"data channel: no answer within the load's deadline ({exc})") from exc
            except (OSError, Closed) as exc:
                if reused:
                    continue
                self._off(f"the connection broke: {exc}", BROKEN_S)
                return None
        return None

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    # -- connections --------------------------------------------------------------------------
    def _connection(self, reused: bool) -> socket.socket | None:
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's connections are not ours
                self._idle, self._pid, self._opening = [], os.getpid(), threading.Lock()
            if reused:
                return self._idle.pop() if self._idle else None
        with self._opening:  # one at a time: where the port cannot be reached, one waits for it
            if time.monotonic() < self._off_until:
                return None
            return self._open()

    def _open(self) -> socket.socket:
        try:
            answer = self._open_data()
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION):
                raise Unusable(f"the server runs none ({exc.code().name})") from exc
            raise Unusable(f"no ticket: {exc.code().name}: {exc.details()}", BROKEN_S) from exc
        if self._ssl_context is not None and not answer.tls:  # type: ignore[attr-defined]
            raise Unusable("the server's data channel has no TLS and this tier asked for it")
        try:
            sock = socket.create_connection((self.host, answer.port), timeout=min(CONNECT_S, self.timeout))  # type: ignore[attr-defined]
        except OSError as exc:  # a port a firewall closes, or no route: not for a while
            raise Unusable(f"cannot reach port {answer.port}: {exc}") from exc  # type: ignore[attr-defined]
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if answer.tls:  # type: ignore[attr-defined]
                try:
                    context = self._ssl_context() if self._ssl_context is not None else ssl.create_default_context()
                except LmtierError as exc:  # the TLS files: gRPC says so in its own words
                    raise Unusable(str(exc)) from exc
                try:
                    sock = context.wrap_socket(sock, server_hostname=self.server_name)
                except ssl.SSLError as exc:  # a certificate this tier does not trust: not for a while
                    raise Unusable(f"TLS: {exc}") from exc
            sock.settimeout(self.timeout)
            sock.sendall(HELLO + answer.ticket)  # type: ignore[attr-defined]
        except BaseException:
            sock.close()
            raise
        return sock

    def _keep(self, sock: socket.socket) -> None:
        with self._lock:
            if len(self._idle) < KEEP and self._pid == os.getpid():
                self._idle.append(sock)
                return
        sock.close()

    def _off(self, why: str, pause: float) -> None:
        self.fallbacks += 1
        if time.monotonic() >= self._off_until:
            log.info("grpc tier %s: loads through gRPC for %.0f s: data channel: %s", self.tier, pause, why)
        self._off_until = time.monotonic() + pause

    # -- one load -------------------------------------------------------------------------------
    def _load(self, sock: socket.socket, keys: Sequence[bytes]) -> list[Chunk | None]:
        out: list[Chunk | None] = [None] * len(keys)
        done = False
        # one deadline for the whole load (a server that trickles a byte a second never
        # trips a per-recv timeout), later by the bytes its frames announce at MIN_RATE
        deadline = Deadline(self.timeout)
        try:
            sock.settimeout(self.timeout)
            sock.sendall(encode_request(keys))
            index = 0
            while True:
                deadline.arm(sock)
                kind, length = ITEM.unpack(recv_exact(sock, ITEM.size))
                if kind == FRAME:
                    if index >= len(keys) or length > self.max_frame:
                        raise Unusable(f"protocol error: frame {index} of {length} bytes for {len(keys)} keys")
                    deadline.extend(length / MIN_RATE)
                    out[index] = self._frame(sock, keys[index], length, deadline)
                    index += 1
                elif kind == END:
                    if length != index:
                        raise Unusable(f"protocol error: the server counted {length} frames, not {index}")
                    break
                elif kind == ERROR:
                    why = recv_exact(sock, min(length, MAX_ERROR)).decode(errors="replace")
                    raise Unusable(f"the server refused: {why}", BROKEN_S)
                else:
                    raise Unusable(f"protocol error: item kind {kind}")
            done = True
            return out
        finally:
            if done:
                self._keep(sock)
            else:
                release_all(out)
                sock.close()

    def _save(self, sock: socket.socket, frames: list[list]) -> int:
        done = False
        try:
            sock.settimeout(self.timeout)
            sock.sendall(REQUEST.pack(PUT, len(frames), 0))
            for parts in frames:
                size = sum(memoryview(p).nbytes for p in parts)
                send_parts(sock, [ITEM.pack(FRAME, size), *parts])
            kind, length = ITEM.unpack(recv_exact(sock, ITEM.size))
            if kind == ERROR:
                why = recv_exact(sock, min(length, MAX_ERROR)).decode(errors="replace")
                raise Unusable(f"the server refused: {why}", BROKEN_S)
            if kind != END or length > len(frames):
                raise Unusable(f"protocol error: item kind {kind} ({length}) after {len(frames)} frames")
            done = True
            return length
        finally:
            if done:
                self._keep(sock)
            else:
                sock.close()

    def _frame(self, sock: socket.socket, want: bytes, length: int, deadline: Deadline) -> Chunk | None:
        buf = self._buffers.acquire(length)
        try:
            view = memoryview(buf)[:length]
            hashed = codec.PayloadHash(view)  # while the bytes are in cache and the link is the wait
            got = 0
            while got < length:
                deadline.arm(sock)
                n = sock.recv_into(view[got:])
                if n == 0:
                    raise Closed(f"connection closed after {got} of {length} bytes of a frame")
                got += n
                hashed.arrived(got)
            return codec.decode(
                view,
                key=want,
                payload_checksum=hashed.digest(),
                on_release=lambda: self._buffers.release(buf),
                on_corrupt=lambda: self._on_corrupt(want),
            )
        except IntegrityError as exc:
            self._buffers.release(buf)
            log.warning("grpc tier %s: damaged chunk %s from the server: %s", self.tier, want.hex()[:16], exc)
            self._on_corrupt(want)
            return None
        except BaseException:
            self._buffers.release(buf)
            raise

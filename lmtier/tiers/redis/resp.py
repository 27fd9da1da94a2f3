"""RESP2, the protocol Redis speaks, over one connected socket.

    command(*args) -> bytes          one command, encoded
    set_parts(key, value, size, ttl_ms) -> list
                                     a SET whose value goes out as its own buffers (views
                                     of a chunk's frame), never joined
    ReplyError                       an error reply (-ERR, -OOM, -MOVED ...): returned, not raised
    Closed                           the stream broke, timed out or made no sense: drop it
    Stream(sock, peer)               one socket and a small buffer for reply lines
        .send(parts)                   every part out, in order (sendmsg: nothing joined)
        .reply() -> str | int | bytes | list | None | ReplyError
        .bulk_into(pool) -> (buffer, length, payload checksum) | None | ReplyError
        .call(*args) -> reply          one command, one reply
        .close()

Replies are read with ``recv_into``: a line at a time from the 64 KiB buffer, and a bulk
value straight into the memory it will live in (``bulk_into``: a pooled buffer that a
chunk becomes a view of), hashed as it arrives.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

from lmtier.buffers import BufferPool
from lmtier.errors import RetryableError, TierError
from lmtier.kv import codec

CRLF = b"\r\n"
IOV_MAX = 512  # buffers per sendmsg call (Linux allows 1024)
MAX_VALUE = 512 << 20  # Redis's default proto-max-bulk-len
LINE_BYTES = 64 * 1024  # the reply-line buffer; a longer line is not RESP from a Redis
SMALL_PART = 16 * 1024  # over TLS, smaller parts are joined into one record
MAX_DEPTH = 6  # arrays in arrays: CLUSTER SLOTS nests 3 deep
MAX_ITEMS = 1 << 20  # elements of one array reply
MIN_RATE = 10e6  # bytes/s a reply must arrive at, past the timeout, however slowly it trickles


class ReplyError(TierError):
    """Redis answered a command with an error (``-ERR``, ``-OOM``, ``-MOVED`` ...)."""

    @property
    def redirect(self) -> bool:
        """A cluster redirection: the key's slot is served by another master."""
        return str(self).startswith(("MOVED", "ASK"))


class Closed(RetryableError):
    """The connection broke or timed out: it is dropped, never reused."""


def command(*args: bytes) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def set_parts(key: bytes, value: list, size: int, ttl_ms: int = 0) -> list:
    """``SET key value [PX ttl_ms]`` with the value as the buffers it is made of
    (``size`` bytes in all): the command's head, the buffers, then CRLF and the rest."""
    extra = [b"PX", b"%d" % ttl_ms] if ttl_ms else []
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 + len(extra), len(key), key, size)
    return [head, *value, CRLF + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in extra)]


class Stream:
    """RESP2 over a connected socket; ``peer`` names the server in errors."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock, self.peer = sock, peer
        self.can_sendmsg = not isinstance(sock, ssl.SSLSocket)
        self.buf = bytearray(LINE_BYTES)
        self.view = memoryview(self.buf)
        self.start = self.end = 0  # buffered bytes not read yet: buf[start:end]
        self.deadline = 0.0  # monotonic; 0: none. Set per exchange (``begin``)
        self.timeout = sock.gettimeout()

    def begin(self, seconds: float) -> None:
        """From now, every receive must make progress within the connection's timeout,
        and the whole exchange end within ``seconds`` plus the time its bytes take at
        ``MIN_RATE``: a server that trickles a reply cannot hold a call forever."""
        self.deadline = time.monotonic() + seconds

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def call(self, *args: bytes) -> Any:
        self.send([command(*args)])
        return self.reply()

    # -- writing ------------------------------------------------------------------------
    def send(self, parts: list) -> None:
        try:
            if not self.can_sendmsg:  # TLS has no sendmsg
                for p in _small_parts_joined(parts):
                    self.sock.sendall(p)
                return
            views = [memoryview(p).cast("B") for p in parts]
            while views:
                batch = views[:IOV_MAX]
                sent = self.sock.sendmsg(batch)
                done = 0
                while done < len(batch) and sent >= len(batch[done]):
                    sent -= len(batch[done])
                    done += 1
                views = views[done:]
                if sent:
                    views[0] = views[0][sent:]
        except OSError as exc:  # includes socket.timeout
            raise Closed(f"{self.peer}: send failed: {exc}") from exc

    # -- reading ------------------------------------------------------------------------
    def reply(self, depth: int = 0) -> Any:
        """One reply: str (status), int, bytes or None (bulk), list (array), or ReplyError."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return ReplyError(rest.decode(errors="replace"))
        if kind == b":":
            try:
                return int(rest)
            except ValueError:
                raise Closed(f"{self.peer}: not an integer reply: {rest[:24]!r}") from None
        if kind == b"$":
            n = _length(rest, MAX_VALUE, self.peer)
            if n < 0:
                return None
            out = bytearray(n)
            self._read_into(memoryview(out))
            self._skip(2)
            return bytes(out)
        if kind == b"*":
            if depth >= MAX_DEPTH:
                raise Closed(f"{self.peer}: a reply nested deeper than {MAX_DEPTH}")
            n = _length(rest, MAX_ITEMS, self.peer)
            return None if n < 0 else [self.reply(depth + 1) for _ in range(n)]
        raise Closed(f"{self.peer}: not a RESP reply: {line[:40]!r}")

    def bulk_into(self, pool: BufferPool) -> tuple[Any, int, int | None] | ReplyError | None:
        """A bulk reply read into a pooled buffer: (buffer, length, payload checksum),
        None, or an error. The value is taken to be a chunk frame, and its payload is
        hashed piece by piece as it arrives, while still in cache (see ``codec.PayloadHash``)."""
        line = self._line()
        if line[:1] == b"-":
            return ReplyError(line[1:].decode(errors="replace"))
        if line[:1] != b"$":
            raise Closed(f"{self.peer}: expected a bulk reply, got {line[:40]!r}")
        n = _length(line[1:], MAX_VALUE, self.peer)
        if n < 0:
            return None
        buf = pool.acquire(n)
        try:
            view = memoryview(buf)[:n]
            payload = codec.PayloadHash(view)
            self._read_into(view, payload.arrived)
            self._skip(2)
        except BaseException:
            pool.release(buf)
            raise
        return buf, n, payload.digest()

    def _fill(self) -> None:
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buf):  # move what is left to the front
            left = self.end - self.start
            self.buf[:left] = self.buf[self.start : self.end]
            self.start, self.end = 0, left
        self.end += self._recv_into(self.view[self.end :])

    def _recv_into(self, dst: memoryview) -> int:
        if self.deadline:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise Closed(f"{self.peer}: the reply came too slowly")
            self.sock.settimeout(min(left, self.timeout) if self.timeout else left)
        try:
            n = self.sock.recv_into(dst)
        except OSError as exc:
            raise Closed(f"{self.peer}: receive failed: {exc}") from exc
        if n == 0:
            raise Closed(f"{self.peer}: connection closed by the server")
        if self.deadline:
            self.deadline += n / MIN_RATE
        return n

    def _line(self) -> bytes:
        while True:
            at = self.buf.find(CRLF, self.start, self.end)
            if at >= 0:
                out = bytes(self.buf[self.start : at])
                self.start = at + 2
                return out
            if self.end - self.start > LINE_BYTES - 2:
                raise Closed(f"{self.peer}: reply line too long")
            self._fill()

    def _read_into(self, dst: memoryview, arrived: Callable[[int], None] | None = None) -> None:
        """Exactly ``len(dst)`` bytes: first what is buffered, then straight from the
        socket; ``arrived(total)`` is told after each piece (bytes ``[0, total)`` are in)."""
        have = min(self.end - self.start, len(dst))
        dst[:have] = self.view[self.start : self.start + have]
        self.start += have
        got = have
        if arrived is not None and got:
            arrived(got)
        while got < len(dst):
            got += self._recv_into(dst[got:])
            if arrived is not None:
                arrived(got)

    def _skip(self, n: int) -> None:
        while n:
            if self.start == self.end:
                self._fill()
            step = min(n, self.end - self.start)
            self.start += step
            n -= step


def _length(text: bytes, most: int, peer: str) -> int:
    """A bulk or array length: -1 (null) to ``most``, or the stream makes no sense."""
    try:
        n = int(text)
    except ValueError:
        n = -2
    if not -1 <= n <= most:
        raise Closed(f"{peer}: a reply length of {text[:24]!r} is not one a Redis sends here")
    return n


def _small_parts_joined(parts: list) -> list:
    """``parts`` with each run of small ones joined: over TLS every ``sendall`` is a
    record of its own, so many short commands are sent as one; large values as they are."""
    out: list = []
    run: list = []
    for p in parts:
        view = memoryview(p).cast("B")
        if len(view) < SMALL_PART:
            run.append(view)
            continue
        if run:
            out.append(b"".join(run))
            run = []
        out.append(p)
    if run:
        out.append(b"".join(run))
    return out

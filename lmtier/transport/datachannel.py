"""The bulk data channel's wire format: loads from and saves to a cache server on another
host without gRPC's per-message costs (both ends: ``lmtier.server.data``, ``lmtier.tiers.grpc.data``).

A client asks the gRPC service for a ticket (``OpenData``: authenticated there, bound to
the caller's tenant, good once for ``TICKET_TTL_S``), connects to the port it names on
the same host, and sends::

    HELLO (8 bytes) + ticket (TICKET_BYTES)

then requests, each followed by its answer::

    load      REQUEST: op b"GET1", key count n (1..max_keys), length of what follows;
              then n times: u8 length + key
      answer  ITEM: kind, length
                FRAME  length bytes: one chunk's frame (lmtier.kv.codec), in the keys' order
                END    length = frames sent: the leading run held ends here
                ERROR  length bytes of UTF-8: why the server refused; it closes then
    save      REQUEST: op b"PUT1", frame count n (1..max_keys), 0;
              then n times: ITEM(FRAME, length) and the frame
      answer  END (length = chunks stored or held already), or ERROR

The frames are the same checksummed frames as gRPC's ``Get`` carries, sent as they lie in
the server's memory; the client checks each one (key, layout, header checksum; the
payload's checksum as the engine copies it out) exactly as it checks gRPC's. Keys are the
client's own: the server scopes them to the ticket's tenant.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable

HELLO = b"LMTDATA1"
TICKET_BYTES = 32
TICKET_TTL_S = 10.0
REQUEST = struct.Struct("<4sII")
GET = b"GET1"
PUT = b"PUT1"
ITEM = struct.Struct("<BQ")
FRAME, END, ERROR = 1, 2, 3
MAX_ERROR = 4096  # bytes of an error message


class Closed(ConnectionError):
    """The peer closed the connection before the bytes expected."""


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray(n)
    recv_into_exact(sock, memoryview(out))
    return bytes(out)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise Closed(f"connection closed after {got} of {len(view)} bytes")
        got += n


def send_parts(sock: socket.socket, parts: list, before: Callable[[], None] | None = None) -> None:
    """Every byte of ``parts`` in order: one ``sendmsg`` for all of them where the socket
    takes one (plain TCP; no copy), ``sendall`` each otherwise (TLS). ``before`` runs
    before each send (a deadline's check)."""
    views = [memoryview(p).cast("B") for p in parts]
    if not hasattr(sock, "sendmsg") or isinstance(sock, _ssl_socket()):
        for view in views:
            if before is not None:
                before()
            sock.sendall(view)
        return
    while views:
        if before is not None:
            before()
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


def encode_request(keys) -> bytes:
    body = b"".join(bytes((len(key),)) + key for key in keys)
    return REQUEST.pack(GET, len(keys), len(body)) + body


def decode_keys(body: bytes, n: int) -> list[bytes]:
    """The keys of a request's body; ``ValueError`` where it is not n length-prefixed keys."""
    keys, at = [], 0
    while at < len(body):
        end = at + 1 + body[at]
        if end > len(body):
            raise ValueError("a key runs past the request")
        keys.append(body[at + 1 : end])
        at = end
    if len(keys) != n:
        raise ValueError(f"the request names {len(keys)} keys, not the {n} it said")
    return keys


def _ssl_socket():
    import ssl

    return ssl.SSLSocket

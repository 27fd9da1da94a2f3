"""A fault-injecting HTTP proxy in front of a real S3 server, for the object-storage tier's
failure tests: the only stand-in in them, and it only breaks what passes through.

    with FaultProxy(server.port) as proxy:      proxy.endpoint: the tier's endpoint
        proxy.throttle = 3        the next 3 requests answered 503 SlowDown (S3's XML)
        proxy.delay = 2.0         each response held this long before its first byte
        proxy.cut_after = 100     each response cut after this many bytes (a server gone mid-load)
        proxy.down = True         connections refused on accept (closed at once)
        proxy.requests            requests seen, by method

One upstream connection per request (``Connection: close``), so that a response ends where
the upstream closes and no framing is parsed beyond a request's head.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter

SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class FaultProxy:
    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.throttle = 0
        self.delay = 0.0
        self.cut_after: int | None = None
        self.down = False
        self.requests: Counter[str] = Counter()
        self.throttled = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="s3-fault-proxy").start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.down:
                client.close()
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            with client:
                head = b""
                while b"\r\n\r\n" not in head:
                    data = client.recv(65536)
                    if not data:
                        return
                    head += data
                head, _, rest = head.partition(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                method = lines[0].split(b" ", 1)[0].decode()
                with self._lock:
                    self.requests[method] += 1
                    throttled = self.throttle > 0
                    if throttled:
                        self.throttle -= 1
                        self.throttled += 1
                if throttled:
                    length = next((int(v) for k, _, v in (ln.partition(b":") for ln in lines[1:])
                                   if k.strip().lower() == b"content-length"), 0)  # fmt: skip
                    while len(rest) < length:  # read the body: closing on unread bytes resets
                        data = client.recv(min(65536, length - len(rest)))
                        if not data:
                            break
                        rest += data
                    client.sendall(
                        b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
                        + b"Content-Length: %d\r\n\r\n" % len(SLOWDOWN)
                        + SLOWDOWN
                    )
                    return
                kept = [ln for ln in lines if not ln.lower().startswith(b"connection:")]
                upstream = socket.create_connection(self.target, timeout=30)
                with upstream:
                    upstream.sendall(b"\r\n".join([*kept, b"Connection: close"]) + b"\r\n\r\n" + rest)
                    threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()
                    self._respond(upstream, client)
        except OSError:
            pass

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass

    def _respond(self, upstream: socket.socket, client: socket.socket) -> None:
        sent, first = 0, True
        while data := upstream.recv(65536):
            if first and self.delay:
                time.sleep(self.delay)
            first = False
            if self.cut_after is not None and sent + len(data) > self.cut_after:
                client.sendall(data[: max(0, self.cut_after - sent)])
                client.shutdown(socket.SHUT_RDWR)
                return
            client.sendall(data)
            sent += len(data)

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

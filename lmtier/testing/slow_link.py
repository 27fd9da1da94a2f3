"""A TCP forwarder that holds what a client sends for ``delay`` seconds before passing it
on: a far-away or congested shared tier, for tests (a producer's writes slowed while a
decode instance reads the tier directly). The delay can change while connections are open."""

from __future__ import annotations

import socket
import threading
import time


class SlowLink:
    def __init__(self, target_port: int, delay: float = 0.0, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self.delay = delay
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="slow-link", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, slow: bool) -> None:
        try:
            while data := src.recv(1 << 20):
                if slow and self.delay:
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                s.close()
            self._sockets.clear()

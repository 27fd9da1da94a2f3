"""``DataChannel``: the cache server's bulk data channel, for loads and saves of other hosts
(the wire: ``lmtier.transport.datachannel``).

    DataChannel.open(service, config, grpc_port) -> DataChannel | None   as configured
    DataChannel(service, config, host, port, ssl_context)   listening, not yet serving
        .start(), .stop(), .port, .tls
        .issue(tag) -> ticket              for OpenData: good once, for TICKET_TTL_S
    (its limits, tickets and connection places: ``limits``; saves: ``saves``)

Python gRPC costs a fixed ~0.2 ms per message and more per call on each side, whatever the
bytes; a connection of its own carries frames at the link's rate: the server sends each
chunk's frame as it lies in its memory (one ``sendmsg`` of the head and the payload), the
client reads it into one buffer.

Who may use it, and how much:

- A connection counts for nothing until it presents a ticket, and a ticket comes only from
  an authenticated ``OpenData`` call: it names the caller's tenant, opens one connection,
  and expires unused after ``TICKET_TTL_S``. Every key a request names is scoped to that
  tenant, as in gRPC's calls.
- Connections that have not yet presented one are held by one thread (a selector), never a
  thread each: at most ``PENDING`` of them and ``PENDING_PER_SOURCE`` from one network,
  each for ``HANDSHAKE_S`` at most. Over a limit, the one that has shown least goes (the
  oldest silent one of the network over it, or of the network with the most), never one
  that has sent its hello for a silent one; a ticket sent with the connection is read as
  it is accepted. So a flood of idle or slow connections takes no worker and pushes out
  no client that speaks, even from its own network (on Kubernetes, a pod on the same
  node). Out of descriptors, the listener rests for ``ACCEPT_PAUSE_S``.
- A connection with a ticket gets a thread: at most ``max_data_connections`` in all, a
  tenant at most its call limit, and while fewer than a quarter are free, no more than its
  share of them. One closes after ``IDLE_S`` without a request, or a stalled send or
  receive (``stall_timeout``). Each request is admitted as a call of its tenant (the call
  limit, rate and fair share of ``calls``), holds at most two batches of chunks while
  it sends, and lets them go when it ends, however it ends.
- Anything malformed ends the connection with an ERROR item saying what; the client then
  loads through gRPC's ``Get``.
"""

from __future__ import annotations

import ipaddress
import logging
import selectors
import socket
import ssl
import threading
import time
from collections import OrderedDict

import grpc

from lmtier import metrics
from lmtier.kv import codec
from lmtier.kv.chunk import release_all
from lmtier.server.auth import is_peer_lane
from lmtier.server.calls import Abort
from lmtier.server.data.limits import Places, Tickets
from lmtier.server.data.saves import Pace, receive, recv_paced
from lmtier.server.methods.reads import GET_BATCH  # a load reads as Get does
from lmtier.tiers.cpu.tier import CpuTier
from lmtier.transport.datachannel import (
    END,
    ERROR,
    FRAME,
    GET,
    HELLO,
    ITEM,
    MAX_ERROR,
    PUT,
    REQUEST,
    TICKET_BYTES,
    TICKET_TTL_S,
    Closed,
    decode_keys,
    recv_exact,
    send_parts,
)

log = logging.getLogger(__name__)

PENDING = 256  # connections not yet past their ticket
PENDING_PER_SOURCE = 32  # of them from one network (an IPv4 /24, an IPv6 /64)
ACCEPT_PAUSE_S = 0.1  # the listener unwatched after a failed accept (out of descriptors)
WARN_EVERY_S = 10.0
HANDSHAKE_S = 5.0
IDLE_S = 60.0


class DataChannel:
    def __init__(self, service, config, host: str, port: int, ssl_context: ssl.SSLContext | None) -> None:
        self.service, self.config = service, config
        self.ssl_context = ssl_context
        self.tls = ssl_context is not None
        if host in ("0.0.0.0", "::", "") and socket.has_dualstack_ipv6():  # every address, as gRPC's
            self.listener = socket.create_server(("", port), family=socket.AF_INET6, backlog=128, dualstack_ipv6=True)
        else:
            self.listener = socket.create_server((host, port), family=_family(host), backlog=128)
        self.port = self.listener.getsockname()[1]
        self.tickets = Tickets(TICKET_TTL_S, service.calls.limit)
        first = service.store.tiers[0]
        self.landing = first if isinstance(first, CpuTier) else None  # saves land in its slots
        self.places = Places(config.max_data_connections, service.calls.limit,
                             service.auth.single_tenant and not service.auth.peers)  # fmt: skip
        self._lock = threading.Lock()
        self._pending: OrderedDict[socket.socket, tuple[float, bytearray, str]] = OrderedDict()
        self._pending_from: dict[str, int] = {}  # source network -> connections pending (bounded by PENDING)
        self.pushed_out = [0, 0, 0]  # pending connections closed for newcomers, by what they had shown
        self._listening_at = 0.0  # after a failed accept: when to watch the listener again
        self._warned_at = -WARN_EVERY_S
        self._selector = selectors.DefaultSelector()
        self._stopping = threading.Event()
        self._sockets: set[socket.socket] = set()  # served connections, closed on stop
        self._thread = threading.Thread(target=self._accept_loop, name="lmtier-data", daemon=True)

    @classmethod
    def open(cls, service, config, grpc_port: int) -> DataChannel | None:
        """The channel the config asks for, listening (None: off, or its default port
        taken, which is logged); a port given and taken raises ``OSError``."""
        if not config.data_channel:
            return None
        port = config.data_port if config.data_port is not None else (grpc_port + 1 if config.port else 0)
        context = None
        if config.tls_cert:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(config.tls_cert, config.tls_key)
            if config.tls_client_ca:
                context.load_verify_locations(config.tls_client_ca)
                context.verify_mode = ssl.CERT_REQUIRED
        try:
            return cls(service, config, config.host, port, context)
        except OSError as exc:
            if config.data_port is not None:
                raise OSError(f"cannot open the data channel on {config.host}:{port}: {exc}") from exc
            log.warning("no data channel on %s:%d (%s): other hosts load through gRPC; set data_port to choose "
                        "another port", config.host, port, exc)  # fmt: skip
            return None

    def start(self) -> None:
        self.listener.setblocking(False)
        self._selector.register(self.listener, selectors.EVENT_READ)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._lock:
            served = list(self._sockets)
        for sock in served:  # their threads end on the error and let their chunks go
            _shut(sock)
        self.listener.close()
        self._selector.close()

    def issue(self, tag: bytes, lane: bytes | None = None) -> bytes:
        return self.tickets.issue(tag, lane)

    # -- before the ticket: one thread for all ----------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                events = self._selector.select(timeout=0.25)
            except OSError:
                return
            try:
                for key, _ in events:
                    if key.fileobj is self.listener:
                        self._accept()
                    elif key.fileobj in self._pending:  # not dropped earlier in this round
                        self._advance(key.fileobj)  # type: ignore[arg-type]
                now = time.monotonic()  # every round, events or none: the pause and the handshakes end on it
                while self._pending and next(iter(self._pending.values()))[0] < now:
                    self._drop(next(iter(self._pending)))
                if self._listening_at and now >= self._listening_at:
                    self._listening_at = 0.0
                    self._selector.register(self.listener, selectors.EVENT_READ)
            except Exception:  # this thread must outlive anything: it is every new connection's
                log.exception("data channel: accepting failed")
        for sock in list(self._pending):
            self._drop(sock)

    def _accept(self) -> None:
        while True:
            try:
                sock, address = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: the ones pending go first, and a pause
                now = time.monotonic()
                if now >= self._warned_at + WARN_EVERY_S:
                    self._warned_at = now
                    log.warning("data channel: accept failed: %s (new connections wait a moment)", exc)
                if self._pending:
                    self._drop(next(iter(self._pending)))
                else:  # the listener stays readable: not watched for a moment, or this thread spins
                    self._selector.unregister(self.listener)
                    self._listening_at = now + ACCEPT_PAUSE_S
                return
            source = _network(address[0])
            sock.setblocking(False)
            # an answer's last item must not wait for the client's delayed ACK (Nagle)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl_context is not None:
                try:
                    sock = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                except (OSError, ssl.SSLError):
                    sock.close()
                    continue
            self._pending[sock] = (time.monotonic() + HANDSHAKE_S, bytearray(), source)
            self._pending_from[source] = self._pending_from.get(source, 0) + 1
            self._selector.register(sock, selectors.EVENT_READ)
            self._advance(sock)  # what came with the connection: a client sends its ticket at once
            if sock in self._pending:
                self._make_room(sock, source)

    def _make_room(self, newcomer: socket.socket, source: str) -> None:
        """Over a limit on pending connections (``source``'s own, else all of them, where
        the network with the most pending gives way): the one that has shown least goes,
        the oldest of those. A silent connection never pushes out one that has sent its
        hello; the newcomer goes itself when every other has sent more than it has."""
        if self._pending_from[source] > PENDING_PER_SOURCE:
            group = source
        elif len(self._pending) > PENDING:
            group = max(self._pending_from, key=self._pending_from.__getitem__)
        else:
            return
        victim, least = newcomer, _shown(self._pending[newcomer][1])
        for sock in [s for s, (_, _, f) in self._pending.items() if f == group and s is not newcomer]:
            self._advance(sock)  # what it sent since: it may be through, or gone
            if sock not in self._pending:
                return  # a place freed
            shown = _shown(self._pending[sock][1])
            if shown <= least:  # the oldest of the least shown (a tie: the older goes)
                victim, least = sock, shown
                if shown == 0:
                    break  # silent: none shows less
        self.pushed_out[least] += 1
        self._drop(victim)

    def _advance(self, sock: socket.socket) -> None:
        """Read what has arrived of the hello and the ticket, without waiting."""
        _, got, _ = self._pending[sock]
        try:
            if isinstance(sock, ssl.SSLSocket) and not got:
                sock.do_handshake()
            data = sock.recv(len(HELLO) + TICKET_BYTES - len(got))
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except (OSError, ssl.SSLError):
            self._drop(sock)
            return
        if not data:
            self._drop(sock)
            return
        got += data
        if not got.startswith(HELLO[: len(got)]):  # not this channel's client: no need to wait for more
            metrics.SERVER_RPCS.labels("Data", "UNAUTHENTICATED").inc()
            self._drop(sock)
            return
        if len(got) < len(HELLO) + TICKET_BYTES:
            return
        self._selector.unregister(sock)
        self._forget_pending(sock)
        redeemed = self.tickets.redeem(bytes(got[len(HELLO) :])) if got[: len(HELLO)] == HELLO else None
        if redeemed is None:
            metrics.SERVER_RPCS.labels("Data", "UNAUTHENTICATED").inc()
            sock.close()
            return
        tag, lane = redeemed
        sock.setblocking(True)
        refused = self.places.take(lane)
        if refused:
            metrics.SERVER_RPCS.labels("Data", "RESOURCE_EXHAUSTED").inc()
            sock.settimeout(1.0)
            _refuse(sock, refused)
            return
        threading.Thread(target=self._serve, args=(sock, tag, lane), name="lmtier-data-conn", daemon=True).start()

    def _forget_pending(self, sock: socket.socket) -> None:
        entry = self._pending.pop(sock, None)
        if entry is not None:
            left = self._pending_from.pop(entry[2]) - 1
            if left:
                self._pending_from[entry[2]] = left

    def _drop(self, sock: socket.socket) -> None:
        self._forget_pending(sock)
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    # -- with the ticket: a thread per connection --------------------------------------------
    def _serve(self, sock: socket.socket, tag: bytes, lane: bytes) -> None:
        """Serve one connection's requests: ``tag`` scopes its keys, ``lane`` admits them
        (a peer's lane reads only)."""
        peer = is_peer_lane(lane)
        with self._lock:
            self._sockets.add(sock)
        method = "Data"  # the metric's label: DataGet, DataPut once a request says which
        try:
            while not self._stopping.is_set():
                sock.settimeout(IDLE_S)
                if not self.places.idle(sock, lane):
                    return  # its place went to another
                try:
                    op, n, length = REQUEST.unpack(recv_exact(sock, REQUEST.size))
                except (Closed, TimeoutError, OSError):
                    return  # the client went away, was idle too long, or its place went to another
                finally:
                    self.places.busy(sock)
                pace = Pace(sock, self.config.stall_timeout, self.config.call_timeout)
                pace()
                method = {PUT: "DataPut", GET: "DataGet"}.get(op, "Data")
                if op == PUT:
                    if peer:
                        raise Abort(grpc.StatusCode.PERMISSION_DENIED, "a peer's token reads only; a save refused")
                    if not 1 <= n <= self.config.max_keys or length:
                        limit = self.config.max_keys
                        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"a save of {n} frames (1 to {limit})")
                    with self.service.calls.admitted(lane):
                        stored, _ = receive(self.service, self.landing, sock, tag, n, pace)
                    sock.sendall(ITEM.pack(END, stored))
                    metrics.SERVER_RPCS.labels("DataPut", "OK").inc()
                    continue
                if op != GET:
                    raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown request {op!r}")
                if not 1 <= n <= self.config.max_keys or length > 33 * n:
                    limit = self.config.max_keys
                    raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{n} keys in {length} bytes (at most {limit} keys)")
                try:
                    keys = decode_keys(recv_paced(sock, length, pace), n)
                except ValueError as exc:
                    raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {exc}") from exc
                with self.service.calls.admitted(lane):
                    sent = self._send(sock, tag, keys, pace)
                sock.sendall(ITEM.pack(END, sent))
                if peer:
                    metrics.SERVER_PEER_CHUNKS.inc(sent)
                metrics.SERVER_RPCS.labels("DataGet", "OK").inc()
        except Abort as exc:
            metrics.SERVER_RPCS.labels(method, exc.code.name).inc()
            _refuse(sock, str(exc))
        except (OSError, Closed):  # the client went away, or stalled past stall_timeout
            metrics.SERVER_RPCS.labels(method, "CANCELLED").inc()
        except Exception:
            log.exception("data channel connection failed")  # a bug: this connection only
            metrics.SERVER_RPCS.labels(method, "INTERNAL").inc()
        finally:
            with self._lock:
                self._sockets.discard(sock)
            sock.close()
            self.places.give(sock, lane)

    def _send(self, sock: socket.socket, tag: bytes, keys: list[bytes], pace: Pace) -> int:
        """The leading run held of ``keys``, frame after frame, as the chunks lie in the
        server's memory (relayed under the checksum recorded when stored: the client
        verifies each one)."""
        scoped = self.service._scoped(tag, keys)
        sent = 0
        batches = self.service.store.iter_get(scoped, GET_BATCH, ahead=1)
        try:
            for chunks in batches:
                try:
                    for chunk in chunks:
                        view = chunk.view_as(keys[sent])
                        size = codec.encoded_size(view)
                        parts = [ITEM.pack(FRAME, size), *codec.encode_parts(view, relay=True)]
                        send_parts(sock, parts, before=pace)
                        metrics.SERVER_BYTES.labels("get", "data").inc(size)
                        sent += 1
                finally:
                    release_all(chunks)
        finally:
            batches.close()
        return sent


def _shown(got: bytearray) -> int:
    """How far a pending connection got: 0 silent, 1 part of the hello, 2 the hello and more."""
    return 0 if not got else 1 if len(got) < len(HELLO) else 2


def _refuse(sock: socket.socket, message: str) -> None:
    data = message.encode()[:MAX_ERROR]
    try:
        sock.sendall(ITEM.pack(ERROR, len(data)) + data)
    except OSError:
        pass
    sock.close()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _network(address: str) -> str:
    """The network a peer's address counts under: its IPv4 /24 or IPv6 /64 (an attacker
    with many addresses usually has them in one such network)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    prefix = 24 if ip.version == 4 else 64
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET

"""The bulk data channel's limits (``lmtier.server.data``): tickets, and the connections
that hold a thread.

    Tickets(ttl, per_tenant)          issue(tag, lane) -> ticket; redeem(ticket) -> (tag, lane) | None
    Places(capacity, calls_per_tenant, single_tenant)
        take(tag) -> "" or why not    a connection's place; give(sock, tag) when it ends
        idle(sock, tag) / busy(sock)  around a connection's wait for its next request

A tenant holds at most its call limit of connections (and half of them where tenants
share the server, so that one never holds every connection), and while fewer than a
quarter are free, no more than its share (the connections over the tenants holding
some). Where that refuses a newcomer, an idle connection makes room if closing it would:
the newcomer's tenant's own oldest, else the oldest of the tenant holding the most.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections import OrderedDict

import grpc

from lmtier.server.calls import Abort
from lmtier.transport.datachannel import TICKET_BYTES

TICKETS = 4096  # tickets issued and not yet used, every tenant's


class Tickets:
    """Tickets issued and not yet used: at most ``limit`` (the oldest go first), a tenant
    at most ``per_tenant`` of them."""

    def __init__(self, ttl: float, per_tenant: int, limit: int = TICKETS) -> None:
        self.ttl, self.per_tenant, self.limit = ttl, per_tenant, limit
        self._open: OrderedDict[bytes, tuple[bytes, float, bytes]] = OrderedDict()  # ticket -> (tag, expiry, lane)
        self._lock = threading.Lock()

    def issue(self, tag: bytes, lane: bytes | None = None) -> bytes:
        """A ticket for a connection of tenant ``tag``, admitted in ``lane`` (the tenant's
        own, or its peers': ``lmtier.server.auth.peer_lane``, which reads only)."""
        lane = tag if lane is None else lane
        now = time.monotonic()
        with self._lock:
            while self._open and next(iter(self._open.values()))[1] < now:
                self._open.popitem(last=False)
            if sum(1 for _, _, held in self._open.values() if held == lane) >= self.per_tenant:
                raise Abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"this tenant holds {self.per_tenant} unused data channel tickets; use or let them expire",
                )
            if len(self._open) >= self.limit:
                self._open.popitem(last=False)
            ticket = secrets.token_bytes(TICKET_BYTES)
            self._open[ticket] = (tag, now + self.ttl, lane)
            return ticket

    def redeem(self, ticket: bytes) -> tuple[bytes, bytes] | None:
        """The tenant tag and lane of a good ticket, once; None for any other bytes."""
        with self._lock:
            entry = self._open.pop(ticket, None)
        if entry is None or entry[1] < time.monotonic():
            return None
        return entry[0], entry[2]


class Places:
    def __init__(self, capacity: int, calls_per_tenant: int, single_tenant: bool) -> None:
        self.capacity = capacity
        shared = not single_tenant and capacity > 1  # a tenant of several never holds every connection
        self.per_tenant = min(calls_per_tenant, capacity // 2 if shared else capacity)
        self._open: dict[bytes, int] = {}  # tenant tag -> connections with a place (bounded by capacity)
        self._idle: OrderedDict[socket.socket, bytes] = OrderedDict()  # waiting for a request, oldest first
        self._evicted: set[socket.socket] = set()  # idle ones closed for a newcomer: their place given already
        self._total = 0
        self._lock = threading.Lock()

    @property
    def total(self) -> int:
        return self._total

    def held(self, tag: bytes) -> int:
        return self._open.get(tag, 0)

    def idle_count(self) -> int:
        return len(self._idle)

    def idle(self, sock: socket.socket, tag: bytes) -> bool:
        """``sock`` waits for its next request; False if its place went to another."""
        with self._lock:
            if sock in self._evicted:
                return False
            self._idle[sock] = tag
            return True

    def busy(self, sock: socket.socket) -> None:
        with self._lock:
            self._idle.pop(sock, None)

    def take(self, tag: bytes) -> str:
        """A connection's place for ``tag``, or why it gets none. Where the limits refuse
        one, an idle connection (waiting for its next request) makes room, if closing it
        would: the tenant's own oldest, else the oldest of the tenant holding the most;
        its client opens another when it needs one."""
        victim = None
        with self._lock:
            refused = self._refusal(tag)
            if refused:
                victim = self._idle_victim(tag)
                if victim is None:
                    return refused
                owner = self._idle[victim]
                self._release(owner)
                refused = self._refusal(tag)
                if refused:  # closing it would not make room for this one: it stays
                    self._open[owner] = self._open.get(owner, 0) + 1
                    self._total += 1
                    return refused
                del self._idle[victim]
                self._evicted.add(victim)
            self._open[tag] = self._open.get(tag, 0) + 1
            self._total += 1
        if victim is not None:
            _shut(victim)  # its thread ends on it
        return ""

    def _refusal(self, tag: bytes) -> str:
        held = self._open.get(tag, 0)
        if held >= self.per_tenant:
            return f"this tenant has {held} data connections open; the limit is {self.per_tenant}"
        tenants = len(self._open) + (tag not in self._open)
        share = max(1, self.capacity // tenants)
        if self._total >= self.capacity or (self._total >= self.capacity * 3 // 4 and held >= share):
            return f"the server's data connections are taken ({self._total} of {self.capacity})"
        return ""

    def _idle_victim(self, tag: bytes) -> socket.socket | None:
        own = next((s for s, t in self._idle.items() if t == tag), None)
        if own is not None or not self._idle or self._open.get(tag, 0) >= self.per_tenant:
            return own  # its own first (that costs no one else); at its own limit, only its own
        most = max(set(self._idle.values()), key=lambda t: self._open.get(t, 0))
        return next(s for s, t in self._idle.items() if t == most)

    def _release(self, tag: bytes) -> None:
        """With the lock held: one connection of ``tag`` gone."""
        held = self._open.pop(tag) - 1
        if held:
            self._open[tag] = held
        self._total -= 1

    def give(self, sock: socket.socket, tag: bytes) -> None:
        with self._lock:
            self._idle.pop(sock, None)
            if sock in self._evicted:  # its place went to a newcomer already
                self._evicted.discard(sock)
            else:
                self._release(tag)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass

"""Who the peers are, as the platform says: a static list, or the addresses a name resolves
to (a Kubernetes headless Service gives one per ready pod), re-resolved in the background.

    Members(static, dns, refresh, advertise)
        .admits(address) -> bool      a peer this instance may read from: a member, not itself
        .addresses() -> list[str]     the members now, "host:port"
        .close()

An address comes to a peer tier from a router's ``kv_transfer_params`` (which any client
of the engine can write) or from the fleet's index: it is read from only when it names a
member exactly, as listed or as a listed name resolved to. Nothing a request says is
resolved or dialled otherwise, so a request cannot make an engine connect to a host of its
choosing and present its token there.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading

from lmtier.errors import ConfigError

log = logging.getLogger(__name__)

MAX_MEMBERS = 1024  # addresses a name may resolve to that are kept


def split_address(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) as (host, port); ``ConfigError`` if it is not one."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"a peer address is host:port, got {text!r}")
    return host.lower(), int(port)


def joined(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _canonical(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host.lower().rstrip(".")


class Members:
    def __init__(self, static: tuple[str, ...] = (), dns: str = "", refresh: float = 5.0, advertise: str = "") -> None:
        self._static = [split_address(a) for a in static if a.strip()]
        self._dns = split_address(dns) if dns else None
        self.open = not self._static and self._dns is None  # no membership given: the index decides
        self.me = {(_canonical(h), p) for h, p in ([split_address(advertise)] if advertise else [])}
        self.refresh = refresh
        self._known: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._resolve()
        self._thread = None
        if self._dns is not None or any(not _is_ip(h) for h, _ in self._static):
            self._thread = threading.Thread(target=self._loop, name="lmtier-peer-members", daemon=True)
            self._thread.start()

    def admits(self, address: str) -> bool:
        try:
            host, port = split_address(address)
        except ConfigError:
            return False
        entry = (_canonical(host), port)
        if entry in self.me:
            return False
        if self.open:
            return True
        with self._lock:
            return entry in self._known

    def admitted(self, address: str) -> str | None:
        """``address`` as the membership spells it, if it is a member's (what is dialled is
        never a request's or an index's own spelling of it); None otherwise."""
        try:
            host, port = split_address(address)
        except ConfigError:
            return None
        host = _canonical(host)
        if not host or host.startswith(".") or not self.admits(address):
            return None
        return joined(host, port)

    def sidecar_of(self, address: str) -> str | None:
        """The member a router's address names: itself, or, where a router names the engine
        (its host and the engine's own port, as llm-d's P2P mode does), the one member on
        that host. None: no member, or several on that host (which one is not known)."""
        admitted = self.admitted(address)
        if admitted is not None:
            return admitted
        try:
            host, _ = split_address(address)
        except ConfigError:
            return None
        host = _canonical(host)
        with self._lock:
            on_host = [(h, p) for h, p in self._known if h == host and (h, p) not in self.me]
        return joined(*on_host[0]) if len(on_host) == 1 else None

    def addresses(self) -> list[str]:
        with self._lock:
            return sorted(joined(h, p) for h, p in self._known if (h, p) not in self.me)

    def close(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.refresh):
            self._resolve()

    def _resolve(self) -> None:
        """The members now: the static list as written and as resolved, and the DNS name's
        addresses. A name that does not resolve keeps what it resolved to before (a DNS
        hiccup must not empty the fleet); a headless Service's pods that left go."""
        known: set[tuple[str, int]] = set()
        for host, port in self._static:
            known.add((_canonical(host), port))
            if not _is_ip(host):
                known |= self._lookup(host, port, keep=True)
        if self._dns is not None:
            known |= self._lookup(*self._dns, keep=True)
        with self._lock:
            self._known = set(list(known)[:MAX_MEMBERS])

    def _lookup(self, host: str, port: int, keep: bool) -> set[tuple[str, int]]:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("peers: %s does not resolve (%s); keeping its last addresses", host, exc)
            with self._lock:
                return {(h, p) for h, p in self._known if p == port} if keep else set()
        return {(_canonical(info[4][0]), port) for info in infos}


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False

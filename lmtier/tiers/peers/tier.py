"""``PeerTier`` (``peers://``): chunks other instances' sidecars hold, read through the
same client as a cache server (``GrpcTier``: gRPC, shared memory on one host, the bulk data
channel across hosts), with a peer's read-only token. It never writes: a prefix loaded
from a peer lands in this instance's own tiers above it, as any lower tier's hit does.

    peers://?members=10.0.0.5:50051,10.0.0.6:50051     a static list
    peers://?dns=lmtier-sidecars.ns.svc:50051          a headless Service's pods
        &index=redis://redis:6379                      the fleet's index (who holds what)
        &advertise=${POD_IP}:50051                     this instance's own sidecar: never asked
        &tenant=fleet&token_env=LMTIER_PEER_TOKEN      whose chunks, and the peers' read-only token

Which peer holds a chunk:

- directed: a router named it for the request (``remote_kv_source`` in vLLM's
  ``kv_transfer_params``); the engine passes it on (``direct``), remembered per key
  (``HINTS`` at most); taken only from a membership (``members``/``dns``);
- found: the fleet's index (``index``): one round trip per lookup, then one ``Lookup`` to the
  holder; its answer is kept ``FOUND_S`` seconds for the load that follows the lookup,
  which goes straight to the holder (a lookup always asks the index). No broadcast: a
  key with no holder named is a miss.

Either way only a member is asked (``members``/``dns``; with neither, any address the
index names), never the instance itself, a drained one, or one that failed within
``cooldown`` seconds. One deadline (``timeout``) bounds each lookup and each read: a peer
that stalls or is gone costs a miss. A peer's chunks are verified as every load's: a
wrong byte or a foreign layout is a miss.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from lmtier import metrics
from lmtier.errors import ConfigError
from lmtier.kv.chunk import Chunk, release_all
from lmtier.kv.keys import tenant_tag
from lmtier.tiers.base import Tier, TierContext, TierURL
from lmtier.tiers.options import TLS_OPTIONS, positive_seconds
from lmtier.tiers.peers.index import DEFAULT_PREFIX, IndexReader
from lmtier.tiers.peers.members import Members, joined, split_address

log = logging.getLogger(__name__)

HINTS = 65536  # keys a router directed to a peer, remembered at most
FOUND_S = 1.0  # the index's answer for a key, kept from a lookup to the load that follows it
PASSED_ON = ("token", "token_env", "tls", "tls_ca", "tls_cert", "tls_key", "tls_server_name", "data")


def _addresses(text: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in text.split(",") if a.strip())


class PeerTier(Tier):
    scheme = "peers"
    OPTIONS = {
        "members": _addresses,
        "dns": str,
        "index": str,
        "prefix": str,
        "tenant": str,
        "advertise": str,
        "timeout": positive_seconds,
        "cooldown": positive_seconds,
        "refresh": positive_seconds,
        "max_peers": int,
        "token": str,
        "token_env": str,
        **TLS_OPTIONS,
        "tls_server_name": str,
        "data": str,
        "name": str,
    }

    def __init__(
        self,
        *,
        members: tuple[str, ...] = (),
        dns: str = "",
        index: str = "",
        prefix: str = DEFAULT_PREFIX,
        tenant: str = "default",
        advertise: str = "",
        timeout: float = 2.0,
        cooldown: float = 5.0,
        refresh: float = 5.0,
        max_peers: int = 64,
        name: str = "peers",
        context: TierContext | None = None,
        **client: Any,
    ) -> None:
        if not (members or dns or index):
            raise ConfigError("a peers tier needs members=, dns= or index= (who the peers are, or where to look)")
        if max_peers < 1:
            raise ConfigError("max_peers must be at least 1")
        client.setdefault("token_env", "LMTIER_PEER_TOKEN")
        self.name, self.timeout, self.peer_cooldown, self.max_peers = name, timeout, cooldown, max_peers
        self.advertise = os.path.expandvars(advertise)
        self.members = Members(members, dns, refresh, self.advertise)
        if self.members.open:
            log.warning("peers: no members= or dns=: any address the index names is asked, with the peer token "
                        "(keep the index's Redis as trusted as a shared tier, or give the membership)")  # fmt: skip
        self.index = IndexReader(index, prefix, tenant_tag(tenant), timeout, refresh) if index else None
        self._context = context or TierContext()
        self._client_options = {k: v for k, v in client.items() if k in PASSED_ON}
        self._clients: OrderedDict[str, Tier] = OrderedDict()  # peer -> its client, most recent last
        self._hints: OrderedDict[bytes, str] = OrderedDict()  # key -> peer a router named
        self._found: OrderedDict[bytes, tuple[str, float]] = OrderedDict()  # key -> (peer the index named, until)
        self._failed: dict[str, float] = {}  # peer -> when it may be asked again (bounded by max_peers)
        self._index_off_until = 0.0  # the index failed: not asked until then
        self._lock = threading.Lock()
        self.counts = {"hits": 0, "misses": 0, "errors": 0, "refused": 0, "corrupt": 0}

    @classmethod
    def from_url(cls, url: TierURL, context: TierContext) -> PeerTier:
        if url.netloc or url.path not in ("", "/"):
            raise ConfigError(f"a peers tier takes options only: peers://?members=host:port,..., got {url.shown!r}")
        options = url.typed_options(cls.OPTIONS)
        for address in options.get("members", ()):
            split_address(address)
        return cls(context=context, **options)

    # -- which peer -----------------------------------------------------------------------
    def direct(self, keys: Sequence[bytes], peer: str) -> bool:
        """A router named ``peer`` as the holder of ``keys`` (for this request): remembered,
        if it is a member; False (and ignored) otherwise. A request's parameters come from
        whoever sends it: without a membership (``members``/``dns``) no address it names is
        dialled, so that no client can send the peer token to a host of its choosing."""
        sidecar = None if self.members.open else self.members.sidecar_of(peer)
        if sidecar is None:
            with self._lock:
                self.counts["refused"] += 1
            log.warning("peers: a request named %r as the holder of its prefix; not a member: ignored", peer[:200])
            return False
        peer = sidecar
        with self._lock:
            for key in keys:
                self._hints[key] = peer
                self._hints.move_to_end(key)
            while len(self._hints) > HINTS:
                self._hints.popitem(last=False)
        return True

    def _holders(self, keys: Sequence[bytes], loading: bool = False) -> list[str | None]:
        """Each key's holder: a router's hint, else (``loading`` only) what a lookup just
        found, else the index's answer."""
        with self._lock:
            found: list[str | None] = [self._hints.get(k) for k in keys]
        # a hint is a member's when it was given; members leave (and their addresses are reused)
        found = [self.members.admitted(p) if p is not None else None for p in found]
        now = time.monotonic()
        if loading:
            with self._lock:
                recent = [self._found.get(k) if p is None else None for k, p in zip(keys, found, strict=True)]
            for i, seen in enumerate(recent):
                if seen is not None and seen[1] > now:
                    found[i] = self.members.admitted(seen[0])
        lacking = [i for i, peer in enumerate(found) if peer is None]
        if lacking and self.index is not None and now >= self._index_off_until:
            try:
                named = self.index.holders([keys[i] for i in lacking])
            except Exception as exc:  # a Redis that does not answer is not asked for cooldown seconds
                log.info("peers: the index did not answer (%s); not asked for %.0f s", exc, self.peer_cooldown)
                with self._lock:
                    self.counts["errors"] += 1
                self._index_off_until = time.monotonic() + self.peer_cooldown
                named = [None] * len(lacking)
            drained = self.index.drained({p for p in named if p is not None}) if any(named) else set()
            for i, peer in zip(lacking, named, strict=True):
                if peer is not None and peer not in drained:
                    found[i] = self.members.admitted(peer)
            until = time.monotonic() + FOUND_S
            with self._lock:
                for i in lacking:
                    if found[i] is not None:
                        self._found[keys[i]] = (found[i], until)  # type: ignore[assignment]
                        self._found.move_to_end(keys[i])
                while len(self._found) > HINTS:
                    self._found.popitem(last=False)
        chosen = {p for p in found if p is not None}
        if chosen and self.index is not None:  # a router's hint, or a lookup's answer, names no drained peer either
            drained = self.index.drained(chosen)
            found = [None if p in drained else p for p in found]
        now = time.monotonic()
        return [p if p is not None and self._failed.get(p, 0.0) <= now else None for p in found]

    def _unhint(self, keys: Sequence[bytes], peer: str) -> None:
        """A peer a router named lacked ``keys`` or failed: its word for them is dropped, so
        that one request's parameters cost later requests nothing (the index answers)."""
        with self._lock:
            for key in keys:
                if self._hints.get(key) == peer:
                    del self._hints[key]
                if (recent := self._found.get(key)) is not None and recent[0] == peer:
                    del self._found[key]

    def _runs(self, keys: Sequence[bytes], loading: bool = False) -> list[tuple[str, int, int]]:
        """The leading keys with a holder, as (peer, start, end) runs in prompt order."""
        runs: list[tuple[str, int, int]] = []
        for i, peer in enumerate(self._holders(keys, loading)):
            if peer is None:
                break
            if runs and runs[-1][0] == peer:
                runs[-1] = (peer, runs[-1][1], i + 1)
            else:
                runs.append((peer, i, i + 1))
        return runs

    def _client(self, peer: str) -> Tier:
        from lmtier.tiers.grpc import GrpcTier

        with self._lock:
            client = self._clients.get(peer)
            if client is not None:
                self._clients.move_to_end(peer)
                return client
        host, port = split_address(peer)
        options = {**self._client_options, "shm": "off"}  # a holder lends no shared memory to peers
        for flag in ("tls", "data"):
            if isinstance(options.get(flag), str):
                options[flag] = options[flag].lower() in ("1", "true", "yes", "on")
        client = GrpcTier(joined(host, port), timeout=self.timeout, retries=0, name=f"peer:{peer}",
                          context=self._context, **options)  # fmt: skip
        with self._lock:
            self._clients[peer] = client
            evicted = []
            while len(self._clients) > self.max_peers:
                evicted.append(self._clients.popitem(last=False))
        for gone, old in evicted:
            old.close()
            self._forget_labels(gone)
        return client

    def _failing(self, peer: str, exc: BaseException) -> None:
        log.info("peers: %s failed (%s); not asked for %.0f s", peer, exc, self.peer_cooldown)
        with self._lock:
            self.counts["errors"] += 1
            self._failed[peer] = time.monotonic() + self.peer_cooldown
            if len(self._failed) > self.max_peers:
                now = time.monotonic()
                self._failed = {p: t for p, t in self._failed.items() if t > now}

    # -- the primitives ---------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> int:
        found = 0
        for peer, start, end in self._runs(keys):
            try:
                n = self._client(peer).contains(keys[start:end])
            except Exception as exc:
                self._failing(peer, exc)
                self._unhint(keys[start:end], peer)
                metrics.PEER_CHUNKS.labels(peer, "error").inc(end - start)
                break
            n = max(0, min(n, end - start))
            found += n
            if n < end - start:
                self._unhint(keys[start + n : end], peer)
                break
        return found

    def get(self, keys: Sequence[bytes]) -> list[Chunk | None]:
        out: list[Chunk | None] = [None] * len(keys)
        for peer, start, end in self._runs(keys, loading=True):
            try:
                got = self._client(peer).get(keys[start:end])
            except Exception as exc:
                self._failing(peer, exc)
                self._unhint(keys[start:end], peer)
                metrics.PEER_CHUNKS.labels(peer, "error").inc(end - start)
                break
            hits = 0
            for i, chunk in enumerate(got):
                if chunk is None or chunk.key != keys[start + i] or not self._fits(chunk):
                    release_all(got[i:])
                    break
                out[start + i] = chunk
                hits += 1
            metrics.PEER_CHUNKS.labels(peer, "hit").inc(hits)
            metrics.PEER_CHUNKS.labels(peer, "miss").inc(end - start - hits)
            metrics.PEER_BYTES.labels(peer).inc(sum(c.nbytes for c in out[start : start + hits]))  # type: ignore[union-attr]
            with self._lock:
                self.counts["hits"] += hits
                self.counts["misses"] += end - start - hits
            if hits < end - start:
                self._unhint(keys[start + hits : end], peer)
                break
        return out

    def _fits(self, chunk: Chunk) -> bool:
        """Of this instance's layouts, and no larger than its chunks: another model's
        chunk, from a peer that lies, is refused here before it takes room in this
        instance's tiers (the engine checks the layout itself too)."""
        limit, layouts = self._context.chunk_bytes, self._context.layouts
        if (limit and chunk.nbytes > limit) or (layouts and chunk.layout not in layouts):
            with self._lock:
                self.counts["corrupt"] += 1
            return False
        return True

    def put(self, chunks: Sequence[Chunk]) -> None:
        """Never: a peer's sidecar is written by its own engine only."""

    def delete(self, keys: Sequence[bytes]) -> None:
        """Never: a peer's chunks are its own (one that fails its check is a miss here, and
        its holder drops it when it reads it itself)."""

    def stats(self) -> dict[str, Any]:
        with self._lock:
            peers = list(self._clients)
            counts = dict(self.counts)
        with self._lock:
            corrupt = sum(c.counts.get("corrupt", 0) for c in self._clients.values())  # type: ignore[attr-defined]
        return {"capacity_bytes": 0, "used_bytes": 0, "chunks": 0, **counts, "corrupt": corrupt + counts["corrupt"],
                "members": self.members.addresses(), "connected": peers}  # fmt: skip

    def close(self) -> None:
        self.members.close()
        with self._lock:
            clients = list(self._clients.items())
            self._clients.clear()
        for _, client in clients:
            client.close()
        if self.index is not None:
            self.index.close()

    @staticmethod
    def _forget_labels(peer: str) -> None:
        for result in ("hit", "miss", "error"):
            try:
                metrics.PEER_CHUNKS.remove(peer, result)
            except KeyError:
                pass
        try:
            metrics.PEER_BYTES.remove(peer)
        except KeyError:
            pass

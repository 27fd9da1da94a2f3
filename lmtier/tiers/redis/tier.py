"""The Redis tier: chunks as Redis values, one per chunk, under ``prefix + hex(key)``.

    RedisTier(nodes, *, unix_path, cluster, prefix, ttl, timeout, ...)   or  .from_url(url, context)
        .contains(keys) -> int           EXISTS; the leading run of keys present
        .get(keys) -> [Chunk | None]     GET; each value read into a pooled buffer the chunk is a view of
        .put(chunks)                     SET of each frame from the chunk's own buffers (PX: the ttl)
        .delete(keys)                    DEL
        .close()
        .masters() -> [str]              "host:port" of each master
        .stats() -> dict                 server figures summed over the masters, and the tier's counts

Each operation is one ``Op`` (what to send and read per key) for the shared pipelined
loop, ``Pipeline.run``, then what it makes of the replies: misses for a node that failed,
a raise when the tier as a whole is down, counts and metrics.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote

from lmtier import metrics
from lmtier.buffers import BufferPool
from lmtier.errors import ConfigError, IntegrityError, TierError
from lmtier.kv import codec
from lmtier.kv.chunk import Chunk
from lmtier.tiers.base import DEFAULT_PORTS, Tier, TierContext, TierURL, parse_bool
from lmtier.tiers.options import TLS_OPTIONS, TlsFiles, positive_seconds, seconds
from lmtier.tiers.redis.cluster import Router
from lmtier.tiers.redis.conn import MAX_BACKOFF, Node, Settings
from lmtier.tiers.redis.pipeline import Op, Pipeline
from lmtier.tiers.redis.resp import MAX_VALUE, ReplyError, Stream, command, set_parts

log = logging.getLogger(__name__)

# GET replies in flight per connection: enough to keep the socket busy, few enough that
# the server streams values instead of piling a whole batch into its output buffer.
# Measured on loopback: 1 MiB (one reply being read, the next request already sent) gave
# 2.5-2.7 GB/s where a whole pipelined batch of 16-64 MiB gave 1.0-1.9.
DEFAULT_PORT = DEFAULT_PORTS["redis"]
READ_WINDOW_BYTES = 1 << 20
# A cluster node that failed is tried again within this long: a master restarted, or a
# host back on the network, serves again about when the cluster sees it (its node timeout).
CLUSTER_MAX_BACKOFF = 2.0


class RedisTier(Tier):
    scheme = "redis"
    OPTIONS = {
        "prefix": str,
        "ttl": seconds,
        "timeout": positive_seconds,
        "connect_timeout": positive_seconds,
        "pool": int,
        "user": str,
        "password": str,
        "db": int,
        **TLS_OPTIONS,
        "tls_verify": parse_bool,
        "replica_reads": parse_bool,
        "name": str,
    }

    def __init__(
        self,
        nodes: Sequence[tuple[str, int]] = (("127.0.0.1", 6379),),
        *,
        unix_path: str = "",
        cluster: bool = False,
        prefix: str = "lmtier:",
        ttl: float = 0.0,
        timeout: float = 2.0,
        connect_timeout: float = 1.0,
        pool: int = 4,
        user: str = "",
        password: str = "",
        db: int = 0,
        tls: bool = False,
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
        tls_verify: bool = True,
        replica_reads: bool = False,
        name: str = "redis",
        context: TierContext | None = None,
    ) -> None:
        if pool < 1:
            raise ConfigError("pool must be at least 1")
        if cluster and db:
            raise ConfigError("Redis Cluster has only database 0")
        if replica_reads and not cluster:
            raise ConfigError("replica_reads is for redis+cluster:// (a single server's replicas are not named)")
        if timeout <= 0 or connect_timeout <= 0:
            raise ConfigError("timeouts must be positive")
        tls_files = TlsFiles(tls, tls_ca, tls_cert, tls_key)
        self.settings = Settings(
            timeout=timeout,
            connect_timeout=connect_timeout,
            pool=pool,
            user=user.encode(),
            password=password.encode(),
            db=db,
            tls=tls_files.ssl_context(name, verify=tls_verify) if tls_files.wanted else None,
            readonly=replica_reads,
            max_backoff=CLUSTER_MAX_BACKOFF if cluster else MAX_BACKOFF,
            name=name,
        )
        self.name, self.cluster, self.pool, self.db, self.timeout = name, cluster, pool, db, timeout
        self.prefix = prefix.encode()
        self.ttl_ms = int(ttl * 1000)
        self.chunk_bytes = (context.chunk_bytes if context else None) or (1 << 20)  # to size parallel reads
        self._buffers = BufferPool(max_free=256, max_free_bytes=256 << 20)
        self._counts = {"stored": 0, "oom": 0, "errors": 0, "corrupt": 0}
        self._counts_lock = threading.Lock()
        if unix_path:
            seeds = [Node(self.settings, path=unix_path)]
        else:
            seeds = [Node(self.settings, host, port) for host, port in nodes]
        self.router = Router(self.settings, seeds, cluster, replica_reads)
        threads = max(2, min(32, pool * max(len(nodes), len(self.router.nodes))))  # the masters found too
        self.pipeline = Pipeline(self.router, pool, threads, name)

    @classmethod
    def from_url(cls, url: TierURL, context: TierContext) -> RedisTier:
        options = url.typed_options(cls.OPTIONS)
        netloc = url.netloc
        if "@" in netloc:  # user:password@hosts
            auth, netloc = netloc.rsplit("@", 1)
            user, _, password = auth.partition(":")
            options.setdefault("user", unquote(user))
            options.setdefault("password", unquote(password))
        if url.scheme == "unix":
            if not url.path:
                raise ConfigError(f"a unix socket URL names a path: unix:///run/redis.sock, got {url.shown!r}")
            return cls(unix_path=url.path, context=context, **options)
        nodes = []
        for item in netloc.split(","):
            host, _, port = item.rpartition(":") if ":" in item else (item, "", str(DEFAULT_PORT))
            try:
                nodes.append((host.strip("[]") or "127.0.0.1", int(port)))
                if not 0 < nodes[-1][1] < 65536:
                    raise ValueError("port out of range")
            except ValueError as exc:
                raise ConfigError(  # the item is not shown: it may hold part of a password
                    f"bad host:port in {url.shown!r} (percent-encode a password's '/', '?', '#' and '@')"
                ) from exc
        cluster = url.scheme == "redis+cluster"
        if not cluster and len(nodes) != 1:
            raise ConfigError(f"one host for redis://, several for redis+cluster://; got {url.shown!r}")
        path = url.path.strip("/")
        if path:
            if "db" in options:
                raise ConfigError(f"database given twice in {url.shown!r}")
            try:
                options["db"] = int(path)
            except ValueError as exc:
                raise ConfigError(f"the path of a redis:// URL is the database number, got {path!r}") from exc
        if url.scheme == "rediss":
            options.setdefault("tls", True)
        return cls(nodes, cluster=cluster, context=context, **options)

    def _rkey(self, key: bytes) -> bytes:
        """The Redis key of a chunk: the prefix and the chunk key in hex (readable in
        ``redis-cli``, matchable by ``SCAN``)."""
        return self.prefix + key.hex().encode()

    def _node_for(self, rkey: bytes) -> Node:
        return self.router.node_for(rkey)

    # -- primitives ---------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        present = self._exists(keys)
        n = 0
        while n < len(keys) and present[n]:
            n += 1
        return n

    def _exists(self, keys: Sequence[bytes]) -> list[bool]:
        rkeys = [self._rkey(k) for k in keys]
        replies = self.pipeline.run(rkeys, Op(lambda i: [command(b"EXISTS", rkeys[i])], reads=True))
        replies.raise_if_down()
        return [r == 1 for r in replies]  # a failed node's keys are misses

    def get(self, keys: Sequence[bytes]) -> list[Chunk | None]:
        out: list[Chunk | None] = [None] * len(keys)
        if not keys:
            return out
        rkeys = [self._rkey(k) for k in keys]
        op = Op(
            request=lambda i: [command(b"GET", rkeys[i])],
            read=lambda stream: stream.bulk_into(self._buffers),
            window=max(1, READ_WINDOW_BYTES // self.chunk_bytes),
            discard=self._release,
            reads=True,
        )
        replies = self.pipeline.run(rkeys, op, sizes=[self.chunk_bytes] * len(keys))
        replies.raise_if_down()
        failed = 0
        for i, reply in enumerate(replies):
            if isinstance(reply, ReplyError):
                self._count("errors")
            elif isinstance(reply, TierError):  # its node failed: a miss
                failed += 1
            elif reply is not None:
                out[i] = self._decode(keys[i], *reply)
        if failed:
            metrics.TIER_OPS.labels(self.name, "get", "error").inc(failed)
        return out

    def put(self, chunks: Sequence[Chunk]) -> None:
        if not chunks:
            return
        frames: list[list | None] = []
        for chunk in chunks:
            try:
                frames.append(codec.encode_parts(chunk))
            except IntegrityError:
                self._count("corrupt")  # a damaged chunk from an upper tier is not stored
                frames.append(None)
        sizes = [sum(memoryview(p).nbytes for p in f) if f else 0 for f in frames]
        rkeys = [self._rkey(c.key) for c in chunks]
        sendable = [i for i, f in enumerate(frames) if f is not None and sizes[i] <= MAX_VALUE]
        op = Op(lambda i: set_parts(rkeys[i], frames[i], sizes[i], self.ttl_ms))  # type: ignore[arg-type]
        replies = self.pipeline.run(rkeys, op, positions=sendable, sizes=sizes)
        stored = 0
        landed: list[bytes] = []
        for i, reply in enumerate(replies):
            if reply is None:  # not sent
                continue
            if reply == "OK":
                stored += 1
                landed.append(chunks[i].key)
                metrics.TIER_BYTES.labels(self.name, "put").inc(sizes[i])
            elif isinstance(reply, ReplyError) and str(reply).startswith("OOM"):
                self._count("oom")
            else:
                self._count("errors")
        self._count("stored", stored)
        self._announce("stored", landed)
        metrics.TIER_OPS.labels(self.name, "put", "stored").inc(stored)
        metrics.TIER_OPS.labels(self.name, "put", "dropped").inc(len(chunks) - stored)
        replies.raise_if_down()

    def delete(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        rkeys = [self._rkey(k) for k in keys]
        self._announce("removed", keys)  # first: a failed delete leaves a router under-counting, never over
        self.pipeline.run(rkeys, Op(lambda i: [command(b"DEL", rkeys[i])])).raise_if_down()

    def close(self) -> None:
        self.pipeline.close()
        self.router.close()

    # -- reading values back ------------------------------------------------------------
    def _decode(self, key: bytes, buf: Any, n: int, payload_sum: int | None) -> Chunk | None:
        try:
            chunk = codec.decode(
                memoryview(buf)[:n],
                key=key,
                lazy=True,
                payload_checksum=payload_sum,
                on_release=lambda b=buf: self._buffers.release(b),
                on_corrupt=lambda: self._drop_corrupt(key),
            )
        except IntegrityError as exc:
            self._buffers.release(buf)
            log.warning("redis tier %s: dropping damaged chunk %s: %s", self.name, key.hex()[:16], exc)
            self._drop_corrupt(key)
            return None
        return chunk

    def _release(self, reply: Any) -> None:
        """Give back the buffer of a GET reply that will not become a chunk."""
        if isinstance(reply, tuple):
            self._buffers.release(reply[0])

    def _drop_corrupt(self, key: bytes) -> None:
        self._count("corrupt")
        metrics.INTEGRITY_FAILURES.labels(self.name).inc()
        try:
            self.delete([key])
        except TierError as exc:
            log.warning("redis tier %s: cannot delete damaged chunk: %s", self.name, exc)

    # -- derived ------------------------------------------------------------------------
    def masters(self) -> list[str]:
        return self.router.masters()

    def stats(self) -> dict[str, Any]:
        """Server-side figures summed over the masters: ``capacity_bytes`` is maxmemory
        (0: unbounded), ``used_bytes`` Redis's used_memory, ``chunks`` the keys under the
        prefix (counted with SCAN: for tests and operators, not for a hot path)."""
        nodes = [self.router.nodes[m] for m in self.masters()]
        capacity = used = chunks = 0
        for node in nodes:
            info = node.run(lambda c: c.call(b"INFO", b"memory"))
            fields = dict(
                line.split(":", 1) for line in info.decode().splitlines() if ":" in line and not line.startswith("#")
            )
            capacity += int(fields.get("maxmemory", 0))
            used += int(fields.get("used_memory", 0))
            chunks += node.run(self._count_keys)
        with self._counts_lock:
            counts = dict(self._counts)
        return {
            "tier": self.name,
            "masters": len(nodes),
            "capacity_bytes": capacity,
            "used_bytes": used,
            "chunks": chunks,
            **counts,
        }

    def _count_keys(self, stream: Stream) -> int:
        cursor, total = b"0", 0
        pattern = self.prefix.replace(b"*", b"\\*").replace(b"?", b"\\?") + b"*"
        while True:
            cursor, found = stream.call(b"SCAN", cursor, b"MATCH", pattern, b"COUNT", b"1000")
            total += len(found)
            if cursor == b"0":
                return total

    def _count(self, what: str, n: int = 1) -> None:
        with self._counts_lock:
            self._counts[what] += n

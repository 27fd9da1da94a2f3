"""Redis tier: one value per chunk in a shared Redis or Redis Cluster, at wire speed.

    redis://[user:password@]host:6379/0        rediss:// for TLS
    unix:///run/redis.sock?db=0
    redis+cluster://h1:7000,h2:7001,h3:7002     (any reachable masters; the rest is discovered)

Options: ``prefix`` (default ``lmtier:``), ``ttl`` (seconds, 0 = none), ``timeout``
(seconds without progress on one call before it fails, default 2), ``connect_timeout``
(default 1), ``pool`` (connections per node, default 4), ``user`` / ``password`` (or in
the URL), ``db``, ``tls_ca`` / ``tls_cert`` / ``tls_key`` / ``tls_verify``, ``name``.

Each chunk is one Redis value, the codec's frame (preamble, header, payload), under
``prefix + hex(key)``. Chunk keys already carry the namespace (model, layout, ranks, tenant):
one Redis serves many models and tenants without collisions.

Speed. redis-py joins header and payload into one ``bytes`` before sending and builds a
new ``bytes`` for every reply: two copies per value, which caps it far below the wire.
This tier speaks RESP itself on plain sockets: a SET goes out with ``sendmsg`` of the
command header, the frame's own buffers (views of the chunk, never joined) and CRLF; a
GET reply is read with ``recv_into`` straight into a reused, pooled buffer that the
returned chunk is a view of. Batches are pipelined (one round trip per node and
connection) and a large batch is spread over up to ``pool`` connections in parallel.
redis-py is used for what it does well and this module does not redo: the cluster key
slot function.

Eviction is Redis's own: give the server ``maxmemory`` and an eviction policy
(``allkeys-lru``); chunks it evicts are misses. A full server without eviction answers
``OOM``: the chunks are not stored and the failure is counted, nothing is raised to the
engine. Reads and lookups on a node that is down or slow fail after ``timeout`` and the
node is skipped (its chunks are misses) for a backoff that doubles up to 30 s; the
``TieredStore``'s circuit breaker does the same for the tier as a whole.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import unquote

from lmtier import codec, metrics
from lmtier.buffers import BufferPool
from lmtier.chunk import Chunk
from lmtier.errors import ConfigError, IntegrityError, MissingDependency, RetryableError, TierError
from lmtier.tiers.base import Tier, TierContext, TierURL, parse_bool

log = logging.getLogger(__name__)

CRLF = b"\r\n"
IOV_MAX = 512  # buffers per sendmsg call (Linux allows 1024)
MAX_VALUE = 512 << 20  # Redis's default proto-max-bulk-len
# GET replies in flight per connection: enough to keep the socket busy, few enough that
# the server streams values instead of piling a whole batch into its output buffer.
# Measured on loopback: 1 MiB (one reply being read, the next request already sent) gave
# 2.5-2.7 GB/s where a whole pipelined batch of 16-64 MiB gave 1.0-1.9.
READ_WINDOW_BYTES = 1 << 20
# A batch is cut over several connections only in pieces of this much: on 2 cores one
# pipelined connection measured fastest (SET 3.0-3.3 GB/s against 2.3-2.7 with 2-4).
SPREAD_BYTES = 32 << 20


class ReplyError(TierError):
    """Redis answered a command with an error (``-ERR``, ``-OOM``, ``-MOVED`` ...)."""


class _Closed(RetryableError):
    """The connection broke or timed out: it is dropped, never reused."""


# -- one connection -----------------------------------------------------------------------
class _Conn:
    """A socket speaking RESP2, with a small read buffer for reply lines."""

    def __init__(self, node: _Node) -> None:
        self.node = node
        timeout = node.tier.connect_timeout
        try:
            if node.path:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout)
                sock.connect(node.path)
            else:
                sock = socket.create_connection((node.host, node.port), timeout=timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if node.tier.tls is not None:
                sock = node.tier.tls.wrap_socket(sock, server_hostname=node.host or None)
        except OSError as exc:
            raise _Closed(f"cannot connect to {node}: {exc}") from exc
        sock.settimeout(node.tier.timeout)
        self.sock = sock
        self.can_sendmsg = not isinstance(sock, ssl.SSLSocket)
        self.buf = bytearray(64 * 1024)
        self.view = memoryview(self.buf)
        self.start = self.end = 0
        tier = node.tier
        setup = []
        if tier.password:
            setup.append([b"AUTH", tier.user, tier.password] if tier.user else [b"AUTH", tier.password])
        if tier.db:
            setup.append([b"SELECT", str(tier.db).encode()])
        for args in setup:
            answer = self.call(*args)
            if isinstance(answer, ReplyError):
                self.close()
                raise _Closed(f"{node} refused {args[0].decode()}: {answer}")

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    # -- writing ------------------------------------------------------------------------
    def send(self, parts: list) -> None:
        try:
            if not self.can_sendmsg:
                for p in parts:
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
            raise _Closed(f"{self.node}: send failed: {exc}") from exc

    def call(self, *args: bytes) -> Any:
        self.send([command(*args)])
        return self.reply()

    # -- reading ------------------------------------------------------------------------
    def _fill(self) -> None:
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buf):  # move what is left to the front
            left = self.end - self.start
            self.buf[:left] = self.buf[self.start : self.end]
            self.start, self.end = 0, left
        try:
            n = self.sock.recv_into(self.view[self.end :])
        except OSError as exc:
            raise _Closed(f"{self.node}: receive failed: {exc}") from exc
        if n == 0:
            raise _Closed(f"{self.node}: connection closed by the server")
        self.end += n

    def line(self) -> bytes:
        while True:
            at = self.buf.find(CRLF, self.start, self.end)
            if at >= 0:
                out = bytes(self.buf[self.start : at])
                self.start = at + 2
                return out
            if self.end - self.start > 64 * 1024 - 2:
                raise _Closed(f"{self.node}: reply line too long")
            self._fill()

    def read_into(self, dst: memoryview, arrived: Callable[[int], None] | None = None) -> None:
        """Exactly ``len(dst)`` bytes: first what is buffered, then straight from the
        socket; ``arrived(total)`` is told after each piece (bytes ``[0, total)`` are in)."""
        have = min(self.end - self.start, len(dst))
        dst[:have] = self.view[self.start : self.start + have]
        self.start += have
        got = have
        if arrived is not None and got:
            arrived(got)
        while got < len(dst):
            try:
                n = self.sock.recv_into(dst[got:])
            except OSError as exc:
                raise _Closed(f"{self.node}: receive failed: {exc}") from exc
            if n == 0:
                raise _Closed(f"{self.node}: connection closed by the server")
            got += n
            if arrived is not None:
                arrived(got)

    def skip(self, n: int) -> None:
        while n:
            if self.start == self.end:
                self._fill()
            step = min(n, self.end - self.start)
            self.start += step
            n -= step

    def reply(self) -> Any:
        """One reply: str (status), int, bytes or None (bulk), list (array), or ReplyError."""
        line = self.line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return ReplyError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            out = bytearray(n)
            self.read_into(memoryview(out))
            self.skip(2)
            return bytes(out)
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.reply() for _ in range(n)]
        raise _Closed(f"{self.node}: not a RESP reply: {line[:40]!r}")

    def bulk_into(self, pool: BufferPool) -> tuple[Any, int, int | None] | ReplyError | None:
        """A bulk reply read into a pooled buffer: (buffer, length, payload checksum),
        None, or an error. The value is taken to be a chunk frame, and its payload is
        hashed piece by piece as it arrives, while still in cache (see ``codec.PayloadHash``)."""
        line = self.line()
        if line[:1] == b"-":
            return ReplyError(line[1:].decode(errors="replace"))
        if line[:1] != b"$":
            raise _Closed(f"{self.node}: expected a bulk reply, got {line[:40]!r}")
        n = int(line[1:])
        if n < 0:
            return None
        buf = pool.acquire(n)
        try:
            view = memoryview(buf)[:n]
            payload = codec.PayloadHash(view)
            self.read_into(view, payload.arrived)
            self.skip(2)
        except BaseException:
            pool.release(buf)
            raise
        return buf, n, payload.digest()


def command(*args: bytes) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


# -- one server -------------------------------------------------------------------------------
class _Node:
    """One Redis server: a bounded pool of connections and a backoff when it is down."""

    def __init__(self, tier: RedisTier, host: str = "", port: int = 0, path: str = "") -> None:
        self.tier, self.host, self.port, self.path = tier, host, port, path
        self._fresh()

    def _fresh(self) -> None:
        """An empty pool for this process. After ``fork`` the parent's connections are not
        ours to use (their bytes would interleave with the parent's), and its locks may
        have been held by a thread that does not exist here."""
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()
        self._permits = threading.BoundedSemaphore(self.tier.pool)
        self._down_until = 0.0
        self._backoff = 0.0
        self._pid = os.getpid()

    def __str__(self) -> str:
        return self.path or f"{self.host}:{self.port}"

    def down(self) -> bool:
        return time.monotonic() < self._down_until

    def run(self, work: Callable[[_Conn], Any]) -> Any:
        """Run ``work`` on a pooled connection; a broken connection is dropped, the node
        backs off, and ``_Closed`` propagates."""
        if self._pid != os.getpid():
            self._fresh()  # the parent's sockets are dropped here without a word to Redis
        if self.down():
            raise _Closed(f"{self} is backing off after a failure")
        if not self._permits.acquire(timeout=self.tier.timeout):
            raise _Closed(f"{self}: no free connection within {self.tier.timeout} s")
        conn = None
        try:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                conn = _Conn(self)
            result = work(conn)
            with self._lock:
                self._idle.append(conn)
            conn = None
            self._backoff = 0.0
            return result
        except _Closed:
            self._backoff = min(30.0, max(0.1, 2 * self._backoff))
            self._down_until = time.monotonic() + self._backoff
            metrics.TIER_ERRORS.labels(self.tier.name, "connection").inc()
            raise
        finally:
            if conn is not None:
                conn.close()
            self._permits.release()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


# -- the tier -----------------------------------------------------------------------------
def _seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise ValueError("must not be negative")
    return value


class RedisTier(Tier):
    scheme = "redis"
    OPTIONS = {
        "prefix": str,
        "ttl": _seconds,
        "timeout": _seconds,
        "connect_timeout": _seconds,
        "pool": int,
        "user": str,
        "password": str,
        "db": int,
        "tls": parse_bool,
        "tls_ca": str,
        "tls_cert": str,
        "tls_key": str,
        "tls_verify": parse_bool,
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
        name: str = "redis",
        context: TierContext | None = None,
    ) -> None:
        if pool < 1:
            raise ConfigError("pool must be at least 1")
        if cluster and db:
            raise ConfigError("Redis Cluster has only database 0")
        if timeout <= 0 or connect_timeout <= 0:
            raise ConfigError("timeouts must be positive")
        self.prefix = prefix.encode()
        self.ttl_ms = int(ttl * 1000)
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.pool, self.db = pool, db
        self.user, self.password = user.encode(), password.encode()
        self.name = name
        self.cluster = cluster
        self.chunk_bytes = (context.chunk_bytes if context else None) or (1 << 20)  # to size parallel reads
        self.tls: ssl.SSLContext | None = None
        if tls or tls_ca or tls_cert:
            try:  # files that cannot be read are a configuration error, not a server that is down
                self.tls = ssl.create_default_context(cafile=tls_ca or None)
                if tls_cert:
                    self.tls.load_cert_chain(tls_cert, tls_key or None)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"cannot use the TLS files of redis tier {name!r}: {exc}") from exc
            if not tls_verify:
                self.tls.check_hostname = False
                self.tls.verify_mode = ssl.CERT_NONE
        self._buffers = BufferPool(max_free=256, max_free_bytes=256 << 20)
        self._counts = {"stored": 0, "oom": 0, "errors": 0, "corrupt": 0}
        self._counts_lock = threading.Lock()
        self._threads = max(2, min(32, pool * max(1, len(nodes))))
        self._executor_pid = -1  # the executor is made per process (threads do not survive fork)
        self._seeds = [_Node(self, h, p) for h, p in nodes] if not unix_path else [_Node(self, path=unix_path)]
        self._nodes: dict[str, _Node] = {str(n): n for n in self._seeds}
        self._slots: list[_Node] = []  # replaced whole on refresh: readers need no lock
        if cluster:
            try:
                from redis.crc import key_slot
            except ImportError as exc:
                raise MissingDependency("redis", "redis") from exc
            self._key_slot = key_slot
            self._refresh_slots()

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
            host, _, port = item.rpartition(":") if ":" in item else (item, "", "6379")
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

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor_pid != os.getpid():
            self._executor = ThreadPoolExecutor(self._threads, thread_name_prefix=self.name)
            self._executor_pid = os.getpid()
        return self._executor

    # -- routing ------------------------------------------------------------------------
    def _rkey(self, key: bytes) -> bytes:
        """The Redis key of a chunk: the prefix and the chunk key in hex (readable in
        ``redis-cli``, matchable by ``SCAN``)."""
        return self.prefix + key.hex().encode()

    def _node_for(self, rkey: bytes) -> _Node:
        if not self.cluster:
            return self._seeds[0]
        return self._slots[self._key_slot(rkey)]

    def _refresh_slots(self) -> None:
        """Learn which master serves each of the 16384 slots (CLUSTER SLOTS)."""
        last: Exception | None = None
        for node in list(self._nodes.values()):
            try:
                answer = node.run(lambda c: c.call(b"CLUSTER", b"SLOTS"))
            except TierError as exc:
                last = exc
                continue
            if isinstance(answer, ReplyError):
                text = str(answer)
                if "cluster support disabled" in text or "unknown command" in text.lower():
                    raise ConfigError(f"{node} is not a cluster node: {text}")
                if text.startswith(("NOAUTH", "WRONGPASS")):
                    raise ConfigError(f"{node} refused the credentials: {text}")
                last = RetryableError(f"{node}: {text}")  # LOADING, BUSY, CLUSTERDOWN...: later
                continue
            slots: list[_Node | None] = [None] * 16384
            for start, end, master, *_replicas in answer:
                host, port = master[0].decode() or node.host, int(master[1])
                key = f"{host}:{port}"
                target = self._nodes.get(key)
                if target is None:
                    target = self._nodes[key] = _Node(self, host, port)
                for s in range(start, end + 1):
                    slots[s] = target
            if any(s is None for s in slots):
                raise TierError("the cluster does not cover every slot")
            self._slots = slots  # type: ignore[assignment]
            return
        raise RetryableError(f"no cluster node answered CLUSTER SLOTS: {last}")

    def _groups(self, keys: Sequence[bytes]) -> dict[_Node, list[int]]:
        """Positions of ``keys`` per node, in key order."""
        by_node: dict[_Node, list[int]] = {}
        for i, key in enumerate(keys):
            by_node.setdefault(self._node_for(self._rkey(key)), []).append(i)
        return by_node

    def _spread(self, positions: list[int], nbytes: int) -> list[list[int]]:
        """Cut a node's batch over up to ``pool`` connections, ``SPREAD_BYTES`` each at least."""
        parts = max(1, min(self.pool, len(positions), nbytes // SPREAD_BYTES))
        step = -(-len(positions) // parts)
        return [positions[i : i + step] for i in range(0, len(positions), step)]

    def _run_all(self, jobs: list[tuple[_Node, Callable[[_Conn], Any]]]) -> list[Any]:
        """Run jobs (in parallel when several); a job's failure is returned, not raised."""

        def one(job: tuple[_Node, Callable[[_Conn], Any]]) -> Any:
            node, work = job
            try:
                return node.run(work)
            except TierError as exc:
                return exc

        if len(jobs) == 1:
            return [one(jobs[0])]
        return list(self._pool().map(one, jobs))

    def _raise_if_down(self, results: list[Any]) -> None:
        """Raise a call's failure when the tier as a whole is down: the one server, or
        every master of a cluster. A cluster with one master down keeps serving the
        others; that master's chunks are misses (and counted) meanwhile."""
        failed = [r for r in results if isinstance(r, Exception)]
        if not failed:
            return
        if not self.cluster or all(self._nodes[m].down() for m in self.masters()):
            raise failed[0]

    def _moved(self, results: Iterable[Any]) -> bool:
        if any(isinstance(r, ReplyError) and str(r).startswith(("MOVED", "ASK")) for r in results):
            try:
                self._refresh_slots()
            except TierError as exc:
                log.warning("redis tier %s: cannot refresh the slot map: %s", self.name, exc)
            return True
        return False

    # -- primitives ---------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        present = self._exists(keys)
        n = 0
        while n < len(keys) and present[n]:
            n += 1
        return n

    def _exists(self, keys: Sequence[bytes], retry: bool = True) -> list[bool]:
        present = [False] * len(keys)
        jobs, order = [], []
        for node, positions in self._groups(keys).items():

            def work(conn: _Conn, positions=positions) -> list[Any]:
                conn.send([b"".join(command(b"EXISTS", self._rkey(keys[i])) for i in positions)])
                return [conn.reply() for _ in positions]

            jobs.append((node, work))
            order.append(positions)
        results = self._run_all(jobs)
        flat = [r for rs in results if isinstance(rs, list) for r in rs]
        if retry and self.cluster and self._moved(flat):
            return self._exists(keys, retry=False)
        self._raise_if_down(results)
        for positions, rs in zip(order, results, strict=True):
            if isinstance(rs, list):
                for i, r in zip(positions, rs, strict=True):
                    present[i] = r == 1
        return present

    def get(self, keys: Sequence[bytes]) -> list[Chunk | None]:
        out: list[Chunk | None] = [None] * len(keys)
        if not keys:
            return out
        jobs, order = [], []
        for node, positions in self._groups(keys).items():
            for part in self._spread(positions, len(positions) * self.chunk_bytes):

                def work(conn: _Conn, part=part) -> list[Any]:
                    gets = [command(b"GET", self._rkey(keys[i])) for i in part]
                    window = max(1, READ_WINDOW_BYTES // self.chunk_bytes)
                    conn.send([b"".join(gets[:window])])
                    replies: list[Any] = []
                    try:
                        for j in range(len(part)):
                            if j + window < len(gets):  # keep ``window`` replies in flight
                                conn.send([gets[j + window]])
                            replies.append(conn.bulk_into(self._buffers))
                    except BaseException:
                        self._release_replies(replies)
                        raise
                    return replies

                jobs.append((node, work))
                order.append(part)
        results = self._run_all(jobs)
        try:
            self._raise_if_down(results)
        except TierError:
            for replies in results:
                if isinstance(replies, list):
                    self._release_replies(replies)
            raise
        moved = False
        for part, replies in zip(order, results, strict=True):
            if not isinstance(replies, list):
                metrics.TIER_OPS.labels(self.name, "get", "error").inc(len(part))
                continue
            for i, reply in zip(part, replies, strict=True):
                if isinstance(reply, ReplyError):
                    moved = moved or str(reply).startswith(("MOVED", "ASK"))
                    self._count("errors")
                elif reply is not None:
                    out[i] = self._decode(keys[i], *reply)
        if moved:
            self._moved([ReplyError("MOVED")])
        return out

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

    def _release_replies(self, replies: list[Any]) -> None:
        for reply in replies:
            if isinstance(reply, tuple):
                self._buffers.release(reply[0])

    def _drop_corrupt(self, key: bytes) -> None:
        self._count("corrupt")
        metrics.INTEGRITY_FAILURES.labels(self.name).inc()
        try:
            self.delete([key])
        except TierError as exc:
            log.warning("redis tier %s: cannot delete damaged chunk: %s", self.name, exc)

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
        ttl = [b"PX", str(self.ttl_ms).encode()] if self.ttl_ms else []
        keys = [c.key for c in chunks]
        jobs, order = [], []
        sizes = [sum(memoryview(p).nbytes for p in f) if f else 0 for f in frames]
        for node, positions in self._groups(keys).items():
            positions = [i for i in positions if frames[i] is not None and sizes[i] <= MAX_VALUE]
            if not positions:
                continue
            for part in self._spread(positions, sum(sizes[i] for i in positions)):

                def work(conn: _Conn, part=part) -> list[Any]:
                    parts: list = []
                    for i in part:
                        rkey = self._rkey(keys[i])
                        head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 + len(ttl), len(rkey), rkey, sizes[i])
                        parts.append(head)
                        parts.extend(frames[i])  # type: ignore[arg-type]
                        parts.append(CRLF + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in ttl))
                    conn.send(parts)
                    return [conn.reply() for _ in part]

                jobs.append((node, work))
                order.append(part)
        results = self._run_all(jobs)
        stored = 0
        for part, replies in zip(order, results, strict=True):
            if not isinstance(replies, list):
                self._count("errors", len(part))
                continue
            for i, reply in zip(part, replies, strict=True):
                if reply == "OK":
                    stored += 1
                    metrics.TIER_BYTES.labels(self.name, "put").inc(sizes[i])
                elif isinstance(reply, ReplyError) and str(reply).startswith("OOM"):
                    self._count("oom")
                else:
                    self._count("errors")
        self._count("stored", stored)
        metrics.TIER_OPS.labels(self.name, "put", "stored").inc(stored)
        metrics.TIER_OPS.labels(self.name, "put", "dropped").inc(len(chunks) - stored)
        if self.cluster:
            self._moved(r for rs in results if isinstance(rs, list) for r in rs)
        self._raise_if_down(results)

    def delete(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        jobs = []
        for node, positions in self._groups(keys).items():

            def work(conn: _Conn, positions=positions) -> list[Any]:
                conn.send([b"".join(command(b"DEL", self._rkey(keys[i])) for i in positions)])
                return [conn.reply() for _ in positions]

            jobs.append((node, work))
        self._raise_if_down(self._run_all(jobs))

    def close(self) -> None:
        if self._executor_pid == os.getpid():
            self._executor.shutdown(wait=True)
        self._executor_pid = -1
        for node in self._nodes.values():
            node.close()

    # -- derived ------------------------------------------------------------------------
    def masters(self) -> list[str]:
        return sorted({str(n) for n in self._slots}) if self.cluster else [str(self._seeds[0])]

    def stats(self) -> dict[str, Any]:
        """Server-side figures summed over the masters: ``capacity_bytes`` is maxmemory
        (0: unbounded), ``used_bytes`` Redis's used_memory, ``chunks`` the keys under the
        prefix (counted with SCAN: for tests and operators, not for a hot path)."""
        nodes = [self._nodes[m] for m in self.masters()]
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

    def _count_keys(self, conn: _Conn) -> int:
        cursor, total = b"0", 0
        pattern = self.prefix.replace(b"*", b"\\*").replace(b"?", b"\\?") + b"*"
        while True:
            cursor, found = conn.call(b"SCAN", cursor, b"MATCH", pattern, b"COUNT", b"1000")
            total += len(found)
            if cursor == b"0":
                return total

    def _count(self, what: str, n: int = 1) -> None:
        with self._counts_lock:
            self._counts[what] += n


__all__ = ["RedisTier", "ReplyError"]

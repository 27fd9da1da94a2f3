"""``GrpcTier``: the Tier primitives as calls to a cache server (see the package docstring).

    contains(keys) -> int              Lookup
    get(keys) -> list[Chunk | None]    Get (one server stream; ``stream.GetStream``), or,
                                       with no shared memory, the server's bulk data
                                       channel where it runs one (``data.DataChannel``)

Same host, one tenant: the chunks the server's memory tier holds are read through its
published directory with no call (``published.DirectoryReads``); ``contains`` and ``get``
call the server only for the keys past the directory's leading run (its lower tiers may
hold them).
    put(chunks) -> None                the bulk data channel where the server runs one
                                       (same host too), else Put (one client stream;
                                       ``stream.put_messages``)
    delete(keys), keys(prefix, limit)  Delete, List
    server_stats(timeout) -> dict      Stats: the server's tiers, this tenant's chunks, settings
    stats(), counts, close()

Each call raises a typed error when it fails (``channel.failure``): the store retries,
breaks and counts. The tier itself keeps no breaker and runs no retry loop; ``backoff``
says how the store may retry it. The one call it makes twice is protocol: a call whose
shared memory the server refused goes again over plain gRPC (``memory.NoShm``).

One module: each primitive chooses among the published directory, shared
memory, the bulk data channel and plain gRPC here, side by side, so that a reader sees in
one place which transport a load or a save takes and what it falls back to.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from lmtier import metrics
from lmtier.breaker import Backoff
from lmtier.buffers import BufferPool
from lmtier.errors import ConfigError, TierError
from lmtier.kv.chunk import Chunk
from lmtier.tiers.base import DEFAULT_PORTS, Capabilities, Tier, TierContext, TierURL, parse_bool
from lmtier.tiers.grpc.channel import MAX_MESSAGE, Channel, credentials, failure, is_local
from lmtier.tiers.grpc.data import FRAME_SLACK, MAX_FRAME, DataChannel
from lmtier.tiers.grpc.memory import NoShm, SharedMemory
from lmtier.tiers.grpc.published import DirectoryReads
from lmtier.tiers.grpc.stream import GetStream, finish_slots, put_messages
from lmtier.tiers.options import TLS_OPTIONS, TlsFiles, positive_seconds
from lmtier.transport.pieces import PIECE_BYTES
from lmtier.units import parse_size
from lmtier.v1 import cache_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_PORT = DEFAULT_PORTS["grpc"]
MIN_RATE = 100e6  # bytes/s: a bulk call's deadline grows by its size at this rate
RELEASE_WAIT_S = 1.0  # a write waits at most this long for the releases sent before it


def _shm_mode(text: str) -> str:
    mode = text.strip().lower()
    if mode in ("auto", ""):
        return "auto"
    return "on" if parse_bool(mode) else "off"


class GrpcTier(Tier):
    scheme = "grpc"
    capabilities = Capabilities(listing=True)
    cooldown = 1.0  # a down server's calls fail at once (the channel knows): probe it often
    OPTIONS = {
        "token": str,
        "token_env": str,
        "timeout": positive_seconds,
        "retries": int,
        **TLS_OPTIONS,
        "tls_server_name": str,
        "shm": _shm_mode,
        "shm_size": parse_size,
        "shm_dir": str,
        "directory": parse_bool,
        "data": parse_bool,
        "piece": parse_size,
        "name": str,
    }

    def __init__(
        self,
        target: str = f"127.0.0.1:{DEFAULT_PORT}",
        *,
        token: str = "",
        token_env: str = "LMTIER_TOKEN",
        timeout: float = 5.0,
        retries: int = 2,
        tls: bool = False,
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
        tls_server_name: str = "",
        shm: str = "auto",
        shm_size: int = 256 * 1024**2,
        shm_dir: str = "/dev/shm",
        directory: bool = True,
        data: bool = True,
        piece: int = PIECE_BYTES,
        name: str = "grpc",
        context: TierContext | None = None,
    ) -> None:
        if retries < 0:
            raise ConfigError("retries must not be negative")
        if not 4096 <= piece <= MAX_MESSAGE - 4096:
            raise ConfigError(f"piece must lie in [4KiB, {MAX_MESSAGE - 4096}] bytes")
        self.target = target
        self.name = name
        self.timeout = timeout
        self.piece = piece
        # Retries of a RetryableError, run by the store. A call that waited out its deadline
        # (a hung server) is not repeated; one refused at once (a restart) is.
        self.backoff = Backoff(attempts=retries, budget=timeout)
        token = token or os.environ.get(token_env, "")
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        tls_files = TlsFiles(tls, tls_ca, tls_cert, tls_key)
        self.credentials = credentials(tls_files, name)
        self.tls_server_name = tls_server_name
        self._buffers = BufferPool(max_free=64, max_free_bytes=128 << 20)
        chunk_bytes = context.chunk_bytes if context else None
        self._frame_guess = (chunk_bytes or 1 << 20) + 4096
        self._max_frame = chunk_bytes + FRAME_SLACK if chunk_bytes else MAX_FRAME  # a chunk and its header
        if shm == "auto":
            shm = "on" if is_local(target) and os.access(shm_dir, os.W_OK) else "off"
        # A slot holds one frame: the chunk plus its header, rounded up to 64 KiB.
        slot_bytes = -(-(chunk_bytes + 4096) // 65536) * 65536 if chunk_bytes else 4 * 1024**2
        self.memory = SharedMemory(shm == "on", shm_dir, shm_size, slot_bytes, name)
        self.directory = DirectoryReads(self.memory, directory, self._ask_directory, self._report_reads,
                                        self._drop_corrupt, self._count)  # fmt: skip
        # Loads that take no shared memory: through the server's bulk data channel.
        self.data = (
            DataChannel(
                target.rsplit(":", 1)[0].strip("[]"),
                lambda: self._channel().open_data(
                    cache_pb2.OpenDataRequest(), timeout=self.timeout, metadata=self._metadata
                ),
                (lambda: tls_files.ssl_context(name)) if tls_files.wanted else None,
                tls_server_name,
                self._buffers,
                self._drop_corrupt,
                name,
                timeout,
                max_frame=self._max_frame,
            )
            if data
            else None
        )
        self._counts = {"errors": 0, "corrupt": 0, "shm_fallbacks": 0, "directory_reads": 0, "directory_races": 0,
                        "directory_warmed_bytes": 0, "data_loads": 0, "data_saves": 0}  # fmt: skip
        self._lock = threading.Lock()
        self._pid = -1
        self._conn: Channel | None = None
        self._releases: deque = deque(maxlen=64)
        self._closed = False

    @classmethod
    def from_url(cls, url: TierURL, context: TierContext) -> GrpcTier:
        options = url.typed_options(cls.OPTIONS)
        if not url.netloc or url.path not in ("", "/"):
            raise ConfigError(f"a grpc tier URL names host:port: grpc://cache:50051, got {url.shown!r}")
        netloc = url.netloc if url.netloc.rsplit(":", 1)[-1].isdigit() else f"{url.netloc}:{DEFAULT_PORT}"
        if url.scheme == "grpcs":
            options.setdefault("tls", True)
        return cls(netloc, context=context, **options)

    # -- per-process state ----------------------------------------------------------------
    def _channel(self) -> Channel:
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    self._conn = Channel(self.target, self.credentials, self.tls_server_name)
                    self.memory.forget()
                    self.directory.forget()
                    self._pid = os.getpid()
        return self._conn  # type: ignore[return-value]

    def warm(self) -> None:
        """Connect, map the server's published directory where there is one and start
        mapping the pages of the chunks it names (in the background), now rather than on
        the first load's path (an engine calls it once it is up)."""
        if not self._closed:
            self._channel()
            self.directory.warm()

    # -- calls ------------------------------------------------------------------------------
    def _rpc(self, fn: Callable[[], T]) -> T:
        """One call to the server; a failure raises a typed error (counted in ``errors``)."""
        if self._closed:
            raise TierError(f"grpc tier {self.name} is closed")
        try:
            try:
                return fn()
            except NoShm as exc:  # protocol: the same call again, over plain gRPC
                self._count("shm_fallbacks")
                self.memory.refused(str(exc))
                return fn()
        except grpc.RpcError as exc:
            self._count("errors")
            raise failure(exc) from exc
        except NoShm as exc:
            self._count("errors")
            raise TierError(f"shared memory refused twice: {exc}") from exc
        except Exception:
            self._count("errors")
            raise

    def _deadline(self, nbytes: int) -> float:
        return self.timeout + nbytes / MIN_RATE

    def contains(self, keys: Sequence[bytes]) -> int:
        if not keys or self.directory.contains(keys) == len(keys):
            return len(keys)
        request = cache_pb2.LookupRequest(keys=list(keys))
        hits = self._rpc(lambda: self._channel().lookup(request, timeout=self.timeout, metadata=self._metadata).hits)
        if 0 <= hits <= len(keys):  # no server of ours answers otherwise: a peer that lies, another protocol
            return hits
        raise TierError(f"grpc tier {self.name}: the server found {hits} of {len(keys)} chunks asked for")

    def get(self, keys: Sequence[bytes]) -> list[Chunk | None]:
        if not keys:
            return []
        found = self.directory.get(keys) if not self._closed else []
        if not found:
            return self._rpc(lambda: self._get(keys))
        if len(found) == len(keys):
            return found
        rest = keys[len(found) :]
        try:
            more = self._rpc(lambda: self._get(rest))
        except TierError as exc:  # counted; what the directory gave is still good
            log.info("grpc tier %s: %d chunks past the directory's: %s", self.name, len(rest), exc)
            more = [None] * len(rest)
        return found + more

    def _get(self, keys: Sequence[bytes]) -> list[Chunk | None]:
        channel = self._channel()
        if self.data is not None and self.memory.segment() is None:
            chunks = self.data.get(keys)
            if chunks is not None:
                self._count("data_loads")
                return chunks
        stream = GetStream(keys, self.memory.segment(), self.memory, self._buffers, self._release,
                           self._drop_corrupt, self.name, self._max_frame)  # fmt: skip
        request = cache_pb2.GetRequest(keys=list(keys), landing=stream.landing)
        call, done = None, False
        try:
            call = channel.get(request, timeout=self._deadline(len(keys) * self._frame_guess), metadata=self._metadata)
            chunks, done = stream.read(call), True
            return chunks
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and stream.landing:
                raise NoShm(exc.details()) from exc
            raise
        finally:
            if call is not None and not done:
                call.cancel()
            stream.close(done)

    def _ask_directory(self) -> str:
        request = cache_pb2.DirectoryRequest()
        return self._channel().directory(request, timeout=self.timeout, metadata=self._metadata).segment

    def _report_reads(self, keys: list[bytes], on_answer: Callable[[str], None]) -> None:
        """Send ``keys`` (read through the directory) without waiting; a write waits for it
        as for a release (``_settle_releases``)."""
        if self._closed:
            return
        request = cache_pb2.DirectoryRequest(read=keys)
        future = self._channel().directory.future(request, timeout=self.timeout, metadata=self._metadata)
        future.add_done_callback(lambda f: f.exception() is None and on_answer(f.result().segment))
        with self._lock:
            self._releases.append(future)

    def _release(self, lease: int) -> None:
        """Tell the server that a lease on its memory ended, without waiting for its answer
        (a dropped future would cancel the call: the last few are kept)."""
        if self._closed:  # our segment is gone with us: the server reaps the lease
            return
        request = cache_pb2.ReleaseRequest(lease=lease)
        future = self._channel().release.future(request, timeout=self.timeout, metadata=self._metadata)
        with self._lock:
            self._releases.append(future)

    def _settle_releases(self) -> None:
        """Wait a moment for the releases sent before a write: the server may then evict
        what this client let go, in recency order, instead of evicting around chunks it
        still counts as lent (which strands their successors)."""
        with self._lock:
            pending = [f for f in self._releases if not f.done()]
        deadline = time.monotonic() + RELEASE_WAIT_S
        for future in pending:
            try:
                future.exception(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # late or failed: the server reaps the lease anyway
                return

    def _drop_corrupt(self, key: bytes) -> None:
        """A chunk from the server failed its check: count it and delete the server's copy
        (best effort: this runs inside a read, often the engine's copy-out)."""
        self._count("corrupt")
        metrics.INTEGRITY_FAILURES.labels(self.name).inc()
        try:
            self.delete([key])
        except TierError as exc:
            log.warning("grpc tier %s: could not delete damaged chunk %s: %s", self.name, key.hex()[:16], exc)

    def put(self, chunks: Sequence[Chunk]) -> None:
        if chunks:
            self._rpc(lambda: self._put(chunks))

    def _put(self, chunks: Sequence[Chunk]) -> None:
        channel = self._channel()
        self.directory.report()  # before the write: the server then knows what was read
        self._settle_releases()
        nbytes = sum(c.nbytes for c in chunks)
        # Saves take the data channel on the same host too: the same copies as through our
        # shared-memory segment (ours into the socket, the server's into its memory tier),
        # without a gRPC message per batch of slot references.
        if self.data is not None:
            stored = self.data.put(chunks)
            if stored is not None:
                self._count("data_saves")
                self._stored(chunks, stored, nbytes)
                return
        segment = self.memory.segment()
        slots: list[int] = []
        messages = put_messages(chunks, segment, slots, self.piece, lambda: self._count("corrupt"))
        done = False
        try:
            response = channel.put(messages, timeout=self._deadline(nbytes), metadata=self._metadata)
            done = True
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and slots:
                raise NoShm(exc.details()) from exc
            raise
        finally:
            finish_slots(segment, slots, done)
        self._stored(chunks, response.stored, nbytes)

    def _stored(self, chunks: Sequence[Chunk], stored: int, nbytes: int) -> None:
        self._announce("stored", [c.key for c in chunks[:stored]])  # the server holds this prefix
        metrics.TIER_OPS.labels(self.name, "put", "stored").inc(stored)
        metrics.TIER_OPS.labels(self.name, "put", "dropped").inc(len(chunks) - stored)
        metrics.TIER_BYTES.labels(self.name, "put").inc(nbytes)

    def delete(self, keys: Sequence[bytes]) -> None:
        if keys:
            request = cache_pb2.DeleteRequest(keys=list(keys))
            self._announce("removed", keys)  # first: a failed delete leaves a router under-counting
            self._rpc(lambda: self._channel().delete(request, timeout=self.timeout, metadata=self._metadata))

    def keys(self, prefix: bytes = b"", limit: int | None = None) -> list[bytes]:
        """The keys the server holds for this tier's tenant (most recent first)."""
        request = cache_pb2.ListRequest(limit=limit or 0)
        response = self._rpc(lambda: self._channel().list(request, timeout=self.timeout, metadata=self._metadata))
        return [k for k in response.keys if k.startswith(prefix)]

    def close(self) -> None:
        if self._pid == os.getpid() and not self._closed:  # the last reads, for the server's counts
            self.directory.report()
            self._settle_releases()
        self._closed = True
        self.directory.close()
        if self._pid == os.getpid():
            if self._conn is not None:
                self._conn.close()
            if self.data is not None:
                self.data.close()
            self.memory.close()
        self._pid = -1

    # -- derived ------------------------------------------------------------------------
    def server_stats(self, timeout: float | None = None) -> dict[str, Any]:
        """What the server says (``Stats``): its ``tiers`` (name, capacity_bytes,
        used_bytes, chunks, counters), this tenant's chunk count (``tenant_chunks``) and
        its public settings (``config``). Raises a typed error when it cannot answer."""
        request = cache_pb2.StatsRequest()
        response = self._rpc(
            lambda: self._channel().stats(request, timeout=timeout or self.timeout, metadata=self._metadata)
        )
        tiers = [
            {
                "name": t.name,
                "capacity_bytes": t.capacity_bytes,
                "used_bytes": t.used_bytes,
                "chunks": t.chunks,
                "counters": dict(t.counters),
            }
            for t in response.tiers
        ]
        config = json.loads(response.config_json or "{}")
        return {"tiers": tiers, "tenant_chunks": response.tenant_chunks, "config": config}

    def match(
        self, tokens: Sequence[int], namespaces: Sequence[bytes], chunk_tokens: int, hash: str = "xxh3"
    ) -> dict[str, Any]:
        """The server's ``Match``: how many leading ``tokens`` it holds for this tenant under
        the engine's ``namespaces`` (one digest per tensor-parallel rank), and in which of
        its tiers: ``{"tokens", "chunks", "runs": [{"tier", "chunks"}, ...]}``."""
        request = cache_pb2.MatchRequest(
            token_ids=list(tokens), namespaces=list(namespaces), chunk_tokens=chunk_tokens, hash=hash
        )
        response = self._rpc(lambda: self._channel().match(request, timeout=self.timeout, metadata=self._metadata))
        runs = [{"tier": r.tier, "chunks": r.chunks} for r in response.runs]
        return {"tokens": response.tokens, "chunks": response.chunks, "runs": runs}

    def stats(self) -> dict[str, Any]:
        """The server's tiers summed (``capacity_bytes``, ``used_bytes``), this tenant's
        chunk count, and this client's counters. Raises when the server cannot answer."""
        server = self.server_stats()
        counts = self.counts
        tiers = server["tiers"]
        return {
            "tier": self.name,
            "target": self.target,
            "capacity_bytes": sum(t["capacity_bytes"] for t in tiers),
            "used_bytes": sum(t["used_bytes"] for t in tiers),
            "chunks": server["tenant_chunks"],
            "server_tiers": tiers,
            "shm": self.memory.in_use,
            **counts,
            "corrupt": counts["corrupt"] + sum(t["counters"].get("corrupt", 0) for t in tiers),
        }

    @property
    def counts(self) -> dict[str, int]:
        """This client's own counters (no call to the server): ``errors`` (calls that
        raised), ``corrupt`` (chunks that failed their check), ``shm_fallbacks``,
        ``data_loads`` and ``data_saves`` (through the bulk data channel) and
        ``data_fallbacks`` (loads and saves that could not take it and went through gRPC)."""
        with self._lock:
            counts = dict(self._counts)
        counts["data_fallbacks"] = self.data.fallbacks if self.data is not None else 0
        return counts

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts[what] += n

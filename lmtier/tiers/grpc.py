"""``grpc://host:port``: a client of ``lmtier serve``, the shared cache server.

    grpc://cache:50051?token=...            grpcs://cache:50051?tls_ca=/etc/lmtier/ca.crt

Options: ``token`` (or the environment variable named by ``token_env``, default
``LMTIER_TOKEN``: keeps the secret out of config files), ``timeout`` (seconds a small call
may take; bulk calls get more in proportion to their bytes, default 5), ``retries``
(default 2), ``tls`` / ``tls_ca`` / ``tls_cert`` / ``tls_key`` (mutual TLS) /
``tls_server_name``, ``shm`` (``auto``, ``on``, ``off``), ``shm_size`` (default 256MiB),
``shm_dir`` (default ``/dev/shm``), ``piece`` (largest message of a chunk's bytes),
``name``.

What the engine sees: misses, never errors. A call that fails is retried with backoff
when the failure is transient (server restarting, overloaded); a server that keeps failing
opens a circuit breaker, after which calls are misses at once (no waiting on a dead
server) until a probe call succeeds again. One channel per process is reused for every
call (HTTP/2 multiplexes them), made anew after ``fork``.

Same-host fast path (``lmtier.shm``): with ``shm=auto`` and a server on a loopback address,
the tier creates a shared-memory segment and moves frame bytes through it, gRPC carrying
only slot references; a server on another host (it cannot see the segment) answers
``FAILED_PRECONDITION`` and the tier falls back to plain gRPC, trying again a minute later.
Chunks read through the segment are views of its slots (no copy), held until released.

Every frame is checked by its reader: the server when it stores, the tier when the engine
reads the chunk (lazily, while the bytes are copied into the engine's cache).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc

from lmtier import codec, metrics
from lmtier.breaker import Backoff, CircuitBreaker, QuietWarning
from lmtier.buffers import BufferPool
from lmtier.chunk import Chunk, release_all
from lmtier.errors import ConfigError, IntegrityError, LmtierError
from lmtier.pieces import FrameAssembler, Region, pack, piece, split, unpack
from lmtier.shm import Segment, SegmentMaps, SegmentUnavailable
from lmtier.tiers.base import Capabilities, Tier, TierContext, TierURL, parse_bool
from lmtier.units import parse_size
from lmtier.v1 import cache_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")

SERVICE = "/lmtier.v1.CacheService/"
DEFAULT_PORT = 50051
PIECE_BYTES = 4 * 1024 * 1024 - 4096  # under gRPC's default 4 MiB message limit
MAX_MESSAGE = 80 * 1024 * 1024
MAX_FRAME = 1 << 30
MIN_RATE = 100e6  # bytes/s: a bulk call's deadline grows by its size at this rate
SHM_RETRY_S = 60.0
SHM_PIECES_PER_MESSAGE = 16
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}


def _seconds(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise ValueError("must be positive")
    return value


def _shm_mode(text: str) -> str:
    mode = text.strip().lower()
    if mode in ("auto", ""):
        return "auto"
    return "on" if parse_bool(mode) else "off"


class _NoShm(Exception):
    """The server cannot see our segment: retry the call without it."""


class _Channel:
    """One process's channel and its method callables."""

    def __init__(self, tier: GrpcTier) -> None:
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
            # Reconnect soon after a server restart (the defaults back off to 2 minutes).
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
            ("grpc.enable_retries", 0),  # the tier retries itself, with its own deadlines
        ]
        if tier.tls_server_name:
            options.append(("grpc.ssl_target_name_override", tier.tls_server_name))
        if tier.credentials is not None:
            self.channel = grpc.secure_channel(tier.target, tier.credentials, options=options)
        else:
            self.channel = grpc.insecure_channel(tier.target, options=options)
        c = self.channel
        self.lookup = c.unary_unary(
            SERVICE + "Lookup", cache_pb2.LookupRequest.SerializeToString, cache_pb2.LookupResponse.FromString
        )
        self.get = c.unary_stream(SERVICE + "Get", cache_pb2.GetRequest.SerializeToString, None)
        self.put = c.stream_unary(SERVICE + "Put", None, cache_pb2.PutResponse.FromString)
        self.delete = c.unary_unary(
            SERVICE + "Delete", cache_pb2.DeleteRequest.SerializeToString, cache_pb2.DeleteResponse.FromString
        )
        self.list = c.unary_unary(
            SERVICE + "List", cache_pb2.ListRequest.SerializeToString, cache_pb2.ListResponse.FromString
        )
        self.stats = c.unary_unary(
            SERVICE + "Stats", cache_pb2.StatsRequest.SerializeToString, cache_pb2.StatsResponse.FromString
        )
        self.release = c.unary_unary(
            SERVICE + "Release", cache_pb2.ReleaseRequest.SerializeToString, cache_pb2.ReleaseResponse.FromString
        )


class GrpcTier(Tier):
    scheme = "grpc"
    capabilities = Capabilities(listing=True)
    OPTIONS = {
        "token": str,
        "token_env": str,
        "timeout": _seconds,
        "retries": int,
        "tls": parse_bool,
        "tls_ca": str,
        "tls_cert": str,
        "tls_key": str,
        "tls_server_name": str,
        "shm": _shm_mode,
        "shm_size": parse_size,
        "shm_dir": str,
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
        token = token or os.environ.get(token_env, "")
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.credentials = None
        if tls or tls_ca or tls_cert:
            try:
                self.credentials = grpc.ssl_channel_credentials(
                    root_certificates=Path(tls_ca).read_bytes() if tls_ca else None,
                    private_key=Path(tls_key).read_bytes() if tls_key else None,
                    certificate_chain=Path(tls_cert).read_bytes() if tls_cert else None,
                )
            except OSError as exc:
                raise ConfigError(f"grpc tier {name}: cannot read a TLS file: {exc}") from exc
        self.tls_server_name = tls_server_name
        self._backoff = Backoff(attempts=retries)
        self._breaker = CircuitBreaker(threshold=3, cooldown=1.0)
        self._warning = QuietWarning(log)
        self._buffers = BufferPool(max_free=64, max_free_bytes=128 << 20)
        chunk_bytes = context.chunk_bytes if context else None
        self._frame_guess = (chunk_bytes or 1 << 20) + 4096
        if shm == "auto":
            shm = "on" if _is_local(target) and os.access(shm_dir, os.W_OK) else "off"
        self._shm_wanted = shm == "on"
        self._shm_size, self._shm_dir = shm_size, shm_dir
        # A slot holds one frame: the chunk plus its header, rounded up to 64 KiB.
        self._slot_bytes = -(-(chunk_bytes + 4096) // 65536) * 65536 if chunk_bytes else 4 * 1024**2
        self._shm_off_until = 0.0
        self._counts = {"errors": 0, "skipped": 0, "corrupt": 0, "retries": 0, "shm_fallbacks": 0}
        self._lock = threading.Lock()
        self._pid = -1
        self._conn: _Channel | None = None
        self._segment: Segment | None = None
        self._server_maps: SegmentMaps | None = None
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
    def _channel(self) -> _Channel:
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    self._conn = _Channel(self)
                    self._segment = None  # the parent's segment stays the parent's
                    self._server_maps = None
                    self._pid = os.getpid()
        return self._conn  # type: ignore[return-value]

    def _shm(self) -> Segment | None:
        """The segment to use for this call, made on first use; None when off."""
        if not self._shm_wanted or time.monotonic() < self._shm_off_until or self._closed:
            return None
        self._channel()
        if self._segment is None:
            with self._lock:
                if self._segment is None:
                    try:
                        self._segment = Segment(self._shm_dir, self._shm_size, self._slot_bytes)
                    except (OSError, LmtierError) as exc:
                        log.warning("grpc tier %s: no shared-memory segment (%s); using plain gRPC", self.name, exc)
                        self._shm_wanted = False
                        return None
        return self._segment

    def _no_shm(self, detail: str) -> None:
        self._count("shm_fallbacks")
        if "turned off" in detail or "several tenants" in detail:  # by design: it never will
            log.info("grpc tier %s: the server refuses shared memory (%s); plain gRPC", self.name, detail)
            with self._lock:
                self._shm_wanted = False
                segment, self._segment = self._segment, None
            if segment is not None:
                segment.close()  # nothing of ours stays in the segment directory
            return
        log.info("grpc tier %s: the server cannot use our shared memory (%s); plain gRPC for now", self.name, detail)
        self._shm_off_until = time.monotonic() + SHM_RETRY_S

    # -- calls ------------------------------------------------------------------------------
    def _call(self, op: str, fn: Callable[[], T], default: T) -> T:
        """Run ``fn`` with retries; a failure becomes ``default`` (a miss), counted."""
        if self._closed:
            return default
        if not self._breaker.allow():
            self._count("skipped")
            metrics.TIER_OPS.labels(self.name, op, "skipped").inc()
            return default
        delays = self._backoff.delays()
        shm_retried = False
        while True:
            try:
                result = fn()
            except _NoShm as exc:
                self._no_shm(str(exc))
                if shm_retried:
                    return default
                shm_retried = True
                continue
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if code in RETRYABLE and delays:
                    self._count("retries")
                    time.sleep(delays.pop(0))
                    continue
                details = exc.details() if hasattr(exc, "details") else str(exc)
                return self._failed(op, f"{getattr(code, 'name', code)} {details}", default)
            except Exception as exc:  # a protocol error, a bug: still a miss for the engine
                return self._failed(op, f"{type(exc).__name__}: {exc}", default)
            self._breaker.success()
            return result

    def _failed(self, op: str, why: str, default: T) -> T:
        self._breaker.failure()
        self._count("errors")
        metrics.TIER_ERRORS.labels(self.name, op).inc()
        self._warning.warning("grpc tier %s: %s failed: %s", self.name, op, why)
        return default

    def _deadline(self, nbytes: int) -> float:
        return self.timeout + nbytes / MIN_RATE

    def contains(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0

        def lookup() -> int:
            request = cache_pb2.LookupRequest(keys=list(keys))
            return self._channel().lookup(request, timeout=self.timeout, metadata=self._metadata).hits

        return self._call("contains", lookup, 0)

    def get(self, keys: Sequence[bytes]) -> list[Chunk | None]:
        if not keys:
            return []
        chunks = self._call("get", lambda: self._get(keys), None)
        return chunks if chunks is not None else [None] * len(keys)

    def _get(self, keys: Sequence[bytes]) -> list[Chunk | None]:
        segment = self._shm()
        slots: list[int] = []
        if segment is not None:
            while len(slots) < len(keys) and (slot := segment.acquire()) is not None:
                slots.append(slot)
        landing = [
            cache_pb2.SharedRegion(segment=segment.name, offset=segment.offset(s), length=segment.slot_bytes)
            for s in slots
        ]
        by_offset = {segment.offset(s): s for s in slots} if segment is not None else {}
        used: set[int] = set()
        out: list[Chunk | None] = [None] * len(keys)
        assembler = FrameAssembler(self._buffers, MAX_FRAME)
        done = False
        lease: _CallLease | None = None
        call = self._channel().get(
            cache_pb2.GetRequest(keys=list(keys), landing=landing),
            timeout=self._deadline(len(keys) * self._frame_guess),
            metadata=self._metadata,
        )
        try:
            index = 0
            for message in call:
                for one in unpack(message):
                    if index >= len(keys):
                        raise _protocol("the server sent more chunks than asked for")
                    if one.region is not None and one.head:  # in the server's memory, leased to us
                        if lease is None:
                            lease = _CallLease(lambda n=one.lease: self._release(n))
                        out[index] = self._in_place(keys[index], one, lease)
                        index += 1
                        continue
                    if one.region is not None:
                        slot = by_offset.get(one.region.offset)
                        if segment is None or slot is None or one.region.segment != segment.name or slot in used:
                            raise _protocol("the server named a region it was not given")
                        used.add(slot)
                        frame = segment.view(slot)[: one.region.length]
                        out[index] = self._decode(keys[index], one.key, frame, None, lambda s=slot: segment.release(s))
                        index += 1
                        continue
                    whole = assembler.add(one, one.data if one.data is not None else memoryview(b""))
                    if whole is not None:
                        key, frame, digest, release = whole
                        out[index] = self._decode(keys[index], key, frame, digest, release)
                        index += 1
            done = True
        except grpc.RpcError as exc:
            release_all(out)
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and landing:
                raise _NoShm(exc.details()) from exc
            raise
        except LmtierError:
            release_all(out)
            call.cancel()
            raise
        finally:
            assembler.abandon()
            if lease is not None:  # the call's own hold: chunks still out keep theirs
                lease.drop()
            if segment is not None:
                rest = [s for s in slots if s not in used]
                if done:
                    for s in rest:
                        segment.release(s)
                else:  # the server may still write into them: let them rest first
                    segment.quarantine(rest)
        return out

    def _release(self, lease: int) -> None:
        """Tell the server, without waiting for its answer (a dropped future would cancel
        the call: the last few are kept)."""
        request = cache_pb2.ReleaseRequest(lease=lease)
        future = self._channel().release.future(request, timeout=self.timeout, metadata=self._metadata)
        with self._lock:
            self._releases.append(future)

    def _in_place(self, want: bytes, one: Any, lease: _CallLease) -> Chunk | None:
        """A chunk the server left in its own memory, read where it lies (mapped read-only,
        verified when the engine copies it out). The server holds it until ``lease`` is
        released: when this call and every chunk from it have let go."""
        payload = self._server_memory(one.region)
        lease.hold()
        return self._decode(want, one.key, one.head, None, lease.drop, payload)

    def _server_memory(self, region: Region) -> memoryview:
        """The payload a server left in its own memory, mapped read-only."""
        if self._server_maps is None:
            self._server_maps = SegmentMaps(self._shm_dir, limit=4, writable=False)
        try:
            return self._server_maps.region(region.segment, region.offset, region.length)
        except SegmentUnavailable as exc:
            raise _NoShm(str(exc)) from exc

    def _decode(
        self,
        want: bytes,
        key: bytes,
        frame: memoryview | bytes,
        digest: int | None,
        release: Callable[[], None],
        payload: memoryview | None = None,
    ) -> Chunk | None:
        if key != want:
            release()
            raise _protocol("the server answered chunks out of order")
        try:
            chunk = codec.decode(
                frame,
                payload=payload,
                key=want,
                lazy=True,  # checked as the engine copies it out
                payload_checksum=digest,
                on_release=release,
                on_corrupt=lambda: self._drop_corrupt(want),
            )
        except IntegrityError as exc:
            release()
            log.warning("grpc tier %s: damaged chunk %s from the server: %s", self.name, want.hex()[:16], exc)
            self._drop_corrupt(want)
            return None
        return chunk

    def _drop_corrupt(self, key: bytes) -> None:
        """A chunk from the server failed its check: count it and delete the server's copy."""
        self._count("corrupt")
        metrics.INTEGRITY_FAILURES.labels(self.name).inc()
        self.delete([key])

    def put(self, chunks: Sequence[Chunk]) -> None:
        if chunks:
            self._call("put", lambda: self._put(chunks), None)

    def _put(self, chunks: Sequence[Chunk]) -> None:
        segment = self._shm()
        slots: list[int] = []
        nbytes = sum(c.nbytes for c in chunks)
        ok = False
        try:
            response = self._channel().put(
                self._messages(chunks, segment, slots), timeout=self._deadline(nbytes), metadata=self._metadata
            )
            ok = True
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and slots:
                raise _NoShm(exc.details()) from exc
            raise
        finally:
            if segment is not None:
                if ok:
                    for s in slots:
                        segment.release(s)
                else:
                    segment.quarantine(slots)
        metrics.TIER_OPS.labels(self.name, "put", "stored").inc(response.stored)
        metrics.TIER_OPS.labels(self.name, "put", "dropped").inc(len(chunks) - response.stored)
        metrics.TIER_BYTES.labels(self.name, "put").inc(nbytes)

    def _messages(self, chunks: Sequence[Chunk], segment: Segment | None, slots: list[int]) -> Iterator[bytes]:
        """The ``Pieces`` messages of ``chunks``: frames through free slots of the segment
        (many to a message), the rest as bytes (a message per piece). A damaged chunk is
        skipped, never sent."""
        landed: list[list] = []
        for chunk in chunks:
            try:
                if segment is not None and codec.encoded_size(chunk) <= segment.slot_bytes:
                    slot = segment.acquire()
                    if slot is not None:
                        slots.append(slot)
                        n = codec.encode_into(chunk, segment.view(slot))  # copies and hashes in one pass
                        landed.append(piece(chunk.key, n, region=Region(segment.name, segment.offset(slot), n)))
                        if len(landed) == SHM_PIECES_PER_MESSAGE:
                            yield pack(*landed)
                            landed = []
                        continue
                parts = [memoryview(p).cast("B") for p in codec.encode_parts(chunk)]
            except IntegrityError:
                self._count("corrupt")
                continue
            if landed:
                yield pack(*landed)
                landed = []
            size = sum(len(p) for p in parts)
            for offset, views in split(parts, self.piece):
                first = offset == 0
                yield pack(piece(chunk.key if first else b"", size if first else 0, offset, data=views))
        if landed:
            yield pack(*landed)

    def delete(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return

        def delete() -> None:
            request = cache_pb2.DeleteRequest(keys=list(keys))
            self._channel().delete(request, timeout=self.timeout, metadata=self._metadata)

        self._call("delete", delete, None)

    def keys(self, prefix: bytes = b"", limit: int | None = None) -> list[bytes]:
        """The keys the server holds for this tier's tenant (most recent first)."""

        def listing() -> list[bytes]:
            request = cache_pb2.ListRequest(limit=limit or 0)
            response = self._channel().list(request, timeout=self.timeout, metadata=self._metadata)
            return [k for k in response.keys if k.startswith(prefix)]

        return self._call("list", listing, [])

    def close(self) -> None:
        self._closed = True
        if self._pid == os.getpid():
            if self._conn is not None:
                self._conn.channel.close()
            if self._segment is not None:
                self._segment.close()
        self._pid = -1

    # -- derived ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The server's tiers summed (``capacity_bytes``, ``used_bytes``), this tenant's
        chunk count, and this client's counters. Raises when the server cannot answer."""
        response = self._channel().stats(cache_pb2.StatsRequest(), timeout=self.timeout, metadata=self._metadata)
        with self._lock:
            counts = dict(self._counts)
        server_corrupt = sum(t.counters.get("corrupt", 0) for t in response.tiers)
        segment = self._segment
        return {
            "tier": self.name,
            "target": self.target,
            "capacity_bytes": sum(t.capacity_bytes for t in response.tiers),
            "used_bytes": sum(t.used_bytes for t in response.tiers),
            "chunks": response.tenant_chunks,
            "server_tiers": [
                {
                    "name": t.name,
                    "capacity_bytes": t.capacity_bytes,
                    "used_bytes": t.used_bytes,
                    "chunks": t.chunks,
                    "counters": dict(t.counters),
                }
                for t in response.tiers
            ],
            "shm": segment.name if segment is not None and time.monotonic() >= self._shm_off_until else None,
            "breaker_open": self._breaker.is_open,
            **counts,
            "corrupt": counts["corrupt"] + server_corrupt,
        }

    @property
    def counts(self) -> dict[str, int]:
        """This client's own counters (no call to the server)."""
        with self._lock:
            return {**self._counts, "breaker_open": int(self._breaker.is_open)}

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts[what] += n


def _nothing() -> None:
    return None


class _CallLease:
    """The server's lease on the chunks of one call that we read in its memory: released
    (``on_done``) once the call and every chunk from it have let go."""

    def __init__(self, on_done: Callable[[], None]) -> None:
        self._count = 1  # the call's own hold
        self._on_done = on_done
        self._lock = threading.Lock()

    def hold(self) -> None:
        with self._lock:
            self._count += 1

    def drop(self) -> None:
        with self._lock:
            self._count -= 1
            done = self._count == 0
        if done:
            self._on_done()


def _protocol(message: str) -> LmtierError:
    return LmtierError(f"protocol error: {message}")


def _is_local(target: str) -> bool:
    host = target.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


__all__ = ["GrpcTier"]

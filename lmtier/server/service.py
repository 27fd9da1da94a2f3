"""``CacheService``: the server side of protos/lmtier/v1/cache.proto, over a TieredStore.

    Lookup  leading hits of a key list          Get   the leading run, frame by frame
    Put     frames in, stored when whole        Delete, List, Stats

Every call first parses its request, resolves the caller's tenant (``auth``) and is
admitted (``max_calls_per_tenant``, see ``_accounted``); it scopes its keys to the tenant,
checks its input and answers a clear status for anything wrong (``INVALID_ARGUMENT`` for a
malformed message or key, ``RESOURCE_EXHAUSTED`` for a frame over the limit, ``DATA_LOSS``
for a damaged one, ``FAILED_PRECONDITION`` for a shared-memory segment not on this host).

Bulk bytes skip protobuf (``lmtier.pieces``): ``Put`` receives raw ``ChunkPiece`` bytes and
``Get`` sends them. A frame is checked as it is stored (``codec.decode``, then the first
tier hashes the payload while copying it in) and as it is served (the chunk is verified
while it is encoded), so the server never keeps or hands out a damaged chunk.

Memory per call is bounded: a ``Put`` holds at most ``PUT_BATCH_BYTES`` of frames plus one
half-built frame; a ``Get`` holds ``GET_BATCH`` chunks and reads one batch ahead.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from lmtier import codec, metrics, shm
from lmtier.buffers import BufferPool
from lmtier.chunk import Chunk, release_all
from lmtier.config import Config, ServerConfig, public_view
from lmtier.errors import IntegrityError, LayoutError, LmtierError
from lmtier.pieces import FrameAssembler, FrameTooLarge, Region, pack, piece, split, unpack
from lmtier.server.auth import Authenticator
from lmtier.shm import SegmentMaps, SegmentUnavailable
from lmtier.store import TieredStore
from lmtier.v1 import cache_pb2

log = logging.getLogger(__name__)

SERVICE = "lmtier.v1.CacheService"
KEY_LENGTHS = (16, 32)  # xxh3-128 and sha256 chunk keys
PIECE_BYTES = 4 * 1024 * 1024 - 4096  # under gRPC's default 4 MiB message limit
PUT_BATCH = 16
PUT_BATCH_BYTES = 16 * 1024 * 1024
GET_BATCH = 8
STATS_COUNT_LIMIT = 100_000  # Stats counts a tenant's chunks up to this many (a bounded listing)
LIST_DEFAULT, LIST_MAX = 1000, 100_000


class _Abort(Exception):
    """Raised inside a handler to end the call with a status (see ``_accounted``)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Leases:
    """Chunks that same-host clients read where they lie in the memory tier.

    The chunks of one call share a lease, held (never evicted, never overwritten) until
    the client releases it (``Release``, once it has let go of every chunk) or is gone:
    a client lives as long as it holds the lock on its shared-memory segment, which the
    probe loop checks (``reap``). At most ``limit`` bytes are leased in all; past that,
    chunks are copied to the client instead, so a client that never releases costs speed,
    never memory."""

    def __init__(self, limit: int, shm_dir: str) -> None:
        self.limit = limit
        self.shm_dir = shm_dir
        self.held = 0
        self._next = int.from_bytes(os.urandom(4), "little") << 20  # ids unlike a restarted server's
        self._leases: dict[int, dict] = {}
        self._lock = threading.Lock()

    def open(self, tag: bytes, owner: str) -> int:
        with self._lock:
            self._next += 1
            self._leases[self._next] = {"tag": tag, "owner": owner, "chunks": [], "ended": False}
            return self._next

    def hold(self, lease: int, chunk: Chunk) -> bool:
        with self._lock:
            entry = self._leases.get(lease)
            if entry is None or self.held + chunk.nbytes > self.limit:
                return False
            entry["chunks"].append(chunk.share())
            self.held += chunk.nbytes
        return True

    def finish(self, lease: int) -> None:
        """The call ended; an empty lease is dropped at once."""
        with self._lock:
            entry = self._leases.get(lease)
            if entry is not None:
                entry["ended"] = True
                if not entry["chunks"]:
                    del self._leases[lease]

    def release(self, lease: int, tag: bytes) -> None:
        with self._lock:
            entry = self._leases.get(lease)
            if entry is None or entry["tag"] != tag:
                return
            self._drop(lease)

    def reap(self, everything: bool = False) -> None:
        """Release the leases of clients that are gone (or all of them, at shutdown)."""
        with self._lock:
            owners = {e["owner"] for e in self._leases.values() if e["ended"]}
        gone = owners if everything else {o for o in owners if not shm.alive(self.shm_dir, o)}
        with self._lock:
            for lease in [k for k, e in self._leases.items() if everything or (e["ended"] and e["owner"] in gone)]:
                self._drop(lease)

    def _drop(self, lease: int) -> None:  # with the lock held
        chunks = self._leases.pop(lease)["chunks"]
        self.held -= sum(c.nbytes for c in chunks)
        release_all(chunks)


class CacheService:
    def __init__(self, store: TieredStore, config: ServerConfig, auth: Authenticator) -> None:
        self._config_json = json.dumps(public_view(Config(server=config))["server"], sort_keys=True)
        self.store = store
        self.config = config
        self.auth = auth
        # Requests name client segments, and every process on the host can see those names:
        # a server with several tenants cannot tell whose a segment is, so it maps none (one
        # tenant could otherwise have it read another's segment or write into its slots).
        self.maps = SegmentMaps(config.shm_dir) if config.shm_dir and auth.single_tenant else None
        self._no_shm = (
            "this server has shared memory turned off"
            if not config.shm_dir
            else "shared memory is refused on a server with several tenants"
        )
        self.buffers = BufferPool(max_free=32, max_free_bytes=128 << 20)
        first = store.tiers[0]
        self.shared = first if first.capabilities.shared_memory else None  # zero-copy reads
        self.leases = _Leases(first.capacity // 4, config.shm_dir)
        self._calls: dict[bytes, int] = {}  # tenant tag -> calls in flight
        self._calls_lock = threading.Lock()

    # -- registration -------------------------------------------------------------------
    def handler(self) -> grpc.GenericRpcHandler:
        """Every method takes its request as bytes and parses it itself: gRPC's own
        deserializer would answer a malformed request with INTERNAL, not INVALID_ARGUMENT."""

        def unary(fn, request_type, response_type, admit=True):
            return grpc.unary_unary_rpc_method_handler(
                self._observed(fn.__name__, fn, request_type, admit),
                request_deserializer=None,
                response_serializer=response_type.SerializeToString,
            )

        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Lookup": unary(self.Lookup, cache_pb2.LookupRequest, cache_pb2.LookupResponse),
                "Get": grpc.unary_stream_rpc_method_handler(
                    self._observed_stream("Get", self.Get, cache_pb2.GetRequest),
                    request_deserializer=None,
                    response_serializer=None,  # ChunkPiece bytes from lmtier.pieces
                ),
                "Put": grpc.stream_unary_rpc_method_handler(
                    self._observed("Put", self.Put, None),  # raw ChunkPiece bytes, parsed by lmtier.pieces
                    request_deserializer=None,
                    response_serializer=cache_pb2.PutResponse.SerializeToString,
                ),
                "Delete": unary(self.Delete, cache_pb2.DeleteRequest, cache_pb2.DeleteResponse),
                "List": unary(self.List, cache_pb2.ListRequest, cache_pb2.ListResponse),
                # Release frees memory: never refused for being one call too many.
                "Release": unary(self.Release, cache_pb2.ReleaseRequest, cache_pb2.ReleaseResponse, admit=False),
                "Stats": unary(self.Stats, cache_pb2.StatsRequest, cache_pb2.StatsResponse),
            },
        )

    @contextmanager
    def _admitted(self, context: grpc.ServicerContext, admit: bool) -> Iterator[bytes]:
        """The caller's tenant tag, for as long as the call runs; a tenant already at
        ``max_calls_per_tenant`` calls is refused with RESOURCE_EXHAUSTED, so that one
        client (however many connections it opens) cannot take every worker."""
        tag = self.auth.tag(context)
        if not admit:
            yield tag
            return
        limit = self.config.max_calls_per_tenant
        with self._calls_lock:
            held = self._calls.get(tag, 0)
            if held >= limit:
                raise _Abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"this tenant has {held} calls in flight; the limit is {limit} (max_calls_per_tenant)",
                )
            self._calls[tag] = held + 1  # one entry per tenant with a call in flight: bounded
        try:
            yield tag
        finally:
            with self._calls_lock:
                held = self._calls.pop(tag) - 1
                if held:
                    self._calls[tag] = held

    def calls_in_flight(self, tag: bytes) -> int:
        with self._calls_lock:
            return self._calls.get(tag, 0)

    @contextmanager
    def _accounted(self, name: str, context: grpc.ServicerContext, admit: bool) -> Iterator[bytes]:
        """Admits and counts one call, yielding its tenant tag; turns ``_Abort`` into its
        status and any other failure into ``INTERNAL`` with a log line (the server never
        dies of one call)."""
        metrics.SERVER_INFLIGHT.inc()
        code = grpc.StatusCode.OK
        try:
            with self._admitted(context, admit) as tag:
                yield tag
        except Exception as exc:
            code, message = _failure(name, context, exc)
            if message is not None:
                context.abort(code, message)
            raise
        finally:
            metrics.SERVER_INFLIGHT.dec()
            metrics.SERVER_RPCS.labels(name, code.name).inc()

    def _observed(self, name: str, fn: Callable[..., Any], request_type: Any, admit: bool = True) -> Callable:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            with self._accounted(name, context, admit) as tag:
                return fn(_parsed(request_type, request), context, tag)

        return call

    def _observed_stream(self, name: str, fn: Callable[..., Iterator[Any]], request_type: Any) -> Callable:
        def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            with self._accounted(name, context, True) as tag:
                yield from fn(_parsed(request_type, request), context, tag)

        return call

    # -- input checks ---------------------------------------------------------------------
    def _scoped(self, tag: bytes, keys) -> list[bytes]:
        if len(keys) > self.config.max_keys:
            raise _Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(keys)} keys in one request; the limit is {self.config.max_keys}",
            )
        out = []
        for i, key in enumerate(keys):
            _check_key(key, f"key {i}")
            out.append(tag + key)
        return out

    # -- calls --------------------------------------------------------------------------
    def Lookup(
        self, request: cache_pb2.LookupRequest, context: grpc.ServicerContext, tag: bytes
    ) -> cache_pb2.LookupResponse:
        keys = self._scoped(tag, request.keys)
        return cache_pb2.LookupResponse(hits=self.store.lookup(keys))

    def Get(self, request: cache_pb2.GetRequest, context: grpc.ServicerContext, tag: bytes) -> Iterator[bytes]:
        keys = list(request.keys)
        scoped = self._scoped(tag, keys)
        landing = [Region(r.segment, r.offset, r.length) for r in request.landing]
        if len(landing) > len(keys):
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "more landing regions than keys")
        if landing and self.maps is None:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, self._no_shm)
        index = 0
        segments: dict[str, memoryview] = {}  # mapped once per call
        lease = self.leases.open(tag, landing[0].segment) if landing and self.shared is not None else 0
        batches = self.store.iter_get(scoped, GET_BATCH, ahead=1)
        try:
            for chunks in batches:
                landed: list[list] = []  # shared-memory pieces of this batch: one message
                damaged = False
                try:
                    for chunk in chunks:
                        if not context.is_active():
                            return
                        region = landing[index] if index < len(landing) else None
                        try:
                            parts, messages = self._serve(keys[index], chunk, region, segments, lease)
                        except IntegrityError as exc:  # the stored copy is dropped: a miss from here
                            log.warning("chunk %s failed verification while served: %s", keys[index].hex()[:16], exc)
                            damaged = True
                            break
                        if parts is not None:
                            landed.append(parts)
                        else:
                            if landed:
                                yield pack(*landed)
                                landed = []
                            yield from messages
                        index += 1
                finally:
                    release_all(chunks)
                if landed:
                    yield pack(*landed)
                if damaged:
                    return
        finally:
            batches.close()
            self.leases.finish(lease)

    def _serve(
        self, key: bytes, chunk: Chunk, region: Region | None, segments: dict, lease: int
    ) -> tuple[list | None, list[bytes]]:
        """One chunk under the caller's key: ``(piece, [])`` when it went through shared
        memory (a piece to pack with others), ``(None, messages)`` when it travels as bytes.

        The bytes are relayed as stored, under the checksum recorded when they were
        stored: the client verifies every frame it reads (and deletes a damaged one), so
        checking here too would hash each chunk twice for nothing."""
        view = chunk.view_as(key)
        size = codec.encoded_size(view)
        if region is not None and self.shared is not None:
            offset = self.shared.locate(chunk)
            if offset is not None and lease and self.leases.hold(lease, chunk):  # read where it lies
                head = codec.encode_parts(view, relay=True)[0]
                where = Region(self.shared.shared_name, offset, chunk.nbytes)  # type: ignore[arg-type]
                metrics.SERVER_BYTES.labels("get", "shm").inc(size)
                return piece(key, size, region=where, head=head, lease=lease), []
        if region is not None and size <= region.length:
            segment = segments.get(region.segment)
            if segment is None:
                segment = segments[region.segment] = self._segment(region.segment)
            if region.offset + size > len(segment):
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"a landing region lies outside {region.segment}")
            codec.encode_into(view, segment[region.offset : region.offset + size], relay=True)
            metrics.SERVER_BYTES.labels("get", "shm").inc(size)
            return piece(key, size, region=Region(region.segment, region.offset, size)), []
        parts = [memoryview(p).cast("B") for p in codec.encode_parts(view, relay=True)]
        metrics.SERVER_BYTES.labels("get", "grpc").inc(size)
        return None, [
            pack(piece(key if offset == 0 else b"", size if offset == 0 else 0, offset, data=views))
            for offset, views in split(parts, PIECE_BYTES)
        ]

    def _segment(self, segment: str) -> memoryview:
        """A whole client segment (checked against its file once)."""
        if self.maps is None:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, self._no_shm)
        try:
            return self.maps.region(segment, 0, None)
        except SegmentUnavailable as exc:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from exc
        except LmtierError as exc:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc

    def _region(self, segment: str, offset: int, length: int) -> memoryview:
        if self.maps is None:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, self._no_shm)
        try:
            return self.maps.region(segment, offset, length)
        except SegmentUnavailable as exc:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from exc
        except LmtierError as exc:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc

    def Put(self, messages: Iterator[bytes], context: grpc.ServicerContext, tag: bytes) -> cache_pb2.PutResponse:
        assembler = FrameAssembler(self.buffers, self.config.max_chunk_bytes)
        batch: list[tuple[Chunk, Callable[[], None]]] = []
        damaged: list[bytes] = []
        totals = {"stored": 0, "dropped": 0}

        def store() -> None:
            chunks = [c for c, _ in batch]
            try:
                held = self.store.put(chunks)
            finally:
                for _, release in batch:
                    release()
                batch.clear()
            if damaged:  # found by the first tier as it hashed the payload in
                raise _Abort(grpc.StatusCode.DATA_LOSS, f"chunk {damaged[0].hex()} failed its payload checksum")
            totals["stored"] += held
            totals["dropped"] += len(chunks) - held

        try:
            for message in messages:
                try:
                    pieces = unpack(message)
                except LmtierError as exc:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed message: {exc}") from exc
                for one in pieces:
                    frame = self._receive(one, assembler)
                    if frame is None:
                        continue
                    key, view, digest, release, transport = frame
                    try:
                        chunk = self._accept(tag, key, view, digest, damaged)
                    except BaseException:
                        release()
                        raise
                    metrics.SERVER_BYTES.labels("put", transport).inc(len(view))
                    batch.append((chunk, release))
                    if len(batch) >= PUT_BATCH or sum(c.nbytes for c, _ in batch) >= PUT_BATCH_BYTES:
                        store()
            if assembler.pending:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "the stream ended in the middle of a chunk")
            if not context.is_active():  # the call failed under us (a message over the limit, a
                return cache_pb2.PutResponse()  # cancel): its stream only looks ended; store nothing
            store()
        finally:
            assembler.abandon()
            for _, release in batch:
                release()
        return cache_pb2.PutResponse(stored=totals["stored"], dropped=totals["dropped"])

    def _receive(self, one, assembler: FrameAssembler):
        """A whole frame from this piece (with what came before), or None for now."""
        try:
            if one.region is not None:
                if assembler.pending or one.offset != 0 or one.region.length != one.frame_size:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "a shared-memory piece must hold a whole frame")
                if not one.key:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "a piece without its chunk's key")
                if one.frame_size > self.config.max_chunk_bytes:
                    raise FrameTooLarge(
                        f"frame of {one.frame_size} bytes exceeds the limit of {self.config.max_chunk_bytes}"
                    )
                view = self._region(one.region.segment, one.region.offset, one.region.length)
                return one.key, view, None, _nothing, "shm"
            done = assembler.add(one, one.data if one.data is not None else memoryview(b""))
        except FrameTooLarge as exc:
            raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from exc
        except LmtierError as exc:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        return None if done is None else (*done, "grpc")

    def _accept(self, tag: bytes, key: bytes, frame: memoryview, digest: int | None, damaged: list[bytes]) -> Chunk:
        """Check one received frame and return the chunk to store under the tenant's key."""
        _check_key(key, "the chunk key")
        try:
            chunk = codec.decode(
                frame,
                key=key,
                lazy=True,  # the first tier hashes the payload as it copies it in
                payload_checksum=digest,
                on_corrupt=lambda: damaged.append(key),
            )
        except LayoutError as exc:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"chunk {key.hex()}: {exc}") from exc
        except IntegrityError as exc:
            code = grpc.StatusCode.DATA_LOSS if "checksum" in str(exc) else grpc.StatusCode.INVALID_ARGUMENT
            raise _Abort(code, f"chunk {key.hex()}: {exc}") from exc
        if chunk.namespace and len(chunk.namespace) != len(key):  # a digest of the key's own hash
            raise _Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"chunk {key.hex()}: a namespace digest of {len(chunk.namespace)} bytes does not go with "
                f"a key of {len(key)}",
            )
        return chunk.view_as(tag + key)

    def Release(
        self, request: cache_pb2.ReleaseRequest, context: grpc.ServicerContext, tag: bytes
    ) -> cache_pb2.ReleaseResponse:
        self.leases.release(request.lease, tag)
        return cache_pb2.ReleaseResponse()

    def Delete(
        self, request: cache_pb2.DeleteRequest, context: grpc.ServicerContext, tag: bytes
    ) -> cache_pb2.DeleteResponse:
        self.store.delete(self._scoped(tag, request.keys))
        return cache_pb2.DeleteResponse()

    def List(self, request: cache_pb2.ListRequest, context: grpc.ServicerContext, tag: bytes) -> cache_pb2.ListResponse:
        limit = min(request.limit or LIST_DEFAULT, LIST_MAX)
        keys = self.tenant_keys(tag, limit + 1)
        return cache_pb2.ListResponse(keys=[k[len(tag) :] for k in keys[:limit]], truncated=len(keys) > limit)

    def tenant_keys(self, tag: bytes, limit: int | None = None) -> list[bytes]:
        """Distinct keys of one tenant across the tiers that can list (fastest first)."""
        seen: dict[bytes, None] = {}
        for tier in self.store.tiers:
            if not tier.capabilities.listing:
                continue
            for key in tier.keys(tag, limit):
                seen.setdefault(key, None)
            if limit is not None and len(seen) >= limit:
                break
        keys = list(seen)
        return keys if limit is None else keys[:limit]

    def Stats(
        self, request: cache_pb2.StatsRequest, context: grpc.ServicerContext, tag: bytes
    ) -> cache_pb2.StatsResponse:
        tiers = []
        for stats in self.store.stats()["tiers"]:
            counters = {
                k: int(v) for k, v in stats.items() if isinstance(v, int | bool) and k not in _SIZES and int(v) >= 0
            }
            tiers.append(
                cache_pb2.TierStats(
                    name=str(stats.get("tier", "")),
                    capacity_bytes=int(stats.get("capacity_bytes", 0)),
                    used_bytes=int(stats.get("used_bytes", 0)),
                    chunks=int(stats.get("chunks", 0)),
                    counters=counters,
                )
            )
        return cache_pb2.StatsResponse(
            tiers=tiers,
            tenant_chunks=len(self.tenant_keys(tag, STATS_COUNT_LIMIT)),
            config_json=self._config_json,
        )


_SIZES = {"capacity_bytes", "used_bytes", "chunks"}


def _check_key(key: bytes, what: str) -> None:
    if len(key) not in KEY_LENGTHS:
        raise _Abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{what} is {len(key)} bytes; chunk keys are {' or '.join(map(str, KEY_LENGTHS))} bytes",
        )


def _nothing() -> None:
    return None


def _parsed(request_type: Any, raw: Any) -> Any:
    """The request message from its bytes; malformed bytes are the caller's error."""
    if request_type is None:
        return raw
    try:
        return request_type.FromString(raw)
    except DecodeError as exc:
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {request_type.__name__}: {exc}") from exc


def _failure(name: str, context: grpc.ServicerContext, exc: BaseException) -> tuple[grpc.StatusCode, str | None]:
    """The status a failed call ends with, and the message to abort it with (None: the
    call was aborted already, by the authenticator)."""
    if isinstance(exc, _Abort):
        return exc.code, str(exc)
    if isinstance(exc, grpc.RpcError):  # the client went away while we read its stream
        return grpc.StatusCode.CANCELLED, None
    code = context.code() if hasattr(context, "code") else None
    if isinstance(code, grpc.StatusCode) and code != grpc.StatusCode.OK:
        return code, None
    log.exception("%s failed", name)  # not an abort: a bug
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"

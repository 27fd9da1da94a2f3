"""``CacheService``: the server side of protos/lmtier/v1/cache.proto, over a TieredStore.

    Lookup  leading hits of a key list          Get   the leading run, frame by frame
    Put     frames in, stored when whole        Delete, List, Stats
    Match   for routers: the leading tokens of a prompt held, from token ids and the
            engine's namespace digests (the server computes the keys)
    Directory  one tenant, same host: where the memory tier's chunks are published, for
            reads with no call (``published``); the chunks read so are counted as used
    OpenData   another host: a ticket for the bulk data channel (``data``), the caller's
            tenant's, for loads without gRPC's per-message costs

Every call first parses its request, resolves the caller's tenant (``auth``) and is
admitted (``max_calls_per_tenant``; ``calls``); it scopes its keys to the tenant,
checks its input and answers a clear status for anything wrong (``INVALID_ARGUMENT`` for a
malformed message or key, ``RESOURCE_EXHAUSTED`` for a frame over the limit, ``DATA_LOSS``
for a damaged one, ``FAILED_PRECONDITION`` for a shared-memory segment not on this host).

Bulk bytes skip protobuf (``lmtier.transport.pieces``): ``Put`` receives raw ``ChunkPiece`` bytes and
``Get`` sends them. A frame is checked as it is stored (``codec.decode``, then the first
tier hashes the payload while copying it in) and as it is served (the chunk is verified
while it is encoded), so the server never keeps or hands out a damaged chunk.

Memory per call is bounded: a ``Put`` holds at most ``PUT_BATCH_BYTES`` of frames, one
half-built frame (all Puts' half-built frames together at most ``RECEIVING_CHUNKS`` of the
largest, half of that per tenant where tenants share the server: ``budget``) and one
message in gRPC's buffers (``max_message_bytes``); a ``Get`` holds ``GET_BATCH`` chunks and
reads one batch ahead.

Longer than 400 lines: one method per call of the service, each with the input checks that
keep one tenant's request from reaching another's chunks or the server's own memory, kept
in one class so that a reader sees every call's checks side by side.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import xxhash

from lmtier import metrics
from lmtier.buffers import BufferPool
from lmtier.config import Config, ServerConfig, public_view
from lmtier.errors import IntegrityError, LayoutError, LmtierError
from lmtier.kv import codec
from lmtier.kv.chunk import Chunk, release_all
from lmtier.server.auth import Authenticator, tenant_tag
from lmtier.server.budget import RECEIVING_CHUNKS, ReceiveBudget
from lmtier.server.calls import Abort, Calls, refusal
from lmtier.server.leases import Leases
from lmtier.server.match import match
from lmtier.server.published import Published
from lmtier.server.watchdog import Watchdog
from lmtier.store.tiered import TieredStore
from lmtier.tiers.cpu import CpuTier
from lmtier.transport.pieces import (
    PIECE_BYTES,
    FrameAssembler,
    FrameTooLarge,
    ReceiveBusy,
    Region,
    pack,
    piece,
    split,
    unpack,
)
from lmtier.transport.shm import SegmentFiles, SegmentUnavailable
from lmtier.v1 import cache_pb2

log = logging.getLogger(__name__)

SERVICE = "lmtier.v1.CacheService"
KEY_LENGTHS = (16, 32)  # xxh3-128 and sha256 chunk keys
PUT_BATCH = 16
PUT_BATCH_BYTES = 16 * 1024 * 1024
HEAD_READ = 4096  # a save's first read of a client's slot: the frame's preamble and header
GET_BATCH = 8
STATS_COUNT_LIMIT = 100_000  # Stats counts a tenant's chunks up to this many (a bounded listing)
STATS_REFRESH_S = 1.0  # a tenant's Stats answer is reused this long
STATS_CACHED = 1024  # tenants whose last answer is kept
LIST_DEFAULT, LIST_MAX = 1000, 100_000


class CacheService:
    def __init__(self, store: TieredStore, config: ServerConfig, auth: Authenticator) -> None:
        view = public_view(Config(server=config))["server"]
        self._config_json = json.dumps(view, sort_keys=True)
        # a tenant's view: no other tenant's name, no operator's
        self._tenant_config_json = json.dumps({**view, "tokens": [], "operators": []}, sort_keys=True)
        self._operators = {tenant_tag(t) for t in config.operators}
        self._stats: dict[bytes, tuple[float, cache_pb2.StatsResponse]] = {}
        self._stats_lock = threading.Lock()
        self.store = store
        self.config = config
        self.auth = auth
        # Requests name client segments, and every process on the host can see those names:
        # a server with several tenants cannot tell whose a segment is, so it maps none (one
        # tenant could otherwise have it read another's segment or write into its slots).
        self.maps = SegmentFiles(config.shm_dir) if config.shm_dir and auth.single_tenant else None
        self._no_shm = (
            "this server has shared memory turned off"
            if not config.shm_dir
            else "shared memory is refused on a server with several tenants"
        )
        self.buffers = BufferPool(max_free=32, max_free_bytes=128 << 20)
        receiving = RECEIVING_CHUNKS * config.max_chunk_bytes
        self.receiving = ReceiveBudget(receiving, receiving if auth.single_tenant else receiving // 2)
        first = store.tiers[0]
        self.shared = first if first.capabilities.shared_memory else None  # zero-copy reads
        # Saves through shared memory are read straight into the memory tier's slots.
        self.landing = first if isinstance(first, CpuTier) and self.maps is not None else None
        self.leases = Leases(first.capacity // 4, config.shm_dir, ttl=config.call_timeout)
        # One tenant, clients on this host: what the memory tier holds, published for reads
        # with no call (lmtier.transport.directory).
        self.published: Published | None = None
        tenant = auth.only_tenant
        if self.maps is not None and self.shared is not None and tenant is not None and hasattr(first, "set_publisher"):
            self.published = Published(first, config.shm_dir, tenant_tag(tenant), KEY_LENGTHS, config.probe_interval)
        limit = config.calls_per_tenant(auth.single_tenant)
        self.watchdog = Watchdog(config.stall_timeout, config.call_timeout)
        self.calls = Calls(auth, limit, config.workers, self.watchdog, rate=config.max_call_rate_per_tenant)
        self.data = None  # the bulk data channel (lmtier.server.data), where the server runs one

    # -- registration -------------------------------------------------------------------
    def handler(self) -> grpc.GenericRpcHandler:
        """Every method takes its request as bytes and parses it itself (gRPC's own
        deserializer would answer a malformed request with INTERNAL, not INVALID_ARGUMENT),
        and is registered as request-streaming (see ``calls``). Credentials are checked
        when the call's headers arrive (``Gate``), before a worker or a byte of memory."""

        def unary(fn, response_type, request_type=None, admit=True):
            return grpc.stream_unary_rpc_method_handler(
                self.calls.unary(fn.__name__, fn, request_type, admit),
                response_serializer=response_type.SerializeToString,
            )

        methods = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Lookup": unary(self.Lookup, cache_pb2.LookupResponse, cache_pb2.LookupRequest),
                # ChunkPiece bytes from lmtier.transport.pieces, both ways
                "Get": grpc.stream_stream_rpc_method_handler(self.calls.stream("Get", self.Get, cache_pb2.GetRequest)),
                "Put": grpc.stream_unary_rpc_method_handler(
                    self.calls.uploads("Put", self.Put), response_serializer=cache_pb2.PutResponse.SerializeToString
                ),
                "Delete": unary(self.Delete, cache_pb2.DeleteResponse, cache_pb2.DeleteRequest),
                "List": unary(self.List, cache_pb2.ListResponse, cache_pb2.ListRequest),
                # Release frees memory: never refused for being one call too many.
                "Release": unary(self.Release, cache_pb2.ReleaseResponse, cache_pb2.ReleaseRequest, admit=False),
                "Stats": unary(self.Stats, cache_pb2.StatsResponse, cache_pb2.StatsRequest),
                "Match": unary(self.Match, cache_pb2.MatchResponse, cache_pb2.MatchRequest),
                "Directory": unary(self.Directory, cache_pb2.DirectoryResponse, cache_pb2.DirectoryRequest),
                "OpenData": unary(self.OpenData, cache_pb2.OpenDataResponse, cache_pb2.OpenDataRequest),
            },
        )
        return Gate(methods, self.auth)

    def calls_in_flight(self, tag: bytes) -> int:
        return self.calls.in_flight(tag)

    # -- input checks ---------------------------------------------------------------------
    def _scoped(self, tag: bytes, keys) -> list[bytes]:
        if len(keys) > self.config.max_keys:
            raise Abort(
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
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "more landing regions than keys")
        if len({r.segment for r in landing}) > 1:  # the lease's owner is that one segment's client
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "landing regions name more than one segment")
        if landing and self.maps is None:
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION, self._no_shm)
        index = 0
        if landing and self.shared is not None:
            self._not_own(landing[0].segment)
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
                            parts, messages = self._serve(keys[index], chunk, region, lease)
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

    def _serve(self, key: bytes, chunk: Chunk, region: Region | None, lease: int) -> tuple[list | None, list[bytes]]:
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
            self._segment_io(
                lambda files: files.write(region.segment, region.offset, codec.encode_parts(view, relay=True)),
                region.segment,
            )
            metrics.SERVER_BYTES.labels("get", "shm").inc(size)
            return piece(key, size, region=Region(region.segment, region.offset, size)), []
        parts = [memoryview(p).cast("B") for p in codec.encode_parts(view, relay=True)]
        metrics.SERVER_BYTES.labels("get", "grpc").inc(size)
        return None, [
            pack(piece(key if offset == 0 else b"", size if offset == 0 else 0, offset, data=views))
            for offset, views in split(parts, PIECE_BYTES)
        ]

    def _segment_io(self, io: Callable[[SegmentFiles], object], segment: str):
        """``io(files)`` on a client's segment; a segment this server cannot or will not
        use, or a region outside it, is the caller's error, with a status."""
        if self.maps is None:
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION, self._no_shm)
        self._not_own(segment)
        try:
            return io(self.maps)
        except SegmentUnavailable as exc:
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from exc
        except LmtierError as exc:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc

    def _not_own(self, segment: str) -> None:
        """A client's segment is never the server's own slab (a lease owned by it would
        never expire, and the server would write into its own memory)."""
        if self.shared is not None and segment == self.shared.shared_name:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "a request names the server's own segment as the client's")

    def Put(self, messages: Iterator[bytes], context: grpc.ServicerContext, tag: bytes) -> cache_pb2.PutResponse:
        assembler = FrameAssembler(self.buffers, self.config.max_chunk_bytes, self.receiving.for_call(tag))
        batch: list[tuple[Chunk, Callable[[], None]]] = []
        landed: list[bytes] = []  # the batch's chunks read into the memory tier in place
        damaged: list[bytes] = []
        totals = {"stored": 0, "dropped": 0}
        head = bytearray(HEAD_READ)  # each landing's first read, copied out of it at once

        def store() -> None:
            chunks = [c for c, _ in batch]
            try:
                held = self.store.put(chunks)
            finally:
                for _, release in batch:
                    release()
                batch.clear()
                landed.clear()
            if damaged:  # found by the first tier as it hashed the payload in
                raise Abort(grpc.StatusCode.DATA_LOSS, f"chunk {damaged[0].hex()} failed its payload checksum")
            totals["stored"] += held
            totals["dropped"] += len(chunks) - held

        def add(chunk: Chunk, release: Callable[[], None]) -> None:
            batch.append((chunk, release))
            if len(batch) >= PUT_BATCH or sum(c.nbytes for c, _ in batch) >= PUT_BATCH_BYTES:
                store()

        try:
            for message in messages:
                try:
                    pieces = unpack(message)
                except LmtierError as exc:
                    raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed message: {exc}") from exc
                for one in pieces:
                    if one.region is not None and self.landing is not None:
                        handled, chunk, placed = self._land(tag, one, assembler, head, damaged)
                        if handled:
                            if chunk is not None:
                                metrics.SERVER_BYTES.labels("put", "shm").inc(one.region.length)
                                if placed:
                                    landed.append(chunk.key)
                                add(chunk, chunk.release)
                            continue
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
                    add(chunk, release)
            if assembler.pending:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "the stream ended in the middle of a chunk")
            # The call failed under us (a message over the limit, a cancel): its stream only
            # looks ended; store nothing more. Best effort: gRPC may show the failure only
            # later, and then the last batch, verified chunks, is stored as if complete.
            if not context.is_active():
                return cache_pb2.PutResponse()
            store()
        finally:
            assembler.abandon()
            if landed:  # the call failed: what it landed is in memory already, whole and checked
                kept = set(landed)
                self._keep_landed([c for c, _ in batch if c.key in kept])
            for _, release in batch:
                release()
        return cache_pb2.PutResponse(stored=totals["stored"], dropped=totals["dropped"])

    def _keep_landed(self, chunks: list[Chunk]) -> None:
        """A failed call's chunks landed in the memory tier: stored as any other (the lower
        tiers get them, they count once). Taking them back out instead would delete a chunk
        another call was told is stored meanwhile (it found it held)."""
        try:
            self.store.put(chunks)
        except Exception:  # the call's own failure is what its caller hears
            log.exception("storing the chunks a failed Put had landed")

    def _check_region(self, one, assembler: FrameAssembler) -> None:
        if assembler.pending or one.offset != 0 or one.region.length != one.frame_size:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "a shared-memory piece must hold a whole frame")
        if not one.key:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "a piece without its chunk's key")
        if one.frame_size > self.config.max_chunk_bytes:
            raise FrameTooLarge(f"frame of {one.frame_size} bytes exceeds the limit of {self.config.max_chunk_bytes}")

    def _land(
        self, tag: bytes, one, assembler: FrameAssembler, head: bytearray, damaged: list[bytes]
    ) -> tuple[bool, Chunk | None, bool]:
        """A save through shared memory, its payload read from the client's slot straight
        into the memory tier's slots and hashed there (``head``: room for the first read):
        one copy by the kernel and one pass of the hash, where the usual way (``_receive``)
        reads the frame into a buffer and the tier copies and hashes it again. Returns
        (handled, chunk, landed): not handled, the caller goes the usual way, which also
        answers whatever is wrong with the frame (a header that does not check, a key or a
        namespace that does not match), so each error has one wording; handled, the chunk
        to store, leased (the one held already when the tier has the key), or None when
        there is nothing to store (a damaged payload, counted in ``damaged``; a tier that
        closed meanwhile); landed, whether it was read in now (the tier holds it from then
        on: a call that fails before its batch is stored still stores it, ``_keep_landed``)."""
        try:
            self._check_region(one, assembler)
        except FrameTooLarge as exc:
            raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from exc
        region, tier = one.region, self.landing
        key, placed = tag + one.key, []

        def rest(view: memoryview) -> tuple:
            """Where the payload goes, once the preamble and the header are read."""
            if len(view) < codec.PREAMBLE.size:
                return 0, None, None
            start = codec.PREAMBLE.size + codec.header_length(view)
            if start > len(view):  # a header longer than the first read (padded): the usual way
                return 0, None, None
            try:
                header = codec.read_head(view[:start], region.length - start)
            except LmtierError:
                return 0, None, None
            if header.key != one.key or (header.namespace and len(header.namespace) != len(one.key)):
                return 0, None, None
            _check_key(one.key, "the chunk key")
            placement = tier.place(key, region.length - start, written=False)
            if placement is None:  # held already (nothing to read), or no run of slots free
                return 0, None, tier.hold([key])[0]
            placed.append(placement)
            return start, placement.view, (header, bytes(view[:start]))

        try:
            got = self._segment_io(
                lambda files: files.read_split(region.segment, region.offset, region.length, head, rest),
                region.segment,
            )
            if not placed:
                return got is not None, got, False
            placement, (header, own_head) = placed[0], got
            if xxhash.xxh3_64_intdigest(placement.view) != header.payload_sum:
                placement.abort()
                damaged.append(one.key)
                return True, None, False
            chunk = Chunk.from_buffer(
                header.key,
                header.layout,
                header.num_tokens,
                placement.view,
                namespace=header.namespace,
                checksum=header.payload_sum,
                verified=True,
            )
        except BaseException:
            for placement in placed:
                placement.abort()
            raise
        out = placement.commit(chunk, own_head)  # the head the client made (checked) is the one published
        return True, out, out is not None

    def _receive(self, one, assembler: FrameAssembler):
        """A whole frame from this piece (with what came before), or None for now."""
        try:
            if one.region is not None:
                self._check_region(one, assembler)
                region, buffer = one.region, self.buffers.acquire(one.region.length)
                try:  # read, never mapped: the client may shrink its segment at any moment
                    view = self._segment_io(
                        lambda files: files.read_into(region.segment, region.offset, region.length, buffer),
                        region.segment,
                    )
                except BaseException:
                    self.buffers.release(buffer)
                    raise
                return one.key, view, None, lambda: self.buffers.release(buffer), "shm"
            done = assembler.add(one, one.data if one.data is not None else memoryview(b""))
        except (FrameTooLarge, ReceiveBusy) as exc:
            raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from exc
        except LmtierError as exc:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
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
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"chunk {key.hex()}: {exc}") from exc
        except IntegrityError as exc:
            code = grpc.StatusCode.DATA_LOSS if "checksum" in str(exc) else grpc.StatusCode.INVALID_ARGUMENT
            raise Abort(code, f"chunk {key.hex()}: {exc}") from exc
        if chunk.namespace and len(chunk.namespace) != len(key):  # a digest of the key's own hash
            raise Abort(
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

    def Directory(
        self, request: cache_pb2.DirectoryRequest, context: grpc.ServicerContext, tag: bytes
    ) -> cache_pb2.DirectoryResponse:
        """Where this tenant's chunks are published, if they are; the chunks it read
        through the directory become the most recently used, as a ``Get`` makes them."""
        published = self.published
        if published is None or tag != published.tag:
            return cache_pb2.DirectoryResponse()
        keys = self._scoped(tag, request.read)
        if keys:
            self.shared.touch(keys)  # type: ignore[union-attr]
            metrics.SERVER_DIRECTORY_READS.inc(len(keys))
        return cache_pb2.DirectoryResponse(segment=published.name)

    def OpenData(
        self, request: cache_pb2.OpenDataRequest, context: grpc.ServicerContext, tag: bytes
    ) -> cache_pb2.OpenDataResponse:
        if self.data is None:
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION, "this server runs no data channel")
        return cache_pb2.OpenDataResponse(ticket=self.data.issue(tag), port=self.data.port, tls=self.data.tls)

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

    def Match(
        self, request: cache_pb2.MatchRequest, context: grpc.ServicerContext, tag: bytes
    ) -> cache_pb2.MatchResponse:
        return match(self.store, request, tag, self.config.max_keys)

    def Stats(
        self, request: cache_pb2.StatsRequest, context: grpc.ServicerContext, tag: bytes
    ) -> cache_pb2.StatsResponse:
        """The caller's own chunks, and the tiers; where several tenants share the server,
        only an operator (``operators``) sees the tiers' use, their counters (every
        tenant's reads and writes) and the settings with the tenants' names. A tenant's answer
        is reused for ``STATS_REFRESH_S`` (an operator's is always fresh): counting a
        tenant's chunks walks the tiers' keys, and a tenant asking in a loop would
        otherwise spend the server's time for all."""
        if self.auth.single_tenant or tag in self._operators:
            return self._stats_answer(tag)  # theirs to spend: always fresh
        now = time.monotonic()
        with self._stats_lock:
            cached = self._stats.get(tag)
            if cached is not None and now - cached[0] < STATS_REFRESH_S:
                return cached[1]
        answer = self._stats_answer(tag)
        with self._stats_lock:
            if len(self._stats) >= STATS_CACHED:
                self._stats.clear()
            self._stats[tag] = (now, answer)
        return answer

    def _stats_answer(self, tag: bytes) -> cache_pb2.StatsResponse:
        own = len(self.tenant_keys(tag, STATS_COUNT_LIMIT))
        if not (self.auth.single_tenant or tag in self._operators):
            tiers = [
                cache_pb2.TierStats(name=str(stats.get("tier", "")), capacity_bytes=int(stats.get("capacity_bytes", 0)))
                for stats in self.store.stats()["tiers"]
            ]
            return cache_pb2.StatsResponse(tiers=tiers, tenant_chunks=own, config_json=self._tenant_config_json)
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
        return cache_pb2.StatsResponse(tiers=tiers, tenant_chunks=own, config_json=self._config_json)


_SIZES = {"capacity_bytes", "used_bytes", "chunks"}


def _check_key(key: bytes, what: str) -> None:
    if len(key) not in KEY_LENGTHS:
        raise Abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{what} is {len(key)} bytes; chunk keys are {' or '.join(map(str, KEY_LENGTHS))} bytes",
        )


class Gate(grpc.GenericRpcHandler):
    """The service's methods behind a check of the call's credentials as its headers
    arrive: a call without a known token is refused there (``UNAUTHENTICATED``), before
    gRPC gives it a worker or reads its request, however large."""

    def __init__(self, methods: grpc.GenericRpcHandler, auth: Authenticator) -> None:
        self.methods = methods
        self.auth = auth

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self.methods.service(handler_call_details)
        if handler is None:
            return None
        reason = self.auth.refuse(handler_call_details.invocation_metadata)
        if reason is None:
            return handler
        metrics.SERVER_REFUSED.inc()
        return refusal(grpc.StatusCode.UNAUTHENTICATED, reason)

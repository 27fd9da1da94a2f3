"""The service's reads: what a tenant holds (``Lookup``), its chunks served (``Get``), what
a same-host client was lent given back (``Release``) and where the memory tier's chunks
are published for reads with no call at all (``Directory``).

    ReadMethods    Lookup, Get, Release, Directory: methods of ``CacheService``

A ``Get`` serves each chunk the cheapest way its client can take it: a same-host client
that named a landing region in its own segment gets, where the memory tier is shared, the
place the chunk lies (lent under a lease until released, ``leases``), else the frame
written into its region; any other gets the frame as ``ChunkPiece`` bytes. It holds
``GET_BATCH`` chunks and reads one batch ahead, so its memory is bounded however long the
run it serves.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc

from lmtier import metrics
from lmtier.errors import IntegrityError
from lmtier.kv import codec
from lmtier.kv.chunk import Chunk, release_all
from lmtier.server.calls import Abort
from lmtier.server.methods.checks import RequestChecks
from lmtier.transport.pieces import PIECE_BYTES, Region, pack, piece, split
from lmtier.v1 import cache_pb2

log = logging.getLogger(__name__)

GET_BATCH = 8


class ReadMethods(RequestChecks):
    """Uses the service's ``store``, ``leases`` (what same-host clients were lent),
    ``shared`` (the memory tier, where it lends it), ``published`` (where it is published,
    or None) and ``maps``/``_no_shm`` (``RequestChecks``)."""

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
        if landing and self.auth.reads_only(context.invocation_metadata()):  # segments are the instance's
            raise Abort(grpc.StatusCode.PERMISSION_DENIED, "a peer's token reads through no shared memory")
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
            if index and self.auth.reads_only(context.invocation_metadata()):
                metrics.SERVER_PEER_CHUNKS.inc(index)

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

    def Release(
        self, request: cache_pb2.ReleaseRequest, context: grpc.ServicerContext, tag: bytes
    ) -> cache_pb2.ReleaseResponse:
        self.leases.release(request.lease, tag)
        return cache_pb2.ReleaseResponse()

    def Directory(
        self, request: cache_pb2.DirectoryRequest, context: grpc.ServicerContext, tag: bytes
    ) -> cache_pb2.DirectoryResponse:
        """Where this tenant's chunks are published, if they are; the chunks it read
        through the directory count as hits and become the most recently used, as a ``Get``
        makes them (``lmtier stats`` then shows the loads of same-host clients too)."""
        published = self.published
        if published is None or tag != published.tag:
            return cache_pb2.DirectoryResponse()
        keys = list(dict.fromkeys(self._scoped(tag, request.read)))  # a key counts once per report
        if keys:
            held = self.shared.count_reads(keys)  # type: ignore[union-attr]
            self.store.count_hits(self.shared, held)
            metrics.SERVER_DIRECTORY_READS.inc(held)
        return cache_pb2.DirectoryResponse(segment=published.name)

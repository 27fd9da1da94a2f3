"""The service's saves (``Put``): frames received as ``ChunkPiece`` bytes or read from a
same-host client's segment, checked, and stored in batches.

    SaveMethods    Put, and the frame checks the data channel's saves share
                   (``_accept``, ``_keep_landed``; ``lmtier.server.data.saves``)
    PUT_BATCH, PUT_BATCH_BYTES   a batch stored at once: chunks, bytes
    HEAD_READ      a save's first read of a client's slot

A save through shared memory lands in place where the memory tier can take it
(``_land``): the payload is read from the client's slot straight into the tier's slots
and hashed there. Every other frame is received into a pooled buffer (``_receive``) and
checked (``_accept``) before the store copies it in.

Memory per call is bounded: a ``Put`` holds at most ``PUT_BATCH_BYTES`` of frames, one
half-built frame (all Puts' half-built frames together at most ``RECEIVING_CHUNKS`` of the
largest, half of that per tenant where tenants share the server: ``budget``) and one
message in gRPC's buffers (``max_message_bytes``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import grpc
import xxhash

from lmtier import metrics
from lmtier.errors import IntegrityError, LayoutError, LmtierError
from lmtier.kv import codec
from lmtier.kv.chunk import Chunk
from lmtier.server.calls import Abort
from lmtier.server.methods.checks import RequestChecks, check_key
from lmtier.transport.pieces import FrameAssembler, FrameTooLarge, ReceiveBusy, unpack
from lmtier.v1 import cache_pb2

log = logging.getLogger(__name__)

PUT_BATCH = 16
PUT_BATCH_BYTES = 16 * 1024 * 1024
HEAD_READ = 4096  # a save's first read of a client's slot: the frame's preamble and header


class SaveMethods(RequestChecks):
    """Uses the service's ``store``, ``config`` (``max_chunk_bytes``), ``buffers`` and
    ``receiving`` (the pooled buffers frames are received into, and their budget),
    ``landing`` (the memory tier where saves land in place, or None) and
    ``maps`` (``RequestChecks``)."""

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
            check_key(one.key, "the chunk key")
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
        check_key(key, "the chunk key")
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

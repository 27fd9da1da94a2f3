"""The bytes of the grpc tier's bulk calls: chunks into ``Put`` messages, ``Get``
messages into chunks. Moving bytes only: which call to make, and what a failure means,
is ``GrpcTier``'s.

    put_messages(chunks, segment, slots, piece_bytes, on_damaged) -> Iterator[bytes]
        the ``Pieces`` messages of a put: frames through free slots of our segment (many
        to a message), the rest as bytes cut into pieces of ``piece_bytes`` (a message each)
    finish_slots(segment, slots, done)
        slots a call used go back: at once when it ended well, after a rest otherwise
    GetStream(keys, segment, memory, buffers, release_lease, on_corrupt, tier, max_frame)
        .landing                         slots of our segment offered to the server
        .read(messages) -> list[Chunk | None]   one entry per key, in order
        .close(done)                     returns what the call holds: after a failure, the
                                         chunks read so far too (and with them the server's
                                         lease, through ``Release``)

A ``Get`` answers each chunk in one of three ways: *in place* (a piece naming the payload
in the server's own memory, leased to this call until every chunk read from it is
released), *landed* (the server wrote the frame into the landing slot we offered), or *as
bytes* (the frame in one or more pieces). Every chunk is checked by its reader: lazily
(``codec.decode(lazy=True)``) as the engine copies it out; a damaged one is a miss, and
``on_corrupt`` has the server's copy deleted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence

from lmtier.buffers import BufferPool
from lmtier.errors import IntegrityError, TierError
from lmtier.kv import codec
from lmtier.kv.chunk import Chunk, Lease, release_all
from lmtier.tiers.grpc.memory import SharedMemory
from lmtier.transport.pieces import FrameAssembler, Piece, Region, pack, piece, split, unpack
from lmtier.transport.shm.segment import Segment
from lmtier.v1 import cache_pb2

log = logging.getLogger(__name__)

MAX_FRAME = 1 << 30
SHM_PIECES_PER_MESSAGE = 16


def put_messages(
    chunks: Sequence[Chunk], segment: Segment | None, slots: list[int], piece_bytes: int, on_damaged: Callable[[], None]
) -> Iterator[bytes]:
    """A damaged chunk is skipped (``on_damaged``), never sent. The slots taken are added
    to ``slots`` as they are, for ``finish_slots`` once the call has ended."""
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
            on_damaged()
            continue
        if landed:
            yield pack(*landed)
            landed = []
        size = sum(len(p) for p in parts)
        for offset, views in split(parts, piece_bytes):
            first = offset == 0
            yield pack(piece(chunk.key if first else b"", size if first else 0, offset, data=views))
    if landed:
        yield pack(*landed)


def finish_slots(segment: Segment | None, slots: Sequence[int], done: bool) -> None:
    if segment is None:
        return
    if done:
        for s in slots:
            segment.release(s)
    else:  # the server may still touch them: let them rest first
        segment.quarantine(slots)


class GetStream:
    def __init__(
        self,
        keys: Sequence[bytes],
        segment: Segment | None,
        memory: SharedMemory,
        buffers: BufferPool,
        release_lease: Callable[[int], None],
        on_corrupt: Callable[[bytes], None],
        tier: str,
        max_frame: int = MAX_FRAME,
    ) -> None:
        self.keys, self.segment, self.memory = keys, segment, memory
        self._release_lease, self._on_corrupt, self._tier = release_lease, on_corrupt, tier
        self.slots: list[int] = []
        if segment is not None:
            while len(self.slots) < len(keys) and (slot := segment.acquire()) is not None:
                self.slots.append(slot)
        self.landing = [
            cache_pb2.SharedRegion(segment=segment.name, offset=segment.offset(s), length=segment.slot_bytes)
            for s in self.slots
        ]
        self._by_offset = {segment.offset(s): s for s in self.slots} if segment is not None else {}
        self._used: set[int] = set()
        self._assembler = FrameAssembler(buffers, max_frame)  # a frame claiming more is refused unread
        self._lease: Lease | None = None  # the server's lease on chunks read in its memory
        self.out: list[Chunk | None] = [None] * len(keys)

    def read(self, messages: Iterable[bytes]) -> list[Chunk | None]:
        index = 0
        for message in messages:
            for one in unpack(message):
                if index >= len(self.keys):
                    raise _protocol("the server sent more chunks than asked for")
                if self._take(index, one):
                    index += 1
        return self.out

    def _take(self, index: int, one: Piece) -> bool:
        """Read one piece into ``out[index]``; False while its frame is still incomplete."""
        want = self.keys[index]
        if one.region is not None and one.head:  # in the server's memory, leased to us
            if self._lease is None:
                self._lease = Lease(lambda n=one.lease: self._release_lease(n))
            payload = self.memory.server_region(one.region)  # mapped read-only
            self._lease.hold()  # the server holds it until this call and its chunks let go
            self.out[index] = self._decode(want, one.key, one.head, None, self._lease.drop, payload)
            return True
        if one.region is not None:  # landed in a slot we offered
            slot = self._by_offset.get(one.region.offset)
            segment = self.segment
            if segment is None or slot is None or one.region.segment != segment.name or slot in self._used:
                raise _protocol("the server named a region it was not given")
            self._used.add(slot)
            frame = segment.view(slot)[: one.region.length]
            self.out[index] = self._decode(want, one.key, frame, None, lambda: segment.release(slot))
            return True
        whole = self._assembler.add(one, one.data if one.data is not None else memoryview(b""))
        if whole is None:
            return False
        key, frame, digest, release = whole
        self.out[index] = self._decode(want, key, frame, digest, release)
        return True

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
            return codec.decode(
                frame,
                payload=payload,
                key=want,
                lazy=True,  # checked as the engine copies it out
                payload_checksum=digest,
                on_release=release,
                on_corrupt=lambda: self._on_corrupt(want),
            )
        except IntegrityError as exc:
            release()
            log.warning("grpc tier %s: damaged chunk %s from the server: %s", self._tier, want.hex()[:16], exc)
            self._on_corrupt(want)
            return None

    def close(self, done: bool) -> None:
        if not done:  # a failed call returns what it had received before it raises
            release_all(self.out)
        self._assembler.abandon()
        if self._lease is not None:  # the call's own hold: chunks still out keep theirs
            self._lease.drop()
        finish_slots(self.segment, [s for s in self.slots if s not in self._used], done)


def _protocol(message: str) -> TierError:
    return TierError(f"protocol error: {message}")

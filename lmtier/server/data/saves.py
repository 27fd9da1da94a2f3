"""Saves on the bulk data channel (``lmtier.server.data``): frames read off the client's
connection, checked and stored as gRPC's ``Put`` stores them.

    receive(service, landing, sock, tag, n, pace) -> (stored, dropped)
    Pace(sock, stall_timeout, call_timeout)   a request's clock, called before each receive

Where the server's first tier is its memory tier, each frame lands in place, as a save
through shared memory does (``CacheService._land``): the frame's first bytes are read
into a small buffer, its head checked (``codec.read_head``: magic, version, header
checksum, layout, key), a run of the tier's slots set aside
(``CpuTier.place(written=False)``), the payload read from the socket straight into them
and hashed as it arrives, and the placement committed. A chunk the tier holds already is
touched and its bytes read past; one with no run of slots free, a head that does not
check or a header longer than the first read goes the usual way: the whole frame into a
pooled buffer (counted against the server's ``ReceiveBudget``, like a gRPC frame in
pieces), ``CacheService._accept``, which also gives every refusal its usual wording.

Chunks are stored in batches (``PUT_BATCH``); a damaged payload ends the request with
``DATA_LOSS`` after the batch before it is stored; a request that fails stores what it
had landed (whole and checked) and lets everything else go.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import grpc
import xxhash

from lmtier import metrics
from lmtier.errors import LmtierError
from lmtier.kv import codec
from lmtier.kv.chunk import Chunk
from lmtier.server.calls import Abort
from lmtier.server.methods.checks import check_key
from lmtier.server.methods.saves import HEAD_READ, PUT_BATCH, PUT_BATCH_BYTES
from lmtier.tiers.cpu.tier import CpuTier
from lmtier.transport.datachannel import FRAME, ITEM, Closed

SCRATCH = 1 << 20  # bytes read past at a time (a chunk held already)


class Pace:
    """A request's clock on its connection: called before each receive or send, it gives
    the socket what is left of ``stall_timeout`` and of the request's ``call_timeout``,
    and ends the request (``DEADLINE_EXCEEDED``) once the latter has passed, however
    steadily a slow client keeps each receive or send alive."""

    def __init__(self, sock: socket.socket, stall: float, limit: float) -> None:
        self.sock, self.stall = sock, stall
        self.deadline = time.monotonic() + limit

    def __call__(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise Abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the request ran past call_timeout")
        self.sock.settimeout(min(self.stall, left))


def receive(service, landing: CpuTier | None, sock: socket.socket, tag: bytes, n: int, pace: Pace):
    batch: list[tuple[Chunk, Callable[[], None], bool]] = []  # chunk, its release, landed in place
    damaged: list[bytes] = []
    totals = [0, 0]
    head = bytearray(HEAD_READ)

    def store() -> None:
        chunks = [c for c, _, _ in batch]
        try:
            held = service.store.put(chunks) if chunks else 0
        finally:
            for _, release, _ in batch:
                release()
            batch.clear()
        if damaged:  # found by the first tier as it hashed a payload in
            raise Abort(grpc.StatusCode.DATA_LOSS, f"chunk {damaged[0].hex()} failed its payload checksum")
        totals[0] += held
        totals[1] += len(chunks) - held

    try:
        for _ in range(n):
            pace()
            kind, length = ITEM.unpack(recv_paced(sock, ITEM.size, pace))
            if kind != FRAME or length == 0:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"expected a frame, got item {kind} of {length} bytes")
            if length > service.config.max_chunk_bytes:
                raise Abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"frame of {length} bytes exceeds the limit of {service.config.max_chunk_bytes}",
                )
            try:
                chunk, release, landed = _one(service, landing, sock, tag, length, head, damaged, pace)
            except Abort:
                store()  # the chunks before the bad one are kept, as gRPC's Put keeps them
                raise
            metrics.SERVER_BYTES.labels("put", "data").inc(length)
            if chunk is not None:
                batch.append((chunk, release, landed))
                if len(batch) >= PUT_BATCH or sum(c.nbytes for c, _, _ in batch) >= PUT_BATCH_BYTES:
                    store()
            elif damaged:
                store()
        store()
    finally:
        landed = [c for c, _, placed in batch if placed]
        if landed:  # the request failed: what it landed is in memory already, whole and checked
            service._keep_landed(landed)
        for _, release, _ in batch:
            release()
    return totals[0], totals[1]


def _one(service, landing, sock, tag, length, head, damaged, pace):
    """One frame off the socket: (chunk to store or None, its release, landed in place).
    Memory set aside for a frame not yet arrived, in the tier's slots or in a buffer, is
    counted against the server's ``ReceiveBudget`` until the frame is whole: a client that
    announces large frames and sends them slowly holds at most its tenant's part of it,
    for at most ``call_timeout``."""
    budget = service.receiving.for_call(tag)
    if not budget.take(length):
        raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the server is receiving too many chunks at once: retry")
    try:
        first = min(len(head), length)
        view = memoryview(head)[:first]
        _recv_into(sock, view, pace)
        header, start = _head(view, length)
        if header is not None and landing is not None:
            landed = _land(landing, sock, tag, header, start, view, length, damaged, pace)
            if landed is not None:
                budget.give(length)
                return landed
    except BaseException:
        budget.give(length)
        raise
    return _usual(service, sock, length, view, damaged, pace, budget, tag)


def _land(landing, sock, tag, header, start, view, length, damaged, pace):
    """The frame's payload straight into the memory tier's slots; None where it cannot
    land (no run of slots free: the usual way)."""
    check_key(header.key, "the chunk key")
    key, first = tag + header.key, len(view)
    placement = landing.place(key, length - start, written=False)
    if placement is None:
        held = landing.hold([key])[0]
        if held is None:
            return None
        _skip(sock, length - first, pace)  # held already: nothing to read in, the bytes are passed over
        return held, held.release, False
    payload = placement.view
    try:
        arrived = first - start
        payload[:arrived] = view[start:first]
        hashed = xxhash.xxh3_64(payload[:arrived])
        _recv_into(sock, payload[arrived:], pace, hashed)
    except BaseException:
        placement.abort()
        raise
    if hashed.intdigest() != header.payload_sum:
        placement.abort()
        damaged.append(header.key)
        return None, None, False
    chunk = Chunk.from_buffer(
        header.key,
        header.layout,
        header.num_tokens,
        payload,
        namespace=header.namespace,
        checksum=header.payload_sum,
        verified=True,
    )
    out = placement.commit(chunk, bytes(view[:start]))
    return out, (out.release if out is not None else _nothing), out is not None


def _head(view: memoryview, length: int):
    """The frame's checked header and where its payload starts, or (None, 0) where the
    first read does not hold a good one (the usual way then says what is wrong)."""
    if len(view) < codec.PREAMBLE.size:
        return None, 0
    start = codec.PREAMBLE.size + codec.header_length(view)
    if start > len(view):
        return None, 0
    try:
        header = codec.read_head(view[:start], length - start)
    except LmtierError:
        return None, 0
    if header.namespace and len(header.namespace) != len(header.key):
        return None, 0
    return header, start


def _usual(service, sock, length, view, damaged, pace, budget, tag):
    """The whole frame into a pooled buffer (its budget held until the chunk is stored)."""
    try:
        buffer = service.buffers.acquire(length)
    except BaseException:
        budget.give(length)
        raise

    def release() -> None:
        service.buffers.release(buffer)
        budget.give(length)

    try:
        frame = memoryview(buffer)[:length]
        frame[: len(view)] = view
        hashed = codec.PayloadHash(frame)
        hashed.arrived(len(view))
        _recv_into(sock, frame[len(view) :], pace, None, hashed, len(view))
        try:
            header, _ = codec.read_header(frame)
        except LmtierError as exc:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"a malformed frame: {exc}") from exc
        chunk = service._accept(tag, header.key, frame, hashed.digest(), damaged)
    except BaseException:
        release()
        raise
    return chunk, release, False


def _recv_into(sock, view: memoryview, pace, hashed=None, frame_hash=None, offset: int = 0) -> None:
    got = 0
    while got < len(view):
        pace()
        n = sock.recv_into(view[got:])
        if n == 0:
            raise Closed(f"connection closed after {got} of {len(view)} bytes")
        if hashed is not None:
            hashed.update(view[got : got + n])
        got += n
        if frame_hash is not None:
            frame_hash.arrived(offset + got)


def recv_paced(sock, n: int, pace) -> bytes:
    """``n`` bytes, each receive timed by ``pace`` (a trickle ends at ``call_timeout``)."""
    out = bytearray(n)
    _recv_into(sock, memoryview(out), pace)
    return bytes(out)


def _skip(sock, n: int, pace) -> None:
    scratch = bytearray(min(n, SCRATCH))
    while n > 0:
        pace()
        got = sock.recv_into(scratch, min(n, len(scratch)))
        if got == 0:
            raise Closed("connection closed in the middle of a frame")
        n -= got


def _nothing() -> None:
    pass

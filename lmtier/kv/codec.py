"""Bytes on the wire and on disk: one frame per chunk.

    offset  size  field
    0       4     magic b"LMTK"
    4       2     frame version (1)
    6       2     flags (0)
    8       4     header length H
    12      8     payload length P
    20      8     payload checksum: xxh3-64 of the P payload bytes
    28      8     header checksum: xxh3-64 of bytes [0, 28) + the H header bytes
    36      4     zero padding (the preamble is 40 bytes)
    40      H     header: msgpack map {v, ns, key, layout, tokens, codec, raw_len}
    40+H    P     payload: the canonical chunk bytes

Two checksums, so that the payload's can be known before the frame is built (it is the
chunk's own checksum) and checked late: the header checksum covers every preamble field,
the payload checksum and the header, so any flipped byte outside the payload is caught at
once, and any flipped payload byte by the payload checksum. ``decode`` checks both, then
the layout, the namespace and the key, and raises a typed ``IntegrityError``; callers
treat that as a miss. ``decode(..., lazy=True)`` leaves the payload check to the chunk,
which does it while the reader copies the bytes out (one pass over memory instead of two).

A writer that wants the payload at an aligned offset of the frame (the disk tier: O_DIRECT
writes straight from a memory-tier slot, reads that leave the payload page-aligned in
their buffer) passes ``align``: the header then carries a ``pad`` entry of zeros that
ends it exactly at a multiple of ``align`` from the frame's start. It is an ordinary
header field under the header checksum, so every reader decodes such a frame unchanged.

One codec, ``raw``: the payload is the canonical bytes, so encoding copies nothing. The
header names its codec so that a frame claiming another one is a ``FormatError`` (a miss),
never misread. There is no compression, on the evidence: lz4 after splitting 16-bit
values into byte planes, on 2 MiB chunks of random K/V drawn like activations and on the
tiny Llama's real KV, made bf16 KV 10-19% smaller, fp16 0-3% and fp8 nothing, at 0.6-0.8
GB/s per core each way: slower than the links it would spare (Redis over loopback moved
2.3-2.5 GB/s of raw frames on the same machine; NVMe and 25-100 GbE move more). It pays
only on links under ~0.5 Gb/s (~4 Gb/s were compressing and sending perfectly
overlapped), and it would cost the copy-free paths (views, verifying while copying,
relaying stored frames unchanged).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import numpy as np
import xxhash

from lmtier.errors import (
    ChecksumError,
    FormatError,
    LayoutMismatch,
    NamespaceMismatch,
)
from lmtier.kv.chunk import Chunk, iter_segments
from lmtier.kv.layout import KVLayout

MAGIC = b"LMTK"
FRAME_VERSION = 1
PREAMBLE = struct.Struct("<4sHHIQQQ4x")  # 40 bytes
CHECKED = 28  # preamble bytes covered by the header checksum
MAX_HEADER = 64 * 1024
CODEC = "raw"  # the one payload encoding (see the module docstring)


@dataclass(frozen=True)
class Header:
    namespace: bytes
    key: bytes
    layout: KVLayout
    num_tokens: int
    payload_sum: int


def _fields(key: bytes, namespace: bytes, layout: KVLayout, num_tokens: int, nbytes: int) -> dict:
    return {
        "v": FRAME_VERSION,
        "ns": namespace,
        "key": key,
        "layout": layout.to_dict(),
        "tokens": num_tokens,
        "codec": CODEC,
        "raw_len": nbytes,
    }


def frame_head(key: bytes, namespace: bytes, layout: KVLayout, num_tokens: int, payload_sum: int) -> bytes:
    """The preamble and header of a chunk's frame, for a payload that lies apart (a
    reader passes it to ``decode`` as ``frame`` with the payload as ``payload``)."""
    header = msgpack.packb(
        _fields(key, namespace, layout, num_tokens, layout.chunk_bytes(num_tokens)), use_bin_type=True
    )
    return _preamble(header, layout.chunk_bytes(num_tokens), payload_sum) + header


def _header_bytes(chunk: Chunk, align: int = 0) -> bytes:
    fields = _fields(chunk.key, chunk.namespace, chunk.layout, chunk.num_tokens, chunk.nbytes)
    header = msgpack.packb(fields, use_bin_type=True)
    if not align:
        return header
    # "pad": zeros as a msgpack bin16 (3 bytes of type and length, so 256 <= n < 65536),
    # after its 4-byte key (a fixstr): the map's one-byte header stays one byte.
    n = -(PREAMBLE.size + len(header) + 4 + 3) % align
    while n < 256:
        n += align
    header = msgpack.packb({**fields, "pad": bytes(n)}, use_bin_type=True)
    if (PREAMBLE.size + len(header)) % align or len(header) > MAX_HEADER:
        raise ValueError(f"cannot align a frame's payload to {align} bytes")
    return header


def _preamble(header: bytes, payload_len: int, payload_sum: int) -> bytes:
    head = PREAMBLE.pack(MAGIC, FRAME_VERSION, 0, len(header), payload_len, payload_sum, 0)
    header_sum = xxhash.xxh3_64(head[:CHECKED] + header).intdigest()
    return PREAMBLE.pack(MAGIC, FRAME_VERSION, 0, len(header), payload_len, payload_sum, header_sum)


def _relayed(chunk: Chunk, relay: bool) -> bool:
    return relay and chunk.checksum is not None


def encode_parts(chunk: Chunk, *, relay: bool = False, align: int = 0) -> list:
    """The frame as a list of buffers (preamble+header, then payload runs), for writev.

    The payload runs are views of the chunk: nothing is copied, and a chunk whose checksum
    is known is not even hashed again. An unverified chunk is verified (``IntegrityError``
    if it fails), so a damaged chunk is never re-encoded as good. ``relay``: pass an
    unverified chunk on unchecked, under the checksum recorded when it was stored, for a
    relay whose reader checks every frame (the cache server). ``align``: the payload starts
    at a multiple of it (see the module docstring).
    """
    header = _header_bytes(chunk, align)
    relayed = _relayed(chunk, relay)
    if not relayed and not chunk.verify():
        raise ChecksumError("chunk failed its checksum")
    if chunk.checksum is None:
        chunk.checksum = chunk.compute_checksum()
    payload = list(iter_segments(chunk.data) if relayed else chunk.segments())
    return [_preamble(header, chunk.nbytes, chunk.checksum) + header, *payload]


def encode(chunk: Chunk, align: int = 0) -> bytes:
    """The frame as one ``bytes`` object (``align``: as for ``encode_parts``)."""
    return b"".join(p if isinstance(p, bytes) else p.tobytes() for p in encode_parts(chunk, align=align))


def encoded_size(chunk: Chunk, align: int = 0) -> int:
    """Frame size of a chunk, known without encoding."""
    return PREAMBLE.size + len(_header_bytes(chunk, align)) + chunk.nbytes


def encode_into(chunk: Chunk, buf: memoryview | np.ndarray, *, relay: bool = False, align: int = 0) -> int:
    """Write the frame of ``chunk`` into ``buf``; returns the frame length.

    The payload is copied with ``Chunk.copy_to``, which hashes it block by block as it
    lands (and verifies an unverified chunk on the way): one pass over memory builds the
    frame and its checksum. For writers that need the frame in their own buffer (O_DIRECT).
    ``relay`` and ``align``: as for ``encode_parts``.
    """
    header = _header_bytes(chunk, align)
    start = PREAMBLE.size + len(header)
    end = start + chunk.nbytes
    out = np.frombuffer(buf, dtype=np.uint8, count=end)
    if _relayed(chunk, relay):
        np.copyto(out[start:end].reshape(chunk.data.shape), chunk.data)
    else:
        chunk.copy_to(out[start:end].reshape(chunk.data.shape), need_checksum=True)
    out[:start] = np.frombuffer(_preamble(header, chunk.nbytes, chunk.checksum) + header, dtype=np.uint8)
    return end


def header_length(frame) -> int:
    """The header length a frame's preamble states (unchecked: for readers that locate
    the payload before the frame is complete)."""
    return int.from_bytes(bytes(frame[8:12]), "little")


_LAYOUT_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "dtype", "mla")


@functools.lru_cache(maxsize=64, typed=True)
def _layout(num_layers, num_kv_heads, head_dim, dtype, mla) -> KVLayout:
    """A header's layout, built once per distinct one (a reader decodes thousands of
    headers of one model's layout; building and checking it each time cost ~20 us).
    ``typed``: a field of another type (``2.0`` for ``2``, ``True`` for ``1``) is another
    key, checked anew, never the layout cached for the value it equals."""
    return KVLayout.from_dict(
        {"num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim, "dtype": dtype, "mla": mla}
    )


def payload_length(frame) -> int:
    """The payload length a frame's preamble states (unchecked, as ``header_length``)."""
    return int.from_bytes(bytes(frame[12:20]), "little")


def read_header(frame, payload=None) -> tuple[Header, memoryview]:
    """Check a frame's preamble and header; returns the header and the payload view.

    ``payload``: the payload lies apart, and ``frame`` holds only the preamble and the
    header. The payload itself is not checked here (see ``decode``). Raises
    ``FormatError`` or ``ChecksumError``. Nothing is copied.
    """
    view = memoryview(frame).cast("B")
    if payload is not None:
        payload = memoryview(payload).cast("B")
        header = _head(view, len(payload))
        return header, payload
    header = _head(view, None)
    return header, view[len(view) - header.layout.chunk_bytes(header.num_tokens) :]


def read_head(head, payload_len: int) -> Header:
    """Check a frame's preamble and header, ``head`` holding only them, for a reader that
    lands the payload (``payload_len`` bytes, which the preamble must state) elsewhere
    afterwards and verifies it there against ``Header.payload_sum``."""
    return _head(memoryview(head).cast("B"), payload_len)


def _head(view: memoryview, apart: int | None) -> Header:
    """The checks of ``read_header``: ``apart`` is the length of a payload that lies apart
    (``view`` is then the preamble and the header only), None for a whole frame."""
    if len(view) < PREAMBLE.size:
        raise FormatError(f"frame of {len(view)} bytes is shorter than its preamble")
    magic, version, flags, header_len, payload_len, payload_sum, header_sum = PREAMBLE.unpack_from(view)
    if magic != MAGIC:
        raise FormatError("bad magic: not an lmtier chunk")
    if version != FRAME_VERSION or flags != 0 or any(view[36:40]):
        raise FormatError(f"unsupported frame version {version} / flags {flags}")
    if apart is not None:
        if header_len > MAX_HEADER or len(view) != PREAMBLE.size + header_len or apart != payload_len:
            raise FormatError(f"frame parts of {len(view)} + {apart} bytes disagree with their preamble")
    elif header_len > MAX_HEADER or len(view) != PREAMBLE.size + header_len + payload_len:
        raise FormatError(f"frame length {len(view)} disagrees with its preamble")
    h = xxhash.xxh3_64(view[:CHECKED])
    h.update(view[PREAMBLE.size : PREAMBLE.size + header_len])
    if h.intdigest() != header_sum:
        raise ChecksumError("chunk header checksum mismatch")
    try:
        raw = msgpack.unpackb(view[PREAMBLE.size : PREAMBLE.size + header_len], raw=False)
        header = Header(
            namespace=bytes(raw["ns"]),
            key=bytes(raw["key"]),
            layout=_layout(*map(raw["layout"].get, _LAYOUT_FIELDS)),
            num_tokens=int(raw["tokens"]),
            payload_sum=payload_sum,
        )
        codec, raw_len = raw["codec"], int(raw["raw_len"])
    except Exception as exc:  # any malformed header, whatever msgpack raises
        raise FormatError(f"malformed chunk header: {exc}") from exc
    if raw.get("v") != FRAME_VERSION or codec != CODEC:
        raise FormatError(f"unsupported header version or codec {codec!r}")
    if header.num_tokens <= 0:
        raise FormatError(f"a chunk of {header.num_tokens} tokens: a chunk holds at least one")
    if raw_len != header.layout.chunk_bytes(header.num_tokens):
        raise FormatError("header length disagrees with its layout")
    if payload_len != raw_len:
        raise FormatError("payload length disagrees with its layout")
    return header


class PayloadHash:
    """xxh3-64 of a frame's payload, fed as the frame's bytes arrive (a socket reader
    calls ``arrived(total)`` after each piece), so the payload is hashed while it is still
    in cache and ``decode(payload_checksum=digest())`` need not read it again. The payload
    starts after the preamble and the header, whose length the preamble gives; a damaged
    preamble only makes the digest wrong, which ``decode`` then refuses."""

    def __init__(self, frame: memoryview) -> None:
        self.frame = frame
        self.start = -1  # payload offset, once the preamble is in
        self.done = 0  # bytes hashed up to here
        self.h = xxhash.xxh3_64()

    def arrived(self, total: int) -> None:
        if self.start < 0:
            if total < PREAMBLE.size:
                return
            self.start = self.done = min(len(self.frame), PREAMBLE.size + header_length(self.frame))
        if total > self.done:
            self.h.update(self.frame[self.done : total])
            self.done = total

    def digest(self) -> int | None:
        return self.h.intdigest() if self.start >= 0 and self.done == len(self.frame) else None


def decode(
    frame,
    *,
    payload=None,
    layout: KVLayout | None = None,
    namespace: bytes | None = None,
    key: bytes | None = None,
    lazy: bool = False,
    payload_checksum: int | None = None,
    on_release: Callable[[], None] | None = None,
    on_corrupt: Callable[[], None] | None = None,
) -> Chunk:
    """Verify and decode a frame. The chunk is a view of ``frame`` (no copy).

    ``payload``: the payload lies apart (a view of it; ``frame`` is then only the preamble
    and the header), for a reader that has the payload where it lies in another's memory.

    ``layout``, ``namespace`` and ``key``, when given, must match the header. With
    ``lazy`` the payload is verified when the returned chunk is read, not here.
    ``payload_checksum``: the payload's xxh3-64 as a reader computed it while the bytes
    arrived; it stands for the payload pass (a mismatch is a ``ChecksumError``).
    ``on_release`` and ``on_corrupt`` are handed to the chunk (see ``lmtier.kv.chunk``).
    """
    header, payload = read_header(frame, payload)
    if payload_checksum is not None:
        if payload_checksum != header.payload_sum:
            raise ChecksumError("chunk payload checksum mismatch")
        lazy = False
    if layout is not None and header.layout != layout:
        raise LayoutMismatch(f"stored layout {header.layout} is not the expected {layout}")
    if namespace is not None and header.namespace != namespace:
        raise NamespaceMismatch("chunk belongs to another namespace")
    if key is not None and header.key != key:
        raise NamespaceMismatch("chunk is stored under another key")
    if not lazy and payload_checksum is None and xxhash.xxh3_64_intdigest(payload) != header.payload_sum:
        raise ChecksumError("chunk payload checksum mismatch")
    return Chunk.from_buffer(
        header.key,
        header.layout,
        header.num_tokens,
        payload,
        namespace=header.namespace,
        checksum=header.payload_sum,
        verified=not lazy,
        on_release=on_release,
        on_corrupt=on_corrupt,
    )

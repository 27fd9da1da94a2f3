"""Bytes on the wire and on disk: one frame per chunk.

    offset  size  field
    0       4     magic b"LMTK"
    4       2     frame version (1)
    6       2     flags (0)
    8       4     header length H
    12      8     payload length P
    20      8     xxh3-64 of bytes [0, 20) + header + payload
    28      4     zero padding (keeps the header 32-byte aligned)
    32      H     header: msgpack map {v, ns, key, layout, tokens, codec, raw_len}
    32+H    P     payload: the canonical chunk bytes, as stored by the codec

The checksum covers every byte but itself and the padding (which must be zero), so any
single flipped byte is refused. Decoding checks the checksum first, then the header, the
layout, the namespace and the key, and raises a typed ``IntegrityError``; callers treat
that as a miss.

Codecs: ``raw`` (the payload is the canonical bytes; encoding copies nothing) and
``lz4``. KV values compress poorly as they are; splitting 16-bit values into a plane of
high bytes and a plane of low bytes first exposes the redundant exponent bytes to lz4.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import lz4.block
import msgpack
import numpy as np
import xxhash

from lmtier.chunk import Chunk
from lmtier.errors import ChecksumError, ConfigError, FormatError, LayoutMismatch, NamespaceMismatch
from lmtier.layout import KVLayout

MAGIC = b"LMTK"
FRAME_VERSION = 1
PREAMBLE = struct.Struct("<4sHHIQQ4x")  # 32 bytes
CHECKED = 20  # the preamble bytes covered by the checksum
MAX_HEADER = 64 * 1024
CODECS = ("raw", "lz4")


@dataclass(frozen=True)
class Header:
    namespace: bytes
    key: bytes
    layout: KVLayout
    num_tokens: int
    codec: str
    raw_len: int


def encode_parts(chunk: Chunk, codec: str = "raw") -> list:
    """The frame as a list of buffers (preamble+header, then payload runs), for writev.

    With ``raw`` the payload runs are views of the chunk: nothing is copied.
    """
    if codec not in CODECS:
        raise ConfigError(f"unknown codec {codec!r}; choose one of {CODECS}")
    payload = list(chunk.segments()) if codec == "raw" else [_lz4_compress(chunk)]
    header = msgpack.packb(
        {
            "v": FRAME_VERSION,
            "ns": chunk.namespace,
            "key": chunk.key,
            "layout": chunk.layout.to_dict(),
            "tokens": chunk.num_tokens,
            "codec": codec,
            "raw_len": chunk.nbytes,
        },
        use_bin_type=True,
    )
    payload_len = sum(len(p) for p in payload)
    head = PREAMBLE.pack(MAGIC, FRAME_VERSION, 0, len(header), payload_len, 0)
    h = xxhash.xxh3_64(head[:CHECKED])
    h.update(header)
    for part in payload:
        h.update(part)
    head = PREAMBLE.pack(MAGIC, FRAME_VERSION, 0, len(header), payload_len, h.intdigest())
    return [head + header, *payload]


def encode(chunk: Chunk, codec: str = "raw") -> bytes:
    """The frame as one ``bytes`` object."""
    return b"".join(bytes(p) if isinstance(p, np.ndarray) else p for p in encode_parts(chunk, codec))


def frame_size(header_len: int, payload_len: int) -> int:
    return PREAMBLE.size + header_len + payload_len


def read_header(frame) -> tuple[Header, memoryview]:
    """Verify a frame and parse its header; returns the header and the payload view.

    Raises ``FormatError`` or ``ChecksumError``. Nothing is copied.
    """
    view = memoryview(frame).cast("B")
    if len(view) < PREAMBLE.size:
        raise FormatError(f"frame of {len(view)} bytes is shorter than its preamble")
    magic, version, flags, header_len, payload_len, checksum = PREAMBLE.unpack_from(view)
    if magic != MAGIC:
        raise FormatError("bad magic: not an lmtier chunk")
    if version != FRAME_VERSION or flags != 0 or any(view[28:32]):
        raise FormatError(f"unsupported frame version {version} / flags {flags}")
    if header_len > MAX_HEADER or len(view) != PREAMBLE.size + header_len + payload_len:
        raise FormatError(f"frame length {len(view)} disagrees with its preamble")
    h = xxhash.xxh3_64(view[:CHECKED])
    h.update(view[PREAMBLE.size :])
    if h.intdigest() != checksum:
        raise ChecksumError("chunk checksum mismatch")
    try:
        raw = msgpack.unpackb(view[PREAMBLE.size : PREAMBLE.size + header_len], raw=False)
        header = Header(
            namespace=bytes(raw["ns"]),
            key=bytes(raw["key"]),
            layout=KVLayout.from_dict(raw["layout"]),
            num_tokens=int(raw["tokens"]),
            codec=str(raw["codec"]),
            raw_len=int(raw["raw_len"]),
        )
    except Exception as exc:  # any malformed header, whatever msgpack raises
        raise FormatError(f"malformed chunk header: {exc}") from exc
    if raw.get("v") != FRAME_VERSION or header.codec not in CODECS:
        raise FormatError(f"unsupported header version or codec {header.codec!r}")
    if header.raw_len != header.layout.chunk_bytes(header.num_tokens):
        raise FormatError("header length disagrees with its layout")
    if header.codec == "raw" and payload_len != header.raw_len:
        raise FormatError("raw payload length disagrees with its layout")
    return header, view[PREAMBLE.size + header_len :]


def decode(
    frame,
    *,
    layout: KVLayout | None = None,
    namespace: bytes | None = None,
    key: bytes | None = None,
) -> Chunk:
    """Verify and decode a frame. A ``raw`` chunk is a view of ``frame`` (no copy).

    ``layout``, ``namespace`` and ``key``, when given, must match the header.
    """
    header, payload = read_header(frame)
    if layout is not None and header.layout != layout:
        raise LayoutMismatch(f"stored layout {header.layout} is not the expected {layout}")
    if namespace is not None and header.namespace != namespace:
        raise NamespaceMismatch("chunk belongs to another namespace")
    if key is not None and header.key != key:
        raise NamespaceMismatch("chunk is stored under another key")
    data = _lz4_decompress(payload, header) if header.codec == "lz4" else payload
    return Chunk.from_buffer(header.key, header.layout, header.num_tokens, data, namespace=header.namespace)


def _lz4_compress(chunk: Chunk) -> bytes:
    raw = np.ascontiguousarray(chunk.data).reshape(-1)
    item = chunk.layout.itemsize
    if item > 1:
        # [n, item] -> [item, n]: byte planes, so exponent bytes sit together.
        raw = np.ascontiguousarray(raw.reshape(-1, item).T)
    return lz4.block.compress(raw, store_size=False)


def _lz4_decompress(payload: memoryview, header: Header) -> np.ndarray:
    try:
        planes = lz4.block.decompress(payload, uncompressed_size=header.raw_len)
    except lz4.block.LZ4BlockError as exc:
        raise FormatError(f"lz4 payload does not decompress: {exc}") from exc
    if len(planes) != header.raw_len:
        raise FormatError("lz4 payload decompressed to the wrong length")
    item = header.layout.itemsize
    flat = np.frombuffer(planes, dtype=np.uint8)
    if item == 1:
        return flat
    out = np.empty(header.raw_len, dtype=np.uint8)
    out.reshape(-1, item)[...] = flat.reshape(item, -1).T  # [item, n] -> [n, item]
    return out

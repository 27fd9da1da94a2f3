"""The chunk frame: round trips, and refusal of every damaged or foreign frame."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from lmtier.errors import ChecksumError, FormatError, IntegrityError, LayoutError, LayoutMismatch, NamespaceMismatch
from lmtier.kv import codec
from lmtier.kv.chunk import Chunk
from lmtier.kv.layout import KVLayout

from conftest import fuzz

LAYOUTS = [
    KVLayout(2, 2, 16, "float32"),
    KVLayout(2, 2, 16, "float16"),
    KVLayout(2, 2, 16, "bfloat16"),
    KVLayout(2, 2, 16, "fp8"),
    KVLayout(3, 1, 48, "bfloat16", mla=True),
]
NS = b"n" * 16


def kv_chunk(layout: KVLayout, tokens: int = 8, seed: int = 0, key: bytes = b"k" * 16) -> Chunk:
    gen = torch.Generator().manual_seed(seed)
    if layout.itemsize == 1:
        data = torch.randint(0, 256, layout.tensor_shape(tokens), generator=gen, dtype=torch.uint8)
    else:
        data = torch.randn(layout.tensor_shape(tokens), generator=gen).to(getattr(torch, layout.dtype))
    raw = data.view(torch.uint8).numpy().reshape(layout.byte_shape(tokens))
    return Chunk(key, layout, raw, namespace=NS)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: f"{layout.dtype}{'-mla' if layout.mla else ''}")
def test_round_trip(layout):
    chunk = kv_chunk(layout)
    back = codec.decode(codec.encode(chunk), layout=layout, namespace=NS, key=chunk.key)
    assert back.tobytes() == chunk.tobytes()
    assert (back.key, back.layout, back.namespace, back.num_tokens) == (chunk.key, layout, NS, 8)


def test_raw_encoding_copies_nothing_and_decoding_returns_a_view():
    chunk = kv_chunk(LAYOUTS[0])
    parts = codec.encode_parts(chunk)
    assert np.shares_memory(parts[1], chunk.data)
    frame = bytearray(codec.encode(chunk))
    back = codec.decode(frame)
    assert np.shares_memory(back.data, np.frombuffer(frame, np.uint8))


def test_strided_chunks_encode_their_canonical_bytes():
    layout = KVLayout(2, 2, 16, "float16")
    big = np.random.default_rng(0).integers(0, 256, layout.byte_shape(32), dtype=np.uint8)
    chunk = Chunk(b"k" * 16, layout, big[:, :, 8:16], namespace=NS)
    assert not chunk.data.flags.c_contiguous
    assert codec.decode(codec.encode(chunk)).tobytes() == np.ascontiguousarray(big[:, :, 8:16]).tobytes()


def test_flipping_any_single_byte_is_refused():
    frame = codec.encode(kv_chunk(KVLayout(1, 1, 8, "bfloat16"), tokens=4))
    for pos in range(len(frame)):  # every position of a small frame
        for flip in (0x01, 0x80):
            damaged = bytearray(frame)
            damaged[pos] ^= flip
            with pytest.raises(IntegrityError):
                codec.decode(damaged)


def test_flipping_random_bytes_of_a_large_frame_is_refused():
    frame = codec.encode(kv_chunk(KVLayout(4, 8, 128, "bfloat16"), tokens=64))
    rng = np.random.default_rng(1)
    for pos in rng.integers(0, len(frame), 300):
        damaged = bytearray(frame)
        damaged[pos] ^= 1 << int(rng.integers(8))
        with pytest.raises(IntegrityError):
            codec.decode(damaged)


def test_truncated_or_extended_frames_are_refused():
    frame = codec.encode(kv_chunk(LAYOUTS[1]))
    for bad in (frame[:-1], frame + b"\0", frame[:31], b"", frame[:100]):
        with pytest.raises(FormatError):
            codec.decode(bad)


def test_foreign_layout_namespace_or_key_raise_typed_errors():
    chunk = kv_chunk(LAYOUTS[1])
    frame = codec.encode(chunk)
    with pytest.raises(LayoutMismatch):
        codec.decode(frame, layout=LAYOUTS[0])
    with pytest.raises(LayoutError):  # a layout mismatch is also a LayoutError
        codec.decode(frame, layout=LAYOUTS[2])
    with pytest.raises(NamespaceMismatch):
        codec.decode(frame, namespace=b"m" * 16)
    with pytest.raises(NamespaceMismatch):
        codec.decode(frame, key=b"x" * 16)


def test_a_well_checksummed_frame_with_a_lying_header_is_refused():
    """A writer with a bug (or an attacker) can produce a valid checksum over bad fields."""
    import msgpack

    chunk = kv_chunk(LAYOUTS[1])
    header = {
        "v": 1,
        "ns": NS,
        "key": chunk.key,
        "layout": chunk.layout.to_dict(),
        "tokens": 9,
        "codec": "raw",
        "raw_len": chunk.nbytes,
    }
    frame = _frame(msgpack.packb(header), chunk.tobytes())
    with pytest.raises(FormatError):
        codec.decode(frame)
    bomb = {**header, "tokens": 1_000_000, "raw_len": chunk.layout.chunk_bytes(1_000_000)}
    with pytest.raises(FormatError):
        codec.decode(_frame(msgpack.packb(bomb), b"\x00" * 64))
    with pytest.raises(FormatError):
        codec.decode(_frame(b"\xc1garbage", b""))


@pytest.mark.parametrize("claimed", ["lz4", "zstd", "", 1, None])
def test_a_frame_claiming_a_codec_this_version_cannot_read_is_a_miss(claimed):
    """Written by a newer lmtier, or by anyone: well checksummed, right lengths, and still
    refused, never misread as raw bytes."""
    import msgpack

    chunk = kv_chunk(LAYOUTS[1])

    def frame(codec_name):
        fields = {"v": 1, "ns": NS, "key": chunk.key, "layout": chunk.layout.to_dict(), "tokens": 8}
        header = msgpack.packb({**fields, "codec": codec_name, "raw_len": chunk.nbytes})
        return _frame(header, chunk.tobytes())

    with pytest.raises(FormatError, match="codec"):
        codec.decode(frame(claimed))
    assert codec.decode(frame("raw")).tobytes() == chunk.tobytes()


@pytest.mark.parametrize("field,value", [("num_layers", 2.0), ("num_kv_heads", 2.0), ("head_dim", 16.0)])
def test_a_layout_field_of_the_wrong_type_is_refused_whatever_was_read_before(field, value):
    """A layout is built once per distinct header (a cache), and ``2.0`` equals ``2``: a
    field of another type must still be checked, not served the layout of the value it
    equals (a reader with a cold cache would refuse what a warm one let through)."""
    import msgpack

    chunk = kv_chunk(LAYOUTS[1])
    fields = {"v": 1, "ns": NS, "key": chunk.key, "tokens": 8, "codec": "raw", "raw_len": chunk.nbytes}
    good = _frame(msgpack.packb({**fields, "layout": chunk.layout.to_dict()}), chunk.tobytes())
    assert codec.decode(good).tobytes() == chunk.tobytes()  # the cache now holds this layout
    layout = {**chunk.layout.to_dict(), field: value}
    assert layout[field] == chunk.layout.to_dict()[field]  # equal, of another type
    with pytest.raises(FormatError):
        codec.decode(_frame(msgpack.packb({**fields, "layout": layout}), chunk.tobytes()))


def _frame(header: bytes, payload: bytes) -> bytes:
    """A frame with valid checksums around whatever header and payload it is given."""
    return codec._preamble(header, len(payload), xxhash.xxh3_64_intdigest(payload)) + header + payload


@fuzz(3)
@given(st.binary(max_size=512))
def test_decoding_arbitrary_bytes_never_crashes(data):
    with pytest.raises(IntegrityError):
        codec.decode(data)


@fuzz(2)
@given(
    header=st.dictionaries(
        st.sampled_from(["v", "ns", "key", "layout", "tokens", "codec", "raw_len", "x"]),
        st.one_of(
            st.integers(-2, 2**40),
            st.binary(max_size=20),
            st.text(max_size=8),
            st.dictionaries(st.text(max_size=12), st.integers(-1, 10**6), max_size=6),
        ),
    ),
    payload=st.binary(max_size=256),
)
def test_decoding_checksummed_garbage_headers_never_crashes(header, payload):
    import msgpack

    with pytest.raises(IntegrityError):
        codec.decode(_frame(msgpack.packb(header), payload))


def test_lazy_decoding_defers_the_payload_check_to_the_reader():
    chunk = kv_chunk(LAYOUTS[2])
    frame = bytearray(codec.encode(chunk))
    frame[-5] ^= 0x10  # damage the payload only
    lazy = codec.decode(frame, lazy=True)
    assert not lazy.verified
    out = np.empty_like(chunk.data)
    with pytest.raises(ChecksumError):
        lazy.copy_to(out)
    with pytest.raises(ChecksumError):
        codec.decode(frame)
    good = codec.decode(codec.encode(chunk), lazy=True)
    good.copy_to(out)
    assert good.verified and out.tobytes() == chunk.tobytes()


def test_encode_into_builds_the_same_frame_in_one_pass():
    chunk = kv_chunk(KVLayout(4, 8, 128, "bfloat16"), tokens=64)
    buf = np.zeros(codec.encoded_size(chunk) + 100, dtype=np.uint8)
    n = codec.encode_into(chunk, buf)
    assert n == codec.encoded_size(chunk)
    assert buf[:n].tobytes() == codec.encode(chunk)


def test_a_damaged_chunk_is_never_re_encoded_as_good():
    chunk = kv_chunk(LAYOUTS[1])
    bad = Chunk(chunk.key, chunk.layout, chunk.data.copy(), namespace=NS, checksum=12345, verified=False)
    with pytest.raises(ChecksumError):
        codec.encode(bad)
    with pytest.raises(ChecksumError):
        codec.encode_into(bad, np.zeros(codec.encoded_size(bad), np.uint8))


def test_a_layout_dict_names_every_field_that_changes_the_bytes():
    from dataclasses import fields

    layout = KVLayout(num_layers=3, num_kv_heads=1, head_dim=576, dtype="float8_e4m3fn", mla=True)
    assert set(layout.to_dict()) == {f.name for f in fields(layout) if f.compare}
    assert KVLayout.from_dict(layout.to_dict()) == layout


def test_a_payload_checksum_computed_by_the_reader_replaces_the_payload_pass():
    chunk = kv_chunk(LAYOUTS[2])
    frame = codec.encode(chunk)
    payload = memoryview(frame)[codec.PREAMBLE.size + codec.header_length(frame) :]
    good = codec.decode(frame, payload_checksum=xxhash.xxh3_64_intdigest(payload))
    assert good.verified and good.tobytes() == chunk.tobytes()
    with pytest.raises(ChecksumError):
        codec.decode(frame, payload_checksum=xxhash.xxh3_64_intdigest(payload) ^ 1)


@pytest.mark.parametrize("align", [512, 4096, 65536])
@pytest.mark.parametrize("ns_bytes", [1, 200, 700])
def test_an_aligned_frame_puts_its_payload_on_the_boundary_and_decodes_anywhere(align, ns_bytes):
    """``align`` pads the header (a ``pad`` field under the header checksum), so that the
    payload starts at a multiple of ``align``; any reader decodes the frame, and a flipped
    pad byte is a checksum error like any other header byte."""
    base = kv_chunk(LAYOUTS[2])
    chunk = Chunk(base.key, base.layout, base.data, namespace=(bytes(range(256)) * 3)[:ns_bytes])
    parts = codec.encode_parts(chunk, align=align)
    frame = b"".join(bytes(p) for p in parts)
    assert len(parts[0]) % align == 0 and len(frame) == codec.encoded_size(chunk, align)
    assert codec.decode(frame).tobytes() == chunk.tobytes()
    buf = np.zeros(len(frame), np.uint8)
    assert codec.encode_into(chunk, buf, align=align) == len(frame) and buf.tobytes() == frame
    bad = bytearray(frame)
    bad[len(parts[0]) - 1] ^= 1  # the last pad byte
    with pytest.raises(ChecksumError):
        codec.decode(bytes(bad))

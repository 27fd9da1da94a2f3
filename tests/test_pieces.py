"""Pieces written and read without protobuf are exactly protobuf's Pieces."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmtier.buffers import BufferPool
from lmtier.errors import FormatError
from lmtier.transport.pieces import FrameAssembler, FrameTooLarge, Piece, Region, pack, piece, split, unpack
from lmtier.v1 import cache_pb2

sizes = st.integers(min_value=0, max_value=2**40)


@given(key=st.binary(max_size=40), frame_size=sizes, offset=sizes, data=st.binary(max_size=3000))
def test_data_pieces_match_protobuf_both_ways(key, frame_size, offset, data):
    ours = pack(piece(key, frame_size, offset, data=[data[:7], memoryview(data)[7:]]), piece(key, 1, data=[b"x"]))
    theirs = cache_pb2.Pieces(
        pieces=[
            cache_pb2.ChunkPiece(key=key, frame_size=frame_size, offset=offset, data=data),
            cache_pb2.ChunkPiece(key=key, frame_size=1, data=b"x"),
        ]
    )
    assert cache_pb2.Pieces.FromString(ours) == theirs
    for message in (theirs.SerializeToString(), theirs.SerializeToString() + b"\x00" * 0):
        back = unpack(message)
        assert [(p.key, p.frame_size, p.offset, bytes(p.data), p.region) for p in back] == [
            (key, frame_size, offset, data, None),
            (key, 1, 0, b"x", None),
        ]


@given(key=st.binary(min_size=1, max_size=40), name=st.text(max_size=50), offset=sizes, length=sizes)
def test_region_pieces_match_protobuf_both_ways(key, name, offset, length):
    ours = pack(piece(key, length, region=Region(name, offset, length)))
    region = cache_pb2.SharedRegion(segment=name, offset=offset, length=length)
    theirs = cache_pb2.Pieces(pieces=[cache_pb2.ChunkPiece(key=key, frame_size=length, region=region)])
    assert cache_pb2.Pieces.FromString(ours) == theirs
    (back,) = unpack(theirs.SerializeToString())
    assert back.region == Region(name, offset, length) and back.data is None


def test_large_messages_parse_without_protobuf_and_agree():
    data = bytes(range(256)) * 64  # over the small-message size: parsed by hand
    message = cache_pb2.Pieces(pieces=[cache_pb2.ChunkPiece(key=b"k", frame_size=len(data), data=data)])
    extra = message.SerializeToString() + b"\x78\x05"  # an unknown field 15 (varint): skipped
    (back,) = unpack(extra)
    assert bytes(back.data) == data and back.key == b"k"
    for bad in (b"\x0a\x05ab", b"\x10\xff\xff", b"\x0b"):  # truncated field, varint, bad wire type
        with pytest.raises(FormatError):
            unpack(bad + b"\x00" * 5000)
        with pytest.raises(FormatError):
            unpack(bad)


def test_split_cuts_buffers_into_pieces_without_losing_a_byte():
    parts = [b"abc", b"defghij", b"", b"klmnopqrstu"]
    pieces = list(split(parts, 4))
    assert [o for o, _ in pieces] == [0, 4, 8, 12, 16, 20]  # 21 bytes
    assert b"".join(b"".join(bytes(v) for v in views) for _, views in pieces) == b"".join(parts)
    assert all(sum(len(v) for v in views) <= 4 for _, views in pieces)


def test_the_assembler_rebuilds_frames_and_refuses_bad_sequences():
    pool = BufferPool()
    asm = FrameAssembler(pool, max_frame=100)
    frame = bytes(range(60))
    whole = asm.add(Piece(b"k", 60, 0), memoryview(frame))
    assert whole is not None and bytes(whole[1]) == frame  # one piece: the bytes themselves
    assert asm.add(Piece(b"k", 60, 0), memoryview(frame[:25])) is None
    key, view, _digest, release = asm.add(Piece(b"", 0, 25), memoryview(frame[25:]))
    assert (key, bytes(view)) == (b"k", frame)
    release()
    assert pool.outstanding == 0
    with pytest.raises(FrameTooLarge):
        asm.add(Piece(b"k", 101, 0), memoryview(b"x"))
    asm.add(Piece(b"k", 60, 0), memoryview(frame[:10]))
    with pytest.raises(FormatError):
        asm.add(Piece(b"", 0, 11), memoryview(frame[11:]))  # a gap
    assert pool.outstanding == 0 and not asm.pending
    with pytest.raises(FormatError):
        asm.add(Piece(b"", 0, 0), memoryview(frame))  # a first piece without its key

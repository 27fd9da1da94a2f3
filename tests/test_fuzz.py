"""Fuzzing: every method of the cache service, the wire parser and the frame assembler, with
inputs built to break them (hypothesis).

A real ``lmtier serve`` process takes every call. Each call must end in OK or a clear status
(``ALLOWED``), never INTERNAL or UNKNOWN, never a hang (every call has a deadline), never a
dead server; whatever a Get serves must verify against its key and be the bytes stored
under it; and the server's peak memory stays within a fixed bound of where it started.

Budget: ``FUZZ_EXAMPLES`` examples per target (100 by default: what CI runs, well under a
minute); ``make fuzz`` runs 5,000 each. Bugs found this way stay as ``@example`` cases.
"""

from __future__ import annotations

import itertools
import re
import urllib.request
from pathlib import Path

import grpc
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from lmtier.buffers import BufferPool
from lmtier.errors import FormatError, LmtierError
from lmtier.kv import codec
from lmtier.kv.layout import KVLayout
from lmtier.testing.cache_server import ServerProcess
from lmtier.testing.redis_server import free_port
from lmtier.transport import shm
from lmtier.transport.pieces import (
    FrameAssembler,
    FrameTooLarge,
    Region,
    _unpack_large,
    _unpack_small,
    pack,
    piece,
    unpack,
)
from lmtier.v1 import cache_pb2

from conftest import fuzz, make_namespace, make_prompt

FUZZ = fuzz()
SERVICE = "/lmtier.v1.CacheService/"
S = grpc.StatusCode
ALLOWED = {S.OK, S.INVALID_ARGUMENT, S.RESOURCE_EXHAUSTED, S.DATA_LOSS, S.FAILED_PRECONDITION, S.UNAUTHENTICATED}
TOKENS = {"alice-secret": "alice", "bob-secret": "bob"}
MAX_CHUNK = 1 << 20
MAX_KEYS = 64
MEMORY_BOUND = 256 << 20  # peak RSS growth allowed over the whole module

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16")  # 8 KiB chunks
PROMPT = make_prompt(4, seed=901, namespace=make_namespace(LAYOUT))
KNOWN = {key: PROMPT.chunk_bytes(i) for i, key in enumerate(PROMPT.keys)}
FRAMES = [codec.encode(c) for c in PROMPT.chunks()]


# -- the server ------------------------------------------------------------------------------
class Fuzzed:
    """The server process, a channel to it, and a client shared-memory segment."""

    def __init__(self, tmp: Path) -> None:
        (tmp / "tokens").write_text("".join(f"{t}={n}\n" for t, n in TOKENS.items()))
        (tmp / "shm").mkdir()
        (tmp / "lmtier.yaml").write_text(
            "server:\n"
            f"  tiers: ['cpu://?size=16MiB&slot=64KiB', 'file://{tmp / 'disk'}?size=32MiB']\n"
            f"  token_file: {tmp / 'tokens'}\n"
            f"  shm_dir: {tmp / 'shm'}\n"
            f"  max_chunk_bytes: {MAX_CHUNK}\n"
            "  max_message_bytes: 4MiB\n"
            f"  max_keys: {MAX_KEYS}\n"
            "  workers: 4\n"
        )
        self.metrics_port = free_port()
        self.proc = ServerProcess(
            tmp, "--config", str(tmp / "lmtier.yaml"), env={"LMTIER_SERVER_METRICS_PORT": str(self.metrics_port)}
        )
        self.channel = grpc.insecure_channel(self.proc.address)
        self.segment = shm.Segment(str(tmp / "shm"), 1 << 20, 64 << 10)
        self.view = memoryview(self.segment.map)  # the whole segment, as the server maps it
        self.baseline = self.memory()["VmRSS"]

    def memory(self) -> dict[str, int]:
        text = Path(f"/proc/{self.proc.pid}/status").read_text()
        return {k: int(v) * 1024 for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", text, re.M)}

    def call(self, method: str, request, token: str | None) -> tuple[grpc.StatusCode, list[bytes]]:
        metadata = (("authorization", f"Bearer {token}"),) if token is not None else ()
        try:
            if method == "Put":
                fn = self.channel.stream_unary(SERVICE + method, None, None)
                return S.OK, [fn(iter(request), metadata=metadata, timeout=30)]
            if method == "Get":
                fn = self.channel.unary_stream(SERVICE + method, None, None)
                return S.OK, list(fn(request, metadata=metadata, timeout=30))
            fn = self.channel.unary_unary(SERVICE + method, None, None)
            return S.OK, [fn(request, metadata=metadata, timeout=30)]
        except grpc.RpcError as exc:
            return exc.code(), []

    def checked(self, method: str, request, token: str | None) -> tuple[grpc.StatusCode, list[bytes]]:
        code, out = self.call(method, request, token)
        assert code in ALLOWED, f"{method}: {code} ({self.proc.log()[-2000:]})"
        assert self.proc.proc.poll() is None, f"the server died on {method}:\n{self.proc.log()[-3000:]}"
        return code, out

    def seed(self, token: str = "alice-secret") -> None:
        """Store the known chunks (for Get to find) and lay a good frame in the segment."""
        code, _ = self.call(
            "Put", [pack(piece(k, len(f), data=[f])) for k, f in zip(KNOWN, FRAMES, strict=True)], token
        )
        assert code == S.OK
        self.view[: len(FRAMES[0])] = FRAMES[0]

    def sound(self) -> None:
        """The server answers, serves the truth, and never failed a call internally."""
        assert self.proc.serving()
        self.seed()
        code, out = self.call("Lookup", cache_pb2.LookupRequest(keys=list(KNOWN)).SerializeToString(), "alice-secret")
        assert code == S.OK and cache_pb2.LookupResponse.FromString(out[0]).hits == len(KNOWN)
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        internal = re.findall(r'^lmtier_server_rpcs_total\{.*code="(INTERNAL|UNKNOWN)".*\} (\S+)$', text, re.M)
        assert sum(float(n) for _, n in internal) == 0, internal
        assert "Traceback" not in self.proc.log()

    def close(self) -> None:
        self.channel.close()
        self.segment.close()
        self.proc.stop()


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = Fuzzed(tmp_path_factory.mktemp("fuzz"))
    yield server
    try:
        grown = server.memory()["VmHWM"] - server.baseline
        assert grown < MEMORY_BOUND, f"the server's peak memory grew by {grown >> 20} MiB under fuzzing"
    finally:
        server.close()


@pytest.fixture
def sound(srv):
    srv.seed()
    yield srv
    srv.sound()


# -- strategies ------------------------------------------------------------------------------
tokens = st.sampled_from([*TOKENS, None, "wrong", ""])
keys_ = st.one_of(
    st.sampled_from(list(KNOWN)),
    st.binary(min_size=16, max_size=16),
    st.binary(min_size=32, max_size=32),
    st.binary(max_size=48),
)
key_lists = st.lists(keys_, max_size=MAX_KEYS + 8)
sizes = st.one_of(
    st.integers(0, 1 << 16),
    st.integers(0, 2**64 - 1),
    st.sampled_from([0, 1, len(FRAMES[0]), MAX_CHUNK, MAX_CHUNK + 1, 2**63, 2**64 - 1]),
)
# Found by this module: a request that protobuf cannot parse was answered INTERNAL (gRPC's
# own deserializer failing) with a traceback in the log; the service now parses requests
# itself and answers INVALID_ARGUMENT.
MALFORMED = b"\x0a\xff\xff"
garbage = st.one_of(st.binary(max_size=600), st.binary(min_size=4090, max_size=4200))


def segments(real: str) -> st.SearchStrategy[str]:
    return st.one_of(
        st.just(real),
        st.sampled_from(["", "..", "../../etc/passwd", "/etc/passwd", "lmtier-" + "0" * 32, real + "/..", "tokens"]),
        st.text(max_size=40),
    )


@st.composite
def frame_pieces(draw) -> list[list]:
    """A known frame, perhaps damaged or lying about itself, cut into pieces."""
    i = draw(st.integers(0, len(FRAMES) - 1))
    frame = bytearray(FRAMES[i])
    key = list(KNOWN)[i]
    harm = draw(st.sampled_from(["none", "none", "flip", "truncate", "extend", "other key", "offsets", "size"]))
    if harm == "flip":
        frame[draw(st.integers(0, len(frame) - 1))] ^= 1 << draw(st.integers(0, 7))
    elif harm == "truncate":
        frame = frame[: draw(st.integers(0, len(frame) - 1))]
    elif harm == "extend":
        frame += draw(st.binary(min_size=1, max_size=64))
    elif harm == "other key":
        key = list(KNOWN)[(i + 1) % len(KNOWN)]
    cuts = sorted(draw(st.lists(st.integers(1, max(1, len(frame) - 1)), max_size=4, unique=True)))
    bounds = [0, *[c for c in cuts if c < len(frame)], len(frame)]
    out = []
    for a, b in itertools.pairwise(bounds):
        offset = a if harm != "offsets" else draw(sizes)
        size = len(frame) if harm != "size" else draw(sizes)
        out.append(piece(key if a == 0 else b"", size if a == 0 else 0, offset, data=[bytes(frame[a:b])]))
    return out


@st.composite
def loose_pieces(draw, segment: str) -> list:
    """A piece whose every field is drawn independently."""
    if draw(st.booleans()):
        region = Region(draw(segments(segment)), draw(sizes), draw(sizes))
        return piece(draw(keys_), draw(sizes), draw(sizes), region=region)
    return piece(draw(keys_), draw(sizes), draw(sizes), data=[draw(st.binary(max_size=300))])


@st.composite
def region_pieces(draw, segment: str) -> list:
    """A whole frame laid in the client's segment (slot 0 holds FRAMES[0])."""
    size = draw(st.sampled_from([len(FRAMES[0]), len(FRAMES[0]) - 1, 64, 0]))
    key = draw(st.sampled_from([PROMPT.keys[0], PROMPT.keys[1]]))
    return piece(key, draw(st.sampled_from([size, size + 1])), 0, region=Region(segment, draw(sizes), size))


@st.composite
def put_streams(draw, segment: str) -> list[bytes]:
    messages = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["garbage", "loose", "frame", "region"]))
        if kind == "garbage":
            messages.append(draw(garbage))
        elif kind == "loose":
            messages.append(pack(*draw(st.lists(loose_pieces(segment), min_size=1, max_size=3))))
        elif kind == "frame":
            parts = draw(frame_pieces())
            if draw(st.booleans()):  # all pieces in one message, or one message each
                messages.append(pack(*parts))
            else:
                messages += [pack(p) for p in parts]
        else:
            messages.append(pack(draw(region_pieces(segment))))
    return messages


# -- every method -----------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["Lookup", "Delete"])
def test_lookup_and_delete_take_any_key_list(sound, method):
    request_type = getattr(cache_pb2, f"{method}Request")

    @FUZZ
    @given(request=st.one_of(garbage, key_lists.map(lambda k: request_type(keys=k).SerializeToString())), token=tokens)
    @example(request=MALFORMED, token="alice-secret")
    def run(request, token):
        code, out = sound.checked(method, request, token)
        if code == S.OK and method == "Lookup":
            keys = list(request_type.FromString(request).keys)
            assert cache_pb2.LookupResponse.FromString(out[0]).hits <= len(keys)

    run()


def test_get_serves_only_verified_bytes_of_the_keys_asked_for(sound):
    segment = sound.segment.name
    regions = st.builds(cache_pb2.SharedRegion, segment=segments(segment), offset=sizes, length=sizes)
    requests = st.builds(lambda k, r: cache_pb2.GetRequest(keys=k, landing=r), key_lists, st.lists(regions, max_size=6))

    @FUZZ
    @given(request=st.one_of(garbage, requests.map(lambda r: r.SerializeToString())), token=tokens)
    @example(request=MALFORMED, token="alice-secret")
    def run(request, token):
        code, messages = sound.checked("Get", request, token)
        if code != S.OK or not messages:
            return
        asked = list(cache_pb2.GetRequest.FromString(request).keys)
        served = frames_of(messages, sound.view, segment)
        assert [k for k, _ in served] == asked[: len(served)], "served keys are not the leading run asked for"
        for key, frame in served:
            chunk = codec.decode(frame, key=key)  # raises if anything was damaged on the way
            assert chunk.tobytes() == KNOWN[key], "a Get served other bytes than were stored"

    run()


def frames_of(messages: list[bytes], view: memoryview, segment: str) -> list[tuple[bytes, bytes]]:
    """The frames of a Get's response stream, whole, in order."""
    frames: list[list] = []
    for message in messages:
        for p in unpack(message):
            if p.region is not None:
                assert p.region.segment == segment, "the server wrote somewhere it was not given"
                frames.append([p.key, bytearray(view[p.region.offset : p.region.offset + p.region.length])])
            elif p.key:
                frames.append([p.key, bytearray(p.data)])
            else:
                frames[-1][1] += p.data
    return [(k, bytes(f)) for k, f in frames]


def test_put_takes_any_stream_and_keeps_only_whole_good_frames(sound):
    segment = sound.segment.name

    @FUZZ
    @given(messages=put_streams(segment), token=tokens)
    @example(messages=[pack(piece(PROMPT.keys[0], 2**64 - 1, 0, data=[b"x"]))], token="alice-secret")
    @example(messages=[pack(piece(PROMPT.keys[0], 64, 0, region=Region(segment, 2**64 - 1, 64)))], token="bob-secret")
    def run(messages, token):
        code, out = sound.checked("Put", messages, token)
        if code == S.OK:
            stored = cache_pb2.PutResponse.FromString(out[0]).stored
            assert stored <= sum(len(unpack(m)) for m in messages)
        # Whatever went in, what comes out under a known key is the truth or nothing.
        if token in TOKENS:
            code, got = sound.checked("Get", cache_pb2.GetRequest(keys=list(KNOWN)).SerializeToString(), token)
            for key, frame in frames_of(got, sound.view, segment):
                assert codec.decode(frame, key=key).tobytes() == KNOWN[key]

    run()


@pytest.mark.parametrize(
    "method,field,values",
    [
        ("List", "limit", st.integers(0, 2**32 - 1)),
        ("Release", "lease", st.integers(0, 2**64 - 1)),
        ("Stats", None, st.none()),
        ("Directory", "read", st.lists(st.binary(max_size=40), max_size=8)),
        ("OpenData", None, st.none()),  # the channel itself: tests/test_data_channel_input.py
    ],
)
def test_list_release_and_stats_take_any_request(sound, method, field, values):
    request_type = getattr(cache_pb2, f"{method}Request")
    built = values.map(lambda v: request_type(**({field: v} if field else {})).SerializeToString())

    @FUZZ
    @given(request=st.one_of(garbage, built), token=tokens)
    @example(request=MALFORMED, token="alice-secret")
    def run(request, token):
        code, out = sound.checked(method, request, token)
        if code == S.OK and method == "List":
            listed = cache_pb2.ListResponse.FromString(out[0])
            limit = cache_pb2.ListRequest.FromString(request).limit or 1000
            assert len(listed.keys) <= limit

    run()


# -- the parsers, in process ------------------------------------------------------------------
_piece_fields = {
    "key": st.binary(max_size=40),
    "frame_size": st.integers(0, 2**64 - 1),
    "head": st.binary(max_size=40),
    "lease": st.integers(0, 2**64 - 1),
}
_regions = st.builds(
    cache_pb2.SharedRegion,
    segment=st.text(max_size=40),
    offset=st.integers(0, 2**64 - 1),
    length=st.integers(0, 2**64 - 1),
)
piece_messages = st.builds(
    cache_pb2.ChunkPiece, offset=st.integers(0, 2**64 - 1), data=st.binary(max_size=5000), **_piece_fields
) | st.builds(cache_pb2.ChunkPiece, region=_regions, **_piece_fields)


@fuzz(5)
@given(st.lists(piece_messages, max_size=4))
def test_both_wire_parsers_read_every_pieces_message_as_protobuf_does(pieces):
    """The hand-written parser (large messages) and protobuf's (small ones) agree."""
    message = cache_pb2.Pieces(pieces=pieces).SerializeToString()
    for parse in (_unpack_small, _unpack_large):
        parsed = parse(message)
        assert len(parsed) == len(pieces)
        for got, want in zip(parsed, pieces, strict=True):
            assert (got.key, got.frame_size, got.offset, got.head, got.lease) == (
                want.key, want.frame_size, want.offset, want.head, want.lease,
            )  # fmt: skip
            if want.WhichOneof("body") == "region":
                assert got.region == Region(want.region.segment, want.region.offset, want.region.length)
                assert got.data is None
            else:
                assert bytes(got.data) == want.data and got.region is None


@fuzz(5)
@given(garbage | st.binary(min_size=4096, max_size=6000))
def test_the_wire_parser_refuses_garbage_with_a_format_error(message):
    try:
        unpack(message)
    except FormatError:
        pass


@fuzz(5)
@given(
    pieces=st.lists(
        st.tuples(st.binary(max_size=2), st.integers(0, 300), st.integers(0, 300), st.binary(max_size=120)),
        max_size=8,
    )
)
def test_the_frame_assembler_yields_frames_in_order_or_refuses(pieces):
    pool = BufferPool(max_free=4, max_free_bytes=1 << 20)
    assembler = FrameAssembler(pool, max_frame=256)
    expected: dict[bytes, bytearray] = {}
    current = b""
    for key, frame_size, offset, data in pieces:
        p = piece(key, frame_size, offset, data=[data])
        (one,) = unpack(pack(p))
        try:
            done = assembler.add(one, one.data)
        except FrameTooLarge:
            assert frame_size > 256
            break
        except LmtierError:
            break
        if key:
            current = key
            expected[current] = bytearray()
        expected[current] += data
        if done is not None:
            got_key, view, _digest, release = done
            assert got_key == current and bytes(view) == bytes(expected[current])
            assert len(view) == frame_size or frame_size == 0
            release()
    assembler.abandon()
    assert pool.outstanding == 0

"""The wire contract: generated code matches the .proto, and the service runs over gRPC."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc

from lmtier.v1 import cache_pb2, cache_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_is_not_stale(tmp_path):
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen-protos.sh"), str(tmp_path)],
        check=True,
        env={**os.environ, "PYTHON": sys.executable},  # the pinned compiler's venv is made from it once
        capture_output=True,
    )
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert fresh, "protoc wrote nothing"
    for rel in fresh:
        committed = ROOT / rel
        assert committed.exists(), f"{rel} is generated but not committed: run scripts/gen-protos.sh"
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), f"{rel} is stale: run scripts/gen-protos.sh"


class _Echo(cache_pb2_grpc.CacheServiceServicer):
    """The smallest service: holds pieces in a dict, to exercise the generated stubs."""

    def __init__(self):
        self.frames: dict[bytes, bytes] = {}

    def Lookup(self, request, context):
        hits = 0
        while hits < len(request.keys) and request.keys[hits] in self.frames:
            hits += 1
        return cache_pb2.LookupResponse(hits=hits)

    def Put(self, request_iterator, context):
        stored = 0
        for message in request_iterator:
            for piece in message.pieces:
                self.frames[piece.key] = piece.data
                stored += 1
        return cache_pb2.PutResponse(stored=stored)

    def Get(self, request, context):
        for key in request.keys:
            if key not in self.frames:
                return
            data = self.frames[key]
            yield cache_pb2.Pieces(pieces=[cache_pb2.ChunkPiece(key=key, frame_size=len(data), offset=0, data=data)])


def test_the_generated_service_round_trips_over_a_real_server_on_port_0():
    server = grpc.server(futures.ThreadPoolExecutor(2))
    cache_pb2_grpc.add_CacheServiceServicer_to_server(_Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = cache_pb2_grpc.CacheServiceStub(channel)
            pieces = [cache_pb2.ChunkPiece(key=b"k%d" % i, frame_size=3, data=b"abc") for i in range(3)]
            assert (
                stub.Put(iter([cache_pb2.Pieces(pieces=pieces[:1]), cache_pb2.Pieces(pieces=pieces[1:])])).stored == 3
            )
            assert stub.Lookup(cache_pb2.LookupRequest(keys=[b"k0", b"k1", b"x", b"k2"])).hits == 2
            got = list(stub.Get(cache_pb2.GetRequest(keys=[b"k0", b"k1", b"x"])))
            want = [(b"k0", b"abc", "data"), (b"k1", b"abc", "data")]
            assert [(p.key, p.data, p.WhichOneof("body")) for m in got for p in m.pieces] == want
    finally:
        server.stop(grace=None)


def test_the_declared_dependency_floors_are_exactly_what_the_generated_code_declares():
    """The extras go into engines' environments: their floors are the generated code's own
    (no higher, or an engine's older protobuf or grpcio would be moved; no lower, or a user
    pinned below would get code that does not load), with no upper bound for a newer
    engine to trip over. The generated message module carries no runtime version check."""
    import re
    import tomllib

    generated = (ROOT / "lmtier" / "v1" / "cache_pb2.py").read_text()
    assert "ValidateProtobufRuntimeVersion" not in generated, "regenerate with scripts/gen-protos.sh's pinned compiler"
    protobuf = re.search(r"Protobuf Python Version: ([\d.]+)", generated)[1]
    grpc_text = (ROOT / "lmtier" / "v1" / "cache_pb2_grpc.py").read_text()
    grpcio = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_text)[1]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("grpc", "server"):
        assert sorted(extras[extra]) == sorted([f"grpcio>={grpcio}", f"protobuf>={protobuf}"]), extra
    for requirement in extras["dev"]:
        name, spec = re.match(r"([A-Za-z0-9_.-]+)(.*)", requirement).groups()
        if name in ("protobuf", "grpcio"):
            assert spec == f">={protobuf if name == 'protobuf' else grpcio}", requirement

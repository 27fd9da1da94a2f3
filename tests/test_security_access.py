"""Security, in tests: who may call and what a caller reaches. Credentials and tenant
isolation on every RPC (the list of RPCs comes from the service descriptor, so a new one
without its cases fails here), health and reflection, mutual TLS, tenant tags, Stats'
count of a tenant's chunks, and no tenant reaching another's shared memory.

Limits on one client's calls and the paths input cannot steer are in
test_security_limits.py; no pickle and no secret shown, in test_security_output.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from test_data_channel import data_get

from lmtier.config import ServerConfig
from lmtier.kv import codec
from lmtier.kv.chunk import release_all
from lmtier.server import create_server
from lmtier.server.auth import tenant_tag
from lmtier.testing.certs import make_certificates
from lmtier.tiers.base import open_tier
from lmtier.transport.pieces import Region, pack, piece, unpack
from lmtier.v1 import cache_pb2

from conftest import make_prompt
from raw_client import PROMPT, S, call, code_of, puts, two_tenant_server

METHODS = sorted(m.name for m in cache_pb2.DESCRIPTOR.services_by_name["CacheService"].methods)
OTHER = make_prompt(3, seed=78)  # other bytes, stored under PROMPT's keys by another tenant


def served(messages: list[bytes]) -> list[bytes]:
    """The chunk bytes of a Get's messages (small chunks: one piece each), verified."""
    return [codec.decode(bytes(p.data), key=p.key).tobytes() for m in messages for p in unpack(m)]


# A well-formed request of every RPC: refused only for who sends it.
REQUESTS = {
    "Lookup": lambda: cache_pb2.LookupRequest(keys=PROMPT.keys),
    "Get": lambda: cache_pb2.GetRequest(keys=PROMPT.keys),
    "Put": lambda: puts(),
    "Delete": lambda: cache_pb2.DeleteRequest(keys=PROMPT.keys),
    "List": lambda: cache_pb2.ListRequest(limit=10),
    "Release": lambda: cache_pb2.ReleaseRequest(lease=1),
    "Stats": lambda: cache_pb2.StatsRequest(),
    "Directory": lambda: cache_pb2.DirectoryRequest(read=PROMPT.keys),
    "OpenData": lambda: cache_pb2.OpenDataRequest(),
    "Match": lambda: cache_pb2.MatchRequest(
        token_ids=PROMPT.tokens.tolist(),
        namespaces=[PROMPT.namespace.digest],
        chunk_tokens=PROMPT.namespace.chunk_tokens,
    ),
}


@pytest.fixture(scope="module")
def server():
    srv, address = two_tenant_server()
    channel = grpc.insecure_channel(address)
    srv.channel = channel
    yield srv
    channel.close()
    srv.stop(0)


def test_every_rpc_has_its_credential_and_isolation_cases():
    assert sorted(REQUESTS) == METHODS
    assert sorted(ISOLATION) == METHODS


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "metadata",
    [
        (),
        (("authorization", "Bearer nope"),),
        (("authorization", "Bearer alice-secret-and-more"),),
        (("authorization", "Bearer alice-secre"),),
        (("authorization", "Basic alice-secret"),),
        (("authorization", "Bearer "),),
        (("authorization", "alice-secret"),),
        (("x-api-key", "alice-secret"),),
    ],
    ids=["none", "unknown", "longer", "prefix", "basic", "empty", "no scheme", "other header"],
)
def test_every_rpc_refuses_a_caller_without_a_known_token(server, method, metadata):
    assert code_of(lambda: call(server.channel, method, REQUESTS[method](), metadata=metadata)) == S.UNAUTHENTICATED
    # and the same request with a known token is served
    call(server.channel, method, REQUESTS[method](), token="alice-secret")


def test_only_health_answers_without_credentials_and_reflection_needs_a_token(server):
    """Kubernetes probes need health without a token (it reveals no key); reflection is a
    tenant's call like any other (an idle stream of it once held a worker for good)."""
    answer = health_pb2_grpc.HealthStub(server.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    ask = [reflection_pb2.ServerReflectionRequest(list_services="")]
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.ServerReflectionInfo(iter(ask), timeout=10))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    answers = list(
        stub.ServerReflectionInfo(iter(ask), timeout=10, metadata=(("authorization", "Bearer alice-secret"),))
    )
    names = {s.name for s in answers[0].list_services_response.service}
    assert "lmtier.v1.CacheService" in names


# -- tenant isolation, per RPC: Alice stores PROMPT; Bob's call must not see or change it ----
def _alice_intact(server) -> None:
    got = call(server.channel, "Get", cache_pb2.GetRequest(keys=PROMPT.keys), token="alice-secret")
    assert served(got) == [PROMPT.chunk_bytes(i) for i in range(3)]


def _bob_lookup(server):
    assert call(server.channel, "Lookup", REQUESTS["Lookup"](), token="bob-secret").hits == 0


def _bob_get(server):
    assert call(server.channel, "Get", REQUESTS["Get"](), token="bob-secret") == []


def _bob_put(server):
    """Bob's own bytes under the same keys: his copies, never Alice's."""
    assert call(server.channel, "Put", puts(OTHER, PROMPT.keys), token="bob-secret").stored == 3
    got = call(server.channel, "Get", REQUESTS["Get"](), token="bob-secret")
    assert served(got) == [OTHER.chunk_bytes(i) for i in range(3)]
    call(server.channel, "Delete", REQUESTS["Delete"](), token="bob-secret")


def _bob_delete(server):
    call(server.channel, "Delete", REQUESTS["Delete"](), token="bob-secret")


def _bob_list(server):
    assert not set(call(server.channel, "List", REQUESTS["List"](), token="bob-secret").keys) & set(PROMPT.keys)


def _bob_release(server):
    """Leases exist only on a one-tenant server; a foreign or made-up lease changes nothing."""
    for lease in (0, 1, 2**63, 2**64 - 1):
        call(server.channel, "Release", cache_pb2.ReleaseRequest(lease=lease), token="bob-secret")
    assert server.service.leases.held == 0 and not server.zero_copy


def _bob_stats(server):
    assert call(server.channel, "Stats", REQUESTS["Stats"](), token="bob-secret").tenant_chunks == 0


def _bob_match(server):
    """Bob cannot probe Alice's prefixes: the same tokens and namespace hold nothing for him."""
    assert call(server.channel, "Match", REQUESTS["Match"](), token="bob-secret").tokens == 0
    assert call(server.channel, "Match", REQUESTS["Match"](), token="alice-secret").tokens == len(PROMPT.tokens)


def _bob_directory(server):
    """A server with several tenants publishes no directory; Bob's reports of reads
    (Alice's keys among them) change nothing of hers."""
    for token in ("bob-secret", "alice-secret"):
        answer = call(server.channel, "Directory", REQUESTS["Directory"](), token=token)
        assert answer.segment == "" and server.service.published is None


def _bob_open_data(server):
    """Bob's ticket opens a data connection that is Bob's: Alice's keys hold nothing there
    (tests/test_data_channel.py tries the channel itself every other way)."""
    answer = call(server.channel, "OpenData", REQUESTS["OpenData"](), token="bob-secret")
    assert data_get(server.service.data.port, answer.ticket, PROMPT.keys) == []


ISOLATION = {
    "OpenData": _bob_open_data,
    "Directory": _bob_directory,
    "Lookup": _bob_lookup,
    "Get": _bob_get,
    "Put": _bob_put,
    "Delete": _bob_delete,
    "List": _bob_list,
    "Release": _bob_release,
    "Stats": _bob_stats,
    "Match": _bob_match,
}


@pytest.mark.parametrize("method", METHODS)
def test_no_rpc_of_one_tenant_sees_or_changes_another_tenants_chunks(server, method):
    assert call(server.channel, "Put", puts(), token="alice-secret").stored == 3
    ISOLATION[method](server)
    _alice_intact(server)
    assert call(server.channel, "Stats", REQUESTS["Stats"](), token="alice-secret").tenant_chunks == 3
    assert set(PROMPT.keys) <= set(call(server.channel, "List", REQUESTS["List"](), token="alice-secret").keys)


# -- TLS ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    ours = make_certificates(tmp_path_factory.mktemp("ours"), clients=("carol",))
    theirs = make_certificates(tmp_path_factory.mktemp("theirs"), clients=("carol",))
    return ours, theirs


def test_mutual_tls_refuses_every_rpc_without_a_certificate_signed_by_its_ca(certs):
    ours, theirs = certs
    srv, port = create_server(
        ServerConfig(
            port=0,
            tiers=("cpu://?size=16MiB&slot=64KiB",),
            tls_cert=ours["server.crt"],
            tls_key=ours["server.key"],
            tls_client_ca=ours["ca.crt"],
            shm_dir="",
        )
    )
    ca = Path(ours["ca.crt"]).read_bytes()

    def channel(client: dict | None) -> grpc.Channel:
        key = Path(client["client-carol.key"]).read_bytes() if client else None
        cert = Path(client["client-carol.crt"]).read_bytes() if client else None
        credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        return grpc.secure_channel(f"localhost:{port}", credentials)

    try:
        good, anonymous, forged = channel(ours), channel(None), channel(theirs)
        plaintext = grpc.insecure_channel(f"127.0.0.1:{port}")
        for method in METHODS:
            call(good, method, REQUESTS[method]())  # carol, signed by our CA: served
            for refused in (anonymous, forged, plaintext):
                assert code_of(lambda c=refused, m=method: call(c, m, REQUESTS[m]())) == S.UNAVAILABLE, method
        assert len(srv.service.tenant_keys(tenant_tag("carol"))) == 3  # carol's Put, the last to store
        for c in (good, anonymous, forged, plaintext):
            c.close()
    finally:
        srv.stop(0)


# -- tenant tags, counts, and another tenant's shared memory ------------------------------------
def test_tenants_are_kept_apart_by_a_128_bit_cryptographic_digest_of_their_names():
    """A 64-bit non-cryptographic hash of a name could be made to collide with another
    tenant's (and share its keys); a keyed-width BLAKE2b digest cannot."""
    import hashlib

    from lmtier.server.auth import TAG_BYTES

    assert TAG_BYTES >= 16
    names = ["alice", "bob", "alice ", "Alice", "", "a" * 1000, "tenant-\x00"]
    tags = [tenant_tag(n) for n in names]
    assert len(set(tags)) == len(names) and {len(t) for t in tags} == {TAG_BYTES}
    assert tags[0] == hashlib.blake2b(b"alice", digest_size=TAG_BYTES, person=b"lmtier.tenant").digest()


def test_stats_counts_a_tenants_chunks_up_to_a_bound(monkeypatch):
    """Stats does not list a tenant's every key: it counts up to STATS_COUNT_LIMIT."""
    from lmtier.server.methods import control as service_control

    monkeypatch.setattr(service_control, "STATS_COUNT_LIMIT", 4)
    srv, address = two_tenant_server()
    channel = grpc.insecure_channel(address)
    try:
        many = make_prompt(10, seed=90)
        assert call(channel, "Put", puts(many), "alice-secret").stored == 10
        assert call(channel, "Stats", cache_pb2.StatsRequest(), "alice-secret").tenant_chunks == 4
        assert call(channel, "Stats", cache_pb2.StatsRequest(), "bob-secret").tenant_chunks == 0
    finally:
        channel.close()
        srv.stop(0)


def test_no_tenant_can_have_the_server_read_or_write_another_tenants_shared_memory(tmp_path):
    """Segment names are visible on the host. Alice names Bob's segment in every RPC that
    takes a region (the descriptor says which): refused, and nothing moves. A server with
    several tenants maps no client memory at all; Bob is served over plain gRPC."""
    from google.protobuf.descriptor import FieldDescriptor

    taking = {
        m.name
        for m in cache_pb2.DESCRIPTOR.services_by_name["CacheService"].methods
        for message in (m.input_type, *(f.message_type for f in m.input_type.fields if f.message_type))
        for f in message.fields
        if f.type == FieldDescriptor.TYPE_MESSAGE and f.message_type.name == "SharedRegion"
    }
    assert taking == {"Get", "Put"}  # Put's Pieces carry regions; a new RPC with one must be added here
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    bobs = "lmtier-" + "b" * 32
    secret = os.urandom(65536)
    (shm_dir / bobs).write_bytes(secret)  # Bob's segment: his KV, his landing slots
    tokens = (("alice-secret", "alice"), ("bob-secret", "bob"))
    config = ServerConfig(port=0, tiers=("cpu://?size=16MiB&slot=64KiB",), shm_dir=str(shm_dir), tokens=tokens)
    srv, port = create_server(config)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    key, frame = PROMPT.keys[0], codec.encode(PROMPT.chunks()[0])
    try:
        assert call(channel, "Put", [pack(piece(key, len(frame), data=[frame]))], "alice-secret").stored == 1
        attacks = {
            "Get": lambda: call(
                channel,
                "Get",
                cache_pb2.GetRequest(keys=[key], landing=[cache_pb2.SharedRegion(segment=bobs, length=65536)]),
                "alice-secret",
            ),
            "Put": lambda: call(
                channel, "Put", [pack(piece(OTHER.keys[0], 4096, region=Region(bobs, 0, 4096)))], "alice-secret"
            ),
        }
        for method in sorted(taking):
            refused = code_of(attacks[method])
            assert refused == S.FAILED_PRECONDITION, method
        assert (shm_dir / bobs).read_bytes() == secret  # nothing written into Bob's slots
        assert call(channel, "Lookup", cache_pb2.LookupRequest(keys=OTHER.keys[:1]), "alice-secret").hits == 0
        assert srv.service.maps is None
        # Bob's own client falls back to plain gRPC and is served.
        bob = open_tier(f"grpc://127.0.0.1:{port}?token=bob-secret&shm_dir={shm_dir}")
        bob.put(OTHER.chunks())
        got = bob.get(OTHER.keys)
        assert [c.tobytes() for c in got] == [c.tobytes() for c in OTHER.chunks()]
        release_all(got)
        assert bob.stats()["shm"] is None
        assert [f.name for f in shm_dir.iterdir()] == [bobs]  # his client's own segment is gone already
        bob.close()
    finally:
        channel.close()
        srv.stop(0)

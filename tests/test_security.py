"""Security, in tests: credentials and tenant isolation on every RPC (the list of RPCs comes
from the service descriptor, so a new one without its cases fails here), TLS refusals,
limits on the calls of one client, disk and shared-memory paths that input cannot steer,
and no pickle anywhere lmtier writes or sends bytes.

Longer than 400 lines: one catalogue of every RPC against every attack, kept together so
that a new RPC without its cases fails in one place.
"""

from __future__ import annotations

import ast
import os
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from test_data_channel import data_get

from lmtier import metrics
from lmtier.config import ServerConfig
from lmtier.errors import RetryableError
from lmtier.kv import codec
from lmtier.kv.chunk import release_all
from lmtier.server import create_server
from lmtier.server.auth import tenant_tag
from lmtier.store.tiered import TieredStore
from lmtier.testing.certs import make_certificates
from lmtier.tiers.base import open_tier
from lmtier.transport.pieces import Region, pack, piece, unpack
from lmtier.v1 import cache_pb2

from conftest import disk_frames, eventually, make_prompt

ROOT = Path(__file__).resolve().parent.parent
SERVICE = "/lmtier.v1.CacheService/"
METHODS = sorted(m.name for m in cache_pb2.DESCRIPTOR.services_by_name["CacheService"].methods)
S = grpc.StatusCode
PROMPT = make_prompt(3, seed=77)
OTHER = make_prompt(3, seed=78)  # other bytes, stored under PROMPT's keys by another tenant


def call(channel: grpc.Channel, method: str, request, token: str | None = None, **kw):
    """One call on a bare channel; the response (a list for Get) or the RpcError raised."""
    metadata = kw.pop("metadata", None)
    timeout = kw.pop("timeout", 20)
    if metadata is None:
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
    if method == "Put":
        fn = channel.stream_unary(SERVICE + "Put", None, cache_pb2.PutResponse.FromString)
        return fn(iter(request), metadata=metadata, timeout=timeout, **kw)
    if method == "Get":
        fn = channel.unary_stream(SERVICE + "Get", cache_pb2.GetRequest.SerializeToString, None)
        return list(fn(request, metadata=metadata, timeout=timeout, **kw))
    response = getattr(cache_pb2, f"{method}Response")
    fn = channel.unary_unary(SERVICE + method, type(request).SerializeToString, response.FromString)
    return fn(request, metadata=metadata, timeout=timeout, **kw)


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code()


def puts(prompt=PROMPT, keys=None) -> list[bytes]:
    """Put messages for a prompt's chunks (under other keys, if given)."""
    frames = [codec.encode(c.view_as(k)) for c, k in zip(prompt.chunks(), keys or prompt.keys, strict=True)]
    return [pack(piece(k, len(f), data=[f])) for k, f in zip(keys or prompt.keys, frames, strict=True)]


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


def two_tenant_server(**settings):
    """A server for tenants alice and bob (memory tier only); returns it and its address."""
    tokens = (("alice-secret", "alice"), ("bob-secret", "bob"))
    settings = {"tiers": ("cpu://?size=16MiB&slot=64KiB",), "shm_dir": "", **settings}
    config = ServerConfig(port=0, tokens=tokens, **settings)
    srv, port = create_server(config)
    return srv, f"127.0.0.1:{port}"


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


# -- limits on one client's calls ----------------------------------------------------------------
class HeldPuts:
    """Put streams that stay open (their request iterators wait) until ``release``."""

    def __init__(self, channel: grpc.Channel, token: str, n: int) -> None:
        self.gate = threading.Event()
        fn = channel.stream_unary(SERVICE + "Put", None, cache_pb2.PutResponse.FromString)
        self.futures = [
            fn.future(self._wait(), metadata=(("authorization", f"Bearer {token}"),), timeout=60) for _ in range(n)
        ]

    def _wait(self):
        self.gate.wait(60)
        yield from ()

    def release(self) -> list:
        self.gate.set()
        return [f.result(timeout=60) for f in self.futures]


def connection(address: str) -> grpc.Channel:
    """A channel with its own connection (channels in one process share them by default)."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def test_a_tenant_past_its_call_limit_is_refused_and_others_are_served(monkeypatch):
    srv, address = two_tenant_server(workers=8, max_calls_per_tenant=2)
    alice = tenant_tag("alice")
    channels = [connection(address) for _ in range(3)]  # one client, many connections
    lookup = cache_pb2.LookupRequest(keys=PROMPT.keys)
    try:
        held = [HeldPuts(channels[0], "alice-secret", 1), HeldPuts(channels[1], "alice-secret", 1)]
        assert eventually(lambda: srv.service.calls_in_flight(alice) == 2)
        with pytest.raises(grpc.RpcError) as refused:
            call(channels[2], "Lookup", lookup, token="alice-secret")
        assert refused.value.code() == S.RESOURCE_EXHAUSTED and "max_calls_per_tenant" in refused.value.details()
        assert call(channels[2], "Lookup", lookup, token="bob-secret").hits == 0  # Bob is served
        # The tier raises a refusal as retryable; the store the engine calls retries it
        # with backoff, then misses, never an error.
        monkeypatch.setenv("LMTIER_TOKEN", "alice-secret")
        tier = open_tier(f"grpc://{address}?retries=1&shm=off")
        with pytest.raises(RetryableError, match="RESOURCE_EXHAUSTED"):
            tier.contains(PROMPT.keys)
        store = TieredStore([tier])
        retried = metrics.TIER_OPS.labels(tier.name, "contains", "retried")
        before = retried._value.get()
        assert store.lookup(PROMPT.keys) == 0
        assert retried._value.get() == before + 1
        for h in held:
            assert [r.stored for r in h.release()] == [0]
        assert eventually(lambda: srv.service.calls_in_flight(alice) == 0)
        store.put(PROMPT.chunks())
        assert store.lookup(PROMPT.keys) == 3  # served again once the calls ended
        store.close()
    finally:
        for c in channels:
            c.close()
        srv.stop(0)


def test_streams_past_a_connections_limit_wait_their_turn(monkeypatch):
    srv, address = two_tenant_server(workers=8, max_calls_per_tenant=6, max_streams_per_connection=2)
    alice = tenant_tag("alice")
    one, other = connection(address), connection(address)
    try:
        held = HeldPuts(one, "alice-secret", 3)
        assert eventually(lambda: srv.service.calls_in_flight(alice) == 2)
        # A call on another connection gets through; the third stream is still queued.
        assert call(other, "Lookup", cache_pb2.LookupRequest(keys=PROMPT.keys), token="alice-secret").hits == 0
        assert srv.service.calls_in_flight(alice) == 2
        assert not held.futures[2].done()
        assert [r.stored for r in held.release()] == [0, 0, 0]  # then all three are served
    finally:
        one.close()
        other.close()
        srv.stop(0)


def test_message_frame_and_key_limits_refuse_what_is_over_them():
    srv, address = two_tenant_server(workers=8, max_message_bytes=1 << 20, max_chunk_bytes=256 << 10, max_keys=8)
    channel = connection(address)
    key, frame = PROMPT.keys[0], codec.encode(PROMPT.chunks()[0])
    keys = [PROMPT.keys[0]] * 9
    try:
        # Half a frame, then a message over the limit: the call fails, the half frame's buffer
        # goes back to the pool. (Whole frames that arrived before the failure may be stored,
        # each verified: gRPC can end a failed call's stream as if it were complete.)
        half = len(frame) // 2
        big = [pack(piece(key, len(frame), data=[frame[:half]])), b"\x0a" + b"\x00" * (1536 << 10)]
        assert code_of(lambda: call(channel, "Put", big, "alice-secret")) == S.RESOURCE_EXHAUSTED  # a message
        huge = [pack(piece(key, 300 << 10, data=[frame]))]
        assert code_of(lambda: call(channel, "Put", huge, "alice-secret")) == S.RESOURCE_EXHAUSTED  # a frame
        for method, request in (("Lookup", cache_pb2.LookupRequest), ("Get", cache_pb2.GetRequest)):
            over = request(keys=keys)  # a Get's stream is as long as its keys: bounded by max_keys
            assert code_of(lambda m=method, r=over: call(channel, m, r, "alice-secret")) == S.INVALID_ARGUMENT
        assert call(channel, "Lookup", cache_pb2.LookupRequest(keys=keys[:8]), "alice-secret").hits == 0
        assert srv.service.buffers.outstanding == 0
    finally:
        channel.close()
        srv.stop(0)


# -- paths that input cannot steer ---------------------------------------------------------------
def test_shared_memory_names_from_a_request_never_reach_outside_the_directory(tmp_path):
    shm_dir, outside = tmp_path / "shm", tmp_path / "outside"
    shm_dir.mkdir()
    outside.write_bytes(b"\x00" * 65536)
    decoy = "lmtier-" + "a" * 32
    (shm_dir / decoy).symlink_to(outside)  # a name of the right shape, pointing away
    linked = "lmtier-" + "b" * 32
    os.link(outside, shm_dir / linked)  # a second name for a file that lives elsewhere
    good = "lmtier-" + "c" * 32
    (shm_dir / good).write_bytes(b"\x00" * 65536)  # a real segment, to show the path works
    # One tenant (a server with several maps no client memory), its memory tier private:
    # the server writes what a Get serves into the regions the client names.
    tokens = (("alice-secret", "alice"),)
    config = ServerConfig(port=0, tiers=("cpu://?size=16MiB&slot=64KiB",), shm_dir=str(shm_dir), tokens=tokens)
    srv, port = create_server(config, TieredStore([open_tier("cpu://?size=16MiB&slot=64KiB")]))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    key, frame = PROMPT.keys[0], codec.encode(PROMPT.chunks()[0])
    assert call(channel, "Put", [pack(piece(key, len(frame), data=[frame]))], "alice-secret").stored == 1

    def get(name: str):
        landing = cache_pb2.SharedRegion(segment=name, length=65536)
        return call(channel, "Get", cache_pb2.GetRequest(keys=[key], landing=[landing]), "alice-secret")

    try:
        assert len(get(good)) == 1 and (shm_dir / good).read_bytes()[: len(frame)] == frame
        names = [decoy, linked, "../outside", str(outside), "..", "lmtier-" + "a" * 31 + "/", "lmtier-" + "A" * 32]
        for name in names:
            assert code_of(lambda n=name: get(n)) in (S.INVALID_ARGUMENT, S.FAILED_PRECONDITION), name
            put = [pack(piece(key, len(frame), region=Region(name, 0, len(frame))))]
            refused = code_of(lambda p=put: call(channel, "Put", p, "alice-secret"))
            assert refused in (S.INVALID_ARGUMENT, S.FAILED_PRECONDITION), name
        assert outside.read_bytes() == b"\x00" * 65536  # nothing was written through any name
    finally:
        channel.close()
        srv.stop(0)


def test_disk_file_names_never_come_from_keys(tmp_path):
    """Keys are bytes inside segment files and the index; no key, however odd, names or
    reaches a file, in the tier's directory or outside it."""
    tier = open_tier(f"file://{tmp_path / 'disk'}?size=16MiB")
    odd = [b"../../../../etc/passwd\x00" + b"\xff" * 9, b"/" * 32, b"\x00" * 16, b"..\\..\\" + b"." * 10]
    chunks = [c.view_as(k) for c, k in zip(PROMPT.chunks() + PROMPT.chunks()[:1], odd, strict=True)]
    tier.put(chunks)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert all(p.resolve().is_relative_to((tmp_path / "disk").resolve()) for p in files)
    assert not any(k.hex() in p.name or "passwd" in p.name for p in files for k in odd)
    got = tier.get(odd)
    assert [c.tobytes() for c in got] == [PROMPT.chunk_bytes(i) for i in (0, 1, 2, 0)]
    release_all(got)
    tier.close()


# -- no pickle ------------------------------------------------------------------------------------
PICKLING_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "shelve", "marshal", "joblib", "copyreg"}
PICKLING_CALLS = {"torch.load", "torch.save", "np.load", "numpy.load", "load", "save"}
PICKLING_NAMES = {"Queue", "SimpleQueue", "Pipe", "Manager", "Pool"}  # from multiprocessing: pickles


def pickle_uses(paths: list[Path]) -> list[str]:
    """Every import of a pickle-based serializer, call that (un)pickles, or
    multiprocessing channel (they pickle what they carry) in ``paths``."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names if a.name.split(".")[0] in PICKLING_MODULES]
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                names = [module] if module.split(".")[0] in PICKLING_MODULES else []
                if module.endswith("multiprocessing"):
                    names += [a.name for a in node.names if a.name in PICKLING_NAMES]
                if module in ("torch", "numpy"):
                    names += [f"{module}.{a.name}" for a in node.names if a.name in ("load", "save")]
            elif isinstance(node, ast.Call):
                func = ast.unparse(node.func)
                last = func.rsplit(".", 1)[-1]
                names = [func] if func in PICKLING_CALLS - {"load", "save"} else []
                if "multiprocessing" in func and last in PICKLING_NAMES:
                    names.append(func)
            else:
                continue
            found += [f"{path.relative_to(path.parents[1])}:{node.lineno}: {n}" for n in names]
    return found


def test_no_module_that_ships_pickles():
    """Bytes that lmtier stores or sends are frames, msgpack or protobuf."""
    sources = sorted(p for d in ("lmtier", "connectors", "benchmarks") for p in (ROOT / d).rglob("*.py"))
    assert len(sources) > 30
    assert pickle_uses(sources) == []


def test_the_pickle_scan_finds_each_kind_of_use(tmp_path):
    bad = tmp_path / "pkg" / "bad.py"
    bad.parent.mkdir()
    bad.write_text(
        "import pickle\nimport dill.settings\nfrom torch import load\nfrom multiprocessing import Queue\n"
        "import torch, numpy as np, multiprocessing\ntorch.load('x')\nnp.load('y', allow_pickle=True)\n"
        "multiprocessing.Pipe()\n"
    )
    assert [f.split(": ")[1] for f in pickle_uses([bad])] == [
        "pickle", "dill", "torch.load", "Queue", "torch.load", "np.load", "multiprocessing.Pipe",
    ]  # fmt: skip


def test_what_a_tier_writes_is_an_lmtier_frame_not_a_pickle(tmp_path):
    """On disk (and so in Redis and the server, which hold the same frames) every chunk is
    a checksummed frame whose header is msgpack."""
    tier = open_tier(f"file://{tmp_path}?size=16MiB")
    tier.put(PROMPT.chunks())
    tier.close()
    frames = disk_frames(tmp_path)
    assert len(frames) == 3
    for path, offset, length in frames.values():
        data = Path(path).read_bytes()[offset : offset + length]
        assert data.startswith(codec.MAGIC)  # a pickle starts with b"\x80" and its protocol
        assert codec.decode(data).key in PROMPT.keys


def test_no_output_surface_shows_a_planted_secret(tmp_path):
    """A password and a token in tier URLs, a token on the command line: none of them in
    the Stats RPC, `lmtier stats` (table, JSON, errors), the server's log, /metrics, or a
    configuration error."""
    import re
    import subprocess
    import sys
    import urllib.request

    from lmtier.errors import ConfigError
    from lmtier.testing.cache_server import ServerProcess
    from lmtier.testing.redis_server import free_port

    secret = "planted-" + os.urandom(8).hex()
    tiers = [
        "cpu://?size=32MiB&slot=64KiB",
        f"redis://:{secret}@127.0.0.1:{free_port()}?timeout=0.2&connect_timeout=0.2",
        f"grpc://127.0.0.1:{free_port()}?token={secret}&timeout=0.5&retries=0",
    ]
    args = [a for url in tiers for a in ("--tier", url)]
    server = ServerProcess(tmp_path, *args, "--token", "fleet=fleet", "--metrics-port", "0", start=False)
    server.start(ready=False)  # its lower tiers cannot answer: alive, not ready
    try:
        shown = []
        for extra in ([], ["--json"]):
            run = subprocess.run(
                [sys.executable, "-m", "lmtier", "stats", "--server", f"grpc://{server.address}?token=fleet", *extra],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert run.returncode == 0, run.stderr
            assert "redis://:***@127.0.0.1" in run.stdout and "token=***" in run.stdout
            shown += [run.stdout, run.stderr]
        wrong = subprocess.run(
            [sys.executable, "-m", "lmtier", "stats", "--server", f"http://{server.address}?token={secret}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert wrong.returncode != 0
        shown += [wrong.stdout, wrong.stderr]
        found = re.search(r"metrics on (http://\S+/metrics)", server.log())
        assert found, server.log()
        shown.append(urllib.request.urlopen(found[1], timeout=10).read().decode())
        for url in (f"{tiers[1]}&bogus=1", f"{tiers[2]}&token=again"):
            with pytest.raises(ConfigError) as info:
                open_tier(url)
            shown.append(str(info.value))
        bad = subprocess.run(
            [sys.executable, "-m", "lmtier", "serve", "--port", "0", "--tier", f"{tiers[1]}&bogus=1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode != 0 and "bogus" in bad.stderr
        shown += [bad.stdout, bad.stderr]
    finally:
        server.stop()
    shown.append(server.log())
    leaks = [text[max(0, text.find(secret) - 200) :][:400] for text in shown if secret in text]
    assert not leaks, leaks


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

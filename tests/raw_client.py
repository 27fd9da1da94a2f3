"""A raw gRPC client of the cache service, written from the ``.proto`` (not lmtier's own
client), and a server for two tenants (alice and bob) to call: what the security tests
(test_security_*.py) and the availability tests (test_availability_*.py) share."""

from __future__ import annotations

import grpc
import pytest

from lmtier.config import ServerConfig
from lmtier.kv import codec
from lmtier.server import create_server
from lmtier.transport.pieces import pack, piece
from lmtier.v1 import cache_pb2

from conftest import make_prompt

SERVICE = "/lmtier.v1.CacheService/"
S = grpc.StatusCode
PROMPT = make_prompt(3, seed=77)


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


def two_tenant_server(**settings):
    """A server for tenants alice and bob (memory tier only); returns it and its address."""
    tokens = (("alice-secret", "alice"), ("bob-secret", "bob"))
    settings = {"tiers": ("cpu://?size=16MiB&slot=64KiB",), "shm_dir": "", **settings}
    config = ServerConfig(port=0, tokens=tokens, **settings)
    srv, port = create_server(config)
    return srv, f"127.0.0.1:{port}"


def connection(address: str) -> grpc.Channel:
    """A channel with its own connection (channels in one process share them by default)."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])

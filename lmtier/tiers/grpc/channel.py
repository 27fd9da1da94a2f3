"""The grpc tier's connection to the cache server, and what its failures mean.

    Channel(target, credentials, server_name)   one process's channel and its method
                                                callables: lookup, get, put, delete, list,
                                                stats, release, directory; close()
    credentials(tls, tier) -> credentials|None  TLS (or mutual TLS) from the URL's files
    failure(exc) -> TierError                   a failed call as lmtier's typed error:
                                                ``RetryableError`` when trying again may work
    is_local(target) -> bool                    a loopback address: shared memory may work

Bulk methods (``Get``'s answers, ``Put``'s requests) carry raw ``Pieces`` bytes
(``lmtier.transport.pieces``); every other message goes through the generated classes.
"""

from __future__ import annotations

import ipaddress

import grpc

from lmtier.errors import RetryableError, TierError
from lmtier.tiers.options import TlsFiles
from lmtier.v1 import cache_pb2

SERVICE = "/lmtier.v1.CacheService/"
MAX_MESSAGE = 80 * 1024 * 1024
# Failures that a later try may not meet: a server restarting or unreachable, one at its
# call limit, a call that lost a race, a deadline that passed (a server too busy to answer).
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)


class Channel:
    """One process's channel and its method callables."""

    def __init__(self, target: str, credentials: grpc.ChannelCredentials | None, server_name: str = "") -> None:
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
            # Reconnect soon after a server restart (the defaults back off to 2 minutes).
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
            ("grpc.enable_retries", 0),  # the store retries, with the tier's deadlines
        ]
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        if credentials is not None:
            self.channel = grpc.secure_channel(target, credentials, options=options)
        else:
            self.channel = grpc.insecure_channel(target, options=options)
        self.lookup = self._unary("Lookup", cache_pb2.LookupRequest, cache_pb2.LookupResponse)
        self.get = self.channel.unary_stream(SERVICE + "Get", cache_pb2.GetRequest.SerializeToString, None)
        self.put = self.channel.stream_unary(SERVICE + "Put", None, cache_pb2.PutResponse.FromString)
        self.delete = self._unary("Delete", cache_pb2.DeleteRequest, cache_pb2.DeleteResponse)
        self.list = self._unary("List", cache_pb2.ListRequest, cache_pb2.ListResponse)
        self.stats = self._unary("Stats", cache_pb2.StatsRequest, cache_pb2.StatsResponse)
        self.release = self._unary("Release", cache_pb2.ReleaseRequest, cache_pb2.ReleaseResponse)
        self.match = self._unary("Match", cache_pb2.MatchRequest, cache_pb2.MatchResponse)
        self.directory = self._unary("Directory", cache_pb2.DirectoryRequest, cache_pb2.DirectoryResponse)
        self.open_data = self._unary("OpenData", cache_pb2.OpenDataRequest, cache_pb2.OpenDataResponse)

    def _unary(self, method: str, request: type, response: type) -> grpc.UnaryUnaryMultiCallable:
        return self.channel.unary_unary(SERVICE + method, request.SerializeToString, response.FromString)

    def close(self) -> None:
        self.channel.close()


def credentials(tls: TlsFiles, tier: str) -> grpc.ChannelCredentials | None:
    """The channel's TLS credentials, None for plaintext; a file that cannot be read is a
    ``ConfigError`` now, not a server that seems down later."""
    if not tls.wanted:
        return None
    ca, key, chain = tls.read(tier)
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=chain)


def failure(exc: grpc.RpcError) -> TierError:
    """``exc`` as a typed error (``CODE: details``); the caller raises it ``from exc``."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    kind = RetryableError if code in RETRYABLE else TierError
    return kind(f"{getattr(code, 'name', code)}: {details}")


def is_local(target: str) -> bool:
    host = target.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

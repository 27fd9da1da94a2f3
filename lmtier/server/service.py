"""``CacheService``: the server side of protos/lmtier/v1/cache.proto, over a TieredStore.

    Lookup  leading hits of a key list          Get   the leading run, frame by frame
    Put     frames in, stored when whole        Delete, List, Stats
    Match   for routers: the leading tokens of a prompt held, from token ids and the
            engine's namespace digests (the server computes the keys)
    Directory  one tenant, same host: where the memory tier's chunks are published, for
            reads with no call (``published``); the chunks read so are counted as used
    OpenData   another host: a ticket for the bulk data channel (``data``), the caller's
            tenant's, for loads without gRPC's per-message costs

Every call first parses its request, resolves the caller's tenant (``auth``) and is
admitted (``max_calls_per_tenant``; ``calls``); it scopes its keys to the tenant,
checks its input and answers a clear status for anything wrong (``INVALID_ARGUMENT`` for a
malformed message or key, ``RESOURCE_EXHAUSTED`` for a frame over the limit, ``DATA_LOSS``
for a damaged one, ``FAILED_PRECONDITION`` for a shared-memory segment not on this host).

Bulk bytes skip protobuf (``lmtier.transport.pieces``): ``Put`` receives raw ``ChunkPiece`` bytes and
``Get`` sends them. A frame is checked as it is stored (``codec.decode``, then the first
tier hashes the payload while copying it in) and as it is served (the chunk is verified
while it is encoded), so the server never keeps or hands out a damaged chunk.

The methods are one object, whose state (the store, the client segments it maps, the
memory tier it lends and lands saves in, its buffers and budgets) they all use, written
by family, one module each of ``lmtier.server.methods``; this one builds that state and
registers the methods:

    methods.reads     Lookup, Get (through shared memory or as bytes), Release, Directory
    methods.saves     Put: frames received, or landed in place from a client's slot
    methods.control   Delete, List, Stats, Match, OpenData
    methods.checks    the input checks they share: a tenant's keys, a client's segment

(Other hosts' loads and saves also go through the bulk data channel, ``lmtier.server.data``.)
"""

from __future__ import annotations

import json
import threading

import grpc

from lmtier._moved import forward
from lmtier.buffers import BufferPool
from lmtier.config.loading import public_view
from lmtier.config.schema import Config, ServerConfig
from lmtier.server.auth import Authenticator, tenant_tag
from lmtier.server.budget import RECEIVING_CHUNKS, ReceiveBudget
from lmtier.server.calls import Calls, Gate
from lmtier.server.leases import Leases
from lmtier.server.methods.checks import KEY_LENGTHS
from lmtier.server.methods.control import ControlMethods
from lmtier.server.methods.reads import ReadMethods
from lmtier.server.methods.saves import SaveMethods
from lmtier.server.published import Published
from lmtier.server.watchdog import Watchdog
from lmtier.store.tiered import TieredStore
from lmtier.tiers.cpu.tier import CpuTier
from lmtier.transport.shm.access import SegmentFiles
from lmtier.v1 import cache_pb2

SERVICE = "lmtier.v1.CacheService"


class CacheService(ReadMethods, SaveMethods, ControlMethods):
    """The cache service: builds the state its methods (one family per base class) share,
    and registers them with gRPC (``handler``)."""

    def __init__(self, store: TieredStore, config: ServerConfig, auth: Authenticator) -> None:
        view = public_view(Config(server=config))["server"]
        self._config_json = json.dumps(view, sort_keys=True)
        # a tenant's view: no other tenant's name, no operator's
        self._tenant_config_json = json.dumps(
            {**view, "tokens": [], "peer_tokens": [], "operators": []}, sort_keys=True
        )
        self._operators = {tenant_tag(t) for t in config.operators}
        self._stats: dict[bytes, tuple[float, cache_pb2.StatsResponse]] = {}
        self._stats_lock = threading.Lock()
        self.store = store
        self.config = config
        self.auth = auth
        # Requests name client segments, and every process on the host can see those names:
        # a server with several tenants cannot tell whose a segment is, so it maps none (one
        # tenant could otherwise have it read another's segment or write into its slots).
        self.maps = SegmentFiles(config.shm_dir) if config.shm_dir and auth.single_tenant else None
        self._no_shm = (
            "this server has shared memory turned off"
            if not config.shm_dir
            else "shared memory is refused on a server with several tenants"
        )
        self.buffers = BufferPool(max_free=32, max_free_bytes=128 << 20)
        receiving = RECEIVING_CHUNKS * config.max_chunk_bytes
        self.receiving = ReceiveBudget(receiving, receiving if auth.single_tenant else receiving // 2)
        first = store.tiers[0]
        self.shared = first if first.capabilities.shared_memory else None  # zero-copy reads
        # Saves through shared memory are read straight into the memory tier's slots.
        self.landing = first if isinstance(first, CpuTier) and self.maps is not None else None
        self.leases = Leases(first.capacity // 4, config.shm_dir, ttl=config.call_timeout)
        # One tenant, clients on this host: what the memory tier holds, published for reads
        # with no call (lmtier.transport.directory).
        self.published: Published | None = None
        tenant = auth.only_tenant
        if self.maps is not None and self.shared is not None and tenant is not None and hasattr(first, "set_publisher"):
            self.published = Published(first, config.shm_dir, tenant_tag(tenant), KEY_LENGTHS, config.probe_interval)
        limit = config.calls_per_tenant(auth.single_tenant)
        self.watchdog = Watchdog(config.stall_timeout, config.call_timeout)
        self.calls = Calls(auth, limit, config.workers, self.watchdog, rate=config.max_call_rate_per_tenant)
        self.data = None  # the bulk data channel (lmtier.server.data), where the server runs one

    # -- registration -------------------------------------------------------------------
    def handler(self) -> grpc.GenericRpcHandler:
        """Every method takes its request as bytes and parses it itself (gRPC's own
        deserializer would answer a malformed request with INTERNAL, not INVALID_ARGUMENT),
        and is registered as request-streaming (see ``calls``). Credentials are checked
        when the call's headers arrive (``Gate``), before a worker or a byte of memory."""

        def unary(fn, response_type, request_type=None, admit=True):
            return grpc.stream_unary_rpc_method_handler(
                self.calls.unary(fn.__name__, fn, request_type, admit),
                response_serializer=response_type.SerializeToString,
            )

        methods = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Lookup": unary(self.Lookup, cache_pb2.LookupResponse, cache_pb2.LookupRequest),
                # ChunkPiece bytes from lmtier.transport.pieces, both ways
                "Get": grpc.stream_stream_rpc_method_handler(self.calls.stream("Get", self.Get, cache_pb2.GetRequest)),
                "Put": grpc.stream_unary_rpc_method_handler(
                    self.calls.uploads("Put", self.Put), response_serializer=cache_pb2.PutResponse.SerializeToString
                ),
                "Delete": unary(self.Delete, cache_pb2.DeleteResponse, cache_pb2.DeleteRequest),
                "List": unary(self.List, cache_pb2.ListResponse, cache_pb2.ListRequest),
                # Release frees memory: never refused for being one call too many.
                "Release": unary(self.Release, cache_pb2.ReleaseResponse, cache_pb2.ReleaseRequest, admit=False),
                "Stats": unary(self.Stats, cache_pb2.StatsResponse, cache_pb2.StatsRequest),
                "Match": unary(self.Match, cache_pb2.MatchResponse, cache_pb2.MatchRequest),
                "Directory": unary(self.Directory, cache_pb2.DirectoryResponse, cache_pb2.DirectoryRequest),
                "OpenData": unary(self.OpenData, cache_pb2.OpenDataResponse, cache_pb2.OpenDataRequest),
            },
        )
        return Gate(methods, self.auth)

    def calls_in_flight(self, tag: bytes) -> int:
        return self.calls.in_flight(tag)


__getattr__ = forward(__name__)  # names of the previous release, found where they live now (CHANGELOG.md)

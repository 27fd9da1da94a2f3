"""``lmtier serve``: the cache service, health, reflection, readiness and metrics, wired up.

    create_server(config) -> (CacheServer, port)    built and started, not blocking
    serve(config)                                   runs until SIGTERM / SIGINT

Readiness is earned, not assumed: a probe thread has every tier prove it answers
(``Tier.probe``: a small chunk's round trip, or a check that evicts nothing where a round
trip would evict), every ``probe_interval`` seconds. The gRPC health
service (``grpc.health.v1``, for Kubernetes ``grpc`` probes) and ``/readyz`` on the
metrics port (for ``httpGet`` probes) both answer from it; ``/healthz`` only says the
process is alive. The same thread sweeps the shared-memory segments of clients that died.

Shutdown drains: readiness drops first (load balancers stop sending), in-flight calls get
``grace`` seconds, then the store flushes its background writes and closes its tiers.
"""

from __future__ import annotations

import faulthandler
import hmac
import logging
import os
import signal
import threading
from concurrent import futures
from http.server import ThreadingHTTPServer
from pathlib import Path

import grpc

from lmtier import metrics
from lmtier.config.schema import ServerConfig
from lmtier.config.tokens import warn_weak_tokens
from lmtier.server.auth import PROBE_TAG, TAG_BYTES, Authenticator, tenant_tag
from lmtier.server.calls import Gate
from lmtier.server.chain import UpstreamTier
from lmtier.server.data.channel import DataChannel
from lmtier.server.health import NOT_SERVING, SERVICE_NAME, SERVING, Health
from lmtier.server.metricsport import MetricsHTTPServer, metrics_handler
from lmtier.server.service import SERVICE, CacheService
from lmtier.store.tiered import TieredStore
from lmtier.tiers.base import Tier, TierContext
from lmtier.transport.shm.segment import sweep

log = logging.getLogger(__name__)

SWEEP_EVERY_S = 30.0
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class CacheServer:
    """A running server: ``port``, ``ready``, ``stop()``, ``wait()``."""

    def __init__(self, config: ServerConfig, store: TieredStore | None = None) -> None:
        self.config = config
        self.auth = Authenticator(config.tokens, mutual_tls=bool(config.tls_client_ca), identity=config.tls_identity,
                                  peer_tokens=config.peer_tokens)  # fmt: skip
        # Same-host clients may read chunks straight from the memory tier (no copy on the
        # server) only when every caller is one tenant: they could map all of that memory.
        self.zero_copy = bool(config.shm_dir) and self.auth.single_tenant
        # Lower tiers that cannot be opened yet are opened later; the first is what it serves from.
        shares = 0 if self.auth.single_tenant else TAG_BYTES  # every tier: a fair share each
        self.store = store or TieredStore.open(
            config.tiers,
            defer="lower",
            context=TierContext(tenant_prefix=shares),
            first=TierContext(shared_dir=config.shm_dir if self.zero_copy else "", tenant_prefix=shares),
            wrap=_upstream,
            write_queue=config.write_queue,
        )
        try:
            self._build(config)
        except BaseException:
            service = getattr(self, "service", None)
            if service is not None and service.published is not None:
                service.published.close()
            if store is None:  # what this server made (a shared-memory slab) must not outlive it
                self.store.close()
            raise

    def _build(self, config: ServerConfig) -> None:
        self.service = CacheService(self.store, config, self.auth)
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_concurrent_streams", config.max_streams_per_connection),
            ("grpc.max_connection_idle_ms", int(config.connection_idle * 1000)),
            ("grpc.max_connection_age_ms", int(config.connection_age * 1000)),
            ("grpc.max_connection_age_grace_ms", int(config.call_timeout * 1000)),
            # a flood of connections takes no descriptor the server needs for itself
            ("grpc.max_allowed_incoming_connections", connection_limit(config.max_connections)),
            ("grpc.server_handshake_timeout_ms", int(config.handshake_timeout * 1000)),
            # gRPC sets SO_REUSEPORT by default: a second server on a taken port would then
            # start, and the kernel would split connections between the two. Refuse instead.
            ("grpc.so_reuseport", 0),
        ]
        self.grpc = grpc.server(
            futures.ThreadPoolExecutor(config.workers, thread_name_prefix="lmtier-rpc"),
            options=options,
            maximum_concurrent_rpcs=config.max_concurrent_rpcs,
        )
        self.grpc.add_generic_rpc_handlers((self.service.handler(),))
        quarter = max(1, config.workers // 4)
        self.health = Health(max_watchers=quarter, max_waiting=quarter, watchdog=self.service.watchdog)
        self.grpc.add_generic_rpc_handlers((self.health.handler(),))
        _enable_reflection(self.grpc, self.service)
        address = f"{config.host}:{config.port}"
        credentials = None
        if config.tls_cert:
            credentials = grpc.ssl_server_credentials(
                [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())],
                root_certificates=Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None,
                require_client_auth=bool(config.tls_client_ca),
            )
        if config.port:
            _check_free(config.host, config.port)
        try:
            self.port = (
                self.grpc.add_secure_port(address, credentials)
                if config.tls_cert
                else self.grpc.add_insecure_port(address)
            )
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise OSError(f"cannot listen on {address}: the port is taken or the address is not this host's")
        try:
            self.service.data = DataChannel.open(self.service, config, self.port)
        except OSError:
            self.grpc.stop(None)
            raise
        self.ready = False
        self.stopping = threading.Event()
        self.stopped = threading.Event()
        self._http: ThreadingHTTPServer | None = None
        self.metrics_port: int | None = None
        self.metrics_host = config.metrics_host or config.host
        self._prober = threading.Thread(target=self._probe_loop, name="lmtier-probe", daemon=True)
        self.peer_index = None
        if config.peer_index:
            from lmtier.server.peers import IndexPublisher

            advertise = os.path.expandvars(config.advertise)
            tenants = frozenset(tenant_tag(t) for _, t in config.peer_tokens) if config.peer_tokens else None
            self.peer_index = IndexPublisher(
                self.store, config.peer_index, advertise, config.peer_index_ttl, tenants=tenants
            )

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> CacheServer:
        warn_weak_tokens(self.config.tokens)
        port, explicit = self._metrics_port()
        if port is not None:  # before anything runs: a taken port (asked for) stops the start cleanly
            try:
                self._http = MetricsHTTPServer((self.metrics_host, port), metrics_handler(self))
            except OSError as exc:
                where = f"{self.metrics_host}:{port}"
                if not explicit and not self.config.metrics_token:  # the default: runs on without /metrics
                    log.warning("no /metrics on %s (%s): set metrics_port to choose its port", where, exc)
                else:
                    self.grpc.stop(None)
                    self.service.watchdog.stop()
                    if self.service.data is not None:
                        self.service.data.stop()
                    if self.service.published is not None:
                        self.service.published.close()
                    self.store.close()
                    why = "" if explicit else " (the default port: with metrics_token set, whoever holds it gets it)"
                    raise OSError(f"cannot serve metrics on {where}{why}: {exc}") from exc
            if self._http is not None:
                self.metrics_port = self._http.server_address[1]
        if self.config.shm_dir:  # segments of servers and clients that died (kill -9) since
            sweep(self.config.shm_dir)
        self.store.warm()  # the memory tier's slab mapped, its first pages faulted in
        self._set_ready(self.probe())
        self.grpc.start()
        if self.service.data is not None:
            self.service.data.start()
        if self._http is not None:
            threading.Thread(target=self._http.serve_forever, name="lmtier-metrics", daemon=True).start()
        self._prober.start()
        if self.peer_index is not None:
            self.peer_index.start()
        log.info(
            "lmtier cache server on %s:%d (%s, tiers: %s; data channel: %s)",
            self.config.host,
            self.port,
            "TLS" if self.config.tls_cert else "plaintext",
            ", ".join(t.name for t in self.store.tiers),
            f"port {self.service.data.port}" if self.service.data is not None else "off",
        )
        watched = self._http is not None and self.metrics_host not in LOOPBACK
        if watched and not self.config.metrics_token and not self.auth.single_tenant:
            log.warning("/metrics on %s sums every tenant's traffic for anyone who reaches it: set metrics_token "
                        "(LMTIER_SERVER_METRICS_TOKEN) or metrics_host=127.0.0.1", self.metrics_host)  # fmt: skip
        if self.auth.open and self.config.host not in LOOPBACK:
            log.warning("no tokens and no mutual TLS: any client that reaches %s may use the cache", self.config.host)
        return self

    def _metrics_port(self) -> tuple[int | None, bool]:
        """Where /metrics goes, and whether that port was asked for: ``metrics_port``, else
        the gRPC port + 2 when a port was given (not 0) and the counters are one tenant's or
        guarded by ``metrics_token``."""
        config = self.config
        if config.metrics_port is not None:
            return config.metrics_port, True
        if not config.metrics or not config.port:
            return None, False
        if not (self.auth.single_tenant or config.metrics_token):
            log.info("no /metrics by default: the server is shared by tenants; set metrics_token to serve them")
            return None, False
        return self.port + 2, False

    def stop(self, grace: float | None = None) -> None:
        """Stop taking calls, let in-flight ones finish, flush and close the store."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        self._set_ready(False)
        if self.peer_index is not None:  # drained first: peers stop choosing it while it finishes
            self.peer_index.stop(drain=True)
        grace = self.config.grace if grace is None else grace
        self.grpc.stop(grace).wait(grace + 5)
        if self.service.data is not None:
            self.service.data.stop()
        self.service.watchdog.stop()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        self.service.leases.reap(everything=True)
        if self.service.published is not None:
            self.service.published.close()
        self.store.close(timeout=max(grace, 1.0))
        if self.service.maps is not None:
            self.service.maps.clear()
        self.stopped.set()

    def wait(self) -> None:
        """Until ``stop`` has finished (queued writes flushed, tiers closed)."""
        self.stopped.wait()

    def metrics_allowed(self, authorization: str) -> bool:
        """Whether a /metrics request may read the counters (``metrics_token``, if set)."""
        want = self.config.metrics_token
        return not want or hmac.compare_digest(authorization.encode(), f"Bearer {want}".encode())

    # -- readiness ----------------------------------------------------------------------
    def probe(self) -> bool:
        """True if every tier answers its probe (``Tier.probe``: a small chunk's round trip,
        or a check that evicts nothing where a round trip would)."""
        for tier in self.store.tiers:
            try:  # a transient failure is retried as the store would
                tier.backoff.call(tier.probe, PROBE_TAG + os.urandom(16))
            except Exception as exc:
                log.warning("readiness probe: tier %s failed: %s", tier.name, exc)
                return False
        return True

    def _set_ready(self, ready: bool) -> None:
        ready = ready and not self.stopping.is_set()
        if ready != self.ready:
            log.info("readiness: %s", "ready" if ready else "not ready")
        self.ready = ready
        status = SERVING if ready else NOT_SERVING
        self.health.set("", status)
        self.health.set(SERVICE, status)
        metrics.SERVER_READY.set(1 if ready else 0)

    def _probe_loop(self) -> None:
        swept_at = 0.0
        clock = 0.0
        while not self.stopping.wait(self.config.probe_interval):
            clock += self.config.probe_interval
            try:
                self.service.leases.reap()
                if self.service.published is not None:
                    self.service.published.beat()
                self._set_ready(self.probe())
                for stats in self.store.stats()["tiers"]:
                    if "used_bytes" in stats:
                        metrics.TIER_USED_BYTES.labels(stats["tier"]).set(stats["used_bytes"])
                if self.config.shm_dir and clock - swept_at >= SWEEP_EVERY_S:
                    swept_at = clock
                    sweep(self.config.shm_dir)
                    if self.service.maps is not None:  # a swept segment's memory comes back now
                        self.service.maps.prune()
            except Exception:  # the prober must outlive anything
                log.exception("readiness probe failed")
                self._set_ready(False)


FD_RESERVE = 256  # descriptors kept for the tiers, probes, metrics and shared-memory segments


def connection_limit(wanted: int) -> int:
    """``wanted`` connections, held below what the process may open: the soft file limit is
    raised to the hard one first (containers often start at 1,024 of 1,048,576), and
    ``FD_RESERVE`` descriptors are kept for the server's own use."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    room = max(16, soft - FD_RESERVE)
    if wanted > room:
        log.warning("at most %d connections (the file limit is %d; max_connections asks %d)", room, soft, wanted)
    return min(wanted, room)


def _check_free(host: str, port: int) -> None:
    """Every address ``host`` names must be free on ``port``. gRPC binds what it can and
    goes on ("localhost" is 127.0.0.1 and ::1): one address taken by another server would
    split the clients between the two."""
    import socket

    for family, kind, proto, _, where in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        with socket.socket(family, kind, proto) as probe:
            # As gRPC binds (SO_REUSEADDR: connections of a server that died are no obstacle),
            # without SO_REUSEPORT: a socket listening there is.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(where)
            except OSError as exc:
                raise OSError(f"cannot listen on {where[0]}:{port}: {exc.strerror or exc}") from exc


def _enable_reflection(server: grpc.Server, service: CacheService) -> None:
    """gRPC server reflection (``grpcurl`` without the .proto), when grpcio-reflection is
    installed beside lmtier: it is left out of the ``server`` extra because it pins a
    grpcio and protobuf as new as itself, which would move an engine's own. Its calls go
    through the service's gate and admission like every other call (a token checked when
    the headers arrive, counted against the tenant, cancelled when it stalls): a stream
    nobody writes to would otherwise hold a worker for good."""
    try:
        from grpc_reflection.v1alpha import reflection, reflection_pb2
    except ImportError:
        log.info("gRPC reflection is off: grpcio-reflection is not installed")
        return
    servicer = reflection.ReflectionServicer((SERVICE, SERVICE_NAME, reflection.SERVICE_NAME))
    method = grpc.stream_stream_rpc_method_handler(
        service.calls.bidi("ServerReflectionInfo", servicer.ServerReflectionInfo),
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    methods = grpc.method_handlers_generic_handler(reflection.SERVICE_NAME, {"ServerReflectionInfo": method})
    server.add_generic_rpc_handlers((Gate(methods, service.auth),))


def _upstream(tier: Tier) -> Tier:
    """Another cache server (a sidecar's central server) as one of the server's tiers gets
    keys re-tagged for its hop."""
    return UpstreamTier(tier) if tier.scheme == "grpc" else tier


def create_server(config: ServerConfig, store: TieredStore | None = None) -> tuple[CacheServer, int]:
    """Build and start a server; returns it and the port it listens on (``port=0``: any)."""
    server = CacheServer(config, store).start()
    return server, server.port


def serve(config: ServerConfig) -> int:
    """Run until SIGTERM or SIGINT, then shut down gracefully."""
    asked = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: shutting down (grace %.0f s)", signum, config.grace)
        asked.set()

    # Handlers first: a SIGTERM that comes while the server starts must not kill it
    # half-way. The main thread waits in short steps, since Python runs handlers only on
    # the main thread, and a signal that lands on one of gRPC's threads would otherwise
    # wait for it forever.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: every thread's stack to the log
    server, port = create_server(config)
    print(f"lmtier serve: listening on {config.host}:{port}", flush=True)
    if server.metrics_port is not None:
        print(f"lmtier serve: metrics on http://{server.metrics_host}:{server.metrics_port}/metrics", flush=True)
    while not asked.wait(0.5):
        pass
    server.stop()  # on the main thread: thread pools refuse work once it has returned
    return 0

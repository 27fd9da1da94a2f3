"""Every configuration key: its field, its comment, its default, its parser and its bounds.

The frozen model that the rest of lmtier reads: ``StoreConfig`` for the engine side (the
vLLM connector, the SGLang backend, the embedded API), ``ServerConfig`` for ``lmtier
serve``, ``Config`` for both. A key's bounds, and the checks across keys, run in
``__post_init__``, so a config built in code is held to them as much as a loaded one.

    StoreConfig                       engine-side settings
    ServerConfig                      the cache server's settings; calls_per_tenant(single_tenant)
    Config(store, server)             everything lmtier reads
    resolve_chunk_tokens(configured, block_size, token_bytes)   -> tokens per chunk ("auto": 0)
    default_server_tiers()            the server's tiers when none are configured
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from lmtier.config.parsers import (
    BOOL,
    CHUNK_TOKENS,
    INTEGER,
    NUMBER,
    OPTIONAL_INTEGER,
    SIZE,
    STRING,
    STRINGS,
    TOKENS,
    setting,
)
from lmtier.errors import ConfigError
from lmtier.kv.keys import HASHES
from lmtier.store.admission import POLICIES


@dataclass(frozen=True)
class StoreConfig:
    # Tier URLs, fastest first. The first is written synchronously, the rest in the
    # background. Default: 1 GiB of host memory and nothing else.
    tiers: tuple[str, ...] = setting(("cpu://?size=1GiB",), STRINGS)
    # Tokens per chunk: the unit of caching, a multiple of the engine's block size.
    # 0 ("auto"): an engine adapter picks the smallest multiple of its block size that
    # holds at least 256 KiB (at most 256 tokens); elsewhere 256.
    chunk_tokens: int = setting(0, CHUNK_TOKENS)
    # Key hash: "xxh3" (fast) or "sha256" (cryptographic).
    hash: str = setting("xxh3", STRING)
    # Tenant / cache salt: stores with different salts never share chunks.
    salt: str = setting("", STRING)
    # Bound on queued background writes; beyond it writes are dropped and counted.
    write_queue: int = setting(64, INTEGER)
    # "through": every put reaches every tier (in the background below the first).
    # "back": lower tiers receive what the first tier evicts, and what it holds at close.
    # "auto": what the save policy asks for ("back" for reuse, else "through").
    write_mode: str = setting("auto", STRING)
    # Which chunks earn a write (lmtier.store.admission): "always" (every chunk to every tier),
    # "reuse" (every chunk to memory; to the lower tiers what proved it is reused, and new
    # chunks while such chunks measurably come back, written a few seconds after they land
    # or when memory lets them go; an engine in vLLM's multiprocess mode finds its own
    # chunks only once they are written down), "min_tokens" ("always" for prompts of at
    # least min_tokens tokens).
    save_policy: str = setting("always", STRING)
    # Prompts shorter than this are not stored ("min_tokens" and "reuse"; 0: no bound).
    min_tokens: int = setting(0, INTEGER)
    # Prometheus /metrics from inside the engine on this port (0: off). Each process of
    # the engine binds its own: the scheduler (or the single process) this port, worker
    # rank r ``port + 1 + r``.
    metrics_port: int = setting(0, INTEGER)
    # Seconds a load may take before the engine recomputes what has not arrived (0: no
    # deadline). Bounds what a slow tier costs a request.
    load_deadline: float = setting(0.0, NUMBER)
    # GPU engines: a step's loads are copied layer by layer on a copy stream while the
    # forward pass runs, each attention layer waiting (a stream wait) for its own layer;
    # vLLM then runs piecewise CUDA graphs (full graphs would skip those waits). Off: loads
    # are complete before the forward pass starts. A CPU engine runs the same path with
    # every layer landed before the forward pass (whole-chunk verification first).
    layer_loads: bool = setting(False, BOOL)
    # Prefill/decode disaggregation (vLLM's kv_role; connectors/vllm/pd.py): how long a
    # producer's step holds its answer for its writes to land, and how long a consumer
    # waits for the chunks a forwarded hand-off names, in seconds; past it, recompute.
    handoff_timeout: float = setting(5.0, NUMBER)
    # kv_role kv_consumer: also store what it computes (off: a consumer never writes).
    save_decoded: bool = setting(False, BOOL)
    # KV events (vLLM's KVEventsConfig): lmtier's chunks announced in the engine's own
    # blocks ("engine": routers that index one block size, vllm-router's kv_aware among
    # them, take them beside the engine's own events) or one block per chunk ("chunk").
    event_blocks: str = setting("engine", STRING)
    # A Redis URL ("" none): instances publish their shared tiers' KV events there and
    # announce each other's, so that a router credits every instance that can load a
    # shared chunk (connectors/vllm/relay.py).
    event_relay: str = setting("", STRING)
    # A file ("" none) where the scheduler writes one line per request: its time, length
    # and chunk keys (lmtier/engine/requestlog.py), for ``lmtier plan --trace log:PATH``;
    # it and its one rotated predecessor hold at most request_log_bytes.
    request_log: str = setting("", STRING)
    request_log_bytes: int = setting(256 * 1024**2, SIZE)

    def __post_init__(self) -> None:
        if isinstance(self.tiers, str):
            object.__setattr__(self, "tiers", tuple(self.tiers.split()))
        object.__setattr__(self, "tiers", tuple(self.tiers))
        if not self.tiers:
            raise ConfigError("at least one tier is needed")
        if self.chunk_tokens < 0:
            raise ConfigError(f"chunk_tokens must be positive (or 0 / 'auto'), got {self.chunk_tokens}")
        if self.event_blocks not in ("engine", "chunk"):
            raise ConfigError(f"event_blocks must be 'engine' or 'chunk', got {self.event_blocks!r}")
        if self.hash not in HASHES:
            raise ConfigError(f"hash must be one of {HASHES}, got {self.hash!r}")
        if self.write_queue < 1:
            raise ConfigError(f"write_queue must be at least 1 (it bounds queued writes), got {self.write_queue}")
        if self.write_mode not in WRITE_MODES:
            raise ConfigError(f"write_mode must be one of {WRITE_MODES}, got {self.write_mode!r}")
        if self.save_policy not in POLICIES:
            raise ConfigError(f"save_policy must be one of {POLICIES}, got {self.save_policy!r}")
        if self.min_tokens < 0:
            raise ConfigError(f"min_tokens must not be negative, got {self.min_tokens}")
        if self.min_tokens and self.save_policy == "always":
            raise ConfigError(
                "min_tokens applies to save_policy=min_tokens or reuse; save_policy=always stores every prompt"
            )
        if self.save_policy == "min_tokens" and not self.min_tokens:
            raise ConfigError("save_policy=min_tokens needs min_tokens (the shortest prompt stored), e.g. 2048")
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics_port must lie in [0, 65536), got {self.metrics_port}")
        for name in ("load_deadline", "handoff_timeout"):  # seconds: NaN or infinity is no bound at all
            value = getattr(self, name)
            if not 0 <= value < float("inf"):
                raise ConfigError(f"{name} must be a number of seconds, 0 or more, got {value}")


WRITE_MODES = ("auto", "through", "back")


AUTO_CHUNK_MIN_BYTES = 256 * 1024
DEFAULT_CHUNK_TOKENS = 256


def resolve_chunk_tokens(configured: int, block_size: int | None = None, token_bytes: int | None = None) -> int:
    """The chunk size to use: the configured one, or the automatic choice.

    Automatic, for an engine with ``block_size`` and ``token_bytes`` of KV per token: the
    smallest multiple of the block size holding ``AUTO_CHUNK_MIN_BYTES``, at most 256
    tokens (rounded up to a whole block). Small chunks lose less on a prompt that diverges
    mid-chunk (the engine recomputes the rest of that chunk); big ones cost less per byte.
    """
    if configured > 0:
        return configured
    if not block_size or not token_bytes:
        return DEFAULT_CHUNK_TOKENS
    blocks = -(-AUTO_CHUNK_MIN_BYTES // (block_size * token_bytes))
    cap = -(-DEFAULT_CHUNK_TOKENS // block_size)
    return min(blocks, cap) * block_size


@dataclass(frozen=True)
class ServerConfig:
    """``lmtier serve``: the standalone cache server (flags override these defaults)."""

    # Where to listen. 127.0.0.1 serves the sidecar case (clients in the same pod);
    # 0.0.0.0 or [::] serves other hosts (use tokens and TLS then).
    host: str = setting("127.0.0.1", STRING)
    port: int = setting(50051, INTEGER)  # 0: any free port (tests)
    # The server's own tiers, fastest first: host memory (256 KiB slots: chunks of many
    # sizes share it without waste), then local disk under the user's cache directory.
    tiers: tuple[str, ...] = field(default_factory=lambda: default_server_tiers(), metadata={"parser": STRINGS})
    # Bearer tokens: token -> tenant. Empty (and no mutual TLS): one open, shared tenant.
    tokens: tuple[tuple[str, str], ...] = setting((), TOKENS)
    # Peers: other instances' read-only tokens (SECRET=TENANT): they read the tenant's chunks,
    # never write or delete, in a lane of calls and data connections of their own.
    peer_tokens: tuple[tuple[str, str], ...] = setting((), TOKENS)
    # The fleet's index of who holds what (a Redis URL, "" none): this server announces its
    # chunks there under ``advertise`` (host:port peers reach its gRPC at; $VARS expanded),
    # each entry for peer_index_ttl seconds unless announced again.
    peer_index: str = setting("", STRING)
    advertise: str = setting("", STRING)
    peer_index_ttl: float = setting(3600.0, NUMBER)
    # TLS: certificate and key of the server; with client_ca, clients must present a
    # certificate signed by it (mutual TLS), and its common name is the tenant when no
    # tokens are configured.
    tls_cert: str = setting("", STRING)
    tls_key: str = setting("", STRING)
    tls_client_ca: str = setting("", STRING)
    # What names a mutual-TLS client's tenant: auto (its common name, else its first URI,
    # else DNS subject alternative name), cn, uri or dns.
    tls_identity: str = setting("auto", STRING)
    # Tenants that see the whole server in Stats (every tier's use and counters, the
    # settings); the others see their own chunks and the tiers' sizes. Where one tenant
    # is all there is, it sees everything.
    operators: tuple[str, ...] = setting((), STRINGS)
    # Limits: one frame, one gRPC message, keys per request, RPCs served at once.
    max_chunk_bytes: int = setting(64 * 1024**2, SIZE)
    max_message_bytes: int = setting(16 * 1024**2, SIZE)
    max_keys: int = setting(4096, INTEGER)
    workers: int = setting(16, INTEGER)
    max_concurrent_rpcs: int = setting(64, INTEGER)
    # Fairness between clients: calls one tenant may have in flight (more get
    # RESOURCE_EXHAUSTED, which the grpc tier retries with backoff; 0: half the workers
    # where several tenants share the server, all of them for one), and streams one
    # connection may have open (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS: more wait in the
    # client until one ends).
    max_calls_per_tenant: int = setting(0, INTEGER)
    # Calls one tenant may start per second, a second's worth at once (0: no limit): each
    # call costs the server time even when it does little, and a tenant that calls in a
    # tight loop would otherwise take the server's time from the others.
    max_call_rate_per_tenant: float = setting(0.0, NUMBER)
    max_streams_per_connection: int = setting(16, INTEGER)
    # Seconds a call may wait on its client (its next message, or room for the next answer)
    # before it is cancelled, and seconds any call may run in all.
    stall_timeout: float = setting(10.0, NUMBER)
    call_timeout: float = setting(300.0, NUMBER)
    # Seconds a connection with no call may stay open, and any connection at all (then it
    # is closed after its calls, given call_timeout to end): clients reconnect.
    connection_idle: float = setting(600.0, NUMBER)
    connection_age: float = setting(3600.0, NUMBER)
    # Connections open at once (more are closed as they arrive; held below the process's
    # file limit, less what the server keeps for its tiers, probes and metrics), and
    # seconds a new connection has to finish its HTTP/2 (and TLS) handshake.
    max_connections: int = setting(4096, INTEGER)
    handshake_timeout: float = setting(10.0, NUMBER)
    # Prometheus /metrics, /healthz and /readyz: on metrics_port, or where that is unset
    # (None), on the gRPC port + 2 (after the data channel's + 1), where a port is given and
    # one tenant uses the server or metrics_token is set (then it runs without them if that
    # port is taken, saying so). metrics: false turns them off.
    metrics: bool = setting(True, BOOL)
    metrics_port: int | None = setting(None, OPTIONAL_INTEGER)
    # Its address; "" (the default): the gRPC address, ``host``. A sidecar whose gRPC
    # stays on 127.0.0.1 sets 0.0.0.0 here for the kubelet's probes and Prometheus.
    metrics_host: str = setting("", STRING)
    # A secret that /metrics asks for (``Authorization: Bearer ...``; /healthz and /readyz
    # stay open for probes), best given as LMTIER_SERVER_METRICS_TOKEN: the counters sum
    # every tenant's traffic, which one tenant of a shared server should not watch.
    metrics_token: str = setting("", STRING)
    # Same-host shared-memory data plane: the directory segments live in ("" turns it off).
    shm_dir: str = setting("/dev/shm", STRING)
    # Other hosts' loads: a bulk data channel beside gRPC (lmtier/transport/datachannel.py), on
    # data_port (None: the gRPC port + 1, or any free port where that is 0; if it is
    # taken, the server runs without one, saying so). Same address and TLS as gRPC.
    data_channel: bool = setting(True, BOOL)
    data_port: int | None = setting(None, OPTIONAL_INTEGER)
    # Data connections open at once, every tenant's together (a tenant: its share).
    max_data_connections: int = setting(32, INTEGER)
    # Seconds between readiness probes of the tiers.
    probe_interval: float = setting(5.0, NUMBER)
    # Seconds in-flight calls get to finish on shutdown.
    grace: float = setting(10.0, NUMBER)
    write_queue: int = setting(64, INTEGER)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tiers", tuple(self.tiers))
        object.__setattr__(self, "tokens", tuple(tuple(t) for t in self.tokens))
        object.__setattr__(self, "peer_tokens", tuple(tuple(t) for t in self.peer_tokens))
        if self.peer_index and not self.advertise:
            raise ConfigError("peer_index needs advertise: the host:port other instances reach this server at")
        if self.peer_index and not self.peer_tokens:
            raise ConfigError("peer_index needs peer_tokens: only what peers may read is announced, and no peer may "
                              "read here")  # fmt: skip
        both = {secret for secret, _ in self.tokens} & {secret for secret, _ in self.peer_tokens}
        if both:
            raise ConfigError(
                f"{len(both)} token(s) are both in tokens and in peer_tokens: a peer's token reads only, so the "
                "engine's own writes would be refused; give peers a secret of their own"
            )
        if self.peer_index_ttl < 1:
            raise ConfigError(f"peer_index_ttl must be at least 1 second, got {self.peer_index_ttl}")
        object.__setattr__(self, "operators", tuple(self.operators))
        if self.host.startswith("[") and self.host.endswith("]"):  # "[::]", as in URLs: the address inside
            object.__setattr__(self, "host", self.host[1:-1])
        if not self.tiers:
            raise ConfigError("the server needs at least one tier")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must lie in [0, 65536), got {self.port}")
        if self.data_port is not None and not 0 <= self.data_port < 65536:
            raise ConfigError(f"data_port must lie in [0, 65536), got {self.data_port}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("TLS needs both a certificate and its key")
        if self.tls_identity not in ("auto", "cn", "uri", "dns"):
            raise ConfigError(f"tls_identity must be auto, cn, uri or dns, got {self.tls_identity!r}")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("mutual TLS (a client CA) needs the server's certificate and key too")
        if self.max_chunk_bytes <= 0 or self.max_message_bytes <= 0 or self.max_keys <= 0:
            raise ConfigError("limits must be positive")
        for name in (
            "workers",
            "max_concurrent_rpcs",
            "max_streams_per_connection",
            "max_connections",
            "write_queue",
            "max_data_connections",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_call_rate_per_tenant < 0:
            raise ConfigError(
                f"max_call_rate_per_tenant must be 0 (no limit) or more, got {self.max_call_rate_per_tenant}"
            )
        if self.max_calls_per_tenant < 0:
            raise ConfigError(f"max_calls_per_tenant must be 0 (automatic) or more, got {self.max_calls_per_tenant}")
        for name in ("stall_timeout", "call_timeout", "connection_idle", "connection_age", "handshake_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
        for token, tenant in self.tokens:
            if not token or not tenant:
                raise ConfigError("a token and its tenant must not be empty")
        owners: dict[str, str] = {}
        for token, tenant in self.tokens:
            if owners.setdefault(token, tenant) != tenant:  # it would only ever be the first one's
                raise ConfigError(f"one secret is given for tenants {owners[token]} and {tenant}: each needs its own")

    def calls_per_tenant(self, single_tenant: bool) -> int:
        """The calls one tenant may have in flight: below the workers where several
        tenants share the server, so that one of them cannot hold every worker."""
        if single_tenant:
            return self.max_calls_per_tenant or self.workers
        if not self.max_calls_per_tenant:
            return max(1, self.workers // 2)
        if self.max_calls_per_tenant >= self.workers and self.workers > 1:
            raise ConfigError(
                f"max_calls_per_tenant ({self.max_calls_per_tenant}) must be below workers ({self.workers}) "
                "where several tenants share the server: one tenant could hold every worker"
            )
        return self.max_calls_per_tenant


def default_server_tiers() -> tuple[str, ...]:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lmtier" / "server"
    return ("cpu://?size=1GiB", f"file://{cache.resolve()}?size=10GiB")


@dataclass(frozen=True)
class Config:
    """Everything lmtier reads: the engine side and the cache server."""

    store: StoreConfig = field(default_factory=StoreConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

"""lmtier's configuration: one frozen model, loaded in one place (``load``).

``Config`` holds the engine side (``StoreConfig``: what the vLLM connector, the SGLang
backend and the embedded API use) and the cache server (``ServerConfig``: ``lmtier
serve``). Precedence, lowest to highest:

1. the defaults below;
2. a config file, YAML (``.yaml`` / ``.yml``), TOML (``.toml``) or JSON (``.json``), its
   path from the caller (``--config``, the ``config`` extra-config key) or
   ``LMTIER_CONFIG``. Engine keys at the top level, server keys under ``server:``; the
   whole may sit under one ``lmtier:`` key;
3. environment variables: ``LMTIER_<KEY>`` for engine keys, ``LMTIER_SERVER_<KEY>`` for
   server keys (lists whitespace-separated);
4. explicit arguments: engine extra-config, command-line flags.

Every key is checked: an unknown key (in a file or as an ``LMTIER_*`` variable) or a bad
value is a ``ConfigError`` naming the key and where it came from.

Longer than 400 lines: configuration has one home, and every key of both sides is here
with its comment, its default and its parser, beside the one loader.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from lmtier.errors import ConfigError
from lmtier.kv.keys import HASHES
from lmtier.store.admission import POLICIES
from lmtier.units import parse_size

log = logging.getLogger(__name__)


# -- how each key is parsed -----------------------------------------------------------------
# A value from a file, an ``LMTIER_*`` variable or a flag becomes its field's through the
# parser named beside the field (``setting(default, PARSER)``), as a tier URL's options
# do through ``Tier.OPTIONS``. A parser raises TypeError / ValueError for a value of the
# wrong kind (the error then says what the key expects) or ConfigError in its own words.
@dataclass(frozen=True)
class Parser:
    parse: Callable[[Any], Any]
    expects: str  # in "port (environment) must be an integer, got 'many'"
    secret: bool = False  # a rejected value is not shown (tokens)


def _int(value: Any) -> int:
    if isinstance(value, (bool, float)):
        raise TypeError("expected an integer")
    return int(value)


def _optional_int(value: Any) -> int | None:
    return None if value in (None, "", "none", "off") else _int(value)


def _chunk_tokens(value: Any) -> int:
    return 0 if value == "auto" else _int(value)


def _float(value: Any) -> float:
    if isinstance(value, bool):
        raise TypeError("expected a number")
    return float(value)


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError("expected a string")
    return value


def _strings(value: Any) -> tuple[str, ...]:
    """A list of strings, or one whitespace-separated string (an environment variable)."""
    items = value.split() if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
        raise TypeError("expected a list of strings")
    return tuple(items)


def _tokens(value: Any) -> tuple[tuple[str, str], ...]:
    """``SECRET=TENANT`` strings (a map would merge every tenant into one), or (secret,
    tenant) pairs from code."""
    if isinstance(value, (list, tuple)) and all(
        isinstance(t, (list, tuple)) and len(t) == 2 and all(isinstance(x, str) for x in t) for t in value
    ):
        return tuple(tuple(t) for t in value)
    return tuple(parse_token(t) for t in _strings(value))


INTEGER = Parser(_int, "an integer")
OPTIONAL_INTEGER = Parser(_optional_int, "an integer")  # none, off or "": None
CHUNK_TOKENS = Parser(_chunk_tokens, "an integer or auto")  # "auto": 0
NUMBER = Parser(_float, "a number")
BOOL = Parser(_bool, "true or false")
STRING = Parser(_str, "a string")
STRINGS = Parser(_strings, "a list of strings")
SIZE = Parser(parse_size, "a size such as 8MiB")  # bytes, or a number and a unit
TOKENS = Parser(_tokens, "a list of SECRET=TENANT strings", secret=True)


def setting(default: Any, parser: Parser) -> Any:
    """A configuration field: its default and its parser."""
    return field(default=default, metadata={"parser": parser})


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
    # Prefill/decode disaggregation (vLLM's kv_role; connectors/vllm_pd.py): how long a
    # producer's step holds its answer for its writes to land, and how long a consumer
    # waits for the chunks a forwarded hand-off names, in seconds; past it, recompute.
    handoff_timeout: float = setting(5.0, NUMBER)
    # kv_role kv_consumer: also store what it computes (off: a consumer never writes).
    save_decoded: bool = setting(False, BOOL)

    def __post_init__(self) -> None:
        if isinstance(self.tiers, str):
            object.__setattr__(self, "tiers", tuple(self.tiers.split()))
        object.__setattr__(self, "tiers", tuple(self.tiers))
        if not self.tiers:
            raise ConfigError("at least one tier is needed")
        if self.chunk_tokens < 0:
            raise ConfigError(f"chunk_tokens must be positive (or 0 / 'auto'), got {self.chunk_tokens}")
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


ROLE_KEYS = frozenset({"handoff_timeout", "save_decoded"})  # engines with vLLM's kv_role


def engine_keys(*, chunk_tokens: bool = True, roles: bool = True) -> frozenset[str]:
    """The extra-config keys an engine adapter accepts: every engine-side setting (without
    ``chunk_tokens`` where the engine's page size decides it, without the disaggregation
    settings where the engine has no roles), the config file, and the model's name in the
    keys."""
    keys = {f.name for f in fields(StoreConfig)} | {"config", "model_id"}
    if not chunk_tokens:
        keys -= {"chunk_tokens"}
    return frozenset(keys if roles else keys - ROLE_KEYS)


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
    # Prometheus /metrics, /healthz and /readyz on this port (None: off).
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
    return ("cpu://?size=1GiB&slot=256KiB", f"file://{cache.resolve()}?size=10GiB")


def parse_token(spec: str) -> tuple[str, str]:
    """``SECRET=TENANT`` (or ``SECRET`` alone: the ``default`` tenant). The tenant follows
    the last ``=``, so a secret may hold ``=`` (base64's padding: ``c2VjcmV0==`` is a
    secret alone, ``c2VjcmV0===alice`` that secret for alice); spaces around either part
    are dropped, and a secret or tenant with spaces inside is refused."""
    text = spec.strip()
    token, sep, tenant = text.rpartition("=")
    if not sep or not tenant.strip():  # no tenant after the last "=": all of it is the secret
        token, tenant = text, ""
    token, tenant = token.strip(), tenant.strip()
    if not token:
        raise ConfigError("an empty token (a line or --token with no secret before '=')")
    if any(c.isspace() for c in token + tenant):
        raise ConfigError("a token or tenant with whitespace inside: write one SECRET=TENANT per line")
    return token, tenant or "default"


WEAK_TOKEN = 16  # characters: a secret shorter than this is warned about


def read_token_file(path: str | Path) -> list[tuple[str, str]]:
    """One ``SECRET=TENANT`` per line; blank lines and ``#`` comments are skipped. A file
    others may read, or a short secret, is warned about (the server still starts)."""
    try:
        text = Path(path).read_text()
        mode = Path(path).stat().st_mode
    except OSError as exc:
        raise ConfigError(f"cannot read token file {path}: {exc}") from exc
    if mode & 0o077:
        log.warning("token file %s can be read by other users (mode %o): chmod 600 it", path, mode & 0o777)
    tokens = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            tokens.append(parse_token(line))
        except ConfigError as exc:
            raise ConfigError(f"{path}, line {n}: {exc}") from exc
    return tokens


def warn_weak_tokens(tokens: tuple[tuple[str, str], ...]) -> None:
    for token, tenant in tokens:
        if len(token) < WEAK_TOKEN:
            log.warning("tenant %s has a token of %d characters: use %d or more (e.g. openssl rand -hex 32)",
                        tenant, len(token), WEAK_TOKEN)  # fmt: skip


# -- loading: one place ---------------------------------------------------------------------
ENV_PREFIX = "LMTIER_"
SERVER_ENV_PREFIX = "LMTIER_SERVER_"
# LMTIER_* variables that are not settings: the config file's path, the grpc tier's token.
OTHER_ENV = frozenset({"LMTIER_CONFIG", "LMTIER_TOKEN", "LMTIER_EVENTS_SALT"})
# Server keys a file or the environment may give beyond ServerConfig's fields.
SERVER_EXTRA_KEYS = frozenset({"token_file"})


@dataclass(frozen=True)
class Config:
    """Everything lmtier reads: the engine side and the cache server."""

    store: StoreConfig = field(default_factory=StoreConfig)
    server: ServerConfig = field(default_factory=ServerConfig)


def _parsed(parser: Parser, name: str, value: Any, source: str) -> Any:
    """``value`` (from a file, a variable or a flag) through the parser of key ``name``."""
    where = f"{name} ({source})"
    try:
        return parser.parse(value)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where} must be {parser.expects}, got {_shown(value, parser)}") from exc


def _shown(value: Any, parser: Parser) -> str:
    """A rejected value fit for an error message: secrets never, URLs redacted."""
    from lmtier.tiers.base import redact_url

    if parser.secret:
        return f"a {type(value).__name__} (values not shown)"
    return repr(_redacted(value, redact_url))


def _redacted(value: Any, redact: Callable[[str], str]) -> Any:
    """``value`` with every URL in it redacted, however deep (lists, maps of them)."""
    if isinstance(value, str):
        return redact(value) if "://" in value else value
    if isinstance(value, (list, tuple)):
        return [_redacted(v, redact) for v in value]
    if isinstance(value, Mapping):
        return {k: _redacted(v, redact) for k, v in value.items()}
    return value


def _section(cls: type, data: Mapping[str, Any], source: str, extra: frozenset[str] = frozenset()) -> dict[str, Any]:
    parsers = {f.name: f.metadata["parser"] for f in fields(cls)}
    known = set(parsers) | extra
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)} in {source}; known: {', '.join(sorted(known))}")
    return {k: (v if k in extra else _parsed(parsers[k], k, v, source)) for k, v in data.items() if v is not None}


def read_file(path: str | Path) -> dict[str, Any]:
    """A config file's settings: ``{"store": {...}, "server": {...}}``, checked."""
    path = Path(path)
    try:
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            data = tomllib.loads(text)
    except Exception as exc:  # OSError, and each parser's own error type
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings")
    if isinstance(data.get("lmtier"), dict) and len(data) == 1:
        data = data["lmtier"]
    server = data.get("server", {})
    if not isinstance(server, dict):
        raise ConfigError(f"'server' in {path} must be a mapping of settings")
    store = {k: v for k, v in data.items() if k != "server"}
    return {
        "store": _section(StoreConfig, store, str(path)),
        "server": _section(ServerConfig, server, f"{path} [server]", SERVER_EXTRA_KEYS),
    }


# Kubernetes gives every pod variables for each Service of its namespace (enableServiceLinks,
# on by default): a Service "lmtier-server" brings LMTIER_SERVER_SERVICE_HOST,
# LMTIER_SERVER_SERVICE_PORT, LMTIER_SERVER_PORT=tcp://10.0.0.7:50051,
# LMTIER_SERVER_PORT_50051_TCP_ADDR, ... They are not settings: skipped, never an error, and
# a port setting whose value is such a link (never a port number) is one of them.
_SERVICE_LINK = re.compile(r"_SERVICE_(HOST|PORT(_\w+)?)$|_PORT_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?$")
_LINK_VALUE = re.compile(r"(tcp|udp|sctp)://[^/]+:\d+")


def _service_link(var: str, value: str) -> bool:
    return bool(_SERVICE_LINK.search(var)) or (var.endswith("_PORT") and bool(_LINK_VALUE.fullmatch(value)))


def from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """The ``LMTIER_*`` settings of ``env``, checked; an unknown ``LMTIER_*`` variable
    is an error (a misspelt setting must not pass silently), but for those Kubernetes
    sets for a Service whose name starts with ``lmtier``."""
    store: dict[str, Any] = {}
    server: dict[str, Any] = {}
    store_keys = {f.name for f in fields(StoreConfig)}
    server_keys = {f.name for f in fields(ServerConfig)} | SERVER_EXTRA_KEYS
    for var, value in env.items():
        if not var.startswith(ENV_PREFIX) or var in OTHER_ENV or _service_link(var, value):
            continue
        if var.startswith(SERVER_ENV_PREFIX) and var[len(SERVER_ENV_PREFIX) :].lower() in server_keys:
            server[var[len(SERVER_ENV_PREFIX) :].lower()] = value
        elif var[len(ENV_PREFIX) :].lower() in store_keys:
            store[var[len(ENV_PREFIX) :].lower()] = value
        else:
            known = [f"{ENV_PREFIX}{k.upper()}" for k in sorted(store_keys)]
            known += [f"{SERVER_ENV_PREFIX}{k.upper()}" for k in sorted(server_keys)] + sorted(OTHER_ENV)
            raise ConfigError(f"unknown setting {var} in the environment; known: {', '.join(known)}")
    return {
        "store": _section(StoreConfig, store, "environment"),
        "server": _section(ServerConfig, server, "environment", SERVER_EXTRA_KEYS),
    }


def load(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    store: Mapping[str, Any] | None = None,
    server: Mapping[str, Any] | None = None,
    arguments: str = "arguments",
) -> Config:
    """The configuration in effect: defaults < file < environment < ``store`` / ``server``
    (explicit arguments, named ``arguments`` in errors; None values are unset)."""
    env = os.environ if env is None else env
    layers = []
    path = path or env.get("LMTIER_CONFIG")
    if path:
        layers.append((read_file(path), str(path)))
    layers.append((from_env(env), "the environment"))
    layers.append(
        (
            {
                "store": _section(StoreConfig, dict(store or {}), arguments),
                "server": _section(ServerConfig, dict(server or {}), arguments, SERVER_EXTRA_KEYS),
            },
            arguments,
        )
    )
    merged_store: dict[str, Any] = {}
    merged_server: dict[str, Any] = {}
    origin: dict[str, dict[str, str]] = {"store": {}, "server": {}}  # where each setting came from
    for layer, where in layers:
        merged_store.update(layer["store"])
        merged_server.update(layer["server"])
        for side, prefix in (("store", ENV_PREFIX), ("server", SERVER_ENV_PREFIX)):
            for key in layer[side]:
                origin[side][key] = f"{prefix}{key.upper()} in the environment" if where == "the environment" else where
    token_files = merged_server.pop("token_file", None)
    if token_files:
        files = token_files.split() if isinstance(token_files, str) else list(token_files)
        tokens = list(merged_server.get("tokens", ()))
        for f in files:
            tokens += read_token_file(f)
        merged_server["tokens"] = tuple(tokens)
    built = {}
    for side, cls, merged in (("store", StoreConfig, merged_store), ("server", ServerConfig, merged_server)):
        try:
            built[side] = replace(cls(), **merged)
        except ConfigError as exc:  # a check across settings: say where those it names were set
            named = [f"{k}: {where}" for k, where in origin[side].items() if re.search(rf"\b{k}\b", str(exc))]
            raise ConfigError(f"{exc} (set by {'; '.join(named)})" if named else str(exc)) from None
    return Config(**built)


def load_config(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    *,
    arguments: str = "arguments",
    **overrides: Any,
) -> StoreConfig:
    """The engine side of ``load``: what the engine adapters and the embedded API use."""
    return load(path, env, store=overrides, arguments=arguments).store


def engine_config(extra: Mapping[str, Any], accepted: frozenset[str], where: str) -> StoreConfig:
    """An engine adapter's settings: its extra-config (``accepted`` keys: engine-side
    settings, ``config`` for a file, adapter keys such as ``model_id``) over the file,
    the environment and the defaults. An unknown key is a ``ConfigError`` naming it."""
    unknown = sorted(set(extra) - accepted)
    if unknown:
        raise ConfigError(f"lmtier: unknown {where} keys {unknown}; known: {sorted(accepted)}")
    store_keys = {f.name for f in fields(StoreConfig)}
    config = load_config(extra.get("config"), arguments=where, **{k: v for k, v in extra.items() if k in store_keys})
    from lmtier.tiers.base import check_tier_url

    for url in config.tiers:  # a URL that can never open is refused now, not when the store opens
        check_tier_url(url)
    return config


def load_server_config(
    path: str | Path | None = None, env: Mapping[str, str] | None = None, **overrides: Any
) -> ServerConfig:
    """The server side of ``load``: what ``lmtier serve`` uses."""
    return load(path, env, server=overrides).server


def public_view(config: Config) -> dict[str, Any]:
    """The settings in effect as plain data, secrets left out (tokens: their tenants; tier
    URLs: passwords and tokens replaced by ***; the key path)."""
    from dataclasses import asdict

    from lmtier.tiers.base import redact_url

    data = asdict(config)
    data["server"]["tokens"] = sorted({tenant for _, tenant in config.server.tokens})
    data["server"]["tiers"] = [redact_url(url) for url in config.server.tiers]
    data["store"]["tiers"] = [redact_url(url) for url in config.store.tiers]
    for secret in ("tls_key", "metrics_token"):
        if data["server"].get(secret):
            data["server"][secret] = "***"
    return data

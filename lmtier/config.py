"""lmtier's configuration, loaded in one place.

Precedence, lowest to highest: the defaults below, a config file (TOML or JSON; its path
from ``LMTIER_CONFIG`` or the caller), ``LMTIER_*`` environment variables, then explicit
arguments (engine extra-config, command-line flags).
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from lmtier.errors import ConfigError
from lmtier.keys import HASHES


@dataclass(frozen=True)
class StoreConfig:
    # Tier URLs, fastest first. The first is written synchronously, the rest in the
    # background. Default: 1 GiB of host memory and nothing else.
    tiers: tuple[str, ...] = ("cpu://?size=1GiB",)
    # Tokens per chunk: the unit of caching, a multiple of the engine's block size.
    # 0 ("auto"): an engine adapter picks the smallest multiple of its block size that
    # holds at least 256 KiB (at most 256 tokens); elsewhere 256.
    chunk_tokens: int = 0
    # Key hash: "xxh3" (fast) or "sha256" (cryptographic).
    hash: str = "xxh3"
    # Tenant / cache salt: stores with different salts never share chunks.
    salt: str = ""
    # Bound on queued background writes; beyond it writes are dropped and counted.
    write_queue: int = 64
    # "through": every put reaches every tier (in the background below the first).
    # "back": lower tiers receive what the first tier evicts, and what it holds at close.
    write_mode: str = "through"

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
        if self.write_queue < 0:
            raise ConfigError("write_queue must not be negative")
        if self.write_mode not in ("through", "back"):
            raise ConfigError(f"write_mode must be 'through' or 'back', got {self.write_mode!r}")


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


_ENV_PREFIX = "LMTIER_"
_INT_FIELDS = {"chunk_tokens", "write_queue"}


def _from_mapping(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    known = {f.name for f in fields(StoreConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)} in {source}; known: {', '.join(sorted(known))}")
    out: dict[str, Any] = {}
    for name, value in data.items():
        if name == "chunk_tokens" and value == "auto":
            value = 0
        if name in _INT_FIELDS:
            try:
                value = int(value)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{name} in {source} must be an integer, got {value!r}") from exc
        out[name] = value
    return out


def read_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    return _from_mapping(data.get("lmtier", data), str(path))


def from_env(env: Mapping[str, str]) -> dict[str, Any]:
    data = {
        key[len(_ENV_PREFIX) :].lower(): value
        for key, value in env.items()
        if key.startswith(_ENV_PREFIX) and key != "LMTIER_CONFIG"
    }
    known = {f.name for f in fields(StoreConfig)}
    return _from_mapping({k: v for k, v in data.items() if k in known}, "environment")


def load_config(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> StoreConfig:
    env = os.environ if env is None else env
    merged: dict[str, Any] = {}
    path = path or env.get("LMTIER_CONFIG")
    if path:
        merged.update(read_file(path))
    merged.update(from_env(env))
    merged.update(_from_mapping({k: v for k, v in overrides.items() if v is not None}, "arguments"))
    return replace(StoreConfig(), **merged)


@dataclass(frozen=True)
class ServerConfig:
    """``lmtier serve``: the standalone cache server (flags override these defaults)."""

    # Where to listen. 127.0.0.1 serves the sidecar case (clients in the same pod);
    # 0.0.0.0 or [::] serves other hosts (use tokens and TLS then).
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port (tests)
    # The server's own tiers, fastest first: host memory (256 KiB slots: chunks of many
    # sizes share it without waste), then local disk under the user's cache directory.
    tiers: tuple[str, ...] = field(default_factory=lambda: default_server_tiers())
    # Bearer tokens: token -> tenant. Empty (and no mutual TLS): one open, shared tenant.
    tokens: tuple[tuple[str, str], ...] = ()
    # TLS: certificate and key of the server; with client_ca, clients must present a
    # certificate signed by it (mutual TLS), and its common name is the tenant when no
    # tokens are configured.
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    # Limits: one frame, one gRPC message, keys per request, RPCs served at once.
    max_chunk_bytes: int = 64 * 1024**2
    max_message_bytes: int = 80 * 1024**2
    max_keys: int = 4096
    workers: int = 16
    max_concurrent_rpcs: int = 64
    # Prometheus /metrics, /healthz and /readyz on this port (None: off).
    metrics_port: int | None = None
    metrics_host: str = "0.0.0.0"
    # Same-host shared-memory data plane: the directory segments live in ("" turns it off).
    shm_dir: str = "/dev/shm"
    # Seconds between readiness probes of the tiers.
    probe_interval: float = 5.0
    # Seconds in-flight calls get to finish on shutdown.
    grace: float = 10.0
    write_queue: int = 64

    def __post_init__(self) -> None:
        object.__setattr__(self, "tiers", tuple(self.tiers))
        object.__setattr__(self, "tokens", tuple(tuple(t) for t in self.tokens))
        if not self.tiers:
            raise ConfigError("the server needs at least one tier")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must lie in [0, 65536), got {self.port}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("TLS needs both a certificate and its key")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("mutual TLS (a client CA) needs the server's certificate and key too")
        if self.max_chunk_bytes <= 0 or self.max_message_bytes <= 0 or self.max_keys <= 0:
            raise ConfigError("limits must be positive")
        if self.workers < 1 or self.max_concurrent_rpcs < 1:
            raise ConfigError("workers and max_concurrent_rpcs must be at least 1")
        for token, tenant in self.tokens:
            if not token or not tenant:
                raise ConfigError("a token and its tenant must not be empty")


def default_server_tiers() -> tuple[str, ...]:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lmtier" / "server"
    return ("cpu://?size=1GiB&slot=256KiB", f"file://{cache.resolve()}?size=10GiB")


def parse_token(spec: str) -> tuple[str, str]:
    """``SECRET=TENANT`` (or ``SECRET`` alone: the ``default`` tenant)."""
    token, _, tenant = spec.strip().partition("=")
    if not token:
        raise ConfigError(f"empty token in {spec!r}")
    return token, tenant or "default"


def read_token_file(path: str | Path) -> list[tuple[str, str]]:
    """One ``SECRET=TENANT`` per line; blank lines and ``#`` comments are skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read token file {path}: {exc}") from exc
    return [parse_token(line) for line in lines if line.strip() and not line.lstrip().startswith("#")]

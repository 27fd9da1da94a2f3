"""Loading the configuration, in one place: defaults < file < environment < arguments.

A config file is YAML (``.yaml`` / ``.yml``), TOML (``.toml``) or JSON (``.json``), its
path from the caller (``--config``, the ``config`` extra-config key) or ``LMTIER_CONFIG``:
engine keys at the top level, server keys under ``server:``, the whole perhaps under one
``lmtier:`` key. The environment gives ``LMTIER_<KEY>`` for engine keys and
``LMTIER_SERVER_<KEY>`` for server keys (lists whitespace-separated). Every key is
checked: an unknown key or a bad value is a ``ConfigError`` naming the key and where it
came from, without showing a secret.

    load(path, env, store, server)           -> Config
    load_config(path, env, **overrides)      -> StoreConfig: the engine side
    load_server_config(path, env, **overrides)   -> ServerConfig: ``lmtier serve``
    engine_keys(chunk_tokens, roles)         the extra-config keys an engine adapter accepts
    engine_config(extra, accepted, where)    -> StoreConfig: an engine adapter's settings
    read_file(path), from_env(env)           one layer's settings, checked
    public_view(config)                      the settings in effect, secrets left out
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from lmtier.config.parsers import Parser
from lmtier.config.schema import Config, ServerConfig, StoreConfig
from lmtier.config.tokens import read_token_file
from lmtier.errors import ConfigError

ENV_PREFIX = "LMTIER_"
SERVER_ENV_PREFIX = "LMTIER_SERVER_"
# LMTIER_* variables that are not settings: the config file's path, the grpc tier's token.
OTHER_ENV = frozenset({"LMTIER_CONFIG", "LMTIER_TOKEN", "LMTIER_EVENTS_SALT"})
# Server keys a file or the environment may give beyond ServerConfig's fields.
SERVER_EXTRA_KEYS = frozenset({"token_file", "peer_token_file"})


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
    for files_key, tokens_key in (("token_file", "tokens"), ("peer_token_file", "peer_tokens")):
        token_files = merged_server.pop(files_key, None)
        if token_files:
            files = token_files.split() if isinstance(token_files, str) else list(token_files)
            tokens = list(merged_server.get(tokens_key, ()))
            for f in files:
                tokens += read_token_file(f)
            merged_server[tokens_key] = tuple(tokens)
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
    data["server"]["peer_tokens"] = sorted({tenant for _, tenant in config.server.peer_tokens})
    if config.server.peer_index:
        data["server"]["peer_index"] = redact_url(config.server.peer_index)
    data["server"]["tiers"] = [redact_url(url) for url in config.server.tiers]
    data["store"]["tiers"] = [redact_url(url) for url in config.store.tiers]
    for secret in ("tls_key", "metrics_token"):
        if data["server"].get(secret):
            data["server"][secret] = "***"
    return data

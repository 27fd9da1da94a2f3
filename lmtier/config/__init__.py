"""lmtier's configuration: one frozen model, loaded in one place (``load``).

``Config`` holds the engine side (``StoreConfig``: what the vLLM connector, the SGLang
backend and the embedded API use) and the cache server (``ServerConfig``: ``lmtier
serve``). Precedence, lowest to highest:

1. the defaults (``schema``);
2. a config file, YAML (``.yaml`` / ``.yml``), TOML (``.toml``) or JSON (``.json``), its
   path from the caller (``--config``, the ``config`` extra-config key) or
   ``LMTIER_CONFIG``. Engine keys at the top level, server keys under ``server:``; the
   whole may sit under one ``lmtier:`` key;
3. environment variables: ``LMTIER_<KEY>`` for engine keys, ``LMTIER_SERVER_<KEY>`` for
   server keys (lists whitespace-separated);
4. explicit arguments: engine extra-config, command-line flags.

Every key is checked: an unknown key (in a file or as an ``LMTIER_*`` variable) or a bad
value is a ``ConfigError`` naming the key and where it came from.

    schema    StoreConfig, ServerConfig, Config: every key with its comment, default, parser and bounds
    parsers   Parser, setting() and the typed parsers a key names (integer, size, tokens, ...)
    tokens    bearer tokens: ``SECRET=TENANT``, token files, the weak-secret warning
    loading   load and its engine / server sides: files, ``LMTIER_*`` variables, public_view
"""

from lmtier._moved import forward
from lmtier.config.loading import (
    SERVER_EXTRA_KEYS,
    engine_config,
    engine_keys,
    load,
    load_config,
    load_server_config,
    public_view,
)
from lmtier.config.parsers import Parser
from lmtier.config.schema import Config, ServerConfig, StoreConfig, resolve_chunk_tokens
from lmtier.config.tokens import parse_token, read_token_file, warn_weak_tokens

__all__ = [
    "SERVER_EXTRA_KEYS",
    "Config",
    "Parser",
    "ServerConfig",
    "StoreConfig",
    "engine_config",
    "engine_keys",
    "load",
    "load_config",
    "load_server_config",
    "parse_token",
    "public_view",
    "read_token_file",
    "resolve_chunk_tokens",
    "warn_weak_tokens",
]

__getattr__ = forward(__name__)  # names of the previous release, found where they live now (CHANGELOG.md)

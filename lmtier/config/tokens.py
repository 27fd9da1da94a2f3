"""Bearer tokens of the cache server: the ``SECRET=TENANT`` form, token files, weak secrets.

A token names its tenant, and one parsing serves ``--token``, a token file and the
``tokens`` setting alike. A token file others may read, or a short secret, is warned
about, not refused: the server still starts.

    parse_token(spec)          -> (secret, tenant): one ``SECRET=TENANT`` (tenant ``default`` if absent)
    read_token_file(path)      -> [(secret, tenant)]: one per line, ``#`` comments skipped
    warn_weak_tokens(tokens)   log each tenant whose secret is shorter than ``WEAK_TOKEN``
"""

from __future__ import annotations

import logging
from pathlib import Path

from lmtier.errors import ConfigError

log = logging.getLogger(__name__)


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

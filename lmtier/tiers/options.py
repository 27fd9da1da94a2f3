"""Option parsers and option groups that several tiers' URLs share.

    seconds(text) -> float            a duration, 0 or more (``ttl=0``: no expiry)
    positive_seconds(text) -> float   a duration above 0 (timeouts)
    TLS_OPTIONS                       ``tls``, ``tls_ca``, ``tls_cert``, ``tls_key``: parsers
    TlsFiles                          those options, read once, for a socket or a gRPC channel

A tier lists these in its ``OPTIONS`` beside its own (``{**TLS_OPTIONS, "timeout": ...}``),
so a misspelt option is still an error, and a TLS file that cannot be read is a
configuration error at open (not a server that seems down).
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmtier.errors import ConfigError
from lmtier.tiers.base import parse_bool


def seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise ValueError("must not be negative")
    return value


def positive_seconds(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise ValueError("must be positive")
    return value


TLS_OPTIONS: dict[str, Callable[[str], Any]] = {
    "tls": parse_bool,  # TLS with the system's CA certificates (implied by rediss://, grpcs://)
    "tls_ca": str,  # a CA certificate file (PEM) instead of the system's
    "tls_cert": str,  # a client certificate (PEM): mutual TLS
    "tls_key": str,  # its private key (PEM)
}


@dataclass(frozen=True)
class TlsFiles:
    """A tier's TLS settings as its URL gave them; ``wanted`` when any of them is set."""

    tls: bool = False
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""

    @property
    def wanted(self) -> bool:
        return self.tls or bool(self.tls_ca or self.tls_cert)

    def read(self, tier: str) -> tuple[bytes | None, bytes | None, bytes | None]:
        """(CA, private key, certificate chain) as bytes, None where not given (gRPC's form)."""
        try:
            return tuple(Path(p).read_bytes() if p else None for p in (self.tls_ca, self.tls_key, self.tls_cert))  # type: ignore[return-value]
        except OSError as exc:
            raise ConfigError(f"cannot read a TLS file of tier {tier!r}: {exc}") from exc

    def ssl_context(self, tier: str, verify: bool = True) -> ssl.SSLContext:
        """A client context for a plain socket; ``verify=False`` skips the server's certificate."""
        try:
            context = ssl.create_default_context(cafile=self.tls_ca or None)
            if self.tls_cert:
                context.load_cert_chain(self.tls_cert, self.tls_key or None)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot use the TLS files of tier {tier!r}: {exc}") from exc
        if not verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context

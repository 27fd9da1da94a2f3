"""Who is calling: bearer tokens (or a mutual-TLS certificate) mapped to tenants.

Every key a tenant stores is kept under ``tenant_tag(tenant) + key`` in the server's
tiers, so tenants share the server's memory and disk but never a key: one tenant's
lookup, get, list or delete of another's key finds nothing.
"""

from __future__ import annotations

import hashlib
import hmac

import grpc

# A cryptographic digest, 128 bits: no tenant name can be found that collides with
# another's (a collision would share keys), by design or by luck.
TAG_BYTES = 16
PROBE_TAG = b"\xff" * TAG_BYTES  # readiness probes; no tenant name digests to it


def tenant_tag(tenant: str) -> bytes:
    return hashlib.blake2b(tenant.encode(), digest_size=TAG_BYTES, person=b"lmtier.tenant").digest()


class Authenticator:
    """Resolves a call's tenant, or aborts it with ``UNAUTHENTICATED``.

    With tokens: the call must carry ``authorization: Bearer <token>`` with a known token
    (compared in constant time). Without tokens but with mutual TLS: the tenant is the
    client certificate's common name. Neither: one open tenant, ``default``.
    """

    def __init__(self, tokens: tuple[tuple[str, str], ...] = (), mutual_tls: bool = False) -> None:
        self._tokens = [(token.encode(), tenant) for token, tenant in tokens]
        self.mutual_tls = mutual_tls
        self._tags: dict[str, bytes] = {}

    @property
    def open(self) -> bool:
        return not self._tokens and not self.mutual_tls

    @property
    def single_tenant(self) -> bool:
        """Whether every call can only ever be one tenant's."""
        if self.mutual_tls and not self._tokens:
            return False  # a tenant per certificate name: not known in advance
        return len({tenant for _, tenant in self._tokens}) <= 1

    def tag(self, context: grpc.ServicerContext) -> bytes:
        """The key prefix of the calling tenant."""
        tenant = self.tenant(context)
        tag = self._tags.get(tenant)
        if tag is None:
            if len(self._tags) > 10_000:  # bounded: tenants come from config or certificates
                self._tags.clear()
            tag = self._tags[tenant] = tenant_tag(tenant)
        return tag

    def tenant(self, context: grpc.ServicerContext) -> str:
        if self._tokens:
            offered = _bearer(context)
            if offered is None:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <token>' metadata")
            found = None
            for token, tenant in self._tokens:  # check them all: no early exit to time
                if hmac.compare_digest(token, offered) and found is None:
                    found = tenant
            if found is None:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown token")
            return found  # type: ignore[return-value]
        if self.mutual_tls:
            names = context.auth_context().get("x509_common_name") or []
            if not names:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "the client certificate has no common name")
            return names[0].decode()
        return "default"


def _bearer(context: grpc.ServicerContext) -> bytes | None:
    for name, value in context.invocation_metadata() or ():
        if name == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip().encode()
    return None

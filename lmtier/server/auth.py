"""Who is calling: bearer tokens (or a mutual-TLS certificate) mapped to tenants.

Every key a tenant stores is kept under ``tenant_tag(tenant) + key`` in the server's
tiers, so tenants share the server's memory and disk but never a key: one tenant's
lookup, get, list or delete of another's key finds nothing.
"""

from __future__ import annotations

import hmac

import grpc

from lmtier.kv.keys import TAG_BYTES, tenant_tag

PROBE_TAG = b"\xff" * TAG_BYTES  # readiness probes; no tenant name digests to it


class Authenticator:
    """Resolves a call's tenant, or aborts it with ``UNAUTHENTICATED``.

    With tokens: the call must carry ``authorization: Bearer <token>`` with a known token
    (compared in constant time). Without tokens but with mutual TLS: the tenant is the
    client certificate's identity (``identity``): ``cn``, its common name; ``uri`` or
    ``dns``, its first subject alternative name of that kind (``uri:spiffe://...``,
    ``dns:name``: SPIFFE/SPIRE and cert-manager issue certificates with no common name);
    ``auto``, the common name if it has one, else a URI name, else a DNS name. A
    certificate with none of them is refused: never the empty name, which every such
    certificate would share. Neither tokens nor TLS: one open tenant, ``default``.
    """

    IDENTITIES = {
        "cn": ("x509_common_name",),
        "uri": ("peer_uri",),
        "dns": ("peer_dns",),
        "auto": ("x509_common_name", "peer_uri", "peer_dns"),
    }

    def __init__(self, tokens: tuple[tuple[str, str], ...] = (), mutual_tls: bool = False,
                 identity: str = "auto", peer_tokens: tuple[tuple[str, str], ...] = ()) -> None:  # fmt: skip
        if identity not in self.IDENTITIES:
            raise ValueError(f"tls_identity must be one of {', '.join(self.IDENTITIES)}, got {identity!r}")
        self._tokens = [(token.encode(), tenant) for token, tenant in (*tokens, *peer_tokens)]
        self._peer_tokens = [token.encode() for token, _ in peer_tokens]  # read only: other instances'
        self.peers = bool(peer_tokens)
        self.mutual_tls = mutual_tls
        self.identity = identity
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

    @property
    def only_tenant(self) -> str | None:
        """The one tenant every call is, where there is one (``single_tenant``)."""
        if not self.single_tenant:
            return None
        return self._tokens[0][1] if self._tokens else "default"

    def tag(self, context: grpc.ServicerContext) -> bytes:
        """The key prefix of the calling tenant."""
        tenant = self.tenant(context)
        tag = self._tags.get(tenant)
        if tag is None:
            if len(self._tags) > 10_000:  # bounded: tenants come from config or certificates
                self._tags.clear()
            tag = self._tags[tenant] = tenant_tag(tenant)
        return tag

    def refuse(self, metadata) -> str | None:
        """Why a call with these headers is refused (None: it is not, or only its
        certificate can say): checked when the headers arrive."""
        if not self._tokens:
            return None
        offered = _bearer(metadata)
        if offered is None:
            return "missing 'authorization: Bearer <token>' metadata"
        return None if self._known(offered) is not None else "unknown token"

    def _known(self, offered: bytes) -> str | None:
        found = None
        for token, tenant in self._tokens:  # check them all: no early exit to time
            if hmac.compare_digest(token, offered) and found is None:
                found = tenant
        return found

    def reads_only(self, metadata) -> bool:
        """Whether a call with these headers carries a peer's token: it may read its
        tenant's chunks, never write or delete them, and is admitted in a lane of its own
        (``peer_lane``), so that peers cannot take the calls of the instance it serves."""
        if not self._peer_tokens:
            return False
        offered = _bearer(metadata)
        found = False
        for token in self._peer_tokens:  # check them all: no early exit to time
            found |= offered is not None and hmac.compare_digest(token, offered)
        return found

    def tenant(self, context: grpc.ServicerContext) -> str:
        if self._tokens:
            offered = _bearer(context.invocation_metadata())
            if offered is None:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <token>' metadata")
            found = self._known(offered)
            if found is None:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown token")
            return found  # type: ignore[return-value]
        if self.mutual_tls:
            name = certificate_identity(context.auth_context(), self.identity)
            if name is None:
                context.abort(
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"the client certificate names no identity of the kind this server takes (tls_identity "
                    f"{self.identity}: a common name, or a URI or DNS subject alternative name)",
                )
            return name  # type: ignore[return-value]
        return "default"


PEER_LANE = b"peer:"
# What a peer's token may call: reads of chunks, by gRPC or the bulk channel. Not writes,
# not Stats (uncached for one tenant: a peer must not spend the holder's time on it), not
# the same-host shared-memory calls (Directory, Release: leases are the instance's own).
PEER_METHODS = frozenset({"Lookup", "Get", "OpenData"})


def peer_lane(tag: bytes) -> bytes:
    """The admission lane of a tenant's peers (calls and data connections are counted per
    lane: a tenant's peers share one, apart from the tenant's own clients)."""
    return PEER_LANE + tag


def is_peer_lane(lane: bytes) -> bool:
    return lane.startswith(PEER_LANE) and len(lane) == len(PEER_LANE) + TAG_BYTES


def certificate_identity(auth: dict, identity: str) -> str | None:
    """A client certificate's tenant name from gRPC's auth context, or None. Names from
    alternative names carry their kind (``uri:``, ``dns:``), so that no common name can
    pass for one: a common name that starts so is not taken."""
    for prop in Authenticator.IDENTITIES[identity]:
        for value in auth.get(prop) or ():
            name = value.decode("utf-8", "replace").strip()
            if not name:
                continue
            if prop == "x509_common_name":
                if name.startswith(("uri:", "dns:")):
                    continue
                return name
            return f"{'uri' if prop == 'peer_uri' else 'dns'}:{name}"
    return None


def _bearer(metadata) -> bytes | None:
    for name, value in metadata or ():
        if name == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip().encode()
    return None

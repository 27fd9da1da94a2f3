"""The tier protocol, its URL syntax and the registry of tier schemes.

A tier implements five batch primitives; everything else is derived here, once:

    contains(keys) -> int             length of the leading run of keys present
    get(keys) -> list[Chunk | None]   one entry per key; None is a miss
    put(chunks) -> None               stores what fits; evicts by its own policy
    delete(keys) -> None              forgets keys (absent keys are fine)
    close() -> None                   releases memory, files and sockets

What a tier can do beyond them it declares in ``capabilities`` (one small record, read by
the store and the server, never probed for):

    listing         keys(prefix, limit) -> list[bytes]   every key held (Stats, List, clear)
    touch           touch(keys) -> None     refresh recency without reading (batched loads)
    leases          get() pins memory until released, and evictions go to ``evict_hook``:
                    write-through hands the writer leased chunks; write-back needs it
    shared_memory   its slab is a named segment that same-host readers map (``shared_name``)

Two optional methods let a lower tier read a chunk straight into an upper tier's memory,
so that promoting a hit costs no copy (a no-op and a plain ``get`` by default):

    place(key, nbytes) -> Placement | None     memory for a chunk about to be read (a slot)
    get_into(keys, place) -> list[Chunk|None]  ``get``, reading payloads where ``place`` says;
                                               a chunk so read is the upper tier's (its lease)

Batches are in prompt order: ``keys[i]`` extends ``keys[i - 1]``. Tiers are thread-safe
and synchronous; the ``TieredStore`` adds background work and failure handling on top.
A tier may hand out unverified chunks that check their checksum when read (see
``lmtier.kv.chunk``); ``stats()`` reports at least ``capacity_bytes``, ``used_bytes``,
``chunks`` and ``corrupt``, which the contract suite checks.

One URL configures one tier: ``scheme://location?option=value``. Each tier class declares
its options with a parser per option, so ``cpu://?size=8GiB`` arrives as an int and a
misspelt option is an error rather than silently ignored.
"""

from __future__ import annotations

import importlib
import os
import re
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol
from urllib.parse import parse_qsl, quote, urlsplit

import numpy as np

from lmtier.breaker import Backoff
from lmtier.errors import ConfigError, MissingDependency, TierError
from lmtier.kv.chunk import Chunk
from lmtier.kv.layout import KVLayout

PROBE_LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16")  # a 1 KiB probe chunk


@dataclass(frozen=True)
class Capabilities:
    """What a tier can do beyond the five primitives (see the module docstring)."""

    listing: bool = False
    touch: bool = False
    leases: bool = False
    shared_memory: bool = False


class Placement(Protocol):
    """Memory an upper tier sets aside for one chunk (``Tier.place``): the reader fills
    ``view`` and then commits (the chunk, as the upper tier now holds it, leased to the
    caller) or aborts (the memory goes back). Exactly one of the two, once."""

    key: bytes
    view: np.ndarray  # writable uint8, the payload's length
    committed: bool  # the upper tier holds the chunk now

    def commit(self, chunk: Chunk) -> Chunk | None: ...

    def abort(self) -> None: ...


Placer = Callable[[bytes, int], "Placement | None"]  # ``Tier.place`` of an upper tier, as a lower one calls it


@dataclass(frozen=True)
class TierContext:
    """What a tier may want to know about the chunks it will hold (all optional)."""

    chunk_bytes: int | None = None  # payload size of one full chunk
    # The layouts of the chunks the store's owner reads (an engine's own): a tier that
    # serves what others wrote (peers) refuses a chunk of any other; (): not known.
    layouts: tuple[KVLayout, ...] = ()
    # A shared-memory directory for a memory tier to keep its slab in, so that same-host
    # readers can map it (the cache server's zero-copy path); "" keeps it private.
    shared_dir: str = ""
    # Bytes at the start of every key that name its tenant (the cache server's tag), for
    # a tier that shares its room fairly between tenants; 0: one pool, plain LRU.
    tenant_prefix: int = 0


class Tier(ABC):
    """Base class of every tier. Subclasses implement the five primitives."""

    scheme: ClassVar[str] = ""
    # option name -> parser; every option of a URL must be listed here.
    OPTIONS: ClassVar[dict[str, Callable[[str], Any]]] = {}

    name: str = ""
    capabilities: Capabilities = Capabilities()
    capacity: int = 0  # bytes it may hold; 0 when it does not know (a remote server's own bound)
    backoff: Backoff = Backoff(attempts=0)  # retries of RetryableError, run by the store
    cooldown: float = 5.0  # seconds the store skips this tier once it keeps failing
    # Told of chunks stored in or removed from this tier: (kind, keys); see ``_announce``.
    listener: Callable[[str, Sequence[bytes]], None] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A tier written before ``capabilities`` existed had them found by probing for its
        methods: still honoured for ``keys`` and ``touch``, with a DeprecationWarning."""
        super().__init_subclass__(**kwargs)
        implied = {"listing": "keys", "touch": "touch"}
        missing = {cap: m for cap, m in implied.items() if m in cls.__dict__ and not getattr(cls.capabilities, cap)}
        if missing:
            warnings.warn(
                f"tier {cls.__name__} defines {', '.join(missing.values())} without declaring it: set "
                f"capabilities = Capabilities({', '.join(f'{c}=True' for c in missing)}) (inferred for now)",
                DeprecationWarning,
                stacklevel=2,
            )
            cls.capabilities = replace(cls.capabilities, **dict.fromkeys(missing, True))

    @abstractmethod
    def contains(self, keys: Sequence[bytes]) -> int: ...

    @abstractmethod
    def get(self, keys: Sequence[bytes]) -> list[Chunk | None]: ...

    @abstractmethod
    def put(self, chunks: Sequence[Chunk]) -> None: ...

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    @classmethod
    def from_url(cls, url: TierURL, context: TierContext) -> Tier:
        """Build from a parsed URL; tiers with a location (host, path) override this."""
        if url.netloc or url.path not in ("", "/"):
            raise ConfigError(f"{cls.scheme}:// takes no location, got {url.shown!r}")
        return cls(**url.typed_options(cls.OPTIONS), context=context)

    # -- optional, as ``capabilities`` declares -------------------------------------------
    def keys(self, prefix: bytes = b"", limit: int | None = None) -> list[bytes]:
        """Keys held that start with ``prefix`` (up to ``limit``); with ``listing`` only."""
        raise NotImplementedError(f"tier {self.name} cannot list its keys")

    def touch(self, keys: Sequence[bytes]) -> None:  # noqa: B027 (a no-op unless ``touch``)
        """Mark ``keys`` used, the first most recent; with ``touch`` only."""

    def warm(self) -> None:  # noqa: B027 (a no-op unless a tier has something to prepare)
        """Get ready for the first read or write now, off its path (an engine that has just
        started calls it through ``TieredStore.warm``)."""

    def place(self, key: bytes, nbytes: int) -> Placement | None:
        """Memory for ``key``'s ``nbytes`` of payload that a lower tier reads into, or None
        (this tier holds the key already, has no room, or cannot offer it)."""
        return None

    def get_into(self, keys: Sequence[bytes], place: Placer) -> list[Chunk | None]:
        """``get``, where the tier may read a payload into memory ``place`` hands out
        (committing it: the chunk returned is then the placer's); plain ``get`` by default."""
        return self.get(keys)

    def probe(self, key: bytes) -> None:
        """Prove the tier answers (a server's readiness); raise if it does not. By default a
        tiny chunk round trip under ``key``: written, read back, compared, deleted. A tier
        in which that would evict what it holds when full (memory, local disk) checks
        itself without storing a chunk."""
        data = np.frombuffer(os.urandom(PROBE_LAYOUT.chunk_bytes(4)), dtype=np.uint8)
        self.put([Chunk.from_buffer(key, PROBE_LAYOUT, 4, data, namespace=bytes(16))])
        got = self.get([key])
        try:
            if got[0] is None or got[0].tobytes() != data.tobytes():
                raise TierError(f"tier {self.name} did not give back what it was given")
        finally:
            for chunk in got:
                if chunk is not None:
                    chunk.release()
        self.delete([key])

    def _announce(self, kind: str, keys: Sequence[bytes]) -> None:
        """Tell ``listener`` (set by ``TieredStore.watch``) that ``keys`` were "stored" in
        this tier or "removed" from it (evicted, deleted, dropped as damaged). It must not
        block; whatever it raises is ignored: events never cost a tier call."""
        listener = self.listener
        if listener is not None and keys:
            try:
                listener(kind, keys)
            except Exception:
                pass

    # -- derived conveniences -----------------------------------------------------------
    def has(self, key: bytes) -> bool:
        return self.contains([key]) == 1

    def stats(self) -> dict[str, Any]:
        """Counters and sizes for ``lmtier stats`` and tests; tiers add their own."""
        return {"tier": self.name}

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


# -- URLs -------------------------------------------------------------------------------
@dataclass(frozen=True)
class TierURL:
    scheme: str
    netloc: str
    path: str
    options: dict[str, str] = field(default_factory=dict)
    url: str = ""

    @classmethod
    def parse(cls, url: str) -> TierURL:
        if "://" not in url:
            raise ConfigError(f"tier URL {redact_url(url)!r} has no scheme (e.g. cpu://?size=8GiB)")
        parts = urlsplit(url)
        options: dict[str, str] = {}
        for name, value in parse_qsl(parts.query, keep_blank_values=True):
            if name in options:
                raise ConfigError(f"option {name!r} given twice in {redact_url(url)!r}")
            options[name] = value
        return cls(parts.scheme.lower(), parts.netloc, parts.path, options, url)

    @property
    def shown(self) -> str:
        """The URL fit for messages: secrets replaced (``redact_url``)."""
        return redact_url(self.url)

    def typed_options(self, spec: dict[str, Callable[[str], Any]]) -> dict[str, Any]:
        unknown = sorted(set(self.options) - set(spec))
        if unknown:
            known = ", ".join(sorted(spec)) or "none"
            raise ConfigError(f"unknown option(s) {', '.join(unknown)} in {self.shown!r}; known: {known}")
        typed = {}
        for name, value in self.options.items():
            try:
                typed[name] = spec[name](value)
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"bad value for {name!r} in {self.shown!r}: {exc}") from exc
        return typed


# Options whose values are secrets (or name where one lies): never shown as written.
SECRET_OPTIONS = frozenset(
    {"password", "token", "tls_key"}
    # what no tier takes, but a user may write by mistake (credentials come from the AWS chain)
    | {"secret", "secret_key", "secret_access_key", "aws_secret_access_key", "session_token", "aws_session_token"}
    | {"access_key", "access_key_id", "aws_access_key_id", "key", "credentials"}
)
_SECRET_VALUE = re.compile(rf"([?&](?:{'|'.join(sorted(SECRET_OPTIONS))})=)[^&#]*", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` fit to show (errors, logs, Stats, the CLI): the password of its user info
    and the values of ``SECRET_OPTIONS`` replaced by ``***``. The user info is everything
    before the last ``@``, whatever it holds (a password with an unencoded ``/``, ``?`` or
    ``#`` too); unparsable text shows its scheme alone."""
    # A secret option's value may hold an '@' (the tiers read it from the query): hidden
    # first, so that no part of it is taken for user info below.
    url = _SECRET_VALUE.sub(lambda m: f"{m.group(1)}***", url)
    if "://" not in url:  # not a URL: no query, no user info
        return url.split("?", 1)[0].rsplit("@", 1)[-1]
    scheme, rest = url.split("://", 1)
    user = ""
    if "@" in rest:
        auth, rest = rest.rsplit("@", 1)
        name, has_password, _ = auth.partition(":")
        user = f"{name}:***@" if has_password and "/" not in name else "***@"
    try:
        parts = urlsplit(f"{scheme}://{rest}")
        options = parse_qsl(parts.query, keep_blank_values=True)
    except ValueError:
        return f"{scheme}://***"
    query = "&".join(
        f"{quote(k, safe='')}={'***' if k.lower() in SECRET_OPTIONS else quote(v, safe='/:,.-_')}" for k, v in options
    )
    shown = f"{parts.scheme}://{user}{parts.netloc}{parts.path}"
    return f"{shown}?{query}" if query else shown


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on", ""):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


# -- registry ---------------------------------------------------------------------------
# scheme -> ("module:Class", extra that provides its dependencies, or None for core)
_REGISTRY: dict[str, tuple[str, str | None]] = {
    "cpu": ("lmtier.tiers.cpu:CpuTier", None),
    "file": ("lmtier.tiers.disk:DiskTier", None),
    "redis": ("lmtier.tiers.redis:RedisTier", "redis"),
    "rediss": ("lmtier.tiers.redis:RedisTier", "redis"),
    "unix": ("lmtier.tiers.redis:RedisTier", "redis"),
    "redis+cluster": ("lmtier.tiers.redis:RedisTier", "redis"),
    "grpc": ("lmtier.tiers.grpc:GrpcTier", "grpc"),
    "grpcs": ("lmtier.tiers.grpc:GrpcTier", "grpc"),
    "s3": ("lmtier.tiers.s3:S3Tier", "s3"),
    "peers": ("lmtier.tiers.peers:PeerTier", "grpc"),
}


# The port a network tier's URL means when it names none. Here rather than in each tier's
# module, so that what reads URLs (events' ownership, logs) imports no client library.
DEFAULT_PORTS = {"redis": 6379, "grpc": 50051}


def register_tier(scheme: str, target: str, extra: str | None = None) -> None:
    """Map a URL scheme to ``"module:Class"``; the module is imported on first use."""
    _REGISTRY[scheme.lower()] = (target, extra)


def known_schemes() -> list[str]:
    return sorted(_REGISTRY)


def tier_class(scheme: str) -> type[Tier]:
    if scheme not in _REGISTRY:
        raise ConfigError(f"unknown tier scheme {scheme!r}; known: {', '.join(known_schemes())}")
    target, extra = _REGISTRY[scheme]
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        if extra and missing.split(".")[0] != "lmtier":
            raise MissingDependency(missing, extra) from exc
        raise
    return getattr(module, class_name)


def check_tier_url(url: str) -> None:
    """Refuse, without opening anything, a tier URL that could never open: no scheme, an
    unknown scheme, an unknown option or a bad value (``ConfigError``), the scheme's extra
    not installed (``MissingDependency``). For checks before an engine starts its work."""
    parsed = TierURL.parse(url)
    parsed.typed_options(tier_class(parsed.scheme).OPTIONS)  # type: ignore[attr-defined]


def open_tier(url: str, context: TierContext | None = None) -> Tier:
    """Build the tier a URL names: ``open_tier("cpu://?size=8GiB")``.

    A misconfigured URL raises ``ConfigError`` (or ``MissingDependency``); a tier that is
    configured well but cannot be opened now (a server down, a directory locked) raises
    what it raised, for the caller to decide: ``lmtier.tiers.deferred.open_or_defer``
    returns a ``DeferredTier`` instead, what an engine wants at start. A configured list
    of tiers is opened by ``TieredStore.open``, which closes the tiers it opened when a
    later one fails.
    """
    parsed = TierURL.parse(url)
    return tier_class(parsed.scheme).from_url(parsed, context or TierContext())  # type: ignore[attr-defined]

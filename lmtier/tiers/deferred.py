"""A tier that could not be opened when its process started: it misses until it opens.

A misconfigured tier (a bad URL, an unknown option, a bad value, a missing extra) is an
error at start: nothing will fix it but the operator. An *unreachable* one is not: Redis
restarting, the cache server not up yet, a disk directory locked by another process that
is opening it too. An engine must not die of that. ``open_or_defer(url)`` then returns a
``DeferredTier``, which

- says so in one warning,
- misses (``contains`` 0, ``get`` all None, ``put`` dropped and counted, ``delete`` a
  no-op), which the store and the engine already treat as "recompute",
- opens the real tier again in a background thread, at most once per backoff interval
  (doubling up to ``MAX_BACKOFF_S``), triggered by the calls it gets,
- and once that succeeds hands every call to the real tier.

    open_or_defer(url, context) -> Tier     ``open_tier``, or a DeferredTier for an unreachable one
    DeferredTier(cls, url, context, error)  misses until its real tier opens
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from lmtier.breaker import Backoff
from lmtier.errors import TierError
from lmtier.kv.chunk import Chunk
from lmtier.tiers.base import Capabilities, Placement, Placer, Tier, TierContext, TierURL, tier_class

log = logging.getLogger(__name__)
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
# What a constructor raises for a configuration that can never work: not retried.
MISCONFIGURED = (ValueError, TypeError, ImportError)


def open_or_defer(url: str, context: TierContext | None = None) -> Tier:
    """The tier a URL names (``open_tier``), or, where it is configured well but cannot be
    opened now (a server down, a directory locked), a ``DeferredTier`` that misses and
    opens it again later, instead of raising. A misconfigured URL still raises
    ``ConfigError`` (or ``MissingDependency``)."""
    parsed = TierURL.parse(url)
    cls = tier_class(parsed.scheme)
    context = context or TierContext()
    try:
        return cls.from_url(parsed, context)  # type: ignore[attr-defined]
    except MISCONFIGURED:
        raise
    except Exception as exc:  # unreachable for now: retried
        return DeferredTier(cls, parsed, context, exc)


class DeferredTier(Tier):
    # It forwards keys and touch; each instance then declares what its real tier's class can do.
    capabilities = Capabilities(listing=True, touch=True)

    def __init__(self, cls: type[Tier], url: TierURL, context: TierContext, error: BaseException) -> None:
        self._cls, self._url, self._context = cls, url, context
        self.name = url.options.get("name") or _default_name(cls)
        self.scheme = cls.scheme
        self.capabilities = cls.capabilities  # what the real tier will do, once open
        self.cooldown = cls.cooldown
        self._tier: Tier | None = None
        self._error = f"{type(error).__name__}: {error}"
        self._lock = threading.Lock()
        self._backoff = FIRST_BACKOFF_S
        self._next_try = time.monotonic() + self._backoff
        self._trying_pid = 0  # the process whose retry thread is running, if any
        self._closed = False
        self.attempts = 1
        self.dropped_puts = 0
        log.warning(
            "tier %s (%s) cannot be opened now (%s); it misses and is retried in the background",
            self.name, cls.scheme, self._error,
        )  # fmt: skip

    @property
    def listener(self):  # type: ignore[override]
        return self.__dict__.get("_listener")

    @listener.setter
    def listener(self, fn) -> None:
        self.__dict__["_listener"] = fn
        tier = self.__dict__.get("_tier")
        if tier is not None:
            tier.listener = fn

    # -- the real tier, once it opens ---------------------------------------------------
    @property
    def opened(self) -> Tier | None:
        if self._tier is None:
            self._retry_soon()
        return self._tier

    def _retry_soon(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self._closed or now < self._next_try or self._trying_pid == os.getpid():
                return
            self._trying_pid = os.getpid()  # a thread of another process (before fork) is gone
        threading.Thread(target=self._try_open, name=f"lmtier-open-{self.name}", daemon=True).start()

    def _try_open(self) -> None:
        try:
            tier = self._cls.from_url(self._url, self._context)  # type: ignore[attr-defined]
        except Exception as exc:  # every failure is one more retry
            with self._lock:
                self.attempts += 1
                self._error = f"{type(exc).__name__}: {exc}"
                self._backoff = min(self._backoff * 2, MAX_BACKOFF_S)
                self._next_try = time.monotonic() + self._backoff
                self._trying_pid = 0
            log.debug("tier %s still cannot be opened: %s", self.name, self._error)
            return
        tier.listener = self.listener  # events flow from the real tier once it opens
        with self._lock:
            closed, self._trying_pid = self._closed, 0
            if not closed:
                self._tier = tier
        if closed:
            tier.close()
            return
        log.warning("tier %s opened after %d attempts; it serves from now on", self.name, self.attempts + 1)

    # -- primitives: the real tier's, or misses ---------------------------------------
    def contains(self, keys: Sequence[bytes]) -> int:
        tier = self.opened
        return tier.contains(keys) if tier is not None else 0

    def get(self, keys: Sequence[bytes]) -> list[Chunk | None]:
        tier = self.opened
        return tier.get(keys) if tier is not None else [None] * len(keys)

    def get_into(self, keys: Sequence[bytes], place: Placer) -> list[Chunk | None]:
        tier = self.opened
        return tier.get_into(keys, place) if tier is not None else [None] * len(keys)

    def place(self, key: bytes, nbytes: int) -> Placement | None:
        tier = self.opened
        return tier.place(key, nbytes) if tier is not None else None

    def put(self, chunks: Sequence[Chunk]) -> None:
        tier = self.opened
        if tier is not None:
            tier.put(chunks)
        else:
            self.dropped_puts += len(chunks)

    def delete(self, keys: Sequence[bytes]) -> None:
        tier = self.opened
        if tier is not None:
            tier.delete(keys)

    def probe(self, key: bytes) -> None:
        tier = self.opened
        if tier is None:
            raise TierError(f"tier {self.name} is not open: {self._error}")
        tier.probe(key)

    @property
    def backoff(self) -> Backoff:  # type: ignore[override]
        tier = self._tier
        return tier.backoff if tier is not None else self._cls.backoff

    def keys(self, prefix: bytes = b"", limit: int | None = None) -> list[bytes]:
        tier = self.opened
        return tier.keys(prefix, limit) if tier is not None else []

    def touch(self, keys: Sequence[bytes]) -> None:
        tier = self.opened
        if tier is not None:
            tier.touch(keys)

    def warm(self) -> None:
        tier = self.opened
        if tier is not None:
            tier.warm()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            tier, self._tier = self._tier, None
        if tier is not None:
            tier.close()

    def stats(self) -> dict[str, Any]:
        tier = self.opened
        if tier is not None:
            return tier.stats()
        return {
            "tier": self.name,
            "state": "unavailable",
            "unavailable": 1,  # a counter, for surfaces that carry numbers only (the Stats RPC)
            "error": self._error,
            "attempts": self.attempts,
            "dropped_puts": self.dropped_puts,
            "capacity_bytes": 0,
            "used_bytes": 0,
            "chunks": 0,
            "corrupt": 0,
        }

    def __getattr__(self, name: str) -> Any:
        """A tier's own extras (``masters``, ``counts``, ...) exist once the real tier is open."""
        if name.startswith("_"):
            raise AttributeError(name)
        tier = self.__dict__.get("_tier")
        if tier is None:
            raise AttributeError(f"{name} (tier {self.__dict__.get('name')} is not open)")
        return getattr(tier, name)

    def __repr__(self) -> str:
        return f"<DeferredTier {self.name}: {'open' if self._tier is not None else 'unavailable'}>"


def _default_name(cls: type[Tier]) -> str:
    parameter = inspect.signature(cls.__init__).parameters.get("name")
    if parameter is not None and isinstance(parameter.default, str):
        return parameter.default
    return cls.name or cls.scheme

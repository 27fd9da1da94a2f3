"""The object-storage tier: one object per chunk, in any S3-compatible bucket.

    S3Tier(bucket, prefix, size=..., endpoint=..., region=...)   or  open_tier("s3://bucket/prefix?...")
        .contains(keys) -> int           what it knows, then HEADs in windows until the first miss
        .get(keys) -> [Chunk | None]     GETs, all in flight; each object verified as a chunk frame
        .put(chunks)                     deletes what must go to stay within ``size``, then PUTs
        .delete(keys) / .keys(prefix, limit) / .stats() / .close()

An object is the chunk's canonical frame (header, layout, checksum: ``lmtier.kv.codec``)
under ``prefix/<key in hex>``: what fails to decode as the frame of the key it is stored
under (truncated, damaged, foreign, another key's) is a miss, and is deleted. A PUT is
atomic in S3: a reader sees a whole object or none, and two writers of one key leave one
writer's whole frame.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

from lmtier import metrics
from lmtier.buffers import BufferPool
from lmtier.errors import ConfigError, IntegrityError, TierError
from lmtier.kv import codec
from lmtier.kv.chunk import Chunk
from lmtier.tiers.base import Capabilities, Tier, TierContext, TierURL
from lmtier.tiers.options import positive_seconds, seconds
from lmtier.tiers.s3.client import TOO_LARGE, Bucket, Reply, Settings
from lmtier.tiers.s3.index import Held
from lmtier.tiers.s3.learn import Learner
from lmtier.units import format_bytes, parse_size

log = logging.getLogger(__name__)

HEAD_WINDOW = 16  # HEADs in flight at once while finding a leading run: requests ~ the run + 16
FRAME_SLACK = 4096  # a frame's preamble and header beyond the payload, for a GET's first buffer
STATUS_EMPTY = 416
DEFAULT_MAX_OBJECT = 256 << 20  # the largest object read where the chunk size is not known


DEFAULT_PREFIX = "lmtier"  # where a URL without a path keeps its objects (never the bucket's root)
MIN_ENTRIES = 4096  # the count bound of what the tier knows: at least this many keys,
MIN_ENTRY_BYTES = 64 << 10  # else one per this many bytes of size (or a quarter chunk, if larger)
_PREFIX = re.compile(r"[A-Za-z0-9!_.*'()/-]*")  # S3's safe characters for a key name, and '/'


def checked_prefix(prefix: str) -> str:
    """``prefix`` as objects' names begin (``a/b/``), or a ConfigError: servers rewrite an
    empty, ``.`` or ``..`` segment or drop what they cannot store, so that what was written
    would not be listed (and so not bounded) under it."""
    body = prefix.strip("/")
    if not body:
        return ""
    if not _PREFIX.fullmatch(body) or any(seg in ("", ".", "..") for seg in body.split("/")):
        raise ConfigError(
            f"the prefix {body[:64]!r} must be segments of letters, digits and !_.*'()- joined by single '/', "
            "none of them '.' or '..'"
        )
    return body + "/"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be at least 1")
    return value


class S3Tier(Tier):
    scheme = "s3"
    capabilities = Capabilities(listing=True, touch=True)
    OPTIONS = {
        "endpoint": str,
        "region": str,
        "addressing": str,
        "size": parse_size,
        "timeout": positive_seconds,
        "connect_timeout": positive_seconds,
        "part_size": parse_size,
        "threads": _positive_int,
        "max_object": parse_size,
        "list_timeout": seconds,
        "relist": seconds,
        "name": str,
    }

    def __init__(
        self,
        bucket: str,
        prefix: str = DEFAULT_PREFIX,
        *,
        size: int = 100 << 30,
        endpoint: str = "",
        region: str = "",
        addressing: str = "",
        timeout: float = 10.0,
        connect_timeout: float = 2.0,
        part_size: int = 8 << 20,
        threads: int = 2,
        max_object: int = 0,
        list_timeout: float = 30.0,
        relist: float = 300.0,
        name: str = "s3",
        context: TierContext | None = None,
    ) -> None:
        if not bucket:
            raise ConfigError("an s3:// URL names its bucket: s3://bucket/prefix")
        if size <= 0:
            raise ConfigError("size must be positive: the tier deletes to stay within it")
        if part_size < 5 << 20:
            raise ConfigError(
                f"part_size is at least 5MiB (S3's smallest multipart part), got {format_bytes(part_size)}"
            )
        if "@" in endpoint:
            raise ConfigError("the endpoint holds no credentials: they come from the AWS chain (environment, files)")
        self.name, self.capacity, self.bucket = name, size, bucket
        self.prefix = checked_prefix(prefix)
        region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        self.region = region
        chunk = (context.chunk_bytes if context else None) or (1 << 20)
        self.expected = chunk + FRAME_SLACK
        # the largest object read: a larger one is no chunk of this tier's (or a server gone wrong)
        self.max_object = max_object or max(4 * self.expected, DEFAULT_MAX_OBJECT)
        self.list_timeout, self.relist = list_timeout, relist
        self._buffers = BufferPool(max_free=64, max_free_bytes=256 << 20)
        settings = Settings(
            bucket, region, endpoint, addressing, part_size, timeout, connect_timeout, threads, name=name
        )
        self.endpoint = endpoint
        self.remote = Bucket(settings, self._buffers)
        self.held = Held(size, max_entries=max(MIN_ENTRIES, size // max(MIN_ENTRY_BYTES, self.expected // 4)))
        self._lock = threading.Lock()
        self._counts = {
            "stored": 0, "corrupt": 0, "errors": 0, "timeouts": 0, "throttled": 0, "evicted": 0,
            "bytes_loaded": 0, "bytes_stored": 0, "listed": 0, "listings": 0,
        }  # fmt: skip
        self.learner = Learner(self)
        self.learner.start()

    @classmethod
    def from_url(cls, url: TierURL, context: TierContext) -> S3Tier:
        options = url.typed_options(cls.OPTIONS)
        if "@" in url.netloc:
            raise ConfigError("an s3:// URL holds no credentials: they come from the AWS chain (environment, files)")
        return cls(url.netloc, url.path.strip("/") or DEFAULT_PREFIX, context=context, **options)

    def _name(self, key: bytes) -> str:
        return self.prefix + key.hex()

    def _key(self, name: str) -> bytes | None:
        """The chunk key an object's name stands for; None for an object not lmtier's."""
        if not name.startswith(self.prefix):
            return None
        rest = name[len(self.prefix) :]
        if len(rest) not in (32, 64):
            return None
        try:
            return bytes.fromhex(rest)
        except ValueError:
            return None

    # -- primitives ---------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            n = 0
            while n < len(keys) and keys[n] in self.held:
                n += 1
        known = n
        deadline = time.monotonic() + self.remote.settings.timeout  # the whole lookup's, not each window's
        while n < len(keys) and time.monotonic() < deadline:
            window = list(keys[n : n + HEAD_WINDOW])
            replies = self.remote.head([self._name(k) for k in window], deadline)
            for reply in replies:
                if not reply.ok and not reply.missing:
                    self._failed(reply)
            if n == known:  # nothing answered yet: the bucket is down; later, what was found stands
                self._raise_if_down(replies)
            found = []
            for key, reply in zip(window, replies, strict=True):
                if not reply.ok or reply.length > self.max_object:
                    break
                found.append((key, reply.length))
            if found:
                with self._lock:
                    fresh = [(k, s) for k, s in found if k not in self.held]
                    self.held.add([k for k, _ in fresh], [s for _, s in fresh], self.learner.generation)
            n += len(found)
            if len(found) < len(window):
                break
        return n

    def get(self, keys: Sequence[bytes]) -> list[Chunk | None]:
        out: list[Chunk | None] = [None] * len(keys)
        if not keys:
            return out
        with self._lock:
            sizes = [self.held.size(k) or self.expected for k in keys]
        replies = self.remote.get([self._name(k) for k in keys], sizes, self.max_object)
        hits, gone = [], []
        for i, reply in enumerate(replies):
            if reply.ok:
                out[i] = self._decode(keys[i], reply)
                if out[i] is not None:
                    hits.append(keys[i])
                    self._count("bytes_loaded", reply.length)
            elif reply.missing:
                gone.append(keys[i])
            elif reply.status == STATUS_EMPTY or reply.error == TOO_LARGE:  # empty, or larger than any chunk
                self._drop_corrupt(keys[i])
            else:
                self._failed(reply)
        with self._lock:
            self.held.recent(hits)
            self.held.remove(gone)
        metrics.TIER_BYTES.labels(self.name, "get").inc(sum(r.length for r in replies if r.ok))
        self._raise_if_down(replies)
        return out

    def put(self, chunks: Sequence[Chunk]) -> None:
        items, keys, total = [], [], 0
        batch = [c.key for c in chunks]
        with self._lock:
            todo = [c for c in chunks if c.key not in self.held]
            self.held.recent(batch)  # what is held already is used again: kept before what is not
        for chunk in todo:
            try:
                parts = codec.encode_parts(chunk)
            except IntegrityError:
                self._count("corrupt")  # a damaged chunk from an upper tier is not stored
                continue
            size = sum(memoryview(p).nbytes for p in parts)
            if total + size > self.capacity:  # the prompt's first chunks are worth most: the rest is not stored
                break
            total += size
            items.append((self._name(chunk.key), parts, size))
            keys.append(chunk.key)
        if not items:
            return
        deadline = time.monotonic() + self.remote.settings.timeout  # the whole put's: deletes, then PUTs
        with self._lock:
            victims = self.held.victims(total, keep=batch, new=len(items))
        if victims:
            self._delete(victims, evicted=True, deadline=deadline)
        replies = self.remote.put(items, deadline)
        landed = [(k, item[2]) for k, item, r in zip(keys, items, replies, strict=True) if r.ok]
        for reply in replies:
            if not reply.ok:
                self._failed(reply)
        with self._lock:
            self.held.add([k for k, _ in landed], [s for _, s in landed], self.learner.generation)
            self.held.recent(batch)  # the batch's first chunk the most recent, whether new or not
            over = self.held.victims(0, keep=batch)  # another writer's objects learned meanwhile
        if over:
            self._delete(over, evicted=True, deadline=deadline)
        stored = sum(s for _, s in landed)
        self._count("stored", len(landed))
        self._count("bytes_stored", stored)
        metrics.TIER_BYTES.labels(self.name, "put").inc(stored)
        metrics.TIER_OPS.labels(self.name, "put", "stored").inc(len(landed))
        metrics.TIER_OPS.labels(self.name, "put", "dropped").inc(len(chunks) - len(landed))
        self._announce("stored", [k for k, _ in landed])
        self._raise_if_down(replies)

    def delete(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._delete(list(keys))

    def _delete(self, keys: list[bytes], evicted: bool = False, deadline: float = 0.0) -> None:
        with self._lock:
            self.held.remove(keys)
        self._announce("removed", keys)  # first: a failed delete leaves a router under-counting
        replies = self.remote.delete([self._name(k) for k in keys], deadline)
        if evicted:
            self._count("evicted", len(keys))
        for reply in replies:
            if not reply.ok and not reply.missing:
                self._failed(reply)
        self._raise_if_down(replies)

    def touch(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            self.held.recent(keys)

    def keys(self, prefix: bytes = b"", limit: int | None = None) -> list[bytes]:
        """The bucket's chunks under this tier's prefix (listed: what other writers stored
        too), up to ``limit``."""
        out: list[bytes] = []
        token = ""
        while limit is None or len(out) < limit:
            objects, token = self.remote.list(self.prefix + prefix.hex(), token)
            out += [k for k in (self._key(name) for name, _, _ in objects) if k is not None]
            if not token:
                break
        return out if limit is None else out[:limit]

    def close(self) -> None:
        self.learner.stop(timeout=self.remote.settings.timeout + 1)
        self.remote.close()

    # -- replies ------------------------------------------------------------------------
    def _decode(self, key: bytes, reply: Reply) -> Chunk | None:
        buf = reply.body
        try:
            return codec.decode(
                memoryview(buf)[: reply.length],
                key=key,
                lazy=True,
                on_release=lambda b=buf: self._buffers.release(b),
                on_corrupt=lambda: self._drop_corrupt(key),
            )
        except IntegrityError as exc:
            self._buffers.release(buf)
            log.warning("s3 tier %s: dropping damaged object %s: %s", self.name, self._name(key), exc)
            self._drop_corrupt(key)
            return None

    def _drop_corrupt(self, key: bytes) -> None:
        self._count("corrupt")
        metrics.INTEGRITY_FAILURES.labels(self.name).inc()
        try:
            self._delete([key])
        except TierError as exc:
            log.warning("s3 tier %s: cannot delete a damaged object: %s", self.name, exc)

    def _failed(self, reply: Reply) -> None:
        if reply.throttled:
            self._count("throttled")
        elif reply.error == "timeout":
            self._count("timeouts")
        else:
            self._count("errors")

    def _raise_if_down(self, replies: Sequence[Reply]) -> None:
        """A batch none of whose requests got an answer: the store is down (or out of time),
        which the store's breaker counts; otherwise failures are misses."""
        if replies and all(r.status == 0 and r.error and r.error != TOO_LARGE for r in replies):
            raise TierError(
                f"s3 tier {self.name}: no answer from the bucket to {len(replies)} requests ({replies[0].error})"
            )

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts[what] += n

    def request_counts(self) -> dict[str, int]:
        """Requests sent by kind (get, put, head, delete, list), as a bill counts them."""
        return dict(self.remote.requests)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counts = dict(self._counts)
            used, chunks = self.held.used, len(self.held)
        requests = dict(self.remote.requests)
        loaded_gb, stored_gb = counts["bytes_loaded"] / 1e9, counts["bytes_stored"] / 1e9
        return {
            "tier": self.name,
            "bucket": self.bucket,
            "prefix": self.prefix,
            "capacity_bytes": self.capacity,
            "used_bytes": used,
            "chunks": chunks,
            **counts,
            **{f"requests_{kind}": n for kind, n in requests.items()},
            # what a bill counts per GB moved (None until something was)
            "gets_per_gb_loaded": round(requests["get"] / loaded_gb, 1) if loaded_gb else None,
            "puts_per_gb_stored": round(requests["put"] / stored_gb, 1) if stored_gb else None,
        }

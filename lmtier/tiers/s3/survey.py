"""What a bucket's prefix holds, read by listing it and never changing it (``lmtier stats
--bucket``): an operator's look at a tier that engines and servers write.

    survey(url, time_limit) -> dict   chunks, bytes, other objects, oldest and newest, the
                                      requests the listing cost, whether it was cut short
    held(url, keys) -> [bool | None]  which of a prompt's chunks the bucket holds (HEADs;
                                      None: no answer)
"""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime
from typing import Any

from lmtier.buffers import BufferPool
from lmtier.errors import ConfigError
from lmtier.tiers.base import TierURL
from lmtier.tiers.s3.client import Bucket, Settings
from lmtier.tiers.s3.tier import DEFAULT_PREFIX, S3Tier, checked_prefix


def _open(url: str) -> tuple[Bucket, str, TierURL, dict[str, Any]]:
    """The bucket a tier URL names, checked as the tier checks it (no credentials in it,
    a prefix servers keep as written), and its prefix."""
    parsed = TierURL.parse(url)
    if parsed.scheme != "s3":
        raise ConfigError(f"--bucket takes an s3:// tier URL, got {parsed.shown!r}")
    options = parsed.typed_options(S3Tier.OPTIONS)
    if "@" in parsed.netloc or "@" in options.get("endpoint", ""):
        raise ConfigError("an s3:// URL and its endpoint hold no credentials: they come from the AWS chain")
    prefix = checked_prefix(parsed.path.strip("/") or DEFAULT_PREFIX).rstrip("/")
    settings = Settings(
        bucket=parsed.netloc,
        region=options.get("region") or os.environ.get("AWS_REGION") or "us-east-1",
        endpoint=options.get("endpoint", ""),
        addressing=options.get("addressing", ""),
        timeout=options.get("timeout", 10.0),
        name="survey",
    )
    return Bucket(settings, BufferPool(max_free=0)), prefix, parsed, options


def held(url: str, keys: list[bytes]) -> list[bool | None]:
    bucket, prefix, _, _ = _open(url)
    try:
        replies = bucket.head([f"{prefix}/{k.hex()}" for k in keys])
    finally:
        bucket.close()
    return [True if r.ok else False if r.missing else None for r in replies]


def survey(url: str, time_limit: float = 60.0) -> dict[str, Any]:
    bucket, prefix, parsed, options = _open(url)
    chunks = other = used = 0
    oldest, newest = float("inf"), 0.0
    token, complete = "", False
    deadline = time.monotonic() + time_limit
    try:
        while time.monotonic() < deadline:
            page, token = bucket.list(prefix + "/", token)
            for name, size, modified in page:
                rest = name[len(prefix) + 1 :]
                if len(rest) in (32, 64) and all(c in "0123456789abcdef" for c in rest):
                    chunks += 1
                    used += size
                    oldest, newest = min(oldest, modified), max(newest, modified)
                else:
                    other += 1
            if not token:
                complete = True
                break
    finally:
        bucket.close()

    def when(t: float) -> str | None:
        return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds") if chunks else None

    return {
        "bucket": parsed.netloc,
        "prefix": prefix,
        "chunks": chunks,
        "used_bytes": used,
        "capacity_bytes": options.get("size", 0),
        "other_objects": other,  # under the prefix, not named as chunks: lmtier leaves them alone
        "oldest": when(oldest),
        "newest": when(newest),
        "list_requests": bucket.requests["list"],
        "complete": complete,  # False: the time limit cut the listing short
    }

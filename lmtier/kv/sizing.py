"""The memory planner behind ``lmtier size``: what a model's KV costs, and what fits where."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmtier.kv.layout import KVLayout
from lmtier.units import format_bytes, format_si


@dataclass(frozen=True)
class TierFit:
    name: str
    capacity_bytes: int
    chunks: int  # full chunks that fit
    tokens: int  # tokens those chunks hold
    contexts: int  # full contexts of the planned length
    requests: dict[str, int] | None = None  # an object store's: what one context costs in requests


@dataclass(frozen=True)
class Plan:
    model: str
    layout: KVLayout
    tokens: int
    batch: int
    chunk_tokens: int
    tiers: list[TierFit] = field(default_factory=list)

    @property
    def bytes_per_token(self) -> int:
        return self.layout.bytes_per_token

    @property
    def bytes_per_chunk(self) -> int:
        return self.layout.chunk_bytes(self.chunk_tokens)

    @property
    def context_bytes(self) -> int:
        return self.bytes_per_token * self.tokens

    @property
    def total_bytes(self) -> int:
        return self.context_bytes * self.batch

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "layout": self.layout.to_dict(),
            "attention": self.layout.attention,
            "dtype": self.layout.dtype,
            "bytes_per_token": self.bytes_per_token,
            "chunk_tokens": self.chunk_tokens,
            "bytes_per_chunk": self.bytes_per_chunk,
            "tokens": self.tokens,
            "batch": self.batch,
            "context_bytes": self.context_bytes,
            "total_bytes": self.total_bytes,
            "tiers": [fit.__dict__ for fit in self.tiers],
        }

    def to_text(self) -> str:
        def both(n: int) -> str:
            return f"{format_bytes(n)} ({n:,} B, {format_si(n)})"

        lines = [
            f"model          {self.model}: {self.layout.describe()}",
            f"per token      {both(self.bytes_per_token)}",
            f"per chunk      {both(self.bytes_per_chunk)} = {self.chunk_tokens} tokens",
            f"context        {both(self.context_bytes)} = {self.tokens:,} tokens",
            f"batch of {self.batch:<5} {both(self.total_bytes)}",
        ]
        for fit in self.tiers:
            lines.append(
                f"tier {fit.name:<9} {format_bytes(fit.capacity_bytes)} holds {fit.tokens:,} tokens "
                f"in {fit.chunks:,} chunks = {fit.contexts:,} full context{'' if fit.contexts == 1 else 's'} "
                f"of {self.tokens:,} tokens"
            )
            if fit.requests:
                r = fit.requests
                lines.append(
                    f"  requests     a context loads with {r['gets_per_context']:,} GETs and stores with "
                    f"{r['puts_per_context']:,} PUTs ({r['gets_per_gb']:,} GETs per GB loaded), objects of "
                    f"{format_bytes(self.bytes_per_chunk)}"
                )
                if self.bytes_per_chunk < SMALL_OBJECT:
                    lines.append(
                        f"  advice       objects under {format_bytes(SMALL_OBJECT)} cost more in requests than in "
                        "bytes moved: a larger --chunk-tokens (chunk_tokens) sends fewer"
                    )
        return "\n".join(lines)


SMALL_OBJECT = 1 << 20  # below this an object store's per-request cost outweighs its bytes
PART_SIZE = 8 << 20  # the s3 tier's default part size: a larger object moves in parts


def object_requests(chunk_bytes: int, chunks_per_context: int, part_size: int = PART_SIZE) -> dict[str, int]:
    """What one context costs an object store: a GET per part of each chunk, a PUT per
    chunk (a multipart upload: its parts, its start and its end)."""
    parts = -(-chunk_bytes // part_size)
    puts = 1 if chunk_bytes <= part_size else parts + 2
    return {
        "gets_per_context": parts * chunks_per_context,
        "puts_per_context": puts * chunks_per_context,
        "gets_per_gb": round(parts * 1e9 / chunk_bytes),
    }


def plan(
    model: str,
    layout: KVLayout,
    tokens: int,
    *,
    batch: int = 1,
    chunk_tokens: int = 256,
    tiers: dict[str, int] | None = None,
) -> Plan:
    if tokens <= 0 or batch <= 0 or chunk_tokens <= 0:
        raise ValueError("tokens, batch and chunk tokens must be positive")
    chunk_bytes = layout.chunk_bytes(chunk_tokens)
    # Only full chunks are cached: a context occupies floor(tokens / chunk) chunks.
    chunks_per_context = max(1, tokens // chunk_tokens)
    fits = []
    for name, capacity in (tiers or {}).items():
        chunks = capacity // chunk_bytes
        requests = object_requests(chunk_bytes, chunks_per_context) if name == "s3" else None
        fits.append(TierFit(name, capacity, chunks, chunks * chunk_tokens, chunks // chunks_per_context, requests))
    return Plan(model, layout, tokens, batch, chunk_tokens, fits)

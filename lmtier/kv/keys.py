"""Content addresses for chunks: a chained hash over token ids, seeded by a namespace.

    key_{-1} = H(namespace)
    key_i    = H(key_{i-1} || tokens of chunk i as int32 little-endian)

so a key names a chunk *and every token before it*: two prompts share key ``i`` only if
they share their first ``(i + 1) x chunk_tokens`` tokens. The namespace folds in
everything that changes the bytes of the KV (model, revision, layout, dtype, parallel
rank and size, chunk size, format version, tenant salt): two models never share a key,
two instances of one model always do. H is xxh3-128 (fast) or sha256 (cryptographic),
never Python's ``hash()``, so keys agree across processes, machines and versions.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import msgpack
import numpy as np
import xxhash

from lmtier.errors import ConfigError, LayoutError
from lmtier.kv.layout import KVLayout

FORMAT_VERSION = 1  # bump when the canonical chunk bytes change meaning
HASHES = ("xxh3", "sha256")
ChunkKey = bytes  # 16 bytes (xxh3-128) or 32 bytes (sha256)

# A tenant's tag prefixes every key it stores in a shared server (``tag + key``). A
# cryptographic digest, 128 bits: no tenant name can be found that collides with another's
# (a collision would share keys), by design or by luck.
TAG_BYTES = 16


def tenant_tag(tenant: str) -> bytes:
    return hashlib.blake2b(tenant.encode(), digest_size=TAG_BYTES, person=b"lmtier.tenant").digest()


def _hash_fn(name: str):
    if name == "xxh3":
        return xxhash.xxh3_128_digest
    if name == "sha256":
        return lambda data: hashlib.sha256(data).digest()
    raise ConfigError(f"unknown key hash {name!r}; choose one of {HASHES}")


@dataclass(frozen=True)
class Namespace:
    """Everything that changes the bytes of a chunk. Its digest seeds every key."""

    model: str
    layout: KVLayout
    chunk_tokens: int = 256
    revision: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    salt: str = ""  # tenant or cache salt: isolates caches that must not share
    hash: str = "xxh3"
    format_version: int = field(default=FORMAT_VERSION)
    # What else decides how an engine's cache bytes read as canonical KV (vLLM's CPU
    # backend: its block size and the instruction set its attention packs K for); only
    # in the digest when set, so the keys of engines that need none stay as they were.
    engine: str = ""
    # A hybrid model's KV cache group (its kind and layers), each group a chain of its own;
    # only in the digest when set, so a model with one group keeps its keys.
    group: str = ""

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("a namespace needs a model id")
        if self.chunk_tokens <= 0:
            raise ConfigError(f"chunk_tokens must be positive, got {self.chunk_tokens}")
        if not (0 <= self.tp_rank < self.tp_size) or not (0 <= self.pp_rank < self.pp_size):
            raise ConfigError("parallel ranks must lie in [0, size)")
        _hash_fn(self.hash)

    def fields(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "revision": self.revision,
            "layout": self.layout.to_dict(),
            "chunk_tokens": self.chunk_tokens,
            "tp": [self.tp_rank, self.tp_size],
            "pp": [self.pp_rank, self.pp_size],
            "salt": self.salt,
            "hash": self.hash,
            "format_version": self.format_version,
            **({"engine": self.engine} if self.engine else {}),
            **({"group": self.group} if self.group else {}),
        }

    @cached_property
    def digest(self) -> bytes:
        """H of a canonical msgpack encoding of :meth:`fields` (sorted keys)."""
        canonical = msgpack.packb(_sorted(self.fields()), use_bin_type=True)
        return _hash_fn(self.hash)(b"lmtier.namespace\x00" + canonical)

    @property
    def chunk_bytes(self) -> int:
        return self.layout.chunk_bytes(self.chunk_tokens)

    def keys(self, tokens: Any) -> list[ChunkKey]:
        """One key per *full* chunk of ``tokens``; a partial tail gets none."""
        return chunk_keys(tokens, self)


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    return value


def as_token_array(tokens: Any) -> np.ndarray:
    """A 1-d little-endian int32 array from a list, numpy array or torch tensor.

    No per-token Python loop: lists go through numpy's C conversion, tensors through
    ``.numpy()``. Token ids must lie in ``[0, 2**31)``.
    """
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # torch.Tensor, no import
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise LayoutError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype="<i4")
    if arr.dtype.kind not in "iu":
        raise LayoutError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.dtype != np.dtype("<i4"):
        if int(arr.min()) < 0 or int(arr.max()) >= 2**31:
            raise LayoutError("token ids must lie in [0, 2**31)")
        arr = arr.astype("<i4")
    elif int(arr.min()) < 0:
        raise LayoutError("token ids must lie in [0, 2**31)")
    return np.ascontiguousarray(arr)


def chunk_keys(tokens: Any, namespace: Namespace) -> list[ChunkKey]:
    """The chained keys of every full chunk of ``tokens`` under ``namespace``."""
    return chained_keys(tokens, namespace.digest, namespace.chunk_tokens, namespace.hash)


def chained_keys(tokens: Any, seed: bytes, chunk_tokens: int, hash: str = "xxh3") -> list[ChunkKey]:
    """``chunk_keys`` from a namespace's digest alone (``seed``): what a router that knows an
    engine's digest, not its whole namespace, computes (the cache server's ``Match``)."""
    if chunk_tokens <= 0:
        raise ConfigError(f"chunk_tokens must be positive, got {chunk_tokens}")
    h = _hash_fn(hash)
    arr = as_token_array(tokens)
    step = chunk_tokens * 4
    data = memoryview(arr).cast("B")
    keys: list[ChunkKey] = []
    prev = seed
    for start in range(0, (len(arr) // chunk_tokens) * step, step):
        prev = h(prev + data[start : start + step])
        keys.append(prev)
    return keys


def named_keys(names: Any, namespace: Namespace) -> list[ChunkKey]:
    """Keys of chunks an engine addresses by its own names rather than by tokens (SGLang
    hands its storage backends page hashes, never token ids):
    ``H(namespace digest || "lmtier.named" || name)``. The namespace keeps two models,
    layouts or tenants apart exactly as for token keys; the engine's name must itself
    cover the whole prefix (SGLang's page hashes are chained)."""
    h = _hash_fn(namespace.hash)
    seed = namespace.digest + b"lmtier.named\x00"
    return [h(seed + (n if isinstance(n, bytes) else str(n).encode("utf-8"))) for n in names]

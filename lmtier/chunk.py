"""``Chunk``: the KV of one chunk of tokens in the canonical layout.

``data`` is always a 4-d ``uint8`` view ``[layers, kv_factor, tokens, row_bytes]`` (see
``KVLayout.byte_shape``): the core moves bytes and never needs to know the dtype, which
keeps bf16 and fp8 (that numpy cannot name) on the same path as fp32. The view may be
strided, for example a slice of a caller's ``[layers, 2, prompt_tokens, ...]`` tensor:
nothing is copied until a tier copies it into its own memory.

A chunk handed out by a tier may be a view of that tier's memory; it then holds a lease
that keeps the memory from being reused. ``release()`` (or leaving a ``with`` block, or
garbage collection) ends the lease.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator

import numpy as np
import xxhash

from lmtier.errors import LayoutError
from lmtier.layout import KVLayout


class Chunk:
    __slots__ = ("__weakref__", "_finalizer", "checksum", "data", "key", "layout", "namespace", "num_tokens")

    def __init__(
        self,
        key: bytes,
        layout: KVLayout,
        data: np.ndarray,
        *,
        namespace: bytes = b"",
        checksum: int | None = None,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        if data.dtype != np.uint8 or data.ndim != 4:
            raise LayoutError(f"chunk data must be a 4-d uint8 view, got {data.dtype} {data.shape}")
        num_tokens = data.shape[2]
        if data.shape != layout.byte_shape(num_tokens):
            raise LayoutError(f"chunk data shape {data.shape} does not match layout {layout.byte_shape(num_tokens)}")
        if data.strides[-1] != 1:
            data = np.ascontiguousarray(data)
        self.key = key
        self.layout = layout
        self.num_tokens = num_tokens
        self.data = data
        self.namespace = namespace
        self.checksum = checksum  # xxh3-64 of the canonical bytes, when known
        self._finalizer = weakref.finalize(self, on_release) if on_release else None

    @classmethod
    def from_buffer(cls, key: bytes, layout: KVLayout, num_tokens: int, buffer, **kw) -> Chunk:
        """A chunk over a contiguous buffer holding the canonical bytes."""
        flat = np.frombuffer(buffer, dtype=np.uint8)
        expected = layout.chunk_bytes(num_tokens)
        if flat.size != expected:
            raise LayoutError(f"buffer of {flat.size} bytes, layout needs {expected}")
        return cls(key, layout, flat.reshape(layout.byte_shape(num_tokens)), **kw)

    @property
    def nbytes(self) -> int:
        return self.data.size

    def segments(self) -> Iterator[np.ndarray]:
        """The canonical bytes as contiguous 1-d runs, in order (one run when contiguous)."""
        yield from iter_segments(self.data)

    def compute_checksum(self) -> int:
        h = xxhash.xxh3_64()
        for seg in self.segments():
            h.update(seg)
        return h.intdigest()

    def tobytes(self) -> bytes:
        return self.data.tobytes()

    def release(self) -> None:
        """End the lease on tier memory (idempotent). The data must not be read after."""
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> Chunk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Chunk({self.key.hex()[:12]}, {self.num_tokens} tokens, {self.nbytes} B)"


def iter_segments(arr: np.ndarray) -> Iterator[np.ndarray]:
    """Contiguous 1-d runs of a (possibly strided) array, in C order."""
    if arr.flags.c_contiguous:
        yield arr.reshape(-1)
        return
    # Find the outermost axis from which the trailing block is contiguous.
    for lead in range(1, arr.ndim + 1):
        if arr[(0,) * lead].flags.c_contiguous:
            break
    for index in np.ndindex(arr.shape[:lead]):
        yield arr[index].reshape(-1)


def release_all(chunks) -> None:
    for chunk in chunks:
        if chunk is not None:
            chunk.release()

"""``Chunk``: the KV of one chunk of tokens in the canonical layout.

``data`` is always a 4-d ``uint8`` view ``[layers, kv_factor, tokens, row_bytes]`` (see
``KVLayout.byte_shape``): the core moves bytes and never needs to know the dtype, which
keeps bf16 and fp8 (that numpy cannot name) on the same path as fp32. The view may be
strided, for example a slice of a caller's ``[layers, 2, prompt_tokens, ...]`` tensor:
nothing is copied until a tier copies it into its own memory.

A chunk handed out by a tier may be a view of that tier's memory; it then holds a lease
that keeps the memory from being reused. ``release()`` (or leaving a ``with`` block, or
garbage collection) ends the lease. ``share()`` gives a second chunk over the same memory
with its own hold on the lease (for a background job that outlives the caller's use):
the memory is returned once every holder has released.

Verification happens where the bytes are read. A tier may hand out an *unverified* chunk
that carries the checksum recorded when it was stored; ``copy_to``, ``tobytes``,
``segments`` and ``verify`` check it as they read (``copy_to`` hashes each block right
after copying it, while it is still in cache, so checking costs little beyond the copy).
A mismatch raises ``IntegrityError`` and tells the tier to drop its bad copy; callers
treat it as a miss. ``data`` itself is the raw, possibly unverified view.

A *volatile* chunk (``volatile``: a check that its memory still holds the bytes it was
found with) views memory that its owner may reuse at any moment, with no lease: a cache
server's memory read through its published directory. What is checked must then be what
is used: ``copy_to`` hashes the bytes it copied, a ``layer_check`` passes only if the
memory did not move until the last layer was copied, and ``verify`` (which the readers
of ``data`` call first) copies the bytes into memory of the chunk's own, checked, and
serves those from then on.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator

import numpy as np
import xxhash

from lmtier.errors import ChecksumError, LayoutError
from lmtier.kv.layout import KVLayout


class Chunk:
    __slots__ = (
        "__weakref__",
        "_finalizer",
        "_lease",
        "_on_corrupt",
        "_volatile",
        "checksum",
        "data",
        "key",
        "layout",
        "namespace",
        "num_tokens",
        "verified",
    )

    def __init__(
        self,
        key: bytes,
        layout: KVLayout,
        data: np.ndarray,
        *,
        namespace: bytes = b"",
        checksum: int | None = None,
        verified: bool = True,
        on_release: Callable[[], None] | None = None,
        on_corrupt: Callable[[], None] | None = None,
        volatile: Callable[[], bool] | None = None,
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
        if not verified and checksum is None:
            raise ValueError("an unverified chunk needs the checksum to verify it against")
        if volatile is not None and verified:
            raise ValueError("a volatile chunk is verified as it is read, not before")
        self.verified = verified
        self._volatile = volatile  # None: the memory stays as it is while the chunk is held
        self._on_corrupt = on_corrupt
        self._lease = Lease(on_release) if on_release else None
        self._finalizer = weakref.finalize(self, self._lease.drop) if self._lease else None

    def share(self) -> Chunk:
        """Another chunk over the same bytes, holding the lease until it is released too.

        Must be called while this chunk is still held (before ``release``)."""
        other = Chunk(
            self.key,
            self.layout,
            self.data,
            namespace=self.namespace,
            checksum=self.checksum,
            verified=self.verified,
            on_corrupt=self._on_corrupt,
            volatile=self._volatile,
        )
        if self._lease is not None:
            if self._finalizer is None or not self._finalizer.alive:
                raise RuntimeError(f"chunk {self.key.hex()[:16]} was released: nothing to share")
            self._lease.hold()
            other._lease = self._lease
            other._finalizer = weakref.finalize(other, self._lease.drop)
        return other

    def view_as(self, key: bytes, *, owning: bool = False) -> Chunk:
        """The same bytes under another key, with no lease of its own: valid while this
        chunk is held (``owning``: releasing the view releases this chunk). A verification
        failure through it drops this chunk's stored copy. (The cache server stores chunks
        under tenant-scoped keys and serves them under the caller's.)"""
        return Chunk(
            key,
            self.layout,
            self.data,
            namespace=self.namespace,
            checksum=self.checksum,
            verified=self.verified,
            on_release=self.release if owning else None,
            on_corrupt=self._corrupt,
            volatile=self._volatile,
        )

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
        """The canonical bytes as contiguous 1-d runs, in order (one run when contiguous).

        Verifies an unverified chunk first (raises ``IntegrityError``).
        """
        self._check()
        yield from iter_segments(self.data)

    def compute_checksum(self) -> int:
        return checksum(self.data)

    def verify(self) -> bool:
        """Check an unverified chunk against its checksum; a failure drops the tier's copy.
        A volatile chunk is copied into memory of its own first, and checked there."""
        if self._volatile is not None:
            own = _page_aligned(self.data.shape)  # as the memory it leaves was: O_DIRECT may write it
            try:
                self.copy_to(own)  # hashes what it copied: the bytes kept are the bytes checked
            except ChecksumError:
                return False
            self.data, self._volatile, self.verified = own, None, True
            return True
        if not self.verified:
            if self.compute_checksum() != self.checksum:
                self._corrupt()
                return False
            self.verified = True
        return True

    def layer_check(self) -> LayerCheck:
        """Verify this chunk one layer at a time, as a reader copies it out: call the check
        with each layer in order (0, 1, ...) *before* copying that layer (hashing it first
        brings it into cache, so the copy that follows reads it from there), then
        ``passed()`` once every layer has been copied."""
        return LayerCheck(self)

    def tobytes(self) -> bytes:
        self._check()
        return self.data.tobytes()

    def copy_to(self, dst: np.ndarray, *, need_checksum: bool = False) -> None:
        """Copy the canonical bytes into ``dst`` (same 4-d byte shape, may be strided).

        An unverified chunk is verified on the way, block by block; on a mismatch ``dst``
        holds garbage and ``IntegrityError`` is raised. With ``need_checksum`` an unknown
        checksum is computed the same way.
        """
        if dst.shape != self.data.shape:
            raise LayoutError(f"cannot copy a chunk of shape {self.data.shape} into {dst.shape}")
        if self.verified and (self.checksum is not None or not need_checksum):
            np.copyto(dst, self.data)
            return
        h = xxhash.xxh3_64()
        for piece in _pieces(dst.shape):
            out = dst[piece]
            np.copyto(out, self.data[piece])
            _hash_runs(h, out)  # just copied: still in cache
        if self.verified:
            self.checksum = h.intdigest()
        elif h.intdigest() != self.checksum:
            self._corrupt()
            raise ChecksumError(f"chunk {self.key.hex()[:16]} failed its checksum")
        elif self._volatile is None:  # a volatile chunk's memory may change after this copy
            self.verified = True

    def _check(self) -> None:
        if not self.verify():
            raise ChecksumError(f"chunk {self.key.hex()[:16]} failed its checksum")

    def _corrupt(self) -> None:
        callback, self._on_corrupt = self._on_corrupt, None
        if callback is not None:
            callback()

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


class LayerCheck:
    """See ``Chunk.layer_check``. The canonical layout puts each layer's bytes after the
    previous layer's, so hashing the layers in order gives the chunk's own checksum: one
    checksum, verified in pieces. A copy that fails must not be used: the reader treats
    the copied blocks as not loaded."""

    __slots__ = ("_chunk", "_hash", "_next")

    def __init__(self, chunk: Chunk) -> None:
        self._chunk = chunk
        self._hash = None if chunk.verified else xxhash.xxh3_64()
        self._next = 0

    def __call__(self, layer: int) -> None:
        if layer != self._next:
            raise ValueError(f"layers are checked in order: expected layer {self._next}, got {layer}")
        self._next += 1
        if self._hash is not None:
            _hash_runs(self._hash, self._chunk.data[layer])

    def passed(self) -> bool:
        """Whether every layer was checked and the bytes match the chunk's checksum (a
        mismatch drops the tier's copy, as ``Chunk.verify`` does)."""
        chunk = self._chunk
        if self._next != chunk.layout.num_layers:
            raise ValueError(f"{self._next} of {chunk.layout.num_layers} layers checked")
        if self._hash is None:
            return True
        # A volatile chunk's memory must not have moved before the last layer was copied:
        # each layer was hashed before its copy, so only then were the copied bytes hashed.
        if self._hash.intdigest() != chunk.checksum or (chunk._volatile is not None and not chunk._volatile()):
            chunk._corrupt()
            return False
        if chunk._volatile is None:
            chunk.verified = True
        return True


class Lease:
    """A count of holders of one piece of tier memory; the last one out returns it
    (``callback``). It starts with one holder, its maker: a chunk's own hold, or a grpc
    call's hold on the server memory its chunks were read from, dropped when the call ends."""

    __slots__ = ("_callback", "_count", "_lock")

    def __init__(self, callback: Callable[[], None]) -> None:
        self._callback = callback
        self._count = 1
        self._lock = threading.Lock()

    def hold(self) -> None:
        with self._lock:
            self._count += 1

    def drop(self) -> None:
        with self._lock:
            self._count -= 1
            last = self._count == 0
        if last:
            self._callback()


def _page_aligned(shape: tuple[int, ...]) -> np.ndarray:
    """An uninitialized ``uint8`` array of ``shape`` starting on a 4 KiB boundary."""
    n = int(np.prod(shape))
    raw = np.empty(n + 4096, dtype=np.uint8)
    start = -raw.ctypes.data % 4096
    return raw[start : start + n].reshape(shape)


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


_BLOCK = 512 * 1024  # copy, then hash, this much at a time: it stays in L2 between the two


def checksum(*arrays: np.ndarray) -> int:
    """xxh3-64 of the bytes of ``arrays``, in order, each read in C order."""
    h = xxhash.xxh3_64()
    for arr in arrays:
        _hash_runs(h, arr)
    return h.intdigest()


def _hash_runs(h: xxhash.xxh3_64, arr: np.ndarray) -> None:
    """Feed the bytes of ``arr`` to ``h`` in C order, one contiguous run at a time."""
    if arr.flags.c_contiguous:
        h.update(arr)
    else:
        for sub in arr:
            _hash_runs(h, sub)


def _pieces(shape: tuple[int, ...]) -> Iterator[tuple]:
    """Index tuples cutting a ``[layers, kv_factor, tokens, row]`` array into pieces of at
    most ``_BLOCK`` bytes (one row at least), in canonical order."""
    layers, factor, tokens, row = shape
    if factor * tokens * row <= _BLOCK:  # whole layers, as many to a piece as fit
        step = _BLOCK // (factor * tokens * row)
        for layer in range(0, layers, step):
            yield (slice(layer, layer + step),)
    elif tokens * row <= _BLOCK:
        for layer in range(layers):
            for f in range(factor):
                yield (layer, f)
    else:
        step = max(1, _BLOCK // row)
        for layer in range(layers):
            for f in range(factor):
                for start in range(0, tokens, step):
                    yield (layer, f, slice(start, start + step))


def release_all(chunks) -> None:
    for chunk in chunks:
        if chunk is not None:
            chunk.release()

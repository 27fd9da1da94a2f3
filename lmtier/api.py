"""The embedded API: a KV store for one model, addressed by token ids.

    store = lmtier.open_store(["cpu://?size=1GiB"], model="my-model", layout=layout)
    store.put(tokens, kv) -> int        tokens stored (full chunks only)
    store.lookup(tokens) -> int         leading tokens available (a multiple of the chunk)
    store.get(tokens) -> torch.Tensor   KV of the leading available chunks of ``tokens``
    store.get_into(tokens, out) -> int  the same, written into ``out``; returns tokens
    store.close()

KV tensors are in the canonical layout ``[layers, 2, tokens, kv_heads, head_dim]`` (MLA:
``[layers, tokens, latent]``), as torch tensors or numpy arrays. Misses and tier failures
never raise from ``lookup`` / ``get``; wrong shapes and dtypes do, clearly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lmtier.config.loading import load_config
from lmtier.config.schema import resolve_chunk_tokens
from lmtier.errors import IntegrityError, LayoutError, MissingDependency
from lmtier.kv.chunk import Chunk, release_all
from lmtier.kv.keys import Namespace, as_token_array
from lmtier.kv.layout import KVLayout, canonical_dtype, preset
from lmtier.store.readpath import deadline_after, load_batch
from lmtier.store.tiered import TieredStore
from lmtier.tiers.base import TierContext


class KVStore:
    def __init__(self, store: TieredStore, namespace: Namespace, load_deadline: float = 0.0) -> None:
        self.store = store
        self.load_deadline = load_deadline
        self.namespace = namespace
        self.layout = namespace.layout
        self.chunk_tokens = namespace.chunk_tokens

    def keys(self, tokens: Any) -> list[bytes]:
        return self.namespace.keys(tokens)

    def lookup(self, tokens: Any) -> int:
        return self.store.lookup(self.keys(tokens)) * self.chunk_tokens

    def put(self, tokens: Any, kv: Any) -> int:
        """Store the full chunks of ``tokens``; returns the tokens stored (0 for a prompt the
        save policy leaves out: shorter than ``min_tokens``)."""
        tokens = as_token_array(tokens)
        data = self._byte_view(kv, len(tokens))
        if not self.store.policy.stores(len(tokens)):
            return 0
        size = self.chunk_tokens
        chunks = [
            Chunk(key, self.layout, data[:, :, i * size : (i + 1) * size], namespace=self.namespace.digest)
            for i, key in enumerate(self.keys(tokens))
        ]
        return self.store.put(chunks) * size

    def get(self, tokens: Any) -> Any:
        torch = _torch()
        chunks = self.store.get(self.keys(tokens))
        try:
            out = torch.empty(
                self.layout.tensor_shape(len(chunks) * self.chunk_tokens), dtype=getattr(torch, self.layout.dtype)
            )
            got = self._fill(out, chunks)
        finally:
            release_all(chunks)
        return out.narrow(self.layout.token_axis, 0, got)

    def get_into(self, tokens: Any, out: Any) -> int:
        """Write the KV of the leading available chunks into ``out`` (which must hold all
        full chunks of ``tokens``); returns how many tokens were written. Reads in ~4 MiB
        batches, the next ones ahead; with a ``load_deadline`` it returns what arrived in
        time (the caller recomputes the rest)."""
        keys = self.keys(tokens)
        self._byte_view(out, len(keys) * self.chunk_tokens, allow_longer=True)
        written = 0
        batches = self.store.iter_get(
            keys, load_batch(self.namespace.chunk_bytes), deadline=deadline_after(self.load_deadline)
        )
        try:
            for chunks in batches:
                try:
                    n = self._fill(out, chunks, start=written)
                finally:
                    release_all(chunks)
                written += n
                if n < len(chunks) * self.chunk_tokens:
                    break
        finally:
            batches.close()
        return written

    def _fill(self, out: Any, chunks: Sequence[Chunk], start: int = 0) -> int:
        """Copy chunks into ``out`` in order from token ``start``, verifying each; returns
        the tokens written. A chunk that fails verification ends the run: what follows it
        is useless.
        """
        if not chunks:
            return 0
        data = self._byte_view(out, start + len(chunks) * self.chunk_tokens, allow_longer=True)
        size = self.chunk_tokens
        for i, chunk in enumerate(chunks):
            if chunk.layout != self.layout or chunk.num_tokens != size:
                return i * size  # a foreign chunk under our key: never copy it in
            try:
                chunk.copy_to(data[:, :, start + i * size : start + (i + 1) * size])
            except IntegrityError:
                return i * size
        return len(chunks) * size

    def _byte_view(self, kv: Any, num_tokens: int, allow_longer: bool = False) -> np.ndarray:
        """``kv`` as ``[layers, kv_factor, tokens, row_bytes]`` uint8, without copying."""
        shape = tuple(kv.shape)
        want = self.layout.tensor_shape(num_tokens)
        axis = self.layout.token_axis
        ok = len(shape) == len(want) and all(
            s == w or (d == axis and allow_longer and s >= w) for d, (s, w) in enumerate(zip(shape, want, strict=True))
        )
        if not ok:
            raise LayoutError(f"KV of shape {shape} does not match layout shape {want} for {num_tokens} tokens")
        if canonical_dtype(kv.dtype) != self.layout.dtype:
            raise LayoutError(f"KV dtype {kv.dtype} does not match layout dtype {self.layout.dtype}")
        if hasattr(kv, "detach"):  # torch.Tensor
            if kv.device.type != "cpu":
                raise LayoutError("the embedded API takes CPU tensors; the CopyEngine moves device KV")
            if kv.stride(-1) != 1:
                raise LayoutError("the last dimension of the KV must be contiguous")
            array = kv.detach().view(_torch().uint8).numpy()
        else:
            array = np.asarray(kv)
            if array.strides[-1] != array.itemsize:
                raise LayoutError("the last dimension of the KV must be contiguous")
            array = array.view(np.uint8)
        flat = array.reshape(self.layout.byte_shape(shape[axis]))  # [layers, kv_factor, tokens, row_bytes]
        if flat.size and not np.may_share_memory(flat, array):  # reshape had to copy
            raise LayoutError("the KV tensor must keep its head and head-dim axes contiguous")
        return flat[:, :, :num_tokens]

    def stats(self) -> dict[str, Any]:
        return self.store.stats()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait for the background writes queued so far; False on timeout."""
        return self.store.flush(timeout)

    def persist(self, timeout: float = 30.0) -> bool:
        """``flush``, and with ``save_policy=reuse`` (write-back) first write what only the
        memory tier holds to the lower tiers; False on timeout."""
        return self.store.persist(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """``persist`` (at most ``timeout`` seconds for each step), then close every tier."""
        self.store.close(timeout)

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_store(
    tiers: Sequence[str] | None = None,
    *,
    model: str,
    layout: KVLayout | str,
    chunk_tokens: int | None = None,
    revision: str = "",
    tp_rank: int = 0,
    tp_size: int = 1,
    salt: str | None = None,
    hash: str | None = None,
    write_queue: int | None = None,
    write_mode: str | None = None,
    save_policy: str | None = None,
    min_tokens: int | None = None,
    load_deadline: float | None = None,
    config: str | None = None,
) -> KVStore:
    """Open a store for one model. Unset arguments come from the config file and
    ``LMTIER_*`` environment variables, then from the defaults (1 GiB of host memory)."""
    cfg = load_config(
        config,
        tiers=tuple(tiers) if tiers else None,
        chunk_tokens=chunk_tokens,
        salt=salt,
        hash=hash,
        write_queue=write_queue,
        write_mode=write_mode,
        save_policy=save_policy,
        min_tokens=min_tokens,
        load_deadline=load_deadline,
    )
    if isinstance(layout, str):
        layout = preset(layout)
    namespace = Namespace(
        model=model,
        layout=layout,
        chunk_tokens=resolve_chunk_tokens(cfg.chunk_tokens),
        revision=revision,
        tp_rank=tp_rank,
        tp_size=tp_size,
        salt=cfg.salt,
        hash=cfg.hash,
    )
    store = TieredStore.open(
        cfg.tiers,
        TierContext(chunk_bytes=namespace.chunk_bytes, layouts=(layout,)),
        defer=True,
        write_queue=cfg.write_queue,
        write_mode=cfg.write_mode,
        save_policy=cfg.save_policy,
        min_tokens=cfg.min_tokens,
    )
    return KVStore(store, namespace, load_deadline=cfg.load_deadline)


def _torch():
    try:
        import torch
    except ImportError as exc:
        raise MissingDependency("torch", "torch") from exc
    return torch

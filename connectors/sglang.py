"""``LMTierStorage``: lmtier as the L3 storage backend of SGLang's hierarchical cache.

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "lmtier",
            "module_path": "lmtier.connectors.sglang", "class_name": "LMTierStorage",
            "interface_v1": 1,
            "tiers": ["file:///var/lib/lmtier?size=100GiB", "redis://cache:6379"]}'

``"interface_v1": 1`` matters: without it SGLang calls the legacy ``batch_get`` /
``batch_set`` with a flat copy of every page (one more copy each way); with it SGLang calls
``batch_get_v1`` / ``batch_set_v1``, and lmtier copies straight between its tiers and
SGLang's host pool. Both work.

Longer than 400 lines: SGLang's backend is one class answering both interfaces (v1 and
legacy), beside the mapping of its host layouts onto the canonical chunk.

Extra-config keys of lmtier's own (all optional): ``tiers``, ``hash``, ``salt`` (tenant:
stores with different salts never share), ``write_queue``, ``write_mode``, ``save_policy``
(not ``min_tokens``, refused: SGLang's storage calls carry pages, not prompts),
``metrics_port`` (Prometheus ``/metrics``, TP rank r on ``port + r``),
``load_deadline`` (seconds a batch_get may take; the rest is recomputed), ``config`` (a
config file), ``model_id`` (the model's name in the namespace; default: SGLang's model
name). Unset keys come from ``LMTIER_*`` environment variables, then lmtier's defaults.
SGLang's own keys (``backend_name``, ``module_path``, ``class_name``, ``interface_v1``)
are ignored; any other key is an error at start.

What is stored: each SGLang page as one lmtier chunk of ``page_size`` tokens in the
canonical layout (``[layers, K/V, tokens, kv_heads, head_dim]``, MLA ``[layers, tokens,
latent]``), so a page written from one host layout (layer-first, page-first,
page-first-direct, page-head) reads back into any other. Keys: SGLang addresses pages by
its own chained page hashes and never hands a backend token ids, so a page's key is
``H(namespace || SGLang's page hash)`` (``lmtier.kv.keys.named_keys``), where the namespace
holds the model, the layout, the page size, the tensor-parallel rank and size (MHA: each
rank stores its slice of the KV heads; MLA: one latent replicated on every rank, so rank 0
writes and every rank reads), the pipeline stage and the salt.

SGLang and vLLM instances of the same model do not share chunks: the bytes would be the
same canonical chunks, but vLLM's keys hash token ids, and SGLang gives a backend only its
page hashes (sha256 over its own token encoding and namespace seed), from which no token
key can be computed. Two SGLang instances of the same model, page size and parallel
layout share everything, through any tier.

Failures are misses: a missing, damaged (checksum) or mislaid (wrong layout) chunk, a dead
tier or a bad argument make the call report ``False`` / ``None`` / a shorter hit, logged
and counted, and SGLang recomputes. Nothing raises into SGLang's cache controller once the
backend is attached; a configuration it cannot serve (an unknown key, the
``page_unified`` host layout, which is not addressable page by page) is refused at attach
with a clear error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lmtier import metrics
from lmtier.config import StoreConfig, engine_config, engine_keys
from lmtier.connectors import announce
from lmtier.errors import ConfigError, LayoutError
from lmtier.kv.chunk import Chunk, release_all
from lmtier.kv.keys import Namespace, named_keys
from lmtier.kv.layout import KVLayout, canonical_dtype
from lmtier.store.tiered import TieredStore, deadline_after, load_batch
from lmtier.tiers.base import TierContext

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
except ImportError as exc:  # pragma: no cover - exercised only without sglang installed
    raise ImportError("lmtier.connectors.sglang needs SGLang (pip install 'lmtier[sglang]')") from exc

log = logging.getLogger(__name__)

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"})
OWN_KEYS = engine_keys(chunk_tokens=False, roles=False)  # the page size is SGLang's; no kv_role
ENGINE = "sglang"


@dataclass(frozen=True)
class PageShape:
    """How one page of a host pool maps onto the canonical chunk.

    ``block``: the shape of ``get_data_page(i, flat=False)`` (and of a flat page
    reshaped); ``squeeze``: that block with its size-1 page axes removed; ``perm``: the
    permutation that turns the squeezed block into canonical order.
    """

    block: tuple[int, ...]
    squeeze: tuple[int, ...]
    perm: tuple[int, ...]

    def canonical(self, block: torch.Tensor) -> torch.Tensor:
        return block.reshape(self.squeeze).permute(self.perm)


def page_shape(pool: Any) -> tuple[KVLayout, PageShape]:
    """The canonical layout of one rank's pages, and how ``pool``'s layout holds them."""
    layout_name = getattr(pool, "layout", None)
    P, L = int(pool.page_size), int(pool.layer_num)
    dtype = canonical_dtype(pool.dtype)
    if hasattr(pool, "kv_cache_dim"):  # MLA: [layers, tokens, latent]
        C = int(pool.kv_cache_dim)
        shapes = {
            "layer_first": ((L, P, 1, C), (L, P, C), (0, 1, 2)),
            "page_first": ((P, L, 1, C), (P, L, C), (1, 0, 2)),
            "page_first_direct": ((1, L, P, 1, C), (L, P, C), (0, 1, 2)),
        }
        layout = KVLayout(L, 1, C, dtype, mla=True)
    else:  # MHA / GQA: [layers, 2, tokens, heads, head_dim]
        H, D = int(pool.head_num), int(pool.head_dim)
        if int(getattr(pool, "v_head_dim", D)) != D:
            raise LayoutError(f"lmtier stores K and V of one width; this model has K {D} and V {pool.v_head_dim}")
        shapes = {
            "layer_first": ((2, L, P, H, D), (2, L, P, H, D), (1, 0, 2, 3, 4)),
            "page_first": ((2, P, L, H, D), (2, P, L, H, D), (2, 0, 1, 3, 4)),
            "page_first_direct": ((2, 1, L, P, H, D), (2, L, P, H, D), (1, 0, 2, 3, 4)),
            "page_head": ((2, 1, H, P, L, D), (2, H, P, L, D), (3, 0, 2, 1, 4)),
        }
        layout = KVLayout(L, H, D, dtype)
    if layout_name not in shapes:
        raise LayoutError(
            f"lmtier cannot address SGLang's {layout_name!r} host layout page by page; "
            f"use --hicache-mem-layout with one of {', '.join(shapes)}"
        )
    return layout, PageShape(*shapes[layout_name])


def byte_view(canonical: torch.Tensor, layout: KVLayout) -> np.ndarray | None:
    """The canonical tensor as the chunk's 4-d byte view ``[layers, kv, tokens, row]``,
    sharing memory; None when its strides cannot express that (heads not adjacent)."""
    raw = canonical.view(torch.uint8)  # last axis contiguous in every host layout
    if layout.mla:
        raw = raw.unsqueeze(1)
    try:
        raw = raw.view(layout.byte_shape(raw.shape[2]))
    except RuntimeError:
        return None
    return raw.numpy()


METRIC_SAMPLES = 4096  # per list: SGLang collects them only with --enable-storage-metrics


def _fresh_metrics() -> dict[str, deque]:
    """SGLang's storage metrics since the last ``get_stats``: the latest samples only, so
    that an engine that never asks for them does not grow them forever."""
    return {name: deque(maxlen=METRIC_SAMPLES) for name in ("prefetch_pgs", "backup_pgs", "pbw", "bbw")}


class LMTierStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.config: StoreConfig = engine_config(extra, SGLANG_KEYS | OWN_KEYS, "storage extra-config")
        if self.config.metrics_port:  # one port per rank: port + TP rank
            metrics.export(self.config.metrics_port + storage_config.tp_rank)
        if self.config.min_tokens or self.config.save_policy == "min_tokens":
            raise ConfigError(
                "lmtier: min_tokens is not available under SGLang (its storage calls carry pages, not prompts); "
                "use save_policy=always or reuse"
            )
        self.model_id = str(extra.get("model_id") or storage_config.model_name or "")
        if not self.model_id:
            raise ConfigError("lmtier: no model name; set model_id in the storage extra config")
        self.storage_config = storage_config
        self.mla = bool(storage_config.is_mla_model)
        self.writer = not self.mla or storage_config.tp_rank == 0
        self.mem_pool_host: Any = None
        self.store: TieredStore | None = None
        self.namespace: Namespace | None = None
        self.layout: KVLayout | None = None
        self._shape: PageShape | None = None
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("exists_pages", "hit_pages", "loaded", "failed", "stored", "skipped"), 0)
        self._metrics = _fresh_metrics()

    # -- attach --------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the host pool's layout and open the tiers (their slots are page-sized)."""
        super().register_mem_pool_host(mem_pool_host)
        layout, shape = page_shape(mem_pool_host)
        cfg = self.storage_config
        rank, size = (0, 1) if self.mla else (cfg.tp_rank, cfg.tp_size)
        namespace = Namespace(
            model=self.model_id,
            layout=layout,
            chunk_tokens=int(mem_pool_host.page_size),
            tp_rank=rank,
            tp_size=size,
            pp_rank=cfg.pp_rank,
            pp_size=cfg.pp_size,
            salt=self.config.salt,
            hash=self.config.hash,
        )
        if self.store is not None and namespace == self.namespace:
            return
        old = self.store
        self.store = TieredStore.open(
            self.config.tiers,
            TierContext(chunk_bytes=namespace.chunk_bytes),
            defer=True,
            write_queue=self.config.write_queue,
            write_mode=self.config.write_mode,
            save_policy=self.config.save_policy,
            min_tokens=self.config.min_tokens,
        )
        self.layout, self._shape, self.namespace = layout, shape, namespace
        if old is not None:
            old.close()
        announce("sglang", self.config.tiers, [namespace], self.model_id)
        log.info("lmtier: SGLang L3 over %s, host pool layout %s", layout.describe(), mem_pool_host.layout)

    def _ready(self) -> bool:
        if self.store is None:
            log.warning("lmtier: no host pool registered yet; treating the call as a miss")
            return False
        return True

    def _keys(self, keys: Sequence[str]) -> list[bytes]:
        return named_keys(keys, self.namespace)

    # -- page views -------------------------------------------------------------------------
    def _host_page(self, index: int) -> torch.Tensor:
        """The canonical view of the host pool's page starting at token slot ``index``."""
        return self._shape.canonical(self.mem_pool_host.get_data_page(int(index), flat=False))

    def _flat_page(self, flat: torch.Tensor) -> torch.Tensor:
        """The canonical view of a flat page in the host layout's order (legacy calls)."""
        if not isinstance(flat, torch.Tensor) or flat.numel() != int(np.prod(self._shape.block)):
            raise LayoutError(f"expected a flat page of {int(np.prod(self._shape.block))} values")
        if str(flat.dtype).removeprefix("torch.") != self.layout.dtype:
            raise LayoutError(f"page of dtype {flat.dtype}, the pool holds {self.layout.dtype}")
        return self._shape.canonical(flat.reshape(self._shape.block))

    def _chunk_of(self, key: bytes, page: torch.Tensor) -> Chunk:
        data = byte_view(page, self.layout)
        if data is None:  # heads not adjacent (page_head): one contiguous copy
            data = byte_view(page.contiguous(), self.layout)
        return Chunk(key, self.layout, data, namespace=self.namespace.digest)

    def _fill(self, page: torch.Tensor, chunk: Chunk) -> bool:
        """Copy a stored chunk into ``page`` (canonical view), verifying it on the way.
        False (a miss) when the chunk is damaged or laid out otherwise."""
        try:
            if chunk.layout != self.layout or chunk.num_tokens != self.namespace.chunk_tokens:
                log.warning("lmtier: chunk %s has another layout; ignored", chunk.key.hex()[:16])
                return False
            dst = byte_view(page, self.layout)
            if dst is not None:
                chunk.copy_to(dst)
                return True
            if not chunk.verify():
                return False
            src = torch.from_numpy(np.ascontiguousarray(chunk.data).reshape(-1))
            page.copy_(src.view(page.dtype).reshape(page.shape))
            return True
        except Exception as exc:  # IntegrityError included: the tier's copy is dropped
            log.warning("lmtier: chunk %s not loaded: %s", chunk.key.hex()[:16], exc)
            return False

    # -- what HiCache calls ----------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        if not keys or not self._ready():
            return 0
        try:
            hits = self.store.lookup(self._keys(keys))
        except Exception as exc:
            log.warning("lmtier: lookup failed (%s); miss", exc)
            hits = 0
        page = self.namespace.chunk_tokens
        metrics.ENGINE_TOKENS.labels(ENGINE, "requested").inc(len(keys) * page)
        metrics.ENGINE_TOKENS.labels(ENGINE, "hit").inc(hits * page)
        with self._lock:
            self._counts["exists_pages"] += len(keys)
            self._counts["hit_pages"] += hits
        return hits

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        results = [False] * len(keys)
        if not keys or not self._ready():
            return results
        start = time.perf_counter()
        try:
            pages = [self._host_page(host_indices[i * self.namespace.chunk_tokens]) for i in range(len(keys))]
            done = self._load(self._keys(keys), lambda i, chunk: self._fill(pages[i], chunk))
        except Exception as exc:
            log.warning("lmtier: batch_get_v1 failed (%s); %d pages recomputed", exc, len(keys))
            done = 0
        results[:done] = [True] * done
        self._count_load(len(keys), done, start)
        return results

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        if not keys:
            return []
        if not self.writer:  # MLA: rank 0 stores the replicated latent for every rank
            with self._lock:
                self._counts["skipped"] += len(keys)
            return [True] * len(keys)
        if not self._ready():
            return [False] * len(keys)
        try:
            pages = [self._host_page(host_indices[i * self.namespace.chunk_tokens]) for i in range(len(keys))]
        except Exception as exc:
            log.warning("lmtier: batch_set_v1 with bad host indices (%s); nothing stored", exc)
            return [False] * len(keys)
        return self._store(keys, pages)

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list:
        """Legacy interface: fill each flat page of ``target_locations`` (in the host
        layout's flat order) and return it, or None from the first miss on."""
        out: list[torch.Tensor | None] = [None] * len(keys)
        if not keys or not self._ready():
            return out
        if target_locations is None:
            target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        start = time.perf_counter()
        try:
            pages = [self._flat_page(t) for t in target_locations[: len(keys)]]
            if len(pages) < len(keys):
                raise LayoutError(f"{len(keys)} keys but {len(pages)} target pages")
            done = self._load(self._keys(keys), lambda i, chunk: self._fill(pages[i], chunk))
        except Exception as exc:
            log.warning("lmtier: batch_get failed (%s); %d pages recomputed", exc, len(keys))
            done = 0
        out[:done] = list(target_locations[:done])
        self._count_load(len(keys), done, start)
        return out

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Legacy interface: store flat pages (in the host layout's flat order)."""
        if not keys:
            return True
        if not self.writer:
            return True
        if not self._ready() or values is None:
            return False
        try:
            if len(values) != len(keys):
                raise LayoutError(f"{len(keys)} keys but {len(values)} pages")
            pages = [self._flat_page(v) for v in values]
        except Exception as exc:
            log.warning("lmtier: batch_set refused (%s); nothing stored", exc)
            return False
        return all(self._store(keys, pages))

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], None if value is None else [value])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def clear(self) -> None:
        """SGLang's "clear HiCache storage" request: drop this namespace's chunks (this
        model, layout, rank and salt) from every tier that can list its keys (memory,
        disk, the cache server). Chunks of other models and tenants sharing those tiers
        stay; Redis entries are left to Redis's own eviction. An admin operation: it reads
        every listed chunk's header, so it takes as long as reading the tier."""
        if self.store is None:
            return
        for tier in self.store.tiers:
            if not tier.capabilities.listing:
                continue
            try:
                listed = tier.keys(b"")
                for i in range(0, len(listed), 64):
                    batch = listed[i : i + 64]
                    mine = []
                    for key, chunk in zip(batch, tier.get(batch), strict=False):
                        if chunk is not None:
                            if chunk.namespace == self.namespace.digest:
                                mine.append(key)
                            chunk.release()
                    if mine:
                        tier.delete(mine)
            except Exception as exc:
                log.warning("lmtier: clearing tier %s failed: %s", tier.name, exc)

    def get_stats(self) -> Any:
        """SGLang's storage metrics since the last call (SGLang logs them when started
        with --enable-storage-metrics)."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return None
        with self._lock:
            m, self._metrics = self._metrics, _fresh_metrics()
        return StorageMetrics(
            prefetch_pgs=list(m["prefetch_pgs"]),
            backup_pgs=list(m["backup_pgs"]),
            prefetch_bandwidth=list(m["pbw"]),
            backup_bandwidth=list(m["bbw"]),
        )

    def stats(self) -> dict[str, Any]:
        """lmtier's own counters for this backend and its tiers."""
        with self._lock:
            counts = dict(self._counts)
        return {"pages": counts, "store": self.store.stats() if self.store is not None else None}

    def close(self) -> None:
        store, self.store = self.store, None
        if store is not None:
            store.close()

    # -- helpers ---------------------------------------------------------------------------
    def _load(self, keys: list[bytes], fill) -> int:
        """Read ``keys`` in batches (reading ahead) and ``fill(i, chunk)`` each one; the
        count of leading pages filled. Stops at the first miss or failed fill."""
        batch = load_batch(self.namespace.chunk_bytes)
        done = 0
        batches = self.store.iter_get(keys, batch, deadline=deadline_after(self.config.load_deadline))
        try:
            for chunks in batches:
                try:
                    for chunk in chunks:
                        if not fill(done, chunk):
                            return done
                        done += 1
                finally:
                    release_all(chunks)
        finally:
            batches.close()
        return done

    def _store(self, keys: list[str], pages: list[torch.Tensor]) -> list[bool]:
        start = time.perf_counter()
        try:
            chunks = [self._chunk_of(k, p) for k, p in zip(self._keys(keys), pages, strict=True)]
            held = self.store.put(chunks)
        except Exception as exc:
            log.warning("lmtier: storing %d pages failed: %s", len(keys), exc)
            held = 0
        page = self.namespace.chunk_tokens
        metrics.ENGINE_TOKENS.labels(ENGINE, "stored").inc(held * page)
        elapsed = time.perf_counter() - start
        with self._lock:
            self._counts["stored"] += held
            self._metrics["backup_pgs"].append(held)
            if held and elapsed > 0:
                self._metrics["bbw"].append(held * self.namespace.chunk_bytes / elapsed / 1e9)
        return [i < held for i in range(len(keys))]

    def _count_load(self, wanted: int, done: int, start: float) -> None:
        page = self.namespace.chunk_tokens
        metrics.ENGINE_TOKENS.labels(ENGINE, "loaded").inc(done * page)
        if done < wanted:
            metrics.ENGINE_TOKENS.labels(ENGINE, "failed").inc((wanted - done) * page)
        elapsed = time.perf_counter() - start
        with self._lock:
            self._counts["loaded"] += done
            self._counts["failed"] += wanted - done
            self._metrics["prefetch_pgs"].append(done)
            if done and elapsed > 0:
                self._metrics["pbw"].append(done * self.namespace.chunk_bytes / elapsed / 1e9)

"""``LMTierStorage``: the backend SGLang's HiCache calls (see ``lmtier.connectors.sglang``
for its configuration). One class answers both of SGLang's interfaces, v1 (straight
between the tiers and the host pool) and legacy (flat pages), over one store opened when
the host pool registers; its pages map onto chunks as ``connectors/sglang/pages.py`` says.

Failures are misses: nothing raises into SGLang's cache controller once the backend is
attached. lmtier's own counters and SGLang's storage metrics (``get_stats``) are kept
here, bounded (``METRIC_SAMPLES``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lmtier import metrics
from lmtier.config.loading import engine_config, engine_keys
from lmtier.config.schema import StoreConfig
from lmtier.connectors import announce
from lmtier.connectors.sglang.pages import PageShape, byte_view, page_shape
from lmtier.errors import ConfigError, LayoutError
from lmtier.kv.chunk import Chunk, release_all
from lmtier.kv.keys import Namespace, named_keys
from lmtier.kv.layout import KVLayout
from lmtier.store.readpath import deadline_after, load_batch
from lmtier.store.tiered import TieredStore
from lmtier.tiers.base import TierContext

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
except ImportError as exc:  # pragma: no cover - exercised only without sglang installed
    raise ImportError("lmtier.connectors.sglang needs SGLang (pip install 'lmtier[sglang]')") from exc

log = logging.getLogger("lmtier.connectors.sglang")  # the name users configure: the package's

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"})
OWN_KEYS = engine_keys(chunk_tokens=False, roles=False)  # the page size is SGLang's; no kv_role
ENGINE = "sglang"
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
            TierContext(chunk_bytes=namespace.chunk_bytes, layouts=(layout,)),
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

"""Where ``LMTierConnector`` is put together: its halves joined, the state both read, one
store per process and configuration, and the connector in vLLM's registry by name.

vLLM makes the one class in each of its processes; the scheduler half
(``connectors/vllm/scheduler.py``, on ``connectors/vllm/lookup.py``) acts in the engine
core, the worker half (``connectors/vllm/worker.py``, on ``connectors/vllm/saves.py``) in
each worker. ``__init__`` reads the settings (``connectors/vllm/settings.py``), the
engine's layout and KV cache groups (``connectors/vllm/groups.py``), makes the namespaces
of every lane and rank, and opens the store that the process's connectors share.

    LMTierConnector    the connector class vLLM loads
    flush_all          every save of this process's connectors in every tier (tests, demo)
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)

from lmtier import metrics
from lmtier.config.schema import StoreConfig, resolve_chunk_tokens
from lmtier.connectors import announce
from lmtier.connectors.vllm.events import EventBook, WorkerEvents, group_specs
from lmtier.connectors.vllm.groups import Group, groups_of
from lmtier.connectors.vllm.lookup import _Request
from lmtier.connectors.vllm.pd import role_of
from lmtier.connectors.vllm.scheduler import SchedulerSide
from lmtier.connectors.vllm.settings import settings
from lmtier.connectors.vllm.stats import Interval, LMTierPromMetrics, LMTierStats
from lmtier.connectors.vllm.worker import WorkerSide
from lmtier.engine.transfer import CopyEngine, HostBuffers, LayerLoad, check_chunk_size
from lmtier.kv.chunk import Chunk
from lmtier.kv.keys import Namespace
from lmtier.kv.layout import KVLayout
from lmtier.store.tiered import TieredStore
from lmtier.tiers.base import TierContext

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("lmtier.vllm")


# -- one store per process and configuration ---------------------------------------------------
_STORES: dict[tuple, TieredStore] = {}
_STORES_LOCK = threading.Lock()
_CONNECTORS: weakref.WeakSet[LMTierConnector] = weakref.WeakSet()  # this process's, for flush_all


def flush_all(timeout: float = 30.0) -> list[dict[str, Any]]:
    """Wait until every save of this process's connectors has reached every tier; returns
    their stores' stats. For single-process engines (tests, benchmarks, the demo)."""
    for connector in list(_CONNECTORS):
        connector.flush(timeout)
    with _STORES_LOCK:
        stores = list(_STORES.values())
    for store in stores:
        store.flush(timeout)
    return [store.stats() for store in stores]


def _shared_store(cfg: StoreConfig, layouts: tuple[KVLayout, ...], chunk_tokens: int) -> TieredStore:
    """The scheduler and worker connectors of one process share their tiers, so that in
    single-process mode a chunk in host memory is visible to both. Keyed by process."""
    chunk_bytes = max(layout.chunk_bytes(chunk_tokens) for layout in layouts)
    key = (os.getpid(), cfg.tiers, cfg.write_mode, cfg.save_policy, cfg.min_tokens, chunk_bytes, layouts)
    with _STORES_LOCK:
        store = _STORES.get(key)
        if store is None:
            store = _STORES[key] = TieredStore.open(
                cfg.tiers,
                TierContext(chunk_bytes=chunk_bytes, layouts=layouts),
                defer=True,
                write_queue=cfg.write_queue,
                write_mode=cfg.write_mode,
                save_policy=cfg.save_policy,
                min_tokens=cfg.min_tokens,
            )
        return store


class LMTierConnector(SchedulerSide, WorkerSide, KVConnectorBase_V1, SupportsHMA):
    """One class, as vLLM makes it in each of its processes: the scheduler half
    (``connectors/vllm/scheduler.py``) in the engine core, the worker half
    (``connectors/vllm/worker.py``) in each worker. The state both read is made here."""

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """With layer_loads, attention layers wait for their own layer's copy: full CUDA
        graphs would skip those waits on replay, so vLLM must run piecewise ones.

        vLLM asks this while it validates its configuration (GPU engines with full CUDA
        graphs, its default there), before any engine process starts or a model loads: the
        one moment lmtier sees its settings that early, so they are checked here, and a bad
        key or tier URL stops the start with lmtier's one-line ``ConfigError`` last."""
        return settings(extra_config).layer_loads

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        kv_role = getattr(self._kv_transfer_config, "kv_role", None) or "kv_both"
        self.config = settings(extra, kv_role)
        self.kv_role = role_of(kv_role, self.config)
        if self.config.metrics_port and role == KVConnectorRole.SCHEDULER:
            metrics.export(self.config.metrics_port)
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = kv_cache_config.num_blocks
        model = vllm_config.model_config
        parallel = vllm_config.parallel_config
        self.tp_size = parallel.tensor_parallel_size
        self.layout = _layout_of(vllm_config)
        self.chunk_tokens = resolve_chunk_tokens(self.config.chunk_tokens, self.block_size, self.layout.chunk_bytes(1))
        check_chunk_size(self.chunk_tokens, self.block_size)
        self.blocks_per_chunk = self.chunk_tokens // self.block_size
        self.chunk_bytes = self.layout.chunk_bytes(self.chunk_tokens)
        model_id = extra.get("model_id") or str(model.model)
        engine = _engine_identity(vllm_config)
        # Lanes: one chain of chunks for the whole model, or one per KV cache group of a
        # hybrid model (connectors/vllm/groups.py), each under its own namespace.
        self.lanes = groups_of(kv_cache_config, self.layout) or [Group(0, (), self.layout)]
        self.lane_namespaces = [
            [
                Namespace(
                    model=model_id,
                    layout=lane.layout,
                    chunk_tokens=self.chunk_tokens,
                    revision=str(model.revision or ""),
                    tp_rank=r,
                    tp_size=self.tp_size,
                    salt=self.config.salt,
                    hash=self.config.hash,
                    engine=engine,
                    group=lane.name,
                )
                for r in range(self.tp_size)
            ]
            for lane in self.lanes
        ]
        self.namespaces = self.lane_namespaces[0]
        self._model_id = model_id
        self.windowed = any(lane.window for lane in self.lanes)
        self.store = _shared_store(self.config, tuple(lane.layout for lane in self.lanes), self.chunk_tokens)
        announce("vllm", self.config.tiers, self.namespaces, model_id)
        if self.kv_role.name != "kv_both" and role == KVConnectorRole.SCHEDULER:
            log.info(
                "lmtier: %s: %s (handoff_timeout %g s)",
                self.kv_role.name,
                "stores every prompt's chunks in every tier, answers once they are readable, never loads"
                if self.kv_role.producer
                else "loads, waits for a forwarded hand-off's chunks, "
                + ("stores what it computes" if self.kv_role.saves else "never stores"),
                self.config.handoff_timeout,
            )
        if hasattr(self._kv_transfer_config, "kv_load_failure_policy"):
            try:
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            except Exception:  # a frozen config: the user must set it (see lmtier.connectors.vllm)
                pass
        # KV events for routers (vLLM's KVEventsConfig): lmtier's tiers in vLLM's stream
        events = getattr(vllm_config, "kv_events_config", None)
        self._with_events = bool(events is not None and events.enable_kv_cache_events)
        self._book: EventBook | None = None
        if self._with_events:
            blocks = self.block_size if self.config.event_blocks == "engine" else 0
            specs = group_specs(kv_cache_config)
            self._book = EventBook(self.config.tiers, self.chunk_tokens, self.tp_size, specs, block_size=blocks)
        self._relay = None  # the other instances' shared-tier events (connectors/vllm/relay.py)
        if self._book is not None and self.config.event_relay and role == KVConnectorRole.SCHEDULER:
            from lmtier.connectors.vllm.relay import EventRelay

            self._relay = EventRelay(self.config.event_relay, self.namespaces[0].digest)
        self._request_log = None  # a line per request, for `lmtier plan` (lmtier/engine/requestlog.py)
        if self.config.request_log and role == KVConnectorRole.SCHEDULER:
            from lmtier.engine.requestlog import RequestLog

            path = self.config.request_log  # one writer per file: each data-parallel rank its own
            if (getattr(parallel, "data_parallel_size", 1) or 1) > 1:
                path = f"{path}.dp{getattr(parallel, 'data_parallel_rank', 0) or 0}"
            self._request_log = RequestLog(path, self.config.request_log_bytes, self.chunk_tokens)
        self._worker_events: WorkerEvents | None = None
        # scheduler side
        self._requests: dict[str, _Request] = {}
        self._napped = False  # a hand-off's wait yielded the core this step
        self._handoff_looks = 0  # hand-offs looked up this step
        self._workers = parallel.world_size  # each reports its copies (LMTierWorkerMeta)
        self._released: list[str] = []  # finished without holding their blocks, for the next step
        # worker side
        self._engine: CopyEngine | None = None  # the first lane's
        self._engines: list[CopyEngine] = []  # per lane
        self._kv_caches: dict[str, torch.Tensor] | None = None  # as registered: sleep mode opens them again
        self._layer_of: dict[str, int] = {}  # attention layer name -> the engine's layer index
        self._interval = Interval()  # figures for vLLM's metrics since the last report
        self._layered = False  # layer_loads (a CPU engine runs the same path, landed at once)
        self._staged: list[tuple[list[int], torch.Tensor]] = []  # a step's loads, once read
        self._layer_load: LayerLoad | None = None  # their copies, landing layer by layer
        self._load_holds: list[Chunk] = []  # the chunks they copy from, held until landed
        self._rank = 0
        self._failed_blocks: set[int] = set()
        self._save_buffers: list[HostBuffers] = []  # per lane
        self._saves: queue.Queue | None = None
        self._saver_pid = -1
        # requests with save plans, until reported finished: blocks copying per request,
        # those vLLM said finished while copying, those done and not yet reported
        self._copying: dict[str, int] = {}
        self._saving: set[str] = set()
        self._finishing: set[str] = set()
        self._copied: set[str] = set()
        self._copy_counts: dict[str, int] = {}  # plans copied since the last step, for the scheduler
        self._storing: dict[str, int] = {}  # a producer's save plans per request, until in every tier
        self._copy_cond = threading.Condition()
        _CONNECTORS.add(self)

    # -- lmtier's figures in vLLM's metrics (lmtier.connectors.vllm.stats) ---------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> LMTierStats:
        return LMTierStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> LMTierPromMetrics:
        return LMTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- sleep mode (vLLM 0.33+: the paged cache is freed while the engine sleeps) ---------
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return True


def _engine_identity(vllm_config: VllmConfig) -> str:
    """What, beyond the layout, decides how this engine's cache bytes read as KV: on vLLM's
    CPU backend a block holds its tokens' K rows and then their V rows, so the bytes a
    chunk holds depend on the block size, and K is packed for the attention's instruction
    set. Engines that differ in either must never share chunks. Empty elsewhere."""
    if vllm_config.device_config is None or str(vllm_config.device_config.device_type) != "cpu":
        return ""
    import torch

    isa = torch.backends.cpu.get_cpu_capability()
    return f"vllm-cpu/block={vllm_config.cache_config.block_size}/isa={isa}"


def _layout_of(vllm_config: VllmConfig) -> KVLayout:
    """The KV layout of one tensor-parallel rank, from the engine's configuration."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = model.dtype if cache_dtype in (None, "auto") else cache_dtype
    if str(dtype) in ("fp8", "fp8_e4m3"):
        dtype = "float8_e4m3fn"
    elif str(dtype) == "fp8_e5m2":
        dtype = "float8_e5m2"
    layers = model.get_num_layers(parallel)
    if getattr(model, "use_mla", False):
        return KVLayout(layers, 1, model.get_head_size(), dtype, mla=True)
    return KVLayout(layers, model.get_num_kv_heads(parallel), model.get_head_size(), dtype)


def _register() -> None:
    """vLLM's registry of connectors by name, with lmtier in it: MultiConnector rebuilds
    its children's figures in the API process by name (``get_connector_class_by_name``),
    and an out-of-tree connector missing there failed every stats report, which ended
    the engine's output handler. Registered once per process, as vLLM's own are."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector("LMTierConnector", __name__, "LMTierConnector")
    except ValueError:  # already registered (this module imported under two names)
        pass


_register()

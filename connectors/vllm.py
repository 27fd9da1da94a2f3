"""``LMTierConnector``: lmtier as a vLLM (v1, 0.32) KV connector.

    --kv-transfer-config '{"kv_connector": "LMTierConnector",
                           "kv_connector_module_path": "lmtier.connectors.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"tiers": ["cpu://?size=4GiB",
                                                                   "file:///var/lib/lmtier?size=100GiB"]}}'

Longer than 400 lines: vLLM's connector is one class that plays both roles (scheduler and
worker), and the plans and save buffers that only it uses are kept beside it.

Extra-config keys (all optional): ``tiers``, ``chunk_tokens``, ``hash``, ``salt``,
``write_queue``, ``write_mode``, ``save_policy``, ``min_tokens`` (which chunks are
stored where: ``lmtier.admission``), ``metrics_port`` (Prometheus ``/metrics`` from the
engine's processes: the scheduler on this port, worker rank r on ``port + 1 + r``),
``load_deadline`` (seconds a step's loads may take; the rest is recomputed),
``layer_loads`` (GPU: copy loads layer by layer beside the forward pass), ``config`` (a
config file), ``model_id`` (the model's name in the namespace; default: the engine's
model path or name). Unset keys come from
``LMTIER_*`` environment variables, then lmtier's defaults.

Deciding and moving live apart, as vLLM splits them:

- Scheduler side (engine-core process): ``get_num_new_matched_tokens`` looks up the
  prompt's chunk keys *for every tensor-parallel rank* (each rank stores its slice of the
  KV heads under its own namespace) and counts the chunks all ranks have: what the workers
  can actually load. Only full chunks; a whole-prompt hit leaves the last token to the
  engine. ``build_connector_meta`` turns allocations into plain plans: which keys to load
  into which blocks, which newly computed full chunks to save from which blocks.
- Worker side (each worker process): ``start_load_kv`` loads the planned chunks into the
  paged cache (``CopyEngine.scatter``) before the forward pass; ``wait_for_save`` hands
  the newly computed full chunks to a background thread, which copies them out of the
  paged cache (``CopyEngine.gather``) and stores them: saving costs the engine's step
  nothing. The blocks must outlive that copy, so a request with saves is freed late
  (``request_finished`` asks vLLM to wait; ``get_finished`` reports the copies done), and
  a request preempted with a copy in flight is fenced: the next step's ``start_load_kv``
  waits for its copy before the forward pass can write its freed blocks.

A request can opt out with ``kv_transfer_params`` (``SamplingParams(extra_args=
{"kv_transfer_params": {"lmtier": {"save": false}}})``, or the same field in an OpenAI
API request): ``"save": false`` keeps its KV out of the store (private documents),
``"load": false`` makes it ignore stored KV.

Failure is a recompute, never wrong output: a chunk that is missing, fails verification
or does not arrive is reported through ``get_block_ids_with_load_errors``, and vLLM
recomputes those blocks. Set ``kv_load_failure_policy="recompute"`` in the
``KVTransferConfig`` (``--kv-transfer-config '{..., "kv_load_failure_policy": "recompute"}'``);
lmtier sets it itself when the engine lets it.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import weakref
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from lmtier import metrics
from lmtier.chunk import Chunk, release_all
from lmtier.config import StoreConfig, resolve_chunk_tokens
from lmtier.connectors import announce
from lmtier.connectors.vllm_events import EventBook, LMTierKVEvents, WorkerEvents, group_specs
from lmtier.connectors.vllm_groups import Group, groups_of, layer_index
from lmtier.connectors.vllm_settings import EXTRA_KEYS, settings  # noqa: F401  (EXTRA_KEYS: the keys it takes)
from lmtier.connectors.vllm_stats import Interval, LMTierPromMetrics, LMTierStats, hit_sources
from lmtier.keys import Namespace, chunk_keys
from lmtier.layout import KVLayout
from lmtier.store import TieredStore, deadline_after, load_batch
from lmtier.tiers.base import TierContext
from lmtier.transfer import CopyEngine, HostBuffers, LayerLoad, check_chunk_size

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("lmtier.vllm")
ENGINE = "vllm"  # the engine label of lmtier_engine_tokens_total

SAVE_BUFFER_BYTES = 256 << 20  # bound on host memory holding chunks on their way to the store
WINDOW_TRIES = 8  # shorter prefixes tried when a sliding-window lane lacks a hit's window
MAX_COPY_REPORTS = 65536  # per step: requests whose copies a worker reports done to the scheduler


# -- plans: scheduler -> workers ----------------------------------------------------------------
@dataclass
class LoadPlan:
    req_id: str
    keys: list[list[bytes]]  # [rank][chunk]: the chunks covering the tokens to load
    block_ids: list[int]  # engine blocks of those chunks, in token order
    first_block: int  # load blocks block_ids[first_block:] (the engine computed the rest)
    num_blocks: int  # ... up to block_ids[:num_blocks]
    lane: int = 0  # which chain of chunks: the model's, or one group's of a hybrid model


@dataclass
class SavePlan:
    req_id: str
    keys: list[list[bytes]]  # [rank][chunk]
    block_ids: list[int]  # engine blocks of those chunks, in token order
    lane: int = 0
    digests: list[bytes] = field(default_factory=list)  # [rank]: the namespace the keys are in


@dataclass
class LMTierMetadata(KVConnectorMetadata):
    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)
    # requests preempted with saves: their blocks are free now, so the step waits for
    # their copies before it runs (nothing may write those blocks while they are read)
    fence: list[str] = field(default_factory=list)
    # a hybrid model with sliding-window layers: vLLM lets go of a window's old blocks at
    # every step, so the step waits for every copy still reading blocks
    fence_all: bool = False
    # [request][rank]: chunks a new request's lookup found (save_policy=reuse counts them as
    # sightings in the worker's store, whose memory decides at eviction what is written down)
    seen: list[list[list[bytes]]] = field(default_factory=list)
    # finished requests whose blocks went back at once (every copy of them was reported
    # done before they finished): the workers forget them instead of reporting them
    released: list[str] = field(default_factory=list)


class LMTierWorkerMeta(KVConnectorWorkerMetadata):
    """Workers -> scheduler, each step: per request, how many of its save plans have
    stopped reading the engine's blocks since the last step (vLLM adds the workers' up)."""

    def __init__(self, copied: dict[str, int] | None = None) -> None:
        self.copied = dict(copied or {})

    def aggregate(self, other: KVConnectorWorkerMetadata) -> LMTierWorkerMeta:
        assert isinstance(other, LMTierWorkerMeta)
        for req_id, n in other.copied.items():
            self.copied[req_id] = self.copied.get(req_id, 0) + n
        return self


@dataclass
class _Request:
    """Scheduler-side state of one request (dropped when it finishes)."""

    request: Any
    hit_chunks: int = 0  # leading chunks every rank holds (at the last lookup)
    sources: list[tuple[str, int]] = field(default_factory=list)  # (tier scheme, chunks): rank 0's hit
    local_tokens: int = 0  # the engine's own prefix-cache hit
    external_tokens: int = 0  # tokens planned to load
    load_pending: bool = False
    block_ids: list[int] = field(default_factory=list)  # a model with one lane (hybrid: the cache manager's)
    saved: list[int] = field(default_factory=list)  # per lane: leading chunks known stored (hit or saved)
    plans: int = 0  # save plans sent (the workers copy its blocks after the step)
    copied: int = 0  # ... and reported copied by the workers (each worker's report counts)
    keys: list[list[list[bytes]]] = field(default_factory=list)  # [lane][rank][chunk], grown as tokens grow
    sighted: int = 0  # chunks its first lookup found, for the workers' save policy (reuse)
    load: bool = True  # per request: kv_transfer_params {"lmtier": {"load": false}}
    save: bool = True  # ... {"lmtier": {"save": false}}


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


def _shared_store(cfg: StoreConfig, chunk_bytes: int) -> TieredStore:
    """The scheduler and worker connectors of one process share their tiers, so that in
    single-process mode a chunk in host memory is visible to both. Keyed by process."""
    key = (os.getpid(), cfg.tiers, cfg.write_mode, cfg.save_policy, cfg.min_tokens, chunk_bytes)
    with _STORES_LOCK:
        store = _STORES.get(key)
        if store is None:
            store = _STORES[key] = TieredStore.open(
                cfg.tiers,
                TierContext(chunk_bytes=chunk_bytes),
                defer=True,
                write_queue=cfg.write_queue,
                write_mode=cfg.write_mode,
                save_policy=cfg.save_policy,
                min_tokens=cfg.min_tokens,
            )
        return store


_SWITCHES = ("load", "save")


def _request_options(request: Any) -> dict[str, bool]:
    """A request's own switches, from its ``kv_transfer_params``:
    ``{"lmtier": {"load": false, "save": false}}`` (both default to true).

    A request is never refused for them, but a typo must not store a private document:
    when the ``lmtier`` entry is not a map, has keys other than these two, or values that
    are not booleans, the request's KV is not saved (the safe side), with a warning."""
    params = getattr(request, "kv_transfer_params", None) or {}
    mine = params.get("lmtier") if isinstance(params, dict) else None
    if mine is None:
        return {}
    if not isinstance(mine, dict):
        log.warning("lmtier: kv_transfer_params['lmtier'] is %r, not a map: this request's KV is not saved", mine)
        return {"save": False}
    options = {k: mine[k] for k in _SWITCHES if isinstance(mine.get(k), bool)}
    wrong = sorted(str(k) for k in mine if k not in _SWITCHES or not isinstance(mine[k], bool))
    if wrong:
        log.warning(
            "lmtier: kv_transfer_params['lmtier'] has unknown keys or values that are not booleans (%s; known: "
            "'load', 'save'): this request's KV is not saved",
            ", ".join(wrong),
        )
        options["save"] = False
    return options


class LMTierConnector(KVConnectorBase_V1, SupportsHMA):
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
        self.config = settings(extra)
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
        # hybrid model (connectors/vllm_groups.py), each under its own namespace.
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
        self.store = _shared_store(self.config, max(lane.layout.chunk_bytes(self.chunk_tokens) for lane in self.lanes))
        announce("vllm", self.config.tiers, self.namespaces, model_id)
        if hasattr(self._kv_transfer_config, "kv_load_failure_policy"):
            try:
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            except Exception:  # a frozen config: the user must set it (see the module docstring)
                pass
        # KV events for routers (vLLM's KVEventsConfig): lmtier's tiers in vLLM's stream
        events = getattr(vllm_config, "kv_events_config", None)
        self._with_events = bool(events is not None and events.enable_kv_cache_events)
        self._book = (
            EventBook(self.config.tiers, self.chunk_tokens, self.tp_size, group_specs(kv_cache_config))
            if self._with_events
            else None
        )
        self._worker_events: WorkerEvents | None = None
        # scheduler side
        self._requests: dict[str, _Request] = {}
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
        self._copy_cond = threading.Condition()
        _CONNECTORS.add(self)

    # ======================================================================================
    # Scheduler side
    # ======================================================================================
    def _keys_for(self, state: _Request, num_tokens: int, lane: int = 0) -> list[list[bytes]]:
        """Keys of every full chunk of the request's first ``num_tokens`` tokens in one
        lane, per rank."""
        chunks = num_tokens // self.chunk_tokens
        if not state.keys or len(state.keys[0][0]) < chunks:
            tokens = np.asarray(state.request.all_token_ids[: chunks * self.chunk_tokens], dtype=np.int64)
            state.keys = [[chunk_keys(tokens, ns) for ns in lane_ns] for lane_ns in self.lane_namespaces]
        return [k[:chunks] for k in state.keys[lane]]

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        state = self._requests.get(request.request_id)
        first_look = state is None
        if state is None:
            state = self._requests[request.request_id] = _Request(request, **_request_options(request))
            state.saved = [0] * len(self.lanes)
        prompt_len = len(request.prompt_token_ids or [])
        # Whole blocks only, and never the whole prompt: the engine computes the last token.
        limit = (prompt_len - 1) // self.block_size * self.block_size
        loadable = 0
        try:
            state.hit_chunks, state.sources = 0, []
            if state.load and prompt_len >= self.chunk_tokens:
                loadable = self._lookup(state, prompt_len, limit)
        except Exception:  # never break the scheduler: a lookup that fails is a miss
            log.exception("lmtier lookup failed for %s", request.request_id)
            state.hit_chunks, loadable = 0, 0
        state.local_tokens = num_computed_tokens
        state.external_tokens = max(0, loadable - num_computed_tokens)
        for i, lane in enumerate(self.lanes):  # what the store holds is not saved again
            known = state.hit_chunks if not lane.window else loadable // self.chunk_tokens
            state.saved[i] = max(state.saved[i], known)
        if first_look:  # the scheduler may ask again for a request it could not place
            state.save = state.save and self.store.policy.stores(prompt_len)  # min_tokens
            if self.store.policy.sketch is not None:  # reuse: a prefix found is a reuse sighted
                state.sighted = state.hit_chunks
            metrics.ENGINE_TOKENS.labels(ENGINE, "requested").inc(prompt_len)
            metrics.ENGINE_TOKENS.labels(ENGINE, "hit").inc(max(loadable, num_computed_tokens))
        return state.external_tokens, False

    def _lookup(self, state: _Request, prompt_len: int, limit: int) -> int:
        """Tokens a load can restore: the leading chunks every full-attention lane holds on
        every rank (``state.hit_chunks``), cut to ``limit``; with sliding-window lanes, the
        longest such prefix whose window (the chunks its next token attends to) each
        sliding-window lane holds too."""
        if len(self.lanes) > 1 and getattr(self, "_kv_cache_manager", None) is None:
            return 0  # a hybrid model's blocks come from the cache manager, which vLLM binds
        full = [i for i, lane in enumerate(self.lanes) if not lane.window] or [0]
        keys = [self._keys_for(state, prompt_len, i) for i in range(len(self.lanes))]
        state.sources = [(t.scheme, n) for t, n in self.store.lookup_tiers(keys[full[0]][0])]
        runs = [sum(n for _, n in state.sources)]
        runs += [self.store.lookup(k) for i in full for k in keys[i][(1 if i == full[0] else 0) :]]
        state.hit_chunks = min(runs)
        tokens = min(state.hit_chunks * self.chunk_tokens, limit)
        for _ in range(WINDOW_TRIES):
            if tokens <= 0 or self._windows_held(keys, tokens):
                return max(0, tokens)
            tokens = (-(-tokens // self.chunk_tokens) - 1) * self.chunk_tokens  # the chunk boundary before
        return 0

    def _windows_held(self, keys: list[list[list[bytes]]], tokens: int) -> bool:
        """Whether every sliding-window lane holds, on every rank, the chunks under the
        window of the token after ``tokens``."""
        last = -(-tokens // self.chunk_tokens)
        for i, lane in enumerate(self.lanes):
            if lane.window:
                first = lane.first_needed(tokens, self.block_size) // self.chunk_tokens
                if any(self.store.lookup(k[first:last]) < last - first for k in keys[i]):
                    return False
        return True

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        """The tokens lmtier supplies, by the tier that holds them (host, disk, or a shared
        tier: unspecified), for vLLM's ``prompt_tokens_cached_by_source``."""
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return hit_sources(state.sources, self.chunk_tokens, state.local_tokens, num_external_tokens)

    # -- lmtier's figures in vLLM's metrics (lmtier.connectors.vllm_stats) ---------------
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

    def _count(self, result: str, tokens: int) -> None:
        """Worker-side tokens (loaded, failed, stored, dropped): lmtier's own metric and
        this interval's figures for vLLM's."""
        metrics.ENGINE_TOKENS.labels(ENGINE, result).inc(tokens)
        self._interval.count(result, tokens)

    def get_kv_connector_stats(self) -> LMTierStats | None:
        """The worker's loads, saves and tier reads since it last reported (the scheduler
        side reports nothing: the workers' figures are the ones that moved KV)."""
        if self._engine is None:
            return None
        return self._interval.take(self.store.read_counts())

    # -- KV events for routers (lmtier.connectors.vllm_events) ------------------------------
    def get_kv_connector_kv_cache_events(self) -> LMTierKVEvents | None:
        return self._worker_events.take() if self._worker_events is not None else None

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        copies = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(copies, LMTierWorkerMeta):
            for req_id, n in copies.copied.items():
                state = self._requests.get(req_id)
                if state is not None:  # (a finished request's blocks wait for get_finished)
                    state.copied += n
        events = getattr(connector_output, "kv_cache_events", None)
        if self._book is not None and isinstance(events, LMTierKVEvents):
            self._book.absorb(events)

    def take_events(self):  # type: ignore[override]
        return self._book.take() if self._book is not None else ()

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        state.external_tokens = num_external_tokens
        state.load_pending = num_external_tokens > 0

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = LMTierMetadata(fence_all=self.windowed, released=self._released)
        self._released = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            if state.sighted:
                meta.seen.append(self._keys_for(state, state.sighted * self.chunk_tokens))
                state.sighted = 0
            self._plan(state, new.req_id, new.num_computed_tokens, scheduled.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # back from preemption: a fresh block list
                state.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                state.block_ids.extend(new_blocks[0])
            self._plan(state, req_id, cached.num_computed_tokens[i], scheduled.get(req_id, 0), meta)
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            state = self._requests.get(req_id)
            if state is not None and state.plans:
                meta.fence.append(req_id)
        return meta

    def _blocks(self, state: _Request, lane: int) -> list[int]:
        """The request's blocks in a lane's group, as they are now. A hybrid model's come
        from the cache manager: a sliding window's old blocks are let go (vLLM's null block
        stands in for them), which no list kept from the scheduler's output would show."""
        if len(self.lanes) == 1:
            return state.block_ids
        manager = getattr(self, "_kv_cache_manager", None)
        if manager is None:
            return []
        return list(manager.get_block_ids(state.request.request_id)[self.lanes[lane].index])

    def _plan(self, state: _Request, req_id: str, computed: int, scheduled: int, meta: LMTierMetadata) -> None:
        per, size = self.blocks_per_chunk, self.chunk_tokens
        load = state.load_pending
        state.load_pending = False
        done = min(computed + scheduled, len(state.request.all_token_ids)) // size
        for i, lane in enumerate(self.lanes):
            blocks = self._blocks(state, i)
            if load:
                end = state.local_tokens + state.external_tokens
                start = max(state.local_tokens, lane.first_needed(end, self.block_size))  # block-aligned
                if lane.window:  # never a block vLLM did not give this window (its null block)
                    while start < end and blocks[start // self.block_size] == self._null_block():
                        start += self.block_size
                first_chunk, last_chunk = start // size, -(-end // size)
                if start < end:
                    keys = self._keys_for(state, last_chunk * size, i)
                    self._remember(state, keys, first_chunk, i)  # a load promotes them into the memory tier
                    meta.loads.append(
                        LoadPlan(
                            req_id,
                            [k[first_chunk:last_chunk] for k in keys],
                            blocks[first_chunk * per : last_chunk * per],
                            first_block=(start - first_chunk * size) // self.block_size,
                            num_blocks=(end - first_chunk * size) // self.block_size,
                            lane=i,
                        )
                    )
            # Save every chunk that is complete after this step and not known to be stored
            # (a sliding window's: those whose blocks it still holds).
            first = state.saved[i]
            if not state.save or done <= first or len(blocks) < done * per:
                continue
            keys = self._keys_for(state, done * size, i)
            null = self._null_block()
            chunks = [c for c in range(first, done) if null not in blocks[c * per : (c + 1) * per]]
            state.saved[i] = done
            if not chunks:
                continue
            self._remember(state, keys, first, i)
            meta.saves.append(
                SavePlan(
                    req_id,
                    [[k[c] for c in chunks] for k in keys],
                    [b for c in chunks for b in blocks[c * per : (c + 1) * per]],
                    lane=i,
                    digests=[ns.digest for ns in self.lane_namespaces[i]],
                )
            )
            state.plans += 1

    def _null_block(self) -> int:
        """The id of vLLM's null block (what a sliding window's let-go blocks become)."""
        manager = getattr(self, "_kv_cache_manager", None)
        return manager.block_pool.null_block.block_id if manager is not None else 0

    def _remember(self, state: _Request, keys: list[list[bytes]], first: int, lane: int = 0) -> None:
        """Keep the tokens behind chunks about to land in a tier, for their events."""
        if self._book is not None:
            tokens = state.request.all_token_ids[: len(keys[0]) * self.chunk_tokens]
            self._book.remember(keys[0], tokens, first, group=self.lanes[lane].index if len(self.lanes) > 1 else 0)

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``, as after a weight update:
        this instance never again loads a chunk stored before. Its namespaces move to a
        fresh epoch (a random salt), so a chunk computed with the old weights is a miss,
        never a hit; what the tiers hold stays for the instances that still use it, and
        the memory tier lets the old chunks go as new ones come. The new digests are
        logged (for ``lmtier match``); routers get vLLM's own ``AllBlocksCleared``. A
        request already in the engine saves nothing more (its KV may predate the reset)."""
        if self.role != KVConnectorRole.SCHEDULER:
            return None
        epoch = secrets.token_hex(8)
        salt = f"{self.config.salt}/reset={epoch}"
        self.lane_namespaces = [[replace(ns, salt=salt) for ns in lane] for lane in self.lane_namespaces]
        self.namespaces = self.lane_namespaces[0]
        for state in self._requests.values():
            # Requests already here (vLLM's reset fails while any runs) computed their KV,
            # or part of it, before the reset: none of it is saved under the new epoch.
            state.save = False
        if self._book is not None:
            self._book.clear()
        announce("vllm", self.config.tiers, self.namespaces, f"{self._model_id} (after a cache reset)")
        return True

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        state = self._requests.pop(request.request_id, None)
        if state is None or not state.plans:
            return False, None
        if state.copied >= state.plans * self._workers:
            # Every worker has reported every copy of its blocks done (a request that
            # finishes a step or more after its last save): they go back now, so that an
            # idle engine holds no block (vLLM's prefix-cache reset needs them all free).
            self._released.append(request.request_id)
            return False, None
        # Copies in flight: the blocks stay until the workers report them done
        # (get_finished), which every worker does for every request it had a save plan for.
        return True, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` of a hybrid model (``SupportsHMA``): every group's blocks
        stay until the copies reading them are done."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    # ======================================================================================
    # Worker side
    # ======================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed import parallel_state

        if parallel_state.model_parallel_is_initialized():
            self._rank = parallel_state.get_tensor_model_parallel_rank()
        elif self.tp_size == 1:
            self._rank = 0  # a worker outside torch.distributed (tests, tools)
        else:
            raise RuntimeError("lmtier: tensor parallelism without an initialized model-parallel group")
        if self.config.metrics_port:
            metrics.export(self.config.metrics_port + 1 + self._rank)
        self._kv_caches = kv_caches
        self._open_caches()
        # layer_loads (on a CPU engine: the same path, landed at once); one lane only
        self._layered = self.config.layer_loads and len(self.lanes) == 1
        if self.config.layer_loads and not self._layered:
            log.warning("lmtier: layer_loads is off for a hybrid model (several KV cache groups)")
        self.store.warm()  # the memory tier's first pages mapped before the first load needs them
        if self._with_events:
            self._worker_events = WorkerEvents(self.store, self._rank, self.tp_size)

    def _open_caches(self) -> None:
        """A copy engine per lane over its layers' caches (a model with one lane: every
        layer the engine registered)."""
        assert self._kv_caches is not None
        engines = []
        for lane in self.lanes:
            names = list(lane.layers) or sorted(self._kv_caches, key=layer_index)
            missing = [n for n in names if n not in self._kv_caches]
            if missing:
                raise RuntimeError(f"lmtier: the engine registered no cache for layers {missing[:3]}")
            caches = [_typed(self._kv_caches[n], lane.layout) for n in names]
            engines.append(CopyEngine(caches, lane.layout, self.block_size, self.num_blocks))
            if len(self.lanes) == 1:
                self._layer_of = {n: i for i, n in enumerate(names)}
        self._engines, self._engine = engines, engines[0]

    # -- sleep mode (vLLM 0.33+: the paged cache is freed while the engine sleeps) ---------
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return True

    def unregister_kv_caches(self) -> None:
        """Before vLLM frees the paged cache: every copy into or out of it has landed, and
        none starts until ``restore_kv_caches`` (a load planned meanwhile is reported
        failed and recomputed, a save is skipped). What lmtier's tiers hold stays. Idempotent."""
        if self._engine is None:
            return
        self._finish_loads()
        if self._saves is not None and self._saver_pid == os.getpid():
            self._saves.join()  # queued saves have gathered their blocks (and stored them)
        for engine in self._engines:
            engine.synchronize()
        self._engine, self._engines = None, []

    def restore_kv_caches(self) -> None:
        """After wake-up: the same cache tensors (vLLM maps them back at their addresses)
        are lmtier's to copy into and out of again. Idempotent."""
        if self._engine is None and self._kv_caches is not None:
            self._open_caches()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward pass (vLLM calls it then; ``start_load_kv`` may run after the
        forward when a step loads nothing): requests preempted while their blocks were
        being copied hold the step until the copy is done, since vLLM freed those blocks
        and this step may write them."""
        if not isinstance(kv_connector_metadata, LMTierMetadata):
            return
        if kv_connector_metadata.fence_all:  # a sliding window's old blocks are free now
            with self._copy_cond:
                self._copy_cond.wait_for(lambda: not any(self._copying.values()))
        elif kv_connector_metadata.fence:
            fence = kv_connector_metadata.fence
            with self._copy_cond:
                self._copy_cond.wait_for(lambda: not any(self._copying.get(r) for r in fence))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, LMTierMetadata):
            return
        for keys in meta.seen:  # reuse: prefixes found by lookups, served or not by lmtier
            self.store.policy.seen(keys[self._rank])
        if self._engine is None:  # no cache to load into (asleep): the engine recomputes them
            for plan in meta.loads:
                self._failed_blocks.update(plan.block_ids[plan.first_block : plan.num_blocks])
            return
        self.handle_preemptions(meta)  # also here: a runner that does not call it
        self._finish_loads()  # the last step's layer copies (landed long since)
        # one deadline for the step's loads: past it, what has not arrived is recomputed
        deadline = deadline_after(self.config.load_deadline)
        for plan in meta.loads:
            self._failed_blocks |= self._read(plan, deadline)
        if self._staged:  # layer_loads: every chunk read and verified; copy layer by layer
            items, self._staged = self._staged, []
            try:
                self._layer_load = self._engine.load_layers(items)
            except Exception:
                log.exception("lmtier: layer-by-layer load failed; the engine recomputes it")
                self._failed_blocks.update(b for blocks, _ in items for b in blocks)
                self._layer_load = None
                # copies issued before the failure may still read the chunks and write the
                # blocks: they end before the chunks go back and before the recompute writes
                self._engine.synchronize("load")
                self._finish_loads()

    def _finish_loads(self, wait: bool = True) -> None:
        """Let go of the chunks a layer-by-layer load copied from, once it has landed (or
        at once when ``wait``: the copies are ordered before this step's kernels anyway)."""
        load = self._layer_load
        if load is not None:
            if not wait and not load.done():
                return
            load.finish()
            self._layer_load = None
        release_all(self._load_holds)
        self._load_holds = []

    def _read(self, plan: LoadPlan, deadline: float | None) -> set[int]:
        """Read the plan's chunks in order, verify each and copy it into its blocks.
        Returns the plan's blocks that did not load: those of a chunk that fails
        verification here (the chunks after it still load: the engine recomputes exactly
        what failed) and everything from the first chunk missing on (a chunk that a tier
        finds damaged is missing: a prefix ends there, unless another tier holds it)."""
        keys = plan.keys[self._rank]
        if self._worker_events is not None:
            self._worker_events.remember(keys, plan.keys[0])
        per, size = self.blocks_per_chunk, self.block_size
        lane = self.lanes[plan.lane]
        failed: set[int] = set()
        covered = plan.first_block  # blocks before this are the engine's own
        # The plan starts at the chunk holding the first block to load (first_block < one chunk).
        # chunks read per batch: the next batch is read while one is copied in
        batch = load_batch(lane.layout.chunk_bytes(self.chunk_tokens))
        batches = self.store.iter_get(keys, batch, deadline=deadline)
        i = 0
        try:
            for chunks in batches:
                left = list(chunks)
                try:
                    while left:
                        chunk = left.pop(0)
                        lo = i * per
                        hi, skip = min(lo + per, plan.num_blocks), max(0, plan.first_block - lo)
                        i += 1
                        blocks = plan.block_ids[lo + skip : hi]
                        if not self._load_chunk(chunk, blocks, skip * size, (hi - lo) * size, plan.lane):
                            failed.update(blocks)
                        chunk.release()
                        covered = hi
                finally:
                    release_all(left)
        except Exception:
            log.exception("lmtier load failed for %s", plan.req_id)
        finally:
            batches.close()
        failed.update(plan.block_ids[covered : plan.num_blocks])
        loaded = plan.num_blocks - plan.first_block - len(failed)
        self._count("loaded", loaded * size)
        if failed:  # the engine recomputes what did not arrive
            self._count("failed", len(failed) * size)
            log.warning(
                "lmtier: %d of %d blocks of %s not loaded; the engine recomputes them",
                len(failed),
                plan.num_blocks - plan.first_block,
                plan.req_id,
            )
        return failed

    def _load_chunk(self, chunk: Chunk, blocks: list[int], tok0: int, tok1: int, lane: int = 0) -> bool:
        """Copy tokens ``tok0:tok1`` of a chunk into ``blocks``, verified: False (the blocks
        hold garbage, the engine recomputes them) if the chunk fails. On a CPU engine each
        layer is hashed right before it is copied, from the cache the hash filled; a device
        engine's chunk is verified before it is staged."""
        layout, engine = self.lanes[lane].layout, self._engines[lane]
        if chunk.layout != layout:
            return False
        if engine.device.type == "cpu" and not self._layered:
            check = chunk.layer_check()
            engine.scatter(blocks, chunk.data[:, :, tok0:tok1], before_layer=check)
            return check.passed()
        if not chunk.verify():
            return False
        kv = _as_tensor(np.ascontiguousarray(chunk.data), layout)
        kv = kv.narrow(layout.token_axis, tok0, tok1 - tok0)
        if self._layered:  # copied in start_load_kv once every chunk is read, layer by layer
            self._staged.append((blocks, kv))
            self._load_holds.append(chunk.share())
            return True
        engine.scatter(blocks, kv)
        return True

    def wait_for_layer_load(self, layer_name: str) -> None:
        """With layer_loads on a GPU: the compute stream waits (a stream wait, not a host
        one) for this layer's copies. Otherwise loads completed in start_load_kv."""
        load = self._layer_load
        if load is not None:
            load.wait(self._layer_of.get(layer_name, len(self._layer_of) - 1))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves copy whole chunks in wait_for_save, once every layer is computed

    def wait_for_save(self) -> None:
        """Hand this step's save plans to the saver thread; the step goes on at once."""
        if self._layer_load is not None:  # whatever a layer did not wait for, later kernels do
            self._layer_load.wait(len(self._layer_of) - 1)
            self._finish_loads(wait=False)
        meta = self._connector_metadata
        if not isinstance(meta, LMTierMetadata) or not meta.saves:
            return
        if self._engine is None:  # no cache to copy from (asleep): nothing saved, the blocks go back
            with self._copy_cond:
                self._saving.update(plan.req_id for plan in meta.saves)
                for plan in meta.saves:
                    self._copy_counts[plan.req_id] = self._copy_counts.get(plan.req_id, 0) + 1
            return
        if not self._save_buffers:
            cuda = self._engine.device.type == "cuda"
            share = SAVE_BUFFER_BYTES // len(self.lanes)
            self._save_buffers = [HostBuffers(lane.layout, self.chunk_tokens, cuda, share) for lane in self.lanes]
        written = self._engine.mark()  # (GPU) where the forward pass wrote this step's KV
        for plan in meta.saves:
            with self._copy_cond:
                self._saving.add(plan.req_id)
                self._copying[plan.req_id] = self._copying.get(plan.req_id, 0) + 1
            if not self._enqueue_save(plan, written):  # the queue is full: a future miss, never a stall
                self._copied_one(plan.req_id)
                self._count("dropped", len(plan.keys[self._rank]) * self.chunk_tokens)

    def _enqueue_save(self, plan: SavePlan, written: Any = None) -> bool:
        if self._saves is None or self._saver_pid != os.getpid():
            self._saves = queue.Queue(maxsize=max(1, self.config.write_queue))
            self._saver_pid = os.getpid()
            threading.Thread(target=self._save_loop, name="lmtier-save", daemon=True).start()
        try:
            self._saves.put_nowait((plan, written))
        except queue.Full:
            return False
        return True

    def _copied_one(self, req_id: str) -> None:
        """One save plan of ``req_id`` no longer reads the engine's blocks."""
        with self._copy_cond:
            if len(self._copy_counts) < MAX_COPY_REPORTS:  # (past it: those requests hold their blocks a step longer)
                self._copy_counts[req_id] = self._copy_counts.get(req_id, 0) + 1
            left = self._copying.get(req_id, 0) - 1
            if left > 0:
                self._copying[req_id] = left
                return
            self._copying.pop(req_id, None)
            if req_id in self._finishing:
                self._finishing.discard(req_id)
                self._copied.add(req_id)
            self._copy_cond.notify_all()

    def _save_loop(self) -> None:
        assert self._saves is not None and self._save_buffers
        while True:
            plan, written = self._saves.get()
            try:
                self._save(plan, written)
            except Exception:
                log.exception("lmtier background save failed for %s", plan.req_id)
            finally:
                self._saves.task_done()

    def _save(self, plan: SavePlan, written: Any = None) -> None:
        """Copy the plan's chunks out of the engine's blocks (on a GPU, once the compute
        stream has passed ``written``), let the blocks go, store."""
        keys = plan.keys[self._rank]
        if self._worker_events is not None:
            self._worker_events.remember(keys, plan.keys[0])
        bufs: list[torch.Tensor] = []
        lane, buffers = self.lanes[plan.lane], self._save_buffers[plan.lane]
        try:
            try:
                for _ in keys:
                    buf = buffers.acquire()
                    if buf is None:  # every buffer is on its way to the store: a future miss
                        break
                    bufs.append(buf)
                per = self.blocks_per_chunk
                blocks = [plan.block_ids[i * per : (i + 1) * per] for i in range(len(bufs))]
                self._engines[plan.lane].gather_many(blocks, bufs, after=written)
            finally:
                self._copied_one(plan.req_id)
            if len(bufs) < len(keys):
                self._count("dropped", (len(keys) - len(bufs)) * self.chunk_tokens)
            digest = plan.digests[self._rank] if plan.digests else self.lane_namespaces[plan.lane][self._rank].digest
            shape = lane.layout.byte_shape(self.chunk_tokens)
            chunks = [
                Chunk(key, lane.layout, buf.view(torch.uint8).numpy().reshape(shape), namespace=digest)
                for key, buf in zip(keys, bufs, strict=False)
            ]
            if chunks:
                self.store.put(chunks)  # copies into the first tier; lower tiers read it back from there
                self._count("stored", len(chunks) * self.chunk_tokens)
        finally:
            for buf in bufs:
                buffers.release(buf)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose blocks no save still reads: exactly those with save
        plans (``request_finished`` held their blocks), once their copies are done."""
        self._finish_loads(wait=False)  # a layer-by-layer load that has landed lets its chunks go
        meta = self._connector_metadata
        released = meta.released if isinstance(meta, LMTierMetadata) else ()
        with self._copy_cond:
            for req_id in released:  # vLLM freed their blocks already: nothing to report
                self._saving.discard(req_id)
            for req_id in finished_req_ids:
                if req_id in self._saving:
                    self._saving.discard(req_id)
                    (self._finishing if self._copying.get(req_id) else self._copied).add(req_id)
            done, self._copied = self._copied, set()
        return done or None, None

    def build_connector_worker_meta(self) -> LMTierWorkerMeta | None:
        """The save plans whose copies are done since the last step, per request: a
        request whose copies are all done when it finishes gives its blocks back at once."""
        with self._copy_cond:
            counts, self._copy_counts = self._copy_counts, {}
        return LMTierWorkerMeta(counts) if counts else None

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for queued saves (tests and shutdown)."""
        if self._saves is not None and self._saver_pid == os.getpid():
            self._saves.join()
        self.store.flush(timeout)

    def shutdown(self) -> None:
        try:
            self._finish_loads()
            self.flush()
            self.store.persist()  # write-back: what only memory holds reaches the lower tiers
        except Exception:
            log.exception("lmtier flush at shutdown failed")


def _typed(cache: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """vLLM allocates fp8 caches as uint8 (its fp8 kernels reinterpret them): view them in
    the layout's one-byte dtype, so that the layout check compares like with like."""
    want = getattr(torch, layout.dtype)
    if cache.dtype == torch.uint8 and want != torch.uint8 and want.itemsize == 1:
        return cache.view(want)
    return cache


def _as_tensor(data: np.ndarray, layout: KVLayout) -> torch.Tensor:
    """Contiguous canonical bytes as a tensor in the canonical layout (a view: no copy)."""
    flat = torch.from_numpy(data.reshape(-1)).view(getattr(torch, layout.dtype))
    return flat.reshape(layout.tensor_shape(data.shape[2]))


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

"""The worker half of ``LMTierConnector`` (each worker process): the engine's paged cache
as lmtier sees it, and the loads into it. Saves out of it are ``connectors/vllm/saves.py``.

- ``register_kv_caches`` opens a copy engine per lane over the caches the engine
  registered; sleep mode (``unregister_kv_caches`` / ``restore_kv_caches``) lets them go
  and opens them again.
- ``start_load_kv`` loads the planned chunks into the paged cache (``CopyEngine.scatter``)
  before the forward pass; with ``layer_loads`` on a GPU the copies land layer by layer
  (``wait_for_layer_load``). What does not load is reported through
  ``get_block_ids_with_load_errors`` and recomputed.
- ``get_kv_connector_stats`` reports this worker's loads, saves and tier reads to vLLM.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lmtier import metrics
from lmtier._moved import forward
from lmtier.connectors.vllm.events import LMTierKVEvents, WorkerEvents
from lmtier.connectors.vllm.groups import layer_index
from lmtier.connectors.vllm.plans import LMTierMetadata, LoadPlan
from lmtier.connectors.vllm.saves import WorkerSaves
from lmtier.connectors.vllm.stats import LMTierStats
from lmtier.engine.transfer import CopyEngine
from lmtier.kv.chunk import Chunk, release_all
from lmtier.kv.layout import KVLayout
from lmtier.store.readpath import deadline_after, load_batch

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

log = logging.getLogger("lmtier.vllm")
ENGINE = "vllm"  # the engine label of lmtier_engine_tokens_total


class WorkerSide(WorkerSaves):
    """Mixed into ``LMTierConnector``; its state is made in the connector's ``__init__``.
    Besides what ``WorkerSaves`` reads and keeps: ``_kv_caches`` (as registered),
    ``_engine`` / ``_engines`` (a copy engine per lane), ``_layer_of``, ``_layered``,
    ``_staged``, ``_layer_load`` and ``_load_holds`` (layer_loads), ``_failed_blocks``,
    ``_interval`` (figures for vLLM's metrics) and ``_worker_events``."""

    def _count(self, result: str, tokens: int) -> None:
        """Worker-side tokens (loaded, failed, stored, dropped): lmtier's own metric and
        this interval's figures for vLLM's."""
        metrics.ENGINE_TOKENS.labels(ENGINE, result).inc(tokens)
        self._interval.count(result, tokens)

    def get_kv_connector_stats(self) -> LMTierStats | None:
        """The worker's loads, saves and tier reads since it last reported; the scheduler
        half's (vLLM asks it too, each step), its hand-offs: a decode instance's waits that
        ended ready, late, with the shared tier down, or ignored."""
        if self._engine is None:
            return self._interval.take({})
        return self._interval.take(self.store.read_counts(), self.store.request_counts())

    # -- KV events for routers (lmtier.connectors.vllm.events) ------------------------------
    def get_kv_connector_kv_cache_events(self) -> LMTierKVEvents | None:
        return self._worker_events.take() if self._worker_events is not None else None

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
        if plan.source:  # a router named the peer that holds them
            self.store.direct(keys, plan.source)
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

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self) -> None:
        if self._request_log is not None:  # the scheduler's: its last lines on disk
            self._request_log.close()
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


__getattr__ = forward(__name__)  # names of the previous release, found where they live now (CHANGELOG.md)

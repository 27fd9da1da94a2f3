"""The worker half of ``LMTierConnector`` (each worker process): the copies between the
engine's paged cache and lmtier's tiers.

- ``start_load_kv`` loads the planned chunks into the paged cache (``CopyEngine.scatter``)
  before the forward pass.
- ``wait_for_save`` hands the newly computed full chunks to a background thread, which
  copies them out of the paged cache (``CopyEngine.gather``) and stores them: saving costs
  the engine's step nothing. The blocks must outlive that copy, so a request with saves is
  freed late (the scheduler's ``request_finished`` asks vLLM to wait; ``get_finished``
  reports the copies done), and a request preempted with a copy in flight is fenced: the
  next step's ``start_load_kv`` waits for its copy before the forward pass can write its
  freed blocks.
- A producer (``kv_producer``, ``connectors/vllm_pd.py``) writes every tier before a save
  counts as done, and the step that completes a prompt whose router forwards nothing
  waits in ``wait_for_save`` until that prompt's chunks have landed (at most
  ``handoff_timeout``): its answer leaves once a decode instance can read them.

Longer than 400 lines: loads, saves and the bookkeeping that keeps a request's blocks
until their copies are done share one lock and one set of per-request counts.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lmtier import metrics
from lmtier.connectors.vllm_events import LMTierKVEvents, WorkerEvents
from lmtier.connectors.vllm_groups import layer_index
from lmtier.connectors.vllm_plans import LMTierMetadata, LMTierWorkerMeta, LoadPlan, SavePlan
from lmtier.connectors.vllm_stats import LMTierStats
from lmtier.engine.transfer import CopyEngine, HostBuffers
from lmtier.kv.chunk import Chunk, release_all
from lmtier.kv.layout import KVLayout
from lmtier.store.tiered import deadline_after, load_batch

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.forward_context import ForwardContext

log = logging.getLogger("lmtier.vllm")
ENGINE = "vllm"  # the engine label of lmtier_engine_tokens_total

SAVE_BUFFER_BYTES = 256 << 20  # bound on host memory holding chunks on their way to the store
MAX_COPY_REPORTS = 65536  # per step: requests whose copies a worker reports done to the scheduler


class WorkerSide:
    """Mixed into ``LMTierConnector``; its state is made in the connector's ``__init__``."""

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
        """Hand this step's save plans to the saver thread; the step goes on at once,
        except a producer's step that completes a prompt whose router forwards nothing: it
        waits until that prompt's chunks are in every tier (``_hold``)."""
        if self._layer_load is not None:  # whatever a layer did not wait for, later kernels do
            self._layer_load.wait(len(self._layer_of) - 1)
            self._finish_loads(wait=False)
        meta = self._connector_metadata
        if not isinstance(meta, LMTierMetadata) or not (meta.saves or meta.hold):
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
                if self.kv_role.producer:
                    self._storing[plan.req_id] = self._storing.get(plan.req_id, 0) + 1
            if not self._enqueue_save(plan, written):  # the queue is full: a future miss, never a stall
                self._copied_one(plan.req_id)
                self._stored_one(plan.req_id)
                self._count("dropped", len(plan.keys[self._rank]) * self.chunk_tokens)
        if meta.hold:
            self._hold(meta.hold)

    def _hold(self, req_ids: list[str]) -> None:
        """A producer: wait until every save of ``req_ids`` is in every tier (their answers
        leave with this step's output), at most ``handoff_timeout`` seconds."""
        timeout = self.config.handoff_timeout
        start = time.monotonic()
        with self._copy_cond:
            landed = self._copy_cond.wait_for(lambda: not any(self._storing.get(r) for r in req_ids), timeout)
        waited = time.monotonic() - start
        metrics.HANDOFF_WAIT.observe(waited)
        if not landed:
            log.warning(
                "lmtier: the chunks of %d prompt(s) were not in every tier after %.1f s (handoff_timeout); "
                "they are answered now, and a decode instance may recompute them",
                len(req_ids), timeout,
            )  # fmt: skip

    def _stored_one(self, req_id: str) -> None:
        """One save plan of a producer's ``req_id`` has reached every tier (or failed)."""
        if not self.kv_role.producer:
            return
        with self._copy_cond:
            left = self._storing.get(req_id, 0) - 1
            if left > 0:
                self._storing[req_id] = left
            else:
                self._storing.pop(req_id, None)
                self._copy_cond.notify_all()

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
                if self.kv_role.producer:  # a hand-off: readable by the other side before the answer leaves
                    self.store.put_all(chunks)
                else:
                    self.store.put(chunks)  # copies into the first tier; lower tiers read it back from there
                self._count("stored", len(chunks) * self.chunk_tokens)
        finally:
            for buf in bufs:
                buffers.release(buf)
            self._stored_one(plan.req_id)

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

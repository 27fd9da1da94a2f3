"""The worker half's saves (each worker process): newly computed full chunks out of the
engine's paged cache and into lmtier's tiers, and the bookkeeping that keeps a request's
blocks until the copies reading them are done.

- ``wait_for_save`` hands the step's save plans to a background thread, which copies them
  out of the paged cache (``CopyEngine.gather``) and stores them: saving costs the
  engine's step nothing. The blocks must outlive that copy, so a request with saves is
  freed late (the scheduler's ``request_finished`` asks vLLM to wait; ``get_finished``
  reports the copies done), and a request preempted with a copy in flight is fenced
  (``handle_preemptions``): the next step waits for its copy before the forward pass can
  write its freed blocks.
- A producer (``kv_producer``, ``connectors/vllm/pd.py``; or any instance's request that
  names its decode instance, ``remote_decoder``) writes every tier before a save counts
  as done, and the step that completes a prompt whose router forwards nothing waits in
  ``wait_for_save`` until that prompt's chunks have landed (at most
  ``handoff_timeout``): its answer leaves once a decode instance can read them.

    WorkerSaves          the saves, mixed into the connector (via WorkerSide)
    SAVE_BUFFER_BYTES    host memory holding chunks on their way to the store, at most
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from lmtier import metrics
from lmtier.connectors.vllm.plans import LMTierMetadata, LMTierWorkerMeta, SavePlan
from lmtier.engine.transfer import HostBuffers
from lmtier.kv.chunk import Chunk

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

log = logging.getLogger("lmtier.vllm")

SAVE_BUFFER_BYTES = 256 << 20  # bound on host memory holding chunks on their way to the store
MAX_COPY_REPORTS = 65536  # per step: requests whose copies a worker reports done to the scheduler


class WorkerSaves:
    """Mixed into ``LMTierConnector`` (through ``WorkerSide``); its state is made in the
    connector's ``__init__``. Reads ``lanes``, ``chunk_tokens``, ``blocks_per_chunk``,
    ``lane_namespaces``, ``store``, ``kv_role``, ``config``, and the worker's ``_rank``,
    ``_engine`` / ``_engines``, ``_layer_load``, ``_layer_of``, ``_worker_events``,
    ``_finish_loads`` and ``_count`` (``WorkerSide``). Keeps, under ``_copy_cond``, the
    per-request counts ``_copying``, ``_saving``, ``_finishing``, ``_copied``,
    ``_copy_counts`` and ``_storing``; and the saver thread's ``_saves`` queue,
    ``_saver_pid`` and ``_save_buffers``."""

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
                if plan.hand_off:
                    self._storing[plan.req_id] = self._storing.get(plan.req_id, 0) + 1
            if not self._enqueue_save(plan, written):  # the queue is full: a future miss, never a stall
                self._copied_one(plan.req_id)
                self._stored_one(plan)
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

    def _stored_one(self, plan: SavePlan) -> None:
        """One save plan of a producer's request has reached every tier (or failed)."""
        if not plan.hand_off:
            return
        with self._copy_cond:
            left = self._storing.get(plan.req_id, 0) - 1
            if left > 0:
                self._storing[plan.req_id] = left
            else:
                self._storing.pop(plan.req_id, None)
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
                if plan.hand_off:  # a hand-off: readable by the other side before the answer leaves
                    self.store.put_all(chunks)
                else:
                    self.store.put(chunks)  # copies into the first tier; lower tiers read it back from there
                self._count("stored", len(chunks) * self.chunk_tokens)
        finally:
            for buf in bufs:
                buffers.release(buf)
            self._stored_one(plan)

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

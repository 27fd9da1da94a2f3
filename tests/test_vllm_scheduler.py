"""The connector inside vLLM's real Scheduler (no model run): hits, misses, tails,
whole-prompt hits, preemption, a worker whose load fails, and saves that copy blocks
after the step (held blocks, reported copies, the fence after a preemption).

One file: every behaviour of the scheduler half runs on one fixture (vLLM's
real Scheduler), and its helpers serve the PD and hybrid-model tests too."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from lmtier.connectors.vllm import LMTierConnector, LMTierMetadata
from lmtier.connectors.vllm.worker import _typed
from lmtier.engine.transfer import CopyEngine
from lmtier.kv.chunk import Chunk
from lmtier.kv.layout import KVLayout
from lmtier.testing.tinymodel import build

from conftest import flip_byte

BLOCK, CHUNK, NUM_BLOCKS = 64, 128, 256
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(build(tmp_path_factory.mktemp("model")))


@pytest.fixture
def vllm_config(model, tmp_path) -> VllmConfig:
    return config_for(model, [f"file://{tmp_path}/disk?size=256MiB"])


def config_for(model: str, tiers: list[str], **extra) -> VllmConfig:
    """A CPU engine's configuration with lmtier over ``tiers``, chunks of CHUNK tokens
    (``extra``: more of lmtier's extra config)."""
    transfer = KVTransferConfig(
        kv_connector="LMTierConnector",
        kv_connector_module_path="lmtier.connectors.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"tiers": tiers, "chunk_tokens": CHUNK, **extra},
    )
    cache = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=False)
    cache.num_gpu_blocks = NUM_BLOCKS
    return VllmConfig(
        model_config=ModelConfig(model=model, dtype="bfloat16", max_model_len=4096),
        cache_config=cache,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=4096,
            max_model_len=4096,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
        ),
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])


@pytest.fixture
def scheduler(vllm_config) -> Scheduler:
    return scheduler_for(vllm_config, kv_cache_config())


def scheduler_for(vllm_config: VllmConfig, cache: KVCacheConfig) -> Scheduler:
    """vLLM's real Scheduler over ``cache`` (no model runs)."""
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=cache,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
    )


def tokens(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(5, 500, n)]


def store_chunks(connector: LMTierConnector, prompt: list[int], n: int) -> list[np.ndarray]:
    """Put the first ``n`` chunks of ``prompt`` into the store, as a worker would."""
    ns = connector.namespaces[0]
    layout = connector.layout
    data = [np.random.default_rng(i).integers(0, 256, layout.byte_shape(CHUNK), dtype=np.uint8) for i in range(n)]
    connector.store.put(
        [Chunk(k, layout, d, namespace=ns.digest) for k, d in zip(ns.keys(prompt)[:n], data, strict=True)]
    )
    return data


def schedule(scheduler: Scheduler, prompt: list[int], req_id: str = "r", params: dict | None = None):
    sampling = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params} if params else None)
    request = Request(request_id=req_id, prompt_token_ids=prompt, sampling_params=sampling, pooling_params=None)
    scheduler.add_request(request)
    out = scheduler.schedule()
    return request, out, out.kv_connector_metadata


def test_a_miss_computes_everything_and_saves_the_full_chunks(scheduler):
    prompt = tokens(500)
    _, out, meta = schedule(scheduler, prompt)
    assert out.num_scheduled_tokens["r"] == 500
    assert meta.loads == []
    (save,) = meta.saves
    assert len(save.keys[0]) == 3 and save.block_ids == request_blocks(scheduler, "r")[:6]


def request_blocks(scheduler: Scheduler, req_id: str) -> list[int]:
    return list(scheduler.kv_cache_manager.get_block_ids(req_id)[0])


def test_a_hit_loads_whole_chunks_and_the_engine_computes_the_partial_tail(scheduler):
    prompt = tokens(450)
    store_chunks(scheduler.connector, prompt, 3)
    request, out, meta = schedule(scheduler, prompt)
    assert request.num_computed_tokens - out.num_scheduled_tokens["r"] == 384
    assert out.num_scheduled_tokens["r"] == 450 - 384  # the 66-token tail
    (load,) = meta.loads
    assert load.keys[0] == scheduler.connector.namespaces[0].keys(prompt)[:3]
    assert (load.first_block, load.num_blocks) == (0, 6)
    assert load.block_ids == request_blocks(scheduler, "r")[:6]
    assert meta.saves == []  # nothing new is complete: the hit chunks are not saved again
    sources = scheduler.connector.get_external_cache_hit_sources(request, 384)
    assert sources == {CacheHitSource.DISK: 384}  # the fixture's one tier is a disk


def test_a_whole_prompt_hit_leaves_the_last_token_to_the_engine(scheduler):
    prompt = tokens(512)
    store_chunks(scheduler.connector, prompt, 4)
    _, out, meta = schedule(scheduler, prompt)
    assert out.num_scheduled_tokens["r"] == 64  # the last block, whose last token the engine must compute
    (load,) = meta.loads
    assert (load.first_block, load.num_blocks, len(load.keys[0])) == (0, 7, 4)


@pytest.mark.parametrize(
    ("params", "loads", "saves"),
    [
        ({"lmtier": {"save": False}}, 1, 0),
        ({"lmtier": {"load": False}}, 0, 1),
        ({"lmtier": {"load": False, "save": False}}, 0, 0),
        ({"lmtier": {"save": "no"}}, 1, 0),  # malformed: never refused, never saved
        ({"lmtier": {"safe": False}}, 1, 0),  # a typo must not store a private document
        ({"lmtier": {"load": False, "extra": 1}}, 0, 0),
        ({"lmtier": "off"}, 1, 0),
        ({"other_connector": 1}, 1, 1),
    ],
)
def test_a_request_can_opt_out_of_loading_or_saving(scheduler, params, loads, saves):
    prompt = tokens(600)
    store_chunks(scheduler.connector, prompt, 1)
    _, out, meta = schedule(scheduler, prompt, params=params)
    assert len(meta.loads) == loads
    assert out.num_scheduled_tokens["r"] == 600 - 128 * loads
    assert len(meta.saves) == saves
    if saves:
        assert len(meta.saves[0].keys[0]) == 4 - loads  # the hit chunk is not saved again


def test_asking_twice_gives_the_same_answer(scheduler):
    prompt = tokens(700)
    store_chunks(scheduler.connector, prompt, 2)
    request = Request(
        request_id="q", prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=1), pooling_params=None
    )
    connector = scheduler.connector
    assert (
        connector.get_num_new_matched_tokens(request, 0)
        == connector.get_num_new_matched_tokens(request, 0)
        == (256, False)
    )
    assert connector.get_num_new_matched_tokens(request, 128) == (128, False)  # beyond the engine's own hit


def test_a_preempted_request_is_planned_again_into_its_new_blocks(scheduler):
    prompt = tokens(450)
    store_chunks(scheduler.connector, prompt, 3)
    request, out, meta = schedule(scheduler, prompt)
    assert len(meta.loads) == 1
    # The step runs (one token sampled), then the request is preempted.
    scheduler.update_from_output(
        out, ModelRunnerOutput(req_ids=["r"], req_id_to_index={"r": 0}, sampled_token_ids=[[7]])
    )
    scheduler.running.remove(request)  # as the scheduler does when it must free blocks
    scheduler._preempt_request(request, 0.0)
    out = scheduler.schedule()
    (load,) = out.kv_connector_metadata.loads
    assert load.block_ids == request_blocks(scheduler, "r")[:6]
    assert out.num_scheduled_tokens["r"] == 451 - 384  # the tail and the sampled token


def test_finished_requests_leave_no_state_behind(scheduler):
    prompt = tokens(300)
    request, _, _ = schedule(scheduler, prompt)
    assert "r" in scheduler.connector._requests
    scheduler.finish_requests(["r"], request.status.FINISHED_ABORTED)
    assert "r" not in scheduler.connector._requests


def test_a_worker_reports_blocks_it_could_not_load_and_loads_the_rest(vllm_config, scheduler):
    prompt = tokens(600)
    data = store_chunks(scheduler.connector, prompt, 4)
    _, _, meta = schedule(scheduler, prompt)
    (load,) = meta.loads
    worker = LMTierConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config())
    caches = {name: torch.zeros(NUM_BLOCKS, 2, BLOCK, 128, dtype=torch.bfloat16) for name in LAYERS}
    worker.register_kv_caches(caches)
    # Chunk 2 goes bad on disk between lookup and load.
    disk = worker.store.tiers[0]
    path, offset, length = disk.locate(load.keys[0][2])
    flip_byte(path, offset + length - 7)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    failed = worker.get_block_ids_with_load_errors()
    assert failed == set(load.block_ids[4:8])  # chunks 2 and 3: nothing after a bad chunk is used
    assert worker.get_block_ids_with_load_errors() == set()  # reported once
    # Chunks 0 and 1 arrived in the right blocks: K of token 70 (block 1, slot 6) of layer 0.
    k = torch.from_numpy(data[0].copy()).view(torch.bfloat16).reshape(connector_shape(worker))
    assert torch.equal(caches[LAYERS[0]][load.block_ids[1], :, 6, :64], k[0, 0, 70])
    assert isinstance(meta, LMTierMetadata)


def connector_shape(worker: LMTierConnector) -> tuple[int, ...]:
    return worker.layout.tensor_shape(CHUNK)


def worker_for(vllm_config) -> tuple[LMTierConnector, dict[str, torch.Tensor]]:
    worker = LMTierConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config())
    caches = {name: torch.randn(NUM_BLOCKS, 2, BLOCK, 128).to(torch.bfloat16) for name in LAYERS}
    worker.register_kv_caches(caches)
    return worker, caches


def hold_copies(worker: LMTierConnector) -> threading.Event:
    """Fault injection: the worker's copies out of the paged cache wait for the event."""
    gate, gather = threading.Event(), worker._engine.gather

    def held(*args, **kwargs):
        assert gate.wait(30)
        gather(*args, **kwargs)

    worker._engine.gather = held
    return gate


def test_a_request_with_saves_keeps_its_blocks_until_every_copy_is_done(vllm_config, scheduler):
    request, _, meta = schedule(scheduler, tokens(300))
    (save,) = meta.saves
    worker, caches = worker_for(vllm_config)
    gate = hold_copies(worker)
    worker.bind_connector_metadata(meta)
    worker.wait_for_save()  # returns at once: the copy runs on the saver thread
    free_before = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    scheduler.finish_requests(["r"], request.status.FINISHED_ABORTED)
    # vLLM holds the blocks: they are still being read
    assert "r" in scheduler.requests
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
    assert worker.get_finished({"r"}) == (None, None)
    gate.set()
    worker.flush()
    assert worker.get_finished(set()) == ({"r"}, None)  # reported once
    assert worker.get_finished(set()) == (None, None)
    scheduler._update_from_kv_xfer_finished(KVConnectorOutput(finished_sending={"r"}))
    assert "r" not in scheduler.requests
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() > free_before
    # what was stored is what the blocks held: K of token 70 (block 1, slot 6), layer 0
    (chunk,) = worker.store.get(save.keys[0][:1])
    with chunk:
        k = torch.from_numpy(chunk.data.copy()).view(torch.bfloat16).reshape(connector_shape(worker))
        assert torch.equal(caches[LAYERS[0]][save.block_ids[1], :, 6, :64], k[0, 0, 70])


def test_requests_without_saves_are_freed_at_once_and_never_reported(vllm_config, scheduler):
    request, _, meta = schedule(scheduler, tokens(300), params={"lmtier": {"save": False}})
    assert meta.saves == []
    worker, _ = worker_for(vllm_config)
    worker.bind_connector_metadata(meta)
    worker.wait_for_save()
    scheduler.finish_requests(["r"], request.status.FINISHED_ABORTED)
    assert "r" not in scheduler.requests
    assert worker.get_finished({"r", "stranger"}) == (None, None)


def test_a_request_preempted_while_its_blocks_are_copied_holds_the_next_step(vllm_config, scheduler):
    request, out, meta = schedule(scheduler, tokens(300))
    worker, _ = worker_for(vllm_config)
    gate = hold_copies(worker)
    worker.bind_connector_metadata(meta)
    worker.wait_for_save()
    scheduler.update_from_output(
        out, ModelRunnerOutput(req_ids=["r"], req_id_to_index={"r": 0}, sampled_token_ids=[[7]])
    )
    scheduler.running.remove(request)
    scheduler._preempt_request(request, 0.0)  # its blocks are free now, the copy still reads them
    nxt = scheduler.schedule().kv_connector_metadata
    assert nxt.fence == ["r"]
    worker.bind_connector_metadata(nxt)
    step = threading.Thread(target=worker.handle_preemptions, args=(nxt,))  # vLLM: before the forward
    step.start()
    step.join(0.5)
    assert step.is_alive()  # the forward pass may not write those blocks yet
    gate.set()
    step.join(30)
    assert not step.is_alive()


@pytest.mark.parametrize("layer_loads", [False, True], ids=["whole", "layer_by_layer"])
def test_one_damaged_layer_of_one_chunk_fails_exactly_that_chunk(vllm_config, layer_loads):
    """Also with layer_loads (the GPU path's layer-by-layer copies, run synchronously on a
    CPU engine): the same blocks fail, the same bytes land, the chunks are let go."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    extra.update(tiers=["cpu://?size=64MiB"], layer_loads=layer_loads)
    assert LMTierConnector.requires_piecewise_for_cudagraph(extra) is layer_loads
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config(),
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
    )
    prompt = tokens(600)
    data = store_chunks(scheduler.connector, prompt, 4)
    _, _, meta = schedule(scheduler, prompt)
    (load,) = meta.loads
    worker, caches = worker_for(vllm_config)
    memory = worker.store.tiers[0]  # the scheduler's tier too: one store per process
    entry = memory._index[load.keys[0][2]]
    layer_bytes = worker.layout.chunk_bytes(CHUNK) // worker.layout.num_layers
    memory.slab.array[entry.slots[0] * memory.slot_bytes + 1 * layer_bytes + 5] ^= 0x10  # layer 1 of chunk 2
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    for name in LAYERS:
        worker.wait_for_layer_load(name)
    assert worker.get_block_ids_with_load_errors() == set(load.block_ids[4:6])  # chunk 2's blocks, no more
    worker.wait_for_save()
    assert worker._load_holds == [] and all(e.leases == 0 for e in memory._index.values())
    # chunk 3, after the damaged one, arrived: K of its token 70 (its block 1, slot 6), layer 0
    k = torch.from_numpy(data[3].copy()).view(torch.bfloat16).reshape(connector_shape(worker))
    assert torch.equal(caches[LAYERS[0]][load.block_ids[7], :, 6, :64].view(torch.int16), k[0, 0, 70].view(torch.int16))


def test_prompts_shorter_than_min_tokens_are_not_saved(vllm_config):
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    extra.update({"tiers": ["cpu://?size=64MiB"], "save_policy": "min_tokens", "min_tokens": 400})
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config(),
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
    )
    _, _, short = schedule(scheduler, tokens(300, seed=1), req_id="short")
    assert short.saves == []
    _, _, long = schedule(scheduler, tokens(500, seed=2), req_id="long")
    assert [s.req_id for s in long.saves] == ["long"]
    assert scheduler.connector.store.stats()["policy"]["policy"] == "min_tokens"


def test_cpu_engines_with_another_block_size_or_instruction_set_never_share_chunks(vllm_config):
    """vLLM's CPU cache keeps a block's K rows, then its V rows, and packs K for the CPU's
    attention instruction set: the bytes of a chunk depend on both, so both are in the keys."""
    from lmtier.connectors.vllm.connector import _engine_identity

    here = _engine_identity(vllm_config)
    assert here.startswith("vllm-cpu/block=64/isa=")
    vllm_config.cache_config.block_size = 128
    assert _engine_identity(vllm_config) != here
    connector = LMTierConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config())
    assert connector.namespaces[0].engine == _engine_identity(vllm_config)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_caches_that_vllm_allocates_as_bytes_are_taken_as_fp8(dtype):
    """vLLM allocates an fp8 KV cache as uint8: the worker reads it as the layout's fp8
    type (no LayoutError at registration) and moves the same bytes."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype)
    caches = [torch.randint(0, 256, (NUM_BLOCKS, 2, BLOCK, 16), dtype=torch.uint8) for _ in range(2)]
    typed = [_typed(c, layout) for c in caches]
    assert all(
        t.dtype == getattr(torch, dtype) and t.data_ptr() == c.data_ptr() for t, c in zip(typed, caches, strict=True)
    )
    engine = CopyEngine(typed, layout, BLOCK, NUM_BLOCKS)
    out = torch.empty(layout.tensor_shape(BLOCK), dtype=getattr(torch, dtype))
    engine.gather([3], out)
    assert torch.equal(out.view(torch.uint8)[1, 0, 5], caches[1][3, :, 5, :8])  # K of token 5, layer 1
    assert _typed(caches[0], KVLayout(2, 2, 8, dtype="bfloat16")) is caches[0]  # others untouched


def test_a_cache_salt_keeps_a_requests_kv_to_requests_with_the_same_salt(scheduler):
    """vLLM's per-request ``cache_salt`` keeps a user's prefix cache apart: lmtier keys a
    salted request's chunks with it (it neither loads nor saves where others look)."""
    prompt = tokens(450, seed=41)
    store_chunks(scheduler.connector, prompt, 3)  # stored without a salt

    def submit(req_id, salt):
        request = Request(
            request_id=req_id, prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None, cache_salt=salt,
        )  # fmt: skip
        return scheduler.connector.get_num_new_matched_tokens(request, 0), scheduler.connector._requests[req_id]

    assert submit("plain", None)[0] == (384, False)
    hit, alice = submit("alice", "alice-secret")
    assert hit == (0, False)
    assert scheduler.connector._keys_for(alice, 384)[0] != scheduler.connector.namespaces[0].keys(prompt)[:3]
    assert submit("alice-again", "alice-secret")[1].namespaces[0][0].digest == alice.namespaces[0][0].digest
    assert submit("bob", "bob-secret")[1].namespaces[0][0].digest != alice.namespaces[0][0].digest


def test_the_request_log_is_a_trace_lmtier_plan_replays(model, tmp_path):
    """``request_log``: vLLM's scheduler writes one line per request (its chunk keys, no
    tokens); the file is a trace for ``lmtier plan``, in which the second request's shared
    prefix (2 of its 3 chunks) is a hit, as it was here."""
    from lmtier.plan.fleet import Fleet
    from lmtier.plan.sim import simulate
    from lmtier.plan.traces import request_log

    path = tmp_path / "requests.jsonl"
    config = config_for(model, ["cpu://?size=64MiB"], request_log=str(path), request_log_bytes=8192)
    s = scheduler_for(config, kv_cache_config())
    first, second = tokens(3 * CHUNK + 5, seed=41), tokens(2 * CHUNK, seed=41) + tokens(CHUNK + 9, seed=42)
    schedule(s, first, "a")
    schedule(s, second, "b")
    s.connector.shutdown()  # as vLLM ends its scheduler: the log flushed and closed
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["tokens"], len(r["chunks"])) for r in lines] == [(3 * CHUNK + 5, 3), (3 * CHUNK + 9, 3)]
    assert lines[0]["chunks"][:2] == lines[1]["chunks"][:2] and lines[0]["chunks"][2] != lines[1]["chunks"][2]
    assert set(lines[0]) == {"t", "tokens", "chunk_tokens", "chunks"}  # the chunks' keys, never a token
    assert lines[0]["chunk_tokens"] == CHUNK
    plan = simulate(Fleet(chunk_tokens=CHUNK, kv_bytes_per_token=1, memory=64 * CHUNK), request_log(path))
    assert plan["prefill_tokens_saved"] == 2 * CHUNK

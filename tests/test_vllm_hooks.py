"""The connector's lifecycle hooks beyond loads and saves, under vLLM's real Scheduler:
the hooks of the installed vLLM's base class (and 0.33's sleep mode), sleep mode's
unregister / restore, and a cache reset with the connector (as after a weight update)."""

from __future__ import annotations

import threading

import pytest
from test_vllm_scheduler import (
    LAYERS,
    NUM_BLOCKS,
    config_for,
    hold_copies,
    kv_cache_config,
    schedule,
    scheduler_for,
    store_chunks,
    tokens,
    worker_for,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.outputs import KVConnectorOutput

from lmtier.connectors.vllm import LMTierConnector, LMTierWorkerMeta
from lmtier.testing.engine import run_engine
from lmtier.testing.tinymodel import build


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(build(tmp_path_factory.mktemp("model")))


@pytest.fixture
def vllm_config(model, tmp_path):
    return config_for(model, [f"file://{tmp_path}/disk?size=256MiB"])


@pytest.fixture
def scheduler(vllm_config):
    return scheduler_for(vllm_config, kv_cache_config())


def test_sleep_mode_no_copy_touches_the_cache_while_it_is_freed(vllm_config, scheduler):
    """vLLM 0.33's sleep hooks: unregister_kv_caches waits for the copies in flight and
    lets no copy start until restore_kv_caches; a load planned meanwhile is a load error
    (recomputed), a save is skipped and its request's blocks go back."""
    prompt = tokens(400)
    request, _, meta = schedule(scheduler, prompt)
    (save,) = meta.saves
    worker, caches = worker_for(vllm_config)
    gate = hold_copies(worker)
    worker.bind_connector_metadata(meta)
    worker.wait_for_save()
    threading.Timer(0.2, gate.set).start()  # a gather still reading the cache as sleep begins
    worker.unregister_kv_caches()
    assert worker.store.lookup(save.keys[0]) == 3  # it landed before the cache went away
    worker.unregister_kv_caches()  # idempotent
    scheduler.finish_requests(["r"], request.status.FINISHED_ABORTED)
    assert worker.get_finished({"r"}) == ({"r"}, None)

    # asleep: the caches may be unmapped; a step that plans a load or a save copies nothing
    other = tokens(400, seed=1)
    _, _, asleep_meta = schedule(scheduler, prompt + [9] * 10, req_id="hit")
    _, _, save_meta = schedule(scheduler, other, req_id="miss")
    (load,) = asleep_meta.loads
    for tensor in caches.values():
        tensor.fill_(0)
    worker.bind_connector_metadata(asleep_meta)
    worker.start_load_kv(None)
    assert worker.get_block_ids_with_load_errors() == set(load.block_ids[load.first_block : load.num_blocks])
    assert all(not t.any() for t in caches.values())  # nothing written
    worker.bind_connector_metadata(save_meta)
    worker.wait_for_save()
    worker.flush()
    assert worker.store.lookup(save_meta.saves[0].keys[0]) == 0
    assert worker.get_finished({"miss"}) == ({"miss"}, None)  # its blocks go back

    # awake: the same tensors are copied into again
    worker.restore_kv_caches()
    worker.restore_kv_caches()
    worker.bind_connector_metadata(asleep_meta)
    worker.start_load_kv(None)
    assert worker.get_block_ids_with_load_errors() == set()
    assert caches[LAYERS[0]][load.block_ids[load.first_block]].any()


def test_after_a_cache_reset_nothing_stored_before_is_loaded(scheduler):
    """vLLM's reset_prefix_cache(reset_connector=True), as after a weight update: the old
    chunks (computed with the old weights) must never be served to this instance again."""
    prompt = tokens(450)
    store_chunks(scheduler.connector, prompt, 3)
    request, out, meta = schedule(scheduler, prompt)
    assert len(meta.loads) == 1
    scheduler.finish_requests(["r"], request.status.FINISHED_ABORTED)
    before = [ns.digest for ns in scheduler.connector.namespaces]
    assert scheduler.reset_prefix_cache(reset_connector=True)
    assert [ns.digest for ns in scheduler.connector.namespaces] != before
    request, out, meta = schedule(scheduler, prompt, req_id="after")
    assert meta.loads == [] and out.num_scheduled_tokens["after"] == 450
    (save,) = meta.saves  # stored anew, under the new namespace
    assert save.digests == [ns.digest for ns in scheduler.connector.namespaces]
    assert not set(save.keys[0]) & set(scheduler.connector.store.tiers[0].keys())


def test_a_request_running_through_a_reset_saves_nothing_after_it(vllm_config):
    """vLLM's reset fails while a request runs, yet the connector's moves on: the running
    request's KV (computed before) must not be saved under the new namespace, where a later
    request would load it as fresh."""
    from vllm.v1.outputs import ModelRunnerOutput

    scheduler = scheduler_for(vllm_config, kv_cache_config())
    scheduler.max_num_scheduled_tokens = 200
    prompt = tokens(640, seed=8)
    request, out, meta = schedule(scheduler, prompt)
    assert meta.saves  # its first chunk, before the reset
    assert not scheduler.reset_prefix_cache(reset_connector=True)  # vLLM's own fails: the request runs
    while request.num_computed_tokens < len(prompt):
        scheduler.update_from_output(
            out, ModelRunnerOutput(req_ids=["r"], req_id_to_index={"r": 0}, sampled_token_ids=[[]])
        )
        out = scheduler.schedule()
        assert out.kv_connector_metadata.saves == []


def test_an_idle_engine_holds_no_block_so_its_cache_reset_succeeds(vllm_config, scheduler):
    """A request whose copies every worker reported done before it finished gives its
    blocks back at once: an engine gone idle (an offline LLM between two generate calls
    takes no further step) holds none, and vLLM's prefix-cache reset, which needs every
    block free, succeeds. The workers then forget the request instead of reporting it."""
    request, _, meta = schedule(scheduler, tokens(300))
    worker, _ = worker_for(vllm_config)
    worker.bind_connector_metadata(meta)
    worker.wait_for_save()
    worker.flush()
    report = worker.build_connector_worker_meta()
    assert report.copied == {"r": 1}
    assert worker.build_connector_worker_meta() is None  # reported once
    scheduler._update_from_kv_xfer_finished(KVConnectorOutput(kv_connector_worker_meta=report))
    scheduler.finish_requests(["r"], request.status.FINISHED_LENGTH_CAPPED)
    assert "r" not in scheduler.requests
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1  # all but the null block
    assert scheduler.reset_prefix_cache(reset_connector=True)
    out = scheduler.schedule()
    assert out.kv_connector_metadata.released == ["r"] and "r" in out.finished_req_ids
    worker.bind_connector_metadata(out.kv_connector_metadata)
    assert worker.get_finished(out.finished_req_ids) == (None, None)  # vLLM has freed them
    assert worker.get_finished(set()) == (None, None)
    assert scheduler.schedule().kv_connector_metadata.released == []


@pytest.mark.engine
def test_a_real_idle_engine_resets_and_loads_nothing_stored_before(model, tmp_path):
    """The flow after a weight update on a real single-process engine (an offline LLM takes
    no step between two generate calls): the reset succeeds, and the same prompt is then
    computed whole, neither vLLM's prefix cache nor lmtier serving KV from before it."""
    prompt = tokens(700, seed=3)
    phases = [
        {"name": "first", "prompts": [prompt]},
        {"name": "reset", "reset": True},
        {"name": "again", "prompts": [prompt]},
        {"name": "reset2", "reset": True},
    ]
    lmtier = {"tiers": ["cpu://?size=64MiB", f"file://{tmp_path}/disk?size=256MiB"], "chunk_tokens": 128}
    spec = {"model": model, "lmtier": lmtier, "block_size": 64, "prefix_caching": True, "phases": phases}
    results = run_engine(spec, tmp_path, "reset", timeout=600)["results"]
    (first,), (again,) = results["first"], results["again"]
    assert results["reset"] is True and results["reset2"] is True
    assert first["cached"] == 0 and again["cached"] == 0
    assert again["tokens"] == first["tokens"]


def test_blocks_stay_held_until_every_worker_reported_every_copy(vllm_config, scheduler):
    """Tensor parallelism: each worker reports its own copies (vLLM adds the workers'
    reports up); one rank's report is not enough to give the blocks back."""
    assert LMTierWorkerMeta({"r": 1}).aggregate(LMTierWorkerMeta({"r": 1, "s": 2})).copied == {"r": 2, "s": 2}
    scheduler.connector._workers = 2  # as with tensor_parallel_size=2
    request, _, _ = schedule(scheduler, tokens(300))
    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    one_rank = KVConnectorOutput(kv_connector_worker_meta=LMTierWorkerMeta({"r": 1}))
    scheduler._update_from_kv_xfer_finished(one_rank)
    scheduler.finish_requests(["r"], request.status.FINISHED_ABORTED)
    assert "r" in scheduler.requests  # held: the other rank may still be reading them
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free
    assert scheduler.schedule().kv_connector_metadata.released == []
    scheduler._update_from_kv_xfer_finished(KVConnectorOutput(finished_sending={"r"}))
    assert "r" not in scheduler.requests


def test_with_save_policy_reuse_a_prefix_found_by_a_lookup_is_a_sighting_in_the_workers_store(model, tmp_path):
    """A prefix vLLM serves from its own cache is never read from lmtier, yet it is reused:
    the lookup that found it counts, in the worker's store (whose memory decides what is
    written down at eviction), so that it is proven there."""
    config = config_for(model, ["cpu://?size=64MiB", f"file://{tmp_path}/disk?size=256MiB"], save_policy="reuse")
    scheduler = scheduler_for(config, kv_cache_config())
    prompt = tokens(450, seed=9)
    store_chunks(scheduler.connector, prompt, 3)
    _, _, meta = schedule(scheduler, prompt)
    keys = scheduler.connector.namespaces[0].keys(prompt)[:3]
    assert meta.seen == [[keys]]
    worker = LMTierConnector(config, KVConnectorRole.WORKER, kv_cache_config())
    sketch = worker.store.policy.sketch
    before = [sketch.estimate(k) for k in keys]
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    assert all(sketch.estimate(k) == b + 1 for k, b in zip(keys, before, strict=True))


def test_the_connector_implements_every_abstract_hook_of_the_installed_vllm_as_declared():
    """Against the vLLM installed here (not a copy of its API): every abstract method of
    its connector base class is overridden, with the same parameters in the same order
    and of the same kinds, so that a vLLM that calls a hook by keyword reaches it."""
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    abstract = sorted(KVConnectorBase_V1.__abstractmethods__)
    assert abstract and not LMTierConnector.__abstractmethods__
    for name in abstract:
        owner = next(c for c in LMTierConnector.__mro__ if name in vars(c))  # its scheduler or worker half
        assert owner.__module__.startswith("lmtier.connectors."), f"{name} is not overridden"
        want = inspect.signature(getattr(KVConnectorBase_V1, name)).parameters
        have = inspect.signature(getattr(LMTierConnector, name)).parameters
        assert [(p.name, p.kind) for p in want.values()] == [(p.name, p.kind) for p in have.values()], name
    # the optional hooks lmtier implements keep vLLM's signatures too
    for name in ("request_finished", "get_finished", "get_block_ids_with_load_errors", "register_kv_caches",
                 "handle_preemptions", "shutdown", "requires_piecewise_for_cudagraph", "get_kv_connector_stats",
                 "build_kv_connector_stats", "build_prom_metrics", "get_external_cache_hit_sources",
                 "take_events", "get_kv_connector_kv_cache_events", "update_connector_output"):  # fmt: skip
        want = inspect.signature(getattr(KVConnectorBase_V1, name)).parameters
        have = inspect.signature(getattr(LMTierConnector, name)).parameters
        assert list(want) == list(have), name
    # vLLM 0.33's sleep-mode hooks: the installed vLLM's where it has them (0.32 has none),
    # else as 0.33's base class declares them
    declared_in_033 = {"supports_sleep_mode": ["kv_transfer_config"], "unregister_kv_caches": ["self"],
                       "restore_kv_caches": ["self"]}  # fmt: skip
    for name, params in declared_in_033.items():
        base = getattr(KVConnectorBase_V1, name, None)
        want = list(inspect.signature(base).parameters) if base is not None else params
        assert list(inspect.signature(getattr(LMTierConnector, name)).parameters) == want, name
    assert isinstance(vars(LMTierConnector)["supports_sleep_mode"], classmethod)


def test_vllms_registry_knows_the_connector_by_name():
    """MultiConnector looks its children up by class name in the API process (their stats);
    an out-of-tree connector missing there ended the engine's output handler."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    assert KVConnectorFactory.get_connector_class_by_name("LMTierConnector") is LMTierConnector

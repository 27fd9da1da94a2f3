"""lmtier's figures for vLLM's metrics (lmtier.connectors.vllm.stats): what a worker
reports per interval, how vLLM adds workers up, what /metrics counts, and where an
external hit came from. The end-to-end check (vLLM's /metrics after a hit) is in
test_vllm_http.py."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from lmtier.connectors.vllm import LMTierConnector
from lmtier.connectors.vllm.stats import Interval, LMTierStats, hit_sources


def test_an_interval_reports_what_changed_then_starts_over():
    interval = Interval()
    assert interval.take({"cpu": (0, 0), "disk": (0, 0)}) is None  # nothing happened
    interval.count("loaded", 512)
    interval.count("stored", 256)
    stats = interval.take({"cpu": (2, 6), "disk": (6, 0)})
    assert stats.data == {"tokens": {"loaded": 512, "stored": 256},
                          "tiers": {"cpu": {"hits": 2, "misses": 6}, "disk": {"hits": 6, "misses": 0}},
                          "handoffs": {}, "requests": {}}  # fmt: skip
    again = interval.take({"cpu": (3, 6), "disk": (6, 0)})
    assert again.data == {"tokens": {}, "tiers": {"cpu": {"hits": 1, "misses": 0}}, "handoffs": {}, "requests": {}}
    assert interval.take({"cpu": (3, 6), "disk": (6, 0)}) is None
    # an object store's requests: what was sent since the last interval
    reads = {"cpu": (3, 6), "s3": (0, 0)}
    assert interval.take(reads, {"s3": {"get": 0, "put": 4}}).data["requests"] == {"s3": {"put": 4}}
    assert interval.take(reads, {"s3": {"get": 2, "put": 4}}).data["requests"] == {"s3": {"get": 2}}
    assert interval.take(reads, {"s3": {"get": 2, "put": 4}}) is None


def test_workers_add_up_and_the_log_line_is_flat():
    a = LMTierStats({"tokens": {"loaded": 128}, "tiers": {"cpu": {"hits": 1, "misses": 0}}})
    b = LMTierStats({"tokens": {"loaded": 128, "failed": 64}, "tiers": {"cpu": {"hits": 2}, "disk": {"misses": 1}}})
    both = a.aggregate(b)
    assert both.data == {"tokens": {"loaded": 256, "failed": 64},
                         "tiers": {"cpu": {"hits": 3, "misses": 0}, "disk": {"misses": 1}}, "handoffs": {},
                         "requests": {}}  # fmt: skip
    assert both.reduce() == {"loaded_tokens": 256, "failed_tokens": 64, "cpu_hits": 3, "cpu_misses": 0,
                             "disk_misses": 1}  # fmt: skip
    assert a.data["tokens"] == {"loaded": 128}  # adding up leaves the parts as they were
    assert LMTierStats().is_empty() and not both.is_empty()
    rebuilt = LMTierConnector.build_kv_connector_stats(both.to_dict())  # as vLLM's front end does
    assert isinstance(rebuilt, LMTierStats) and rebuilt.data == both.data


def test_the_prometheus_counters_count_per_engine_tier_and_result():
    registry = CollectorRegistry()

    def counter(**kw):
        return Counter(**kw, registry=registry)

    types = {Counter: counter, Gauge: Gauge, Histogram: Histogram}
    config = SimpleNamespace(kv_transfer_config=None)  # all a connector's metrics read of it
    prom = LMTierConnector.build_prom_metrics(config, types, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    prom.observe({"tokens": {"loaded": 1024, "failed": 0}, "tiers": {"disk": {"hits": 8, "misses": 0}}}, 0)
    prom.observe({"tokens": {"loaded": 256}, "tiers": {}, "requests": {"s3": {"get": 3, "put": 0}}}, 1)
    sent = {"model_name": "m", "engine": "1", "tier": "s3", "kind": "get"}
    assert registry.get_sample_value("vllm:lmtier_object_store_requests_total", sent) == 3
    get = registry.get_sample_value
    assert get("vllm:lmtier_tokens_total", {"model_name": "m", "engine": "0", "result": "loaded"}) == 1024
    assert get("vllm:lmtier_tokens_total", {"model_name": "m", "engine": "1", "result": "loaded"}) == 256
    assert get("vllm:lmtier_tokens_total", {"model_name": "m", "engine": "0", "result": "failed"}) is None
    labels = {"model_name": "m", "engine": "0", "tier": "disk", "result": "hits"}
    assert get("vllm:lmtier_tier_reads_total", labels) == 8


def test_the_scheduler_halfs_handoffs_reach_vllms_metrics_beside_the_workers_figures():
    """vLLM asks the scheduler half for stats each step and adds them to the workers':
    a decode instance's hand-offs then count on vLLM's own ``/metrics``."""
    scheduler = Interval()  # the scheduler half's: no tier reads of its own
    scheduler.handoff("ready")
    scheduler.handoff("ready")
    scheduler.handoff("late")
    handoffs = scheduler.take({})
    assert handoffs.data == {"tokens": {}, "tiers": {}, "handoffs": {"ready": 2, "late": 1}, "requests": {}}
    assert scheduler.take({}) is None  # counted once
    worker = LMTierStats({"tokens": {"loaded": 256}, "tiers": {"cpu": {"hits": 2}}, "handoffs": {}})
    step = LMTierConnector.build_kv_connector_stats(worker.aggregate(handoffs).to_dict())
    assert step.reduce()["handoffs_ready"] == 2
    registry = CollectorRegistry()
    types = {Counter: lambda **kw: Counter(**kw, registry=registry), Gauge: Gauge, Histogram: Histogram}
    config = SimpleNamespace(kv_transfer_config=None)
    prom = LMTierConnector.build_prom_metrics(config, types, ["model_name"], {0: ["m"]})
    prom.observe(step.data, 0)
    get = registry.get_sample_value
    assert get("vllm:lmtier_handoffs_total", {"model_name": "m", "result": "ready"}) == 2
    assert get("vllm:lmtier_handoffs_total", {"model_name": "m", "result": "late"}) == 1
    assert get("vllm:lmtier_tokens_total", {"model_name": "m", "result": "loaded"}) == 256


def test_an_external_hit_is_split_by_the_tier_of_each_chunk():
    runs = [("cpu", 2), ("file", 3), ("redis", 1)]  # 6 chunks of 100 tokens
    assert hit_sources(runs, 100, 0, 600) == {CacheHitSource.HOST: 200, CacheHitSource.DISK: 300,
                                              CacheHitSource.EXTERNAL_UNSPECIFIED: 100}  # fmt: skip
    # the engine's own prefix hit covers the first 250 tokens; 300 are loaded
    assert hit_sources(runs, 100, 250, 300) == {CacheHitSource.DISK: 250, CacheHitSource.EXTERNAL_UNSPECIFIED: 50}
    assert sum(hit_sources([("cpu", 1)], 100, 0, 150).values()) == 150  # never less than vLLM counts
    # another instance's sidecar is vLLM's p2p: KV transferred from another instance
    sources = hit_sources([("peers", 2), ("grpc", 1)], 100, 0, 300)
    assert sources == {CacheHitSource.P2P: 200, CacheHitSource.EXTERNAL_UNSPECIFIED: 100}

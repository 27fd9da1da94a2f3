"""Every ratio target of the benchmark suite, met or not, read from the benchmarks' reports:
one row per target (what is measured, lmtier's figure, the same-run reference and its figure,
the ratio, the target and whether it is met).

    targets(reports) -> [row]     reports: {NAME: the report benchmark NAME wrote}

``run.py`` puts these rows in ``results.json`` and the table of ``results.md``; they share
one vocabulary with the reports (their fields), read here in one place.
"""

from __future__ import annotations

from typing import Any


def _row(bench: str, what: str, lmtier: float, ref_name: str, ref: float, ratio: float, target: str, met: bool):
    return {
        "benchmark": bench,
        "what": what,
        "lmtier": lmtier,
        "reference": ref_name,
        "reference_value": ref,
        "ratio": ratio,
        "target": target,
        "met": bool(met),
    }


def targets(reports: dict[str, Any]) -> list[dict[str, Any]]:
    """Every ratio target of the earlier issues, from the reports present, met or not."""
    rows: list[dict[str, Any]] = []
    if "cpu" in reports:
        r = reports["cpu"]["results"]
        c = r["cpu_tier"]
        rows.append(
            _row("cpu", "memory tier put+get, 2 MiB chunks (GB/s)", c["gb_per_s"], "np.copyto",
                 r["reference_copyto"]["gb_per_s"], c["ratio_to_reference"], ">= 0.7x", c["ratio_to_reference"] >= 0.7)
        )  # fmt: skip
    if "disk" in reports:
        t = reports["disk"]["throughput"]
        for d in ("write", "read"):
            x = t[d]
            rows.append(
                _row("disk", f"disk tier {d} (GB/s; ratio: median of same-round pairs)", x["lmtier_gb_per_s"],
                     f"dd O_DIRECT {d}", x["dd_gb_per_s"], x["ratio"], ">= 0.8x", x["ratio"] >= 0.8)
            )  # fmt: skip
    if "redis" in reports:
        for x in reports["redis"]["rows"]:
            if x["op"] not in ("set", "get", "set+get"):  # set+get: the round trip, store then load
                continue
            what = f"redis tier {x['op'].upper()}, {x['chunk_mib']:g} MiB (GB/s)"
            ratio = x["lmtier_over_redis_benchmark"]
            rows.append(_row("redis", what, x["lmtier_gbps"], "redis-benchmark -c 4", x["redis_benchmark_gbps"],
                             ratio, ">= 0.8x", ratio >= 0.8))  # fmt: skip
            py = x["lmtier_over_redis_py"]  # the tier's own RESP path earns its place above 1.1x
            rows.append(_row("redis", what, x["lmtier_gbps"], "redis-py pipeline, same connections",
                             x["redis_py_gbps"], py, "> 1.1x", py > 1.1))  # fmt: skip
    if "s3" in reports:
        for x in reports["s3"]["rows"]:
            for op in ("put", "get"):
                r = x[op]  # met only when every round met it: the lowest same-round ratio
                what = f"object-storage tier {op.upper()}, {x['size_mib']:g} MiB (GB/s; ratio: lowest round)"
                rows.append(_row("s3", what, r["lmtier_gbps"], "awscrt S3Client alone, all in flight",
                                 r["awscrt_gbps"], r["ratio_min"], ">= 0.8x", r["ratio_min"] >= 0.8))  # fmt: skip
    if "grpc" in reports:
        for x in reports["grpc"]["rows"]:
            size, op = f"{x['chunk_mib']:g} MiB", x["op"].upper()
            if x["op"] in ("put", "get"):
                rows.append(_row("grpc", f"gRPC tier over TCP, {op} {size} (GB/s)", x["tcp_gbps"],
                                 "bare gRPC echo", x["echo_gbps"], x["tcp_over_echo"], ">= 0.9x",
                                 x["tcp_over_echo"] >= 0.9))  # fmt: skip
            if x["op"] in ("put", "load"):  # a save; a load verified into the engine's buffer
                rows.append(_row("grpc", f"gRPC tier over shared memory, {op} {size} (GB/s)", x["shm_gbps"],
                                 "memcpy + xxh3", x["copyhash_gbps"], x["shm_over_copyhash"], ">= 0.6x",
                                 x["shm_over_copyhash"] >= 0.6))  # fmt: skip
    if "netns" in reports:
        rate = reports["netns"]["rate"]
        for x in reports["netns"]["rows"]:
            what = (
                f"gRPC tier across a {rate} link (network namespaces), {x['op'].upper()} {x['chunk_mib']:g} MiB (GB/s)"
            )
            rows.append(_row("netns", what, x["tier_gbps"], "raw TCP, same link", x["tcp_gbps"], x["tier_over_tcp"],
                             ">= 0.8x", x["tier_over_tcp"] >= 0.8))  # fmt: skip
            rows.append(_row("netns", what, x["tier_gbps"], "bare gRPC echo, same link", x["echo_gbps"],
                             x["tier_over_echo"], ">= 0.9x", x["tier_over_echo"] >= 0.9))  # fmt: skip
    if "server_load" in reports:
        for x in reports["server_load"]["runs"]:
            worst = max(x["load_latency"], key=lambda c: c["p99_over_p50"])
            who = f"{x['clients']} clients x {x['duration_s']:.0f} s, {x['tenants']} tenant(s)"
            rows.append(_row("server_load", f"{who}: the most spread client's load p99 (ms)", worst["p99_ms"],
                             "its p50", worst["p50_ms"], worst["p99_over_p50"], "<= 4x",
                             worst["p99_over_p50"] <= 4))  # fmt: skip
            ratio = x["rss_peak_mib"] / x["rss_bound_mib"]
            rows.append(_row("server_load", f"{who}: the server's peak memory (MiB)", x["rss_peak_mib"],
                             "its bound", x["rss_bound_mib"], ratio, "<= 1.0x", ratio <= 1.0))  # fmt: skip
    if "vllm" in reports:
        v = reports["vllm"]
        for x in v["rows"]:
            n = x["prompt_tokens"]
            ratio = x["disk_hit_over_floor"]
            rows.append(_row("vllm", f"TTFT of an lmtier disk hit, new instance, {n} tokens (s)", x["lmtier_disk_hit"],
                             "disk floor: vLLM's prefix hit + dd O_DIRECT read", x["disk_floor"], ratio,
                             "<= 1.15x (at 8k)", ratio <= 1.15))  # fmt: skip
            ratio = x["lmtier_cpu_hit"] / x["vllm_prefix_hit"]
            rows.append(_row("vllm", f"TTFT of an lmtier memory hit, {n} tokens (s)", x["lmtier_cpu_hit"],
                             "vLLM resident prefix hit", x["vllm_prefix_hit"], ratio, "<= 1.15x (at 8k)",
                             ratio <= 1.15))  # fmt: skip
            overhead = x["store_overhead"]
            rows.append(_row("vllm", f"TTFT of a storing request, {n} tokens (s)", x["lmtier_store"],
                             "same engine, not storing", x["lmtier_no_store"], 1 + overhead, "<= 1.03x",
                             overhead <= 0.03))  # fmt: skip
        t = v["no_reuse_throughput"]
        rows.append(_row("vllm", "throughput without reuse, two engines (tokens/s)", t["with_lmtier_tokens_per_s"],
                         "vLLM without lmtier", t["without_lmtier_tokens_per_s"], t["ratio"], ">= 0.95x",
                         t["ratio"] >= 0.95))  # fmt: skip
        policies = (("paired", "every chunk stored (save_policy=always, the default)", 0.93),
                    ("paired_reuse", "save_policy=reuse", 0.97))  # fmt: skip
        for key, policy, floor in policies:
            p = t[key]
            rows.append(_row("vllm", f"throughput without reuse, one engine, saves landed, {policy} (tokens/s)",
                             p["lmtier_on_tokens_per_s"], "same engine, lmtier off per request",
                             p["lmtier_off_tokens_per_s"], p["ratio"], f">= {floor}x",
                             p["ratio"] >= floor))  # fmt: skip
    if "trace" in reports:
        found = [x for x in reports["trace"]["rows"] if x["workload"] == "trace"]

        def ref(policy: str, x: dict) -> dict:
            return next(y for y in found if y["policy"] == policy and y["setup"] == x["setup"]
                        and y["memory_pct"] == x["memory_pct"] and y["lower_pct"] == x["lower_pct"])  # fmt: skip

        for x in (x for x in found if x["policy"] == "reuse"):
            where = (f"memory {x['memory_pct']}%" if x["lower_pct"] is None
                     else f"memory {x['memory_pct']}% + lower tier {x['lower_pct']}%")  # fmt: skip
            rows.append(_row("trace", f"token hit ratio of the reuse policy, {where} of the trace's chunks",
                             x["hit_ratio"], "Belady (MIN with bypass)", ref("belady", x)["hit_ratio"],
                             x["x_belady"], ">= 0.9x", x["x_belady"] >= 0.9))  # fmt: skip
            if x["lower_pct"] is not None:
                always = ref("always", x)["lower_written_gib"]
                ratio = x["lower_written_gib"] / always
                rows.append(_row("trace", f"GiB written to the lower tier, reuse policy, {where}",
                                 x["lower_written_gib"], "always (write-through)", always, ratio, "< 1.0x",
                                 ratio < 1.0))  # fmt: skip
    if "vllm_tiers" in reports:
        v = reports["vllm_tiers"]
        size = f"{v['kv_mib_per_prompt']:.0f} MiB, {v['tokens']} tokens"
        for x in v["rows"]:
            if x["tier"] == "s3":  # an object store's hit has no target: its figure is in the benchmark's table
                continue
            rows.append(_row("vllm_tiers", f"TTFT of an lmtier {x['tier']} hit, {size} (s)", x["ttft"],
                             "vLLM resident prefix hit", v["vllm_prefix_hit"], x["ratio"], "<= 1.15x",
                             x["ratio"] <= 1.15))  # fmt: skip
        tiers = {x["tier"]: x for x in v["rows"]}
        if "server" in tiers and "memory" in tiers:  # costs under 1 ms count as 1 ms: below a TTFT's noise
            server, memory = (max(tiers[t]["over_floor_s"], 1e-3) for t in ("server", "memory"))
            what = f"a new instance's hit from lmtier serve, cost above the prefix hit, {size} (s)"
            rows.append(_row("vllm_tiers", what, server, "the in-process memory tier's hit, its cost", memory,
                             server / memory, "<= 1.2x", server / memory <= 1.2))  # fmt: skip
    if "vllm_pd" in reports:
        for x in reports["vllm_pd"]["rows"]:
            n = x["tokens"]
            rows.append(_row("vllm_pd", f"producer prefill answered once its KV is in Redis, {n} tokens (s)",
                             x["producer_hold"], "same engine, not storing", x["producer_no_store"],
                             x["hold_ratio"], "<= 1.10x", x["hold_ratio"] <= 1.10))  # fmt: skip
            rows.append(_row("vllm_pd", f"decode instance TTFT, the prompt's KV from Redis, {n} tokens (s)",
                             x["decode_lmtier"], "vLLM resident prefix hit, same prompt", x["vllm_prefix_hit"],
                             x["decode_ratio"], "<= 1.2x", x["decode_ratio"] <= 1.2))  # fmt: skip
    if "cluster_ops" in reports:
        r = reports["cluster_ops"]
        for e in r["events"]:
            ours = [f for name, f in e["clients"].items() if name.startswith("lmtier")]
            wrong = sum(f["wrong"] for f in ours)
            if e["target_back_s"]:
                back = max(f["back_after_healthy_s"] for f in ours)
                rows.append(_row("cluster_ops", f"Redis Cluster, {e['event']}: the hits back after the cluster is "
                                 f"healthy (s; wrong KV: {wrong})", back, "2x the node timeout", e["target_back_s"],
                                 back / e["target_back_s"], "<= 1x, 0 wrong",
                                 back <= e["target_back_s"] and not wrong))  # fmt: skip
            longest = max(f["load_max_s"] for f in ours)
            deadline = r["load_deadline_s"]
            rows.append(_row("cluster_ops", f"Redis Cluster, {e['event']}: the longest load (s)", longest,
                             "the load deadline", deadline, longest / deadline, "<= 1.1x",
                             longest <= 1.1 * deadline))  # fmt: skip
    return rows

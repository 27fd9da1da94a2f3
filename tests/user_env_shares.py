"""What a cell of tests/user_envs.py runs once lmtier's wheel is in an engine's
environment: two engine instances (or their processes) sharing KV through Redis and the
cache server, each writing what it found into the cell's ``results``.

    vllm_share(label, results, env_dir, model, redis_url, server_url, work)
        three real vLLM engines side by side (one cell per engine)
    vllm_light(results, env_dir, redis_url, server_url)
        the connector imported as vLLM does, KV stored and read by two processes
    sglang_share(results, env_dir, redis_url, server_url)
        SGLang's backend factory over its real host pools, in two processes
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path

from pip_envs import in_env, installed

HERE = Path(__file__).resolve().parent
SECRET = "user-env-secret"  # the cache server's token in every cell
PREFIX = 2048  # tokens two vLLM instances share
ONE_LINE_QUESTION = 40


def vllm_share(
    label: str, results: dict, env_dir: Path, model: Path, redis_url: str, server_url: str, work: Path
) -> None:
    """Three engines up side by side: A answers a 2k-token prompt without lmtier, then
    stores it in Redis and the cache server; B (Redis only) and C (the server only) wait
    for A's results, then must load the prefix and answer with A's greedy tokens."""
    ids = [int(x) for x in __import__("numpy").random.default_rng(29).integers(5, 500, PREFIX + ONE_LINE_QUESTION)]
    salt = {"salt": f"user-env-{label}-{time.time_ns()}"}
    common = {"model": str(model), "block_size": 64, "max_model_len": 4096, "prefix_caching": False, "max_tokens": 16}
    env = {"LMTIER_TOKEN": SECRET}
    off = {"lmtier": {"load": False, "save": False}}
    cell_dir = work / label.replace("/", "-")
    cell_dir.mkdir(parents=True, exist_ok=True)
    stored = {"wait": str(cell_dir / "a.out.json")}  # written once A has shut down, its saves landed
    hit = [stored, {"name": "hit", "prompts": [ids]}]
    specs = {
        "a": {**common, "lmtier": {"tiers": [redis_url, server_url], **salt},
              "phases": [{"name": "off", "prompts": [ids], "request": off}, {"name": "store", "prompts": [ids]}]},
        "b": {**common, "lmtier": {"tiers": [redis_url], **salt}, "phases": hit},
        "c": {**common, "lmtier": {"tiers": [server_url], **salt}, "phases": hit},
    }  # fmt: skip

    def engine(name: str) -> dict:
        (cell_dir / f"{name}.json").write_text(json.dumps(specs[name]))
        out = cell_dir / f"{name}.out.json"
        in_env(env_dir, ["-m", "lmtier.testing.engine", str(cell_dir / f"{name}.json"), str(out)], env=env)
        ran = json.loads(out.read_text())
        return {**ran["results"], "connector": ran["connector"]}

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        a, b, c = pool.map(engine, ["a", "b", "c"])
    results["import"] = all(installed(run["connector"] or "", env_dir) for run in (a, b, c))
    want = a["off"][0]["tokens"]
    for tier, run in (("redis", b), ("server", c)):
        got = run["hit"][0]
        same = got["tokens"] == want
        results[f"{tier}_hit"] = same and got["cached"] >= PREFIX and a["store"][0]["cached"] == 0
        results[f"{tier}_detail"] = f"{got['cached']} tokens loaded, answer {'equal' if same else 'DIFFERENT'}"


def vllm_light(results: dict, env_dir: Path, redis_url: str, server_url: str) -> None:
    """What protobuf / grpcio versions can break, without an engine's minutes: the connector
    imported as vLLM imports it (and in vLLM's connector registry), 1,024 tokens of KV
    stored by one process through Redis and the cache server, read back by another from
    each alone, byte for byte."""
    env = {"LMTIER_TOKEN": SECRET}
    worker, urls, seed = str(HERE / "vllm_light.py"), f"{redis_url},{server_url}", str(time.time_ns() % 10**6)
    wrote = json.loads(in_env(env_dir, [worker, "set", urls, seed], env=env).splitlines()[-1])
    read = json.loads(in_env(env_dir, [worker, "get", urls, seed], env=env).splitlines()[-1])
    imported = installed(wrote["lmtier"], env_dir) and installed(read["lmtier"], env_dir)
    results["import"] = imported and wrote["registered"] is True
    stored = wrote["tiers"][0]
    for tier, got in zip(("redis", "server"), read["tiers"], strict=True):
        same = got == stored and stored["sha256"] == wrote["want"]
        results[f"{tier}_hit"] = same
        results[f"{tier}_detail"] = f"{got['tokens']} tokens read, KV {'equal' if same else 'DIFFERENT'}"


def sglang_share(results: dict, env_dir: Path, redis_url: str, server_url: str) -> None:
    """SGLang's backend factory over its real host pools: one process writes 8 pages to
    Redis and the cache server, another (another host layout) reads them from each alone;
    the KV must match byte for byte."""
    env = {"LMTIER_TOKEN": SECRET, "PYTHONPATH": str(HERE)}
    worker, urls, seed = str(HERE / "sglang_worker.py"), f"{redis_url},{server_url}", str(time.time_ns() % 10**6)
    wrote = json.loads(in_env(env_dir, [worker, "set", urls, "mha", "page_first", seed], env=env).splitlines()[-1])
    read = json.loads(in_env(env_dir, [worker, "get", urls, "mha", "layer_first", seed], env=env).splitlines()[-1])
    results["import"] = installed(wrote["connector"], env_dir) and installed(read["connector"], env_dir)
    for tier, got in zip(("redis", "server"), read["tiers"], strict=True):
        same = got["canonical_sha256"] == wrote["canonical_sha256"]
        results[f"{tier}_hit"] = wrote["results"] == got["results"] == [True] * 8 and same
        results[f"{tier}_detail"] = f"{sum(got['results'])} of 8 pages read, KV {'equal' if same else 'DIFFERENT'}"

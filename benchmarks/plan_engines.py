"""The real side of ``benchmarks/bench_plan.py --calibrate``: the fleet a plan describes
started as ``vllm serve`` processes (``RealFleet``), a trace's chunks made prompts
(``tokens_of``), and the plan's costs measured on those engines (``measure``) and fitted
(``fit``); a tier's hit ratios, real and planned over the runs, compared (``agreement``) and
written as a table's row (``hit_row``), for both calibrations (``bench_plan.py``,
``bench_plan_fleet.py``)."""

from __future__ import annotations

import re
import statistics
import time
import urllib.request
from pathlib import Path

import numpy as np
import xxhash

from lmtier.plan.fleet import Fleet
from lmtier.plan.traces import chain

CHUNK, TAIL = 128, 16  # the engines' chunk; each prompt's own last tokens
HIT_TARGET = 0.05  # a tier's hit ratio, plan against real (absolute)


def agreement(real: list[float], plan: list[float]) -> dict:
    """A tier's hit ratios over the runs, real and planned, and whether every run's pair is
    within HIT_TARGET."""
    diff = max(abs(p - r) for p, r in zip(plan, real, strict=True))
    return {"real": real, "plan": plan, "max_abs_diff": diff, "met": diff <= HIT_TARGET}


def hit_row(name: str, tier: str, t: dict) -> str:
    """A table's row of ``agreement``'s result for ``tier`` ("cached": the whole)."""
    what = "hit ratio" if tier == "cached" else f"hit ratio from {tier}"
    return (f"| {name} | {what} | {' / '.join(f'{v:.3f}' for v in t['real'])} "
            f"| {' / '.join(f'{v:.3f}' for v in t['plan'])} | {t['max_abs_diff']:.3f} of {HIT_TARGET}: "
            f"{'met' if t['met'] else 'not met'} |")  # fmt: skip


def tokens_of(keys: list[int], own: int) -> list[int]:
    """A prompt for chained ``keys``: each chunk's tokens drawn from its key (an equal prefix
    gives equal tokens), then TAIL tokens of the prompt's own."""
    out: list[int] = []
    for key in keys:
        out += np.random.default_rng(key).integers(5, 500, CHUNK).tolist()
    return out + np.random.default_rng(10**9 + own).integers(5, 500, TAIL).tolist()


class RealFleet:
    """The fleet a plan describes, as engines: ``instances`` ``vllm serve`` processes, each
    with lmtier's memory tier (``memory``), a disk tier of its own (``disk``, a directory
    here) and the shared tier (``shared``: kind ``server``, an ``lmtier serve``; or kind
    ``redis``, a ``redis-server`` evicting its least recently used keys past the tier's
    size and a tenth more, room for what Redis keeps per key); vLLM's own prefix cache off
    (``gpu: 0``). Routers other than round robin, peers and object stores are left to
    ``bench_fleet.py``."""

    def __init__(self, fleet: Fleet, model: str, tmp: Path) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from lmtier.testing.cache_server import ServerProcess
        from lmtier.testing.redis_server import RedisServer
        from lmtier.testing.vllm_serve import VllmServer

        unsupported = fleet.gpu or fleet.peers or fleet.router != "round_robin"
        if unsupported or fleet.shared not in ("", "server", "redis"):
            raise SystemExit("a calibration fleet is round robin over memory, a disk and a cache server or Redis "
                             "(gpu: 0, no peers)")  # fmt: skip
        self.model = model
        self.server: ServerProcess | RedisServer | None = None  # the shared tier's process
        self.memory_chunks, self.disk = fleet.chunks(fleet.memory), bool(fleet.disk)
        shared = []
        if fleet.shared == "server":
            self.server = ServerProcess(tmp, "--tier", f"cpu://?size={fleet.shared_size}&slot={fleet.chunk_bytes}",
                                        "--no-shm")  # fmt: skip
            shared.append(f"grpc://{self.server.address}?shm=off")
        elif fleet.shared == "redis":
            self.server = RedisServer(tmp / "redis", "--maxmemory", str(fleet.shared_size * 11 // 10),
                                      "--maxmemory-policy", "allkeys-lru")  # fmt: skip
            shared.append(self.server.url)

        def start(i: int) -> VllmServer:
            disk = [f"file://{tmp / f'disk-{i}'}?size={fleet.disk}"] if fleet.disk else []
            tiers = [f"cpu://?size={fleet.memory}", *disk, *shared]  # fastest first
            return VllmServer(model, None, tmp / f"engine-{i}.log", tiers=tiers, chunk=fleet.chunk_tokens,
                              max_model_len=4096, save_policy=fleet.save_policy,
                              args=("--no-enable-prefix-caching", "--max-num-batched-tokens", "4096"))  # fmt: skip

        with ThreadPoolExecutor(fleet.instances) as pool:
            self.engines = list(pool.map(start, range(fleet.instances)))

    def ttft(self, i: int, prompt: list[int]) -> float:
        return self.engines[i].ttft(self.model, prompt)

    def sources(self) -> dict[str, float]:
        """Prompt tokens, cached tokens, and the tokens the workers read from each tier
        (``vllm:lmtier_tier_reads_total``: chunks read, by the tier that served them). In
        ``vllm serve``'s processes the scheduler finds a chunk in the tiers it sees (the
        shared one: the worker's memory is its own), and the worker reads it from its
        memory where it holds it: vLLM's count by source names the scheduler's tier, this
        one the tier the bytes came from, which is what a plan's tiers mean."""
        out = {"prompt": 0.0, "cached": 0.0, "memory": 0.0, "disk": 0.0, "shared": 0.0}
        for e in self.engines:
            out["prompt"] += e.metric("vllm:prompt_tokens_total")
            out["cached"] += e.metric("vllm:prompt_tokens_cached_total")
            text = urllib.request.urlopen(f"{e.url}/metrics", timeout=10).read().decode()
            for labels, value in re.findall(r"^vllm:lmtier_tier_reads_total\{([^}]*)\} (\S+)$", text, re.M):
                tier = re.search(r'tier="([^"]*)"', labels)
                if 'result="hits"' in labels and tier:
                    name = tier.group(1)
                    where = "memory" if name.startswith("cpu") else "shared"
                    where = "disk" if name.startswith(("disk", "file")) else where
                    out[where] += float(value) * CHUNK
        return out

    def stop(self) -> None:
        for e in self.engines:
            e.stop()
        if self.server:
            self.server.stop()


# the cold prompts' lengths, up to the slice's longest: the engines' step budget (4,096
# tokens) is over every prompt, each computed in one step (a second step costs what a line
# through one-step prompts cannot say: 16 chunks and a tail once took 220-270 ms where 14 took 120)
COST_CHUNKS = (2, 5, 8, 11, 14, 16)
MAX_WARM = 16  # warming asks each engine once for every length up to this many chunks
LOAD_CHUNKS = (4, 10, 16)  # the prompts held in memory, on disk and on the server, for each medium's load


def measure(real: RealFleet, seed: int, pause: float, warm: bool = True) -> dict:
    """The times (ms) the plan's costs are fitted to, on these engines, each request alone
    (``pause`` after it): first (``warm``), untimed, one prompt of each length from 1
    to MAX_WARM chunks on each engine (the CPU kernels build their code for each new
    shape once: the trace's requests of a length seen before do not pay it, nor should
    the cost prompts); cold prompts of COST_CHUNKS chunks, twice each, alternating
    engines, for the prefill rate and a request's fixed time (a least-squares line
    through TTFT against tokens); prompts of LOAD_CHUNKS chunks held in memory (asked
    again of the instance that computed them) and held by the shared server only
    (asked of the other), three times each, for each medium's round trip and rate; with a
    disk, the same held on the first engine's disk only (its memory filled with other
    prompts meanwhile)."""
    engines = len(real.engines)

    def prompt(n: int, k: int) -> list[int]:
        return tokens_of(chain(range(n), xxhash.xxh3_64_intdigest(b"cost%d-%d" % (seed, k))), 10**6 + seed * 1000 + k)

    def timed(i: int, p: list[int]) -> float:
        t = real.ttft(i, p)
        time.sleep(pause)
        return t

    for i in range(engines if warm else 0):  # one prompt of each length a plan's requests have
        for n in range(1, MAX_WARM + 1):
            timed(i, prompt(n, 900 + 100 * i + n))
    time.sleep(10 * pause)  # the saves before land before anything is timed
    points = [(n * CHUNK + TAIL, timed((rep + n) % engines, prompt(n, 10 * n + rep)))
              for rep in range(2) for n in COST_CHUNKS]  # fmt: skip
    memory, shared = [], []
    for k in range(3):
        for n in LOAD_CHUNKS:
            p = prompt(n, 100 + 10 * k + n)
            timed(0, p)
            memory.append([n, timed(0, p) * 1e3])
            if real.server is not None:
                shared.append([n, timed(1 % engines, p) * 1e3])
    disk: list[list[float]] = []
    if real.disk:  # two sets of prompts, each memory's size, held on disk: asking for one set
        # pushes everything else out of memory (no prefill: they load from disk)
        sets = [[prompt(MAX_WARM, 10_000 + 100 * s + j) for j in range(-(-real.memory_chunks // MAX_WARM))]
                for s in range(2)]  # fmt: skip
        for p in sets[0] + sets[1]:
            timed(0, p)
        turn = 0
        for k in range(3):
            for n in LOAD_CHUNKS:
                p = prompt(n, 200 + 10 * k + n)
                timed(0, p)
                for fill in sets[turn]:
                    real.ttft(0, fill)
                    time.sleep(pause / 4)
                turn ^= 1
                disk.append([n, timed(0, p) * 1e3])
    out = {"cold": [[x, t * 1e3] for x, t in points], "memory_hit": memory, "shared_hit": shared}
    return out | ({"disk_hit": disk} if disk else {})


def fit(measured: dict, kv_bytes_per_token: int) -> dict:
    """The plan's costs from the measured times (ms): each length's median (measured
    before the slice and after it, so that the machine's drift over the run is in both;
    the median, as the slice's requests are typical ones, not the fastest). A
    least-squares line through the cold ones gives the prefill rate (its slope) and a
    request's fixed time (its intercept). Each medium's load is its hits' time less that fixed time and the prefill
    of the prompt's tail, a line through those against the bytes loaded: a round trip
    (its intercept) and a rate (its slope). (A report from before loads were measured at
    several lengths holds 16-chunk hits only: a rate alone.)"""
    cold: dict[int, list[float]] = {}
    for tokens, ms in measured["cold"]:
        cold.setdefault(tokens, []).append(ms / 1e3)
    typical = {tokens: statistics.median(times) for tokens, times in cold.items()}
    slope, intercept = np.polyfit(list(typical), list(typical.values()), 1)
    rate, fixed = 1.0 / max(float(slope), 1e-9), max(0.0, float(intercept))
    fitted = {"prefill_tokens_per_s": rate, "request_ms": fixed * 1e3, "measured_ms": measured}
    for medium in ("memory", "disk", "shared"):
        times = measured.get(f"{medium}_hit")
        if not times:
            continue
        loads: dict[int, list[float]] = {}
        for chunks, ms in ([16, t] if isinstance(t, (int, float)) else t for t in times):
            loads.setdefault(chunks, []).append(ms / 1e3 - fixed - TAIL / rate)
        load_s = {chunks: statistics.median(x) for chunks, x in loads.items()}
        nbytes = {n: n * CHUNK * kv_bytes_per_token for n in load_s}
        per_byte, trip = (np.polyfit([nbytes[n] for n in load_s], list(load_s.values()), 1) if len(load_s) > 1
                          else (0.0, 0.0))  # fmt: skip
        if per_byte <= 0 or trip < 0:  # no line through the noise: all of it a rate, at the largest
            n = max(load_s)
            per_byte, trip = max(1e-4, load_s[n]) / nbytes[n], 0.0
        fitted[medium] = {"gbps": 1 / float(per_byte) / 1e9, "ms": float(trip) * 1e3}
    return fitted

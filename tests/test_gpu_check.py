"""`make gpu-check` on a machine without a GPU: the GPU suite stays importable and
collectable, the benchmark's entry point loads, and the script says why it cannot run
instead of reporting a pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*cmd: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})  # fmt: skip


def test_the_gpu_suite_is_collected_whole():
    out = run(sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", "tests/gpu",
              LMTIER_GPU_CHECK="1")  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "34 tests collected" in out.stdout  # 6 layouts x 4 dtypes, 3 MLA/split, sizes, batch, pool, order, 3 loads


def test_the_cpu_suite_leaves_the_gpu_suite_out():
    """``pytest`` walking tests/ as CI does, with the CPU suite's own modules set aside (none
    imported, which would cost half a minute): what is left is tests/gpu, which the conftest
    leaves out unless ``make gpu-check`` asks for it."""
    walk = (sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", "tests",
            "--ignore-glob=tests/test_*.py")  # fmt: skip
    out = run(*walk)
    assert out.returncode == 5 and "tests/gpu/" not in out.stdout, out.stdout[-2000:] + out.stderr  # 5: none collected
    out = run(*walk, LMTIER_GPU_CHECK="1")
    assert out.returncode == 0 and "34 tests collected" in out.stdout, out.stdout[-2000:] + out.stderr


def test_gpu_check_without_a_gpu_says_so_and_fails():
    out = run("bash", "scripts/gpu-check.sh", PYTHON=sys.executable, OUT=str(ROOT / ".pytest_cache" / "gpu"))
    assert out.returncode == 2 and "no CUDA device" in out.stderr


def test_the_gpu_benchmark_loads():
    out = run(sys.executable, "benchmarks/bench_gpu.py", "--help")
    assert out.returncode == 0 and "--report" in out.stdout

"""lmtier imports gRPC, protobuf and Redis code only for a tier of that kind.

A plugin lives in its engine's environment: whatever it imports must load beside the
engine's own versions, so an instance whose tiers are memory and disk must not touch
lmtier's gRPC, protobuf or Redis code at all. Each entry point runs in a child process
where those libraries are unimportable (``tests/import_guard``); the child reports which
of lmtier's network modules it loaded, and that list must be empty. The vLLM engines of
tests/test_vllm_engine.py run under the same guard (``GUARDED``).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GUARD = HERE / "import_guard"
NETWORK_LIBRARIES = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf", "redis", "hiredis", "awscrt")
NETWORK_MODULES = (
    "lmtier.v1",
    "lmtier.transport.pieces",
    "lmtier.tiers.grpc",
    "lmtier.tiers.redis",
    "lmtier.tiers.s3",
    "lmtier.server",
    "lmtier.testing.cache_server",
)


def guarded(tmp_path: Path, mode: str = "all") -> dict[str, str]:
    """The environment of a child process under the guard: ``all`` (nobody may import the
    network libraries) or ``lmtier`` (only lmtier's own modules may not)."""
    path = os.pathsep.join([str(GUARD), str(HERE), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "IMPORT_GUARD": mode, "IMPORT_GUARD_REPORT": str(tmp_path / "loaded")}


def loaded(tmp_path: Path) -> list[list[str]]:
    """What each guarded process reported: lmtier's network modules it had loaded (a
    process the guarded one started, a helper of the engine's, reports too)."""
    reports = sorted(tmp_path.glob("loaded.*"))
    assert reports, "no guarded process reported"
    return [json.loads(r.read_text()) for r in reports]


def none_loaded(tmp_path: Path, processes: int) -> bool:
    """Whether at least ``processes`` guarded processes reported, none of them having loaded
    a network module of lmtier's."""
    reports = loaded(tmp_path)
    return len(reports) >= processes and all(report == [] for report in reports)


def run(tmp_path: Path, code: str, mode: str = "all", *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=guarded(tmp_path, mode),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "connectors":
        parts = ["lmtier", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def test_only_the_network_modules_import_network_libraries_at_their_top():
    """The list the guard reports on is complete: any lmtier module that imports gRPC,
    protobuf or Redis when it loads lies under one of ``NETWORK_MODULES``."""
    offenders = []
    for path in sorted([*ROOT.glob("lmtier/**/*.py"), *ROOT.glob("connectors/**/*.py")]):
        name = _module_name(path)
        if any(name == m or name.startswith(m + ".") for m in NETWORK_MODULES):
            continue
        for node in ast.parse(path.read_text()).body:  # module level only: a lazy import is fine
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                targets = [node.module or ""]
            else:
                continue
            for target in targets:
                if any(target == lib or target.startswith(lib + ".") for lib in NETWORK_LIBRARIES):
                    offenders.append(f"{name}: import {target}")
                if any(target == m or target.startswith(m + ".") for m in NETWORK_MODULES):
                    offenders.append(f"{name}: import {target}")
    assert not offenders, offenders


def test_the_guard_blocks_what_it_says(tmp_path):
    out = run(
        tmp_path,
        """
        for name in ("grpc", "google.protobuf", "redis"):
            try:
                __import__(name)
            except ModuleNotFoundError:
                print("blocked", name)
        """,
    )
    assert out.split("\n")[:3] == ["blocked grpc", "blocked google.protobuf", "blocked redis"]


def test_the_embedded_api_saves_and_loads_on_disk_without_grpc_protobuf_or_redis(tmp_path):
    out = run(
        tmp_path,
        """
        import os
        import numpy as np
        import lmtier
        from lmtier.errors import MissingDependency

        layout = lmtier.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16")
        disk = "file://" + os.path.abspath("disk") + "?size=64MiB"
        tiers = ["cpu://?size=16MiB", disk]
        tokens = list(range(600))
        kv = np.random.default_rng(0).integers(0, 2**16, (2, 2, 600, 2, 64), dtype=np.uint16).view(np.float16)
        store = lmtier.open_store(tiers, model="m", layout=layout, chunk_tokens=64)
        assert store.put(tokens, kv) == 576
        store.close()
        again = lmtier.open_store([disk], model="m", layout=layout, chunk_tokens=64)
        assert again.lookup(tokens) == 576
        got = again.get(tokens[:576])
        assert np.array_equal(np.asarray(got).view(np.uint16), kv[:, :, :576].view(np.uint16))
        again.close()
        print("ok")
        """,
    )
    assert out.split() == ["ok"]
    assert none_loaded(tmp_path, 1), loaded(tmp_path)


def test_a_network_tier_without_its_extra_is_refused_in_one_line_naming_the_extra(tmp_path):
    """A ``redis://`` tier needs nothing beyond lmtier's core (it speaks RESP itself);
    Redis Cluster needs redis-py's slot function, the cache server gRPC and protobuf."""
    out = run(
        tmp_path,
        """
        import lmtier
        from lmtier.errors import MissingDependency

        for url, extra in (("grpc://cache:50051", "grpc"), ("redis+cluster://cache:7000", "redis"), ("s3://b/p", "s3")):
            try:
                lmtier.open_store([url], model="m", layout="llama-3-8b")
            except MissingDependency as exc:
                assert "\\n" not in str(exc) and f"pip install 'lmtier[{extra}]'" in str(exc), exc
                print("refused", url)
        """,
    )
    assert out.split() == [
        "refused",
        "grpc://cache:50051",
        "refused",
        "redis+cluster://cache:7000",
        "refused",
        "s3://b/p",
    ]


def test_the_sglang_backend_saves_and_loads_on_disk_without_grpc_protobuf_or_redis(tmp_path):
    """Two processes, each SGLang's own backend factory over its real host pool (the
    worker of tests/test_sglang_backend.py), share pages through a disk tier."""
    url = f"file://{tmp_path}/l3?size=64MiB"
    results = []
    for op, layout in (("set", "page_first"), ("get", "layer_first")):
        proc = subprocess.run(
            [sys.executable, str(HERE / "sglang_worker.py"), op, url, "mha", layout, "7"],
            env=guarded(tmp_path, "lmtier"),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    wrote, read = results
    assert wrote["results"] == read["results"] == [True] * 8
    assert read["canonical_sha256"] == wrote["canonical_sha256"]
    assert none_loaded(tmp_path, 2), loaded(tmp_path)


def test_the_vllm_connector_module_imports_none_of_them(tmp_path):
    """vLLM imports gRPC, protobuf and Redis itself: only lmtier's own imports are refused."""
    run(tmp_path, "import lmtier.connectors.vllm", "lmtier")
    assert none_loaded(tmp_path, 1), loaded(tmp_path)

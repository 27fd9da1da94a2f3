"""Security, in tests: what lmtier writes and shows. No pickle anywhere lmtier writes or
sends bytes (an AST scan of every module that ships, itself tested, and the frames a tier
writes), and no output surface (the Stats RPC, `lmtier stats`, the server's log, /metrics,
configuration errors) that shows a planted secret."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from lmtier.kv import codec
from lmtier.tiers.base import open_tier

from conftest import disk_frames
from raw_client import PROMPT

ROOT = Path(__file__).resolve().parent.parent


# -- no pickle ------------------------------------------------------------------------------------
PICKLING_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "shelve", "marshal", "joblib", "copyreg"}
PICKLING_CALLS = {"torch.load", "torch.save", "np.load", "numpy.load", "load", "save"}
PICKLING_NAMES = {"Queue", "SimpleQueue", "Pipe", "Manager", "Pool"}  # from multiprocessing: pickles


def pickle_uses(paths: list[Path]) -> list[str]:
    """Every import of a pickle-based serializer, call that (un)pickles, or
    multiprocessing channel (they pickle what they carry) in ``paths``."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names if a.name.split(".")[0] in PICKLING_MODULES]
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                names = [module] if module.split(".")[0] in PICKLING_MODULES else []
                if module.endswith("multiprocessing"):
                    names += [a.name for a in node.names if a.name in PICKLING_NAMES]
                if module in ("torch", "numpy"):
                    names += [f"{module}.{a.name}" for a in node.names if a.name in ("load", "save")]
            elif isinstance(node, ast.Call):
                func = ast.unparse(node.func)
                last = func.rsplit(".", 1)[-1]
                names = [func] if func in PICKLING_CALLS - {"load", "save"} else []
                if "multiprocessing" in func and last in PICKLING_NAMES:
                    names.append(func)
            else:
                continue
            found += [f"{path.relative_to(path.parents[1])}:{node.lineno}: {n}" for n in names]
    return found


def test_no_module_that_ships_pickles():
    """Bytes that lmtier stores or sends are frames, msgpack or protobuf."""
    sources = sorted(p for d in ("lmtier", "connectors", "benchmarks") for p in (ROOT / d).rglob("*.py"))
    assert len(sources) > 30
    assert pickle_uses(sources) == []


def test_the_pickle_scan_finds_each_kind_of_use(tmp_path):
    bad = tmp_path / "pkg" / "bad.py"
    bad.parent.mkdir()
    bad.write_text(
        "import pickle\nimport dill.settings\nfrom torch import load\nfrom multiprocessing import Queue\n"
        "import torch, numpy as np, multiprocessing\ntorch.load('x')\nnp.load('y', allow_pickle=True)\n"
        "multiprocessing.Pipe()\n"
    )
    assert [f.split(": ")[1] for f in pickle_uses([bad])] == [
        "pickle", "dill", "torch.load", "Queue", "torch.load", "np.load", "multiprocessing.Pipe",
    ]  # fmt: skip


def test_what_a_tier_writes_is_an_lmtier_frame_not_a_pickle(tmp_path):
    """On disk (and so in Redis and the server, which hold the same frames) every chunk is
    a checksummed frame whose header is msgpack."""
    tier = open_tier(f"file://{tmp_path}?size=16MiB")
    tier.put(PROMPT.chunks())
    tier.close()
    frames = disk_frames(tmp_path)
    assert len(frames) == 3
    for path, offset, length in frames.values():
        data = Path(path).read_bytes()[offset : offset + length]
        assert data.startswith(codec.MAGIC)  # a pickle starts with b"\x80" and its protocol
        assert codec.decode(data).key in PROMPT.keys


def test_no_output_surface_shows_a_planted_secret(tmp_path):
    """A password and a token in tier URLs, a token on the command line: none of them in
    the Stats RPC, `lmtier stats` (table, JSON, errors), the server's log, /metrics, or a
    configuration error."""
    import re
    import subprocess
    import sys
    import urllib.request

    from lmtier.errors import ConfigError
    from lmtier.testing.cache_server import ServerProcess
    from lmtier.testing.redis_server import free_port

    secret = "planted-" + os.urandom(8).hex()
    tiers = [
        "cpu://?size=32MiB&slot=64KiB",
        f"redis://:{secret}@127.0.0.1:{free_port()}?timeout=0.2&connect_timeout=0.2",
        f"grpc://127.0.0.1:{free_port()}?token={secret}&timeout=0.5&retries=0",
    ]
    args = [a for url in tiers for a in ("--tier", url)]
    server = ServerProcess(tmp_path, *args, "--token", "fleet=fleet", "--metrics-port", "0", start=False)
    server.start(ready=False)  # its lower tiers cannot answer: alive, not ready
    try:
        shown = []
        for extra in ([], ["--json"]):
            run = subprocess.run(
                [sys.executable, "-m", "lmtier", "stats", "--server", f"grpc://{server.address}?token=fleet", *extra],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert run.returncode == 0, run.stderr
            assert "redis://:***@127.0.0.1" in run.stdout and "token=***" in run.stdout
            shown += [run.stdout, run.stderr]
        wrong = subprocess.run(
            [sys.executable, "-m", "lmtier", "stats", "--server", f"http://{server.address}?token={secret}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert wrong.returncode != 0
        shown += [wrong.stdout, wrong.stderr]
        found = re.search(r"metrics on (http://\S+/metrics)", server.log())
        assert found, server.log()
        shown.append(urllib.request.urlopen(found[1], timeout=10).read().decode())
        for url in (f"{tiers[1]}&bogus=1", f"{tiers[2]}&token=again"):
            with pytest.raises(ConfigError) as info:
                open_tier(url)
            shown.append(str(info.value))
        bad = subprocess.run(
            [sys.executable, "-m", "lmtier", "serve", "--port", "0", "--tier", f"{tiers[1]}&bogus=1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode != 0 and "bogus" in bad.stderr
        shown += [bad.stdout, bad.stderr]
    finally:
        server.stop()
    shown.append(server.log())
    leaks = [text[max(0, text.find(secret) - 200) :][:400] for text in shown if secret in text]
    assert not leaks, leaks

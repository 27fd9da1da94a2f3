"""deploy/'s images and pods: the engine image is lmtier over vLLM's own image with
nothing of it moved, the sidecar runs it, the engine and its sidecar run as one user, and
each pod stops (the engine flushing through its sidecar) within its grace period. deploy/
is read by tests/manifests.py."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import tomllib

import pytest
import yaml

from lmtier.transport import shm

from manifests import (
    DEPLOY,
    K8S,
    built,
    config_of,
    container_named,
    containers,
    in_build,
    lmtier_config,
    mounts_of,
    one,
    pod_spec,
    split_image,
)

# -- the images -------------------------------------------------------------------------------
STOCK_VLLM = "vllm/vllm-openai:v0.32.0"
ROOT = 0  # the user the stock vLLM image runs as


def _stages(dockerfile: str) -> list[str]:
    """The stages of a Dockerfile, each from its FROM, continued lines joined."""
    text = re.sub(r"\\\n\s*", " ", (DEPLOY / dockerfile).read_text())
    return ["FROM " + s for s in re.split(r"^FROM ", text, flags=re.M)[1:]]


def _built_as(dockerfile: str) -> str:
    """The tag the Dockerfile's header says to build it as."""
    match = re.search(rf"docker build -f deploy/{re.escape(dockerfile)} -t (\S+) \.", (DEPLOY / dockerfile).read_text())
    assert match, f"{dockerfile} does not say how it is built"
    return match[1]


def _image_user(dockerfile: str, base_user: int) -> int:
    users = re.findall(r"^USER (\d+)", _stages(dockerfile)[-1], re.M)
    return int(users[-1]) if users else base_user


def test_the_sidecar_runs_the_lmtier_engine_image_not_the_stock_one():
    pod = one("Deployment", "sidecar")["spec"]["template"]["spec"]
    assert container_named(pod, "vllm")["image"] == _built_as("engine.Dockerfile")
    assert container_named(pod, "lmtier")["image"] == _built_as("Dockerfile")
    version = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]["version"]
    assert split_image(_built_as("engine.Dockerfile")) == ("lmtier-vllm", version)
    # the production overlay renames both images, as it renames the server's
    renamed = {
        i["name"] for i in yaml.safe_load((K8S / "overlays/production/kustomization.yaml").read_text())["images"]
    }
    for name in (split_image(_built_as("engine.Dockerfile"))[0], split_image(_built_as("Dockerfile"))[0]):
        assert name in renamed
    for doc in built("overlays/production"):
        for container in containers(doc):
            assert not container["image"].startswith("vllm/"), f"{doc['metadata']['name']} runs the stock vLLM image"
            if container["name"] in ("vllm", "lmtier"):
                assert container["image"].startswith("registry.example.com/lmtier")


def test_the_engine_image_adds_lmtier_without_moving_vllms_packages():
    wheel_stage, final = _stages("engine.Dockerfile")
    assert "pip wheel" in wheel_stage and "--no-deps" in wheel_stage
    assert re.search(rf"^ARG VLLM_IMAGE={re.escape(STOCK_VLLM)}$", (DEPLOY / "engine.Dockerfile").read_text(), re.M)
    assert final.startswith("FROM ${VLLM_IMAGE}\n")
    assert "COPY --from=wheel /wheels " in final
    steps = [s.strip() for run in re.findall(r"^RUN (.+)$", final, re.M) for s in run.split("&&")]

    def step(pattern: str) -> int:
        found = [i for i, s in enumerate(steps) if re.search(pattern, s)]
        assert found, f"engine.Dockerfile: no step {pattern!r}"
        return found[0]

    # the image's own packages written down (name==version), then lmtier installed under them
    pinned = step(r"pip (list --format=freeze|freeze) > \S+")
    constraints = re.search(r"> (\S+)", steps[pinned])[1]
    install = step(rf"pip install .*-c {re.escape(constraints)} .*lmtier")
    assert pinned < install
    extras = set(re.search(r"\[([\w,]+)\]", steps[install])[1].split(","))
    pyproject = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())
    assert extras == {"grpc", "redis"} <= set(pyproject["project"]["optional-dependencies"])
    # then: nothing moved (every pin still installed), pip check finds nothing the stock
    # image did not already have, and the connector imports
    assert step(rf"grep -vxFf \S+ {re.escape(constraints)}") > install
    checks = [i for i, s in enumerate(steps) if re.search(r"pip check > (\S+)", s)]
    assert len(checks) == 2 and checks[0] < install < checks[1]
    before, after = (re.search(r"pip check > (\S+)", steps[i])[1] for i in checks)
    assert step(rf"grep -vxFf {re.escape(before)} {re.escape(after)}") > checks[1]
    assert step(r"python3? -c .import lmtier\.connectors\.vllm") > install
    # root, as the stock image: no USER, or USER 0
    assert _image_user("engine.Dockerfile", ROOT) == ROOT


def test_the_server_image_installs_the_server_and_the_prestop_hook():
    build, final = _stages("Dockerfile")
    extras = re.search(r"pip wheel .*\"\.\[([\w,]+)\]\"", build)[1].split(",")
    assert "server" in extras
    assert re.search(r"python -c .import lmtier\.server\.app", final)
    hook = next(c for c in _sidecar_pod()["containers"] if c["name"] == "lmtier")["lifecycle"]["preStop"]
    script = next(a for a in hook["exec"]["command"] if a.endswith("await_clients.py"))
    assert re.search(rf"^COPY deploy/await_clients\.py {re.escape(script)}$", final, re.M)


# -- one user for the engine and its sidecar -------------------------------------------------
def _sidecar_pod(directory: str = "sidecar") -> dict:
    return pod_spec(in_build(built(directory), "Deployment", "vllm-lmtier"))


def _uid(pod: dict, container: dict, image_user: int) -> tuple[int, int | None]:
    """(uid, gid) the container runs as: its own securityContext, the pod's, its image's."""
    own, shared = container.get("securityContext", {}), pod.get("securityContext", {})
    uid = own.get("runAsUser", shared.get("runAsUser", image_user))
    return uid, own.get("runAsGroup", shared.get("runAsGroup"))


@pytest.mark.parametrize("directory", ["sidecar", "overlays/production"])
def test_the_engine_and_its_sidecar_run_as_one_user(directory):
    """Their shared-memory segments are 0600 files of their creator: each side opens the
    other's, so both run as one uid, the one the engine image is built for (root)."""
    pod = _sidecar_pod(directory)
    engine, sidecar = container_named(pod, "vllm"), container_named(pod, "lmtier")
    engine_user = _uid(pod, engine, _image_user("engine.Dockerfile", ROOT))
    sidecar_user = _uid(pod, sidecar, _image_user("Dockerfile", ROOT))
    assert engine_user == sidecar_user
    assert engine_user[0] == _image_user("engine.Dockerfile", ROOT)
    assert not pod["securityContext"].get("runAsNonRoot")  # it would refuse to start them
    if sidecar_user[0] == ROOT:  # root with nothing to bypass permissions with
        context = sidecar["securityContext"]
        assert context["capabilities"]["drop"] == ["ALL"] and not context.get("capabilities", {}).get("add")
        assert context["allowPrivilegeEscalation"] is False and context["readOnlyRootFilesystem"] is True


# -- stopping: the engine flushes through its sidecar, which outlives it ----------------------
def _stop_budget(grace: float) -> float:
    """Seconds ``lmtier serve`` may take after SIGTERM (``CacheServer.stop``): calls drain
    (``grace``, and up to 5 s more for gRPC to wind down), then the store flushes its
    queued writes (``grace`` again)."""
    return 2 * grace + 5


def _flag(args: list[str], name: str) -> float:
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    assert len(values) == 1, f"{name} is not set once in {args}"
    return float(values[0])


@pytest.mark.parametrize("directory", ["sidecar", "overlays/production"])
def test_a_sidecar_pod_stops_engine_first_within_its_grace_period(directory, tmp_path):
    from lmtier.connectors.vllm import LMTierConnector

    docs = built(directory)
    pod = pod_spec(in_build(docs, "Deployment", "vllm-lmtier"))
    engine, sidecar = container_named(pod, "vllm"), container_named(pod, "lmtier")
    cfg = lmtier_config(in_build(docs, "ConfigMap", "lmtier-sidecar"), tmp_path)

    # the engine drains its requests, then the connector flushes (at most its flush timeout)
    shutdown = _flag(engine["args"], "--shutdown-timeout")
    assert shutdown > 0  # vLLM's default, 0, kills the workers before lmtier's flush
    flush = inspect.signature(LMTierConnector.flush).parameters["timeout"].default
    # the sidecar waits for that in preStop (on the segments in the /dev/shm they share) ...
    hook = sidecar["lifecycle"]["preStop"]["exec"]["command"]
    assert any(a.endswith("await_clients.py") for a in hook)
    assert [a for a in hook if a.startswith("--shm-dir=")] == [f"--shm-dir={cfg.server.shm_dir}"]
    assert mounts_of(sidecar)[cfg.server.shm_dir] == mounts_of(engine)["/dev/shm"]
    waits = _flag(hook, "--timeout")
    assert waits >= shutdown + flush
    # ... then drains and flushes itself, all within the grace period
    assert pod["terminationGracePeriodSeconds"] > waits + _stop_budget(cfg.server.grace)


def test_the_shared_server_stops_within_its_grace_period(tmp_path):
    pod = one("StatefulSet", "server")["spec"]["template"]["spec"]
    cfg = config_of("server", "lmtier-server", tmp_path).server
    hook = container_named(pod, "lmtier")["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[0] == "sleep"  # while the endpoints controller takes the pod out of the Service
    assert pod["terminationGracePeriodSeconds"] > float(hook[1]) + _stop_budget(cfg.grace)


def test_the_prestop_hook_waits_for_the_clients_of_other_processes_only(tmp_path):
    """await_clients.py, on real segments: the server's own (this process's) never counts;
    another process's counts while it lives, mapped by the server or not (the server maps a
    client's segment while it sends chunks: open, but not its lock)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("await_clients", DEPLOY / "await_clients.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    directory = str(tmp_path)
    own = shm.Segment(directory, 65536, 65536)  # the server's memory tier
    engine = subprocess.Popen(
        [sys.executable, "-c", "import sys; from lmtier.transport import shm; "
         "s = shm.Segment(sys.argv[1], 65536, 65536); "
         "print(s.name, flush=True); sys.stdin.read()", directory],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        name = engine.stdout.readline().strip()
        assert hook.clients(directory, os.getpid()) == [name]
        files = shm.SegmentFiles(directory)  # as the server does on the client's first call
        files.read_into(name, 0, 1024, bytearray(1024))
        assert hook.clients(directory, os.getpid()) == [name]
        script = [
            sys.executable,
            str(DEPLOY / "await_clients.py"),
            f"--shm-dir={directory}",
            f"--server-pid={os.getpid()}",
        ]
        held = subprocess.run([*script, "--timeout=0"], capture_output=True, text=True)
        assert held.returncode == 0 and "1 client segment(s) still held" in held.stdout
        engine.stdin.close()  # the engine exits without closing its segment: the lock goes with it
        engine.wait(timeout=30)
        assert hook.clients(directory, os.getpid()) == []
        done = subprocess.run([*script, "--timeout=30"], capture_output=True, text=True)
        assert done.returncode == 0 and "no client left" in done.stdout
    finally:
        engine.kill()
        own.close()

"""deploy/: every manifest validated offline (kubernetes-validate's bundled schemas, and
yamllint), kustomizations that name only files that exist, and the sidecar's and the
server's settings checked against lmtier's own configuration schema."""

from __future__ import annotations

import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from yamllint import linter
from yamllint.config import YamlLintConfig

from lmtier import metrics
from lmtier.config import Config, load
from lmtier.tiers.base import TierURL
from lmtier.units import parse_size

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S = DEPLOY / "k8s"
MANIFESTS = sorted(K8S.rglob("*.yaml"))
K8S_VERSION = "1.33"
LINT = YamlLintConfig(
    "extends: default\n"
    "rules:\n"
    "  line-length: {max: 140}\n"
    "  document-start: disable\n"
    "  comments: {min-spaces-from-content: 1}\n"
)
OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor"}  # CRDs: no bundled schema, checked below


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_there_are_manifests_for_each_part():
    dirs = {p.parent.name for p in MANIFESTS}
    assert {"server", "sidecar", "redis-cluster", "monitoring", "production"} <= dirs


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(K8S)))
def test_manifests_pass_yamllint_and_the_kubernetes_schemas(path):
    problems = list(linter.run(path.read_text(), LINT, str(path)))
    assert not problems, "\n".join(f"{path}:{p.line}: {p.message}" for p in problems)
    for doc in documents(path):
        if doc["kind"] == "Kustomization":
            for ref in doc.get("resources", []):
                assert (path.parent / ref).exists(), f"{path} names {ref}, which does not exist"
            continue
        if doc["kind"] in OPERATOR_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _one(kind: str, directory: str) -> dict:
    found = [d for p in sorted((K8S / directory).glob("*.yaml")) for d in documents(p) if d["kind"] == kind]
    assert len(found) == 1, (kind, directory)
    return found[0]


def _config(directory: str, name: str, tmp_path: Path) -> Config:
    """Load a ConfigMap's lmtier.yaml with lmtier's own loader: unknown keys or bad values
    fail here as they would in the pod."""
    cm = _one("ConfigMap", directory)
    assert cm["metadata"]["name"] == name
    path = tmp_path / "lmtier.yaml"
    path.write_text(cm["data"]["lmtier.yaml"])
    data = yaml.safe_load(path.read_text())
    token_file = data.get("server", {}).pop("token_file", None)
    if token_file:  # a Secret in the pod; a stand-in here
        (tmp_path / "tokens").write_text("secret=tenant\n")
        data["server"]["token_file"] = str(tmp_path / "tokens")
        path.write_text(yaml.safe_dump(data))
    return load(path, env={})


def _container(pod_spec: dict, name: str) -> dict:
    return next(c for c in pod_spec["containers"] if c["name"] == name)


def _ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def _mounts(container: dict) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def _memory_tier(tiers) -> int:
    url = TierURL.parse(tiers[0])
    assert url.scheme == "cpu"
    return parse_size(url.options["size"])


def test_the_sidecar_agrees_with_lmtiers_configuration(tmp_path):
    cfg = _config("sidecar", "lmtier-sidecar", tmp_path)
    pod = _one("Deployment", "sidecar")["spec"]["template"]["spec"]
    engine, sidecar = _container(pod, "vllm"), _container(pod, "lmtier")
    volumes = {v["name"]: v for v in pod["volumes"]}

    # the connector: its settings parse, and it reads the mounted config file
    from connectors.vllm import EXTRA_KEYS

    arg = next(a for a in engine["args"] if a.startswith("--kv-transfer-config="))
    transfer = json.loads(arg.split("=", 1)[1])
    assert transfer["kv_connector_module_path"] == "lmtier.connectors.vllm"
    assert transfer["kv_load_failure_policy"] == "recompute"
    extra = transfer["kv_connector_extra_config"]
    assert set(extra) <= EXTRA_KEYS
    config_dir = str(Path(extra["config"]).parent)
    assert volumes[_mounts(engine)[config_dir]]["configMap"]["name"] == "lmtier-sidecar"
    assert volumes[_mounts(sidecar)[config_dir]]["configMap"]["name"] == "lmtier-sidecar"
    assert sidecar["args"] == ["--config", extra["config"]]

    # the engine's last tier is this sidecar, on loopback, on the port it listens on
    server = cfg.server
    remote = TierURL.parse(cfg.store.tiers[-1])
    assert remote.scheme == "grpc" and remote.netloc == f"127.0.0.1:{server.port}"
    assert server.host == "127.0.0.1"
    assert _ports(sidecar)["grpc"] == server.port
    assert _ports(sidecar)["metrics"] == server.metrics_port
    assert _ports(engine)["engine-metrics"] == cfg.store.metrics_port
    assert sidecar["readinessProbe"]["grpc"]["port"] == server.port

    # same-host fast path: one memory-backed /dev/shm in both containers, large enough
    # for the sidecar's memory tier (which lives there with a single tenant)
    assert server.shm_dir == "/dev/shm" and not server.tokens
    shm = volumes[_mounts(engine)["/dev/shm"]]
    assert _mounts(sidecar)["/dev/shm"] == _mounts(engine)["/dev/shm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert parse_size(shm["emptyDir"]["sizeLimit"]) > _memory_tier(server.tiers)
    assert pod["securityContext"]["runAsUser"] and "runAsUser" not in sidecar.get("securityContext", {})

    # the disk tier lies on the node-local NVMe volume
    disk = TierURL.parse(server.tiers[-1])
    assert disk.scheme == "file"
    mount = next(m for m in _mounts(sidecar) if disk.path.startswith(m + "/") or disk.path == m)
    assert "hostPath" in volumes[_mounts(sidecar)[mount]]

    # the memory limit covers the memory tier
    assert parse_size(sidecar["resources"]["limits"]["memory"]) >= _memory_tier(server.tiers) + (512 << 20)


def test_the_server_agrees_with_lmtiers_configuration(tmp_path):
    cfg = _config("server", "lmtier-server", tmp_path).server
    sts = _one("StatefulSet", "server")
    pod = sts["spec"]["template"]["spec"]
    server = _container(pod, "lmtier")
    assert _ports(server) == {"grpc": cfg.port, "metrics": cfg.metrics_port}
    assert server["readinessProbe"]["grpc"]["port"] == cfg.port
    assert parse_size(server["resources"]["limits"]["memory"]) >= _memory_tier(cfg.tiers) + (512 << 20)
    disk = TierURL.parse(cfg.tiers[-1])
    claim = sts["spec"]["volumeClaimTemplates"][0]
    assert _mounts(server)[disk.path] == claim["metadata"]["name"]
    assert parse_size(claim["spec"]["resources"]["requests"]["storage"]) >= parse_size(disk.options["size"])
    assert cfg.host == "0.0.0.0" and cfg.shm_dir == ""
    service = _one("Service", "server")
    assert service["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
    monitor = _one("ServiceMonitor", "monitoring")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_the_dockerfile_runs_unprivileged_with_a_health_check():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^USER (?!0\b|root\b)\S+", text, re.M)
    assert re.search(r"^HEALTHCHECK .*readyz", text, re.M | re.S)
    assert re.search(r'^ENTRYPOINT \["lmtier", "serve"\]', text, re.M)
    assert "torch" not in text.split("RUN pip wheel", 1)[1].split("\n")[0]  # the server needs no torch


def test_the_dashboard_uses_only_metrics_lmtier_exports():
    dashboard = json.loads((DEPLOY / "grafana" / "lmtier-dashboard.json").read_text())
    exported = set()
    for metric in [*metrics.REGISTRY.collect(), *metrics.SERVER_REGISTRY.collect()]:
        for s in metric.samples:
            exported.add(s.name)
        exported.add(metric.name)
        exported.update({f"{metric.name}_total", f"{metric.name}_bucket", f"{metric.name}_count"})
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used.update(re.findall(r"\blmtier_[a-z_]+", target["expr"]))
    assert used, "no lmtier metric on the dashboard"
    assert used <= exported, used - exported


def test_the_readme_lists_every_setting():
    from dataclasses import fields

    from lmtier.config import SERVER_EXTRA_KEYS, ServerConfig, StoreConfig

    readme = (DEPLOY.parent / "README.md").read_text()
    section = readme.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    names = [f.name for f in fields(StoreConfig)] + [f.name for f in fields(ServerConfig)] + sorted(SERVER_EXTRA_KEYS)
    missing = [n for n in names if f"`{n}`" not in section]
    assert not missing, f"settings missing from the README's table: {missing}"


def test_the_image_build_stage_has_all_it_needs_to_build_a_wheel_with_the_server(tmp_path):
    """What the Dockerfile copies into its build stage, and nothing else, builds a wheel
    that holds the server (Docker itself is not needed to check that)."""
    import shutil
    import subprocess
    import sys
    import zipfile

    text = (DEPLOY / "Dockerfile").read_text()
    build_stage = text.split("\nFROM ")[1]  # the first stage, after the header comments
    context = tmp_path / "src"
    context.mkdir()
    for line in re.findall(r"^COPY (?!--from)(.+)$", build_stage, re.M):
        *sources, target = line.split()
        for source in sources:
            origin = DEPLOY.parent / source
            dest = context / source if target in ("./", ".") else context / target
            if origin.is_dir():
                shutil.copytree(origin, dest, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(origin, dest)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), "."],
        cwd=context,
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = tmp_path.glob("lmtier-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "lmtier/server/app.py" in names and "lmtier/connectors/vllm.py" in names

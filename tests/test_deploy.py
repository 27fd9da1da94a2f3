"""deploy/: every manifest validated offline (kubernetes-validate's bundled schemas, and
yamllint), kustomizations that name only files that exist and build (by tests/manifests.py's
own reading of them: there is no cluster and no container engine on the CI machine) into
resources whose every reference is met, and the sidecar's and the server's settings checked
against lmtier's own configuration schema. The images, the users the pods run as and how
they stop: tests/test_deploy_pods.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from yamllint import linter
from yamllint.config import YamlLintConfig

from lmtier import metrics
from lmtier.tiers.base import TierURL
from lmtier.units import parse_size

from manifests import (
    DEPLOY,
    K8S,
    KUSTOMIZATIONS,
    MANIFESTS,
    MERGE_KEYS,
    PATCHES,
    built,
    config_of,
    container_named,
    containers,
    documents,
    find,
    hosts,
    in_build,
    kustomize,
    lmtier_config,
    memory_tier,
    merge_key,
    mounts_of,
    network_tiers,
    one,
    pod_spec,
    ports_of,
    references,
    service_for,
    what_you_create,
)

K8S_VERSION = "1.33"
LINT = YamlLintConfig(
    "extends: default\n"
    "rules:\n"
    "  line-length: {max: 140}\n"
    "  document-start: disable\n"
    "  comments: {min-spaces-from-content: 1}\n"
)
OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor"}  # CRDs: no bundled schema, checked below


def test_there_are_manifests_for_each_part():
    dirs = {p.parent.name for p in MANIFESTS}
    assert {"server", "sidecar", "redis-cluster", "monitoring", "production"} <= dirs


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(K8S)))
def test_manifests_pass_yamllint_and_the_kubernetes_schemas(path):
    problems = list(linter.run(path.read_text(), LINT, str(path)))
    assert not problems, "\n".join(f"{path}:{p.line}: {p.message}" for p in problems)
    for doc in documents(path):
        if doc["kind"] == "Kustomization":
            for ref in [*doc.get("resources", []), *(p["path"] for p in doc.get("patches", []) if "path" in p)]:
                assert (path.parent / ref).exists(), f"{path} names {ref}, which does not exist"
            continue
        if path.resolve() in PATCHES:
            continue  # a patch: test_every_kustomization_builds_valid_resources validates the result
        if doc["kind"] in OPERATOR_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_sidecar_agrees_with_lmtiers_configuration(tmp_path):
    cfg = config_of("sidecar", "lmtier-sidecar", tmp_path)
    pod = one("Deployment", "sidecar")["spec"]["template"]["spec"]
    engine, sidecar = container_named(pod, "vllm"), container_named(pod, "lmtier")
    volumes = {v["name"]: v for v in pod["volumes"]}

    # the connector: its settings parse, and it reads the mounted config file
    from lmtier.connectors.vllm import EXTRA_KEYS

    arg = next(a for a in engine["args"] if a.startswith("--kv-transfer-config="))
    transfer = json.loads(arg.split("=", 1)[1])
    assert transfer["kv_connector_module_path"] == "lmtier.connectors.vllm"
    assert transfer["kv_load_failure_policy"] == "recompute"
    extra = transfer["kv_connector_extra_config"]
    assert set(extra) <= EXTRA_KEYS
    config_dir = str(Path(extra["config"]).parent)
    assert volumes[mounts_of(engine)[config_dir]]["configMap"]["name"] == "lmtier-sidecar"
    assert volumes[mounts_of(sidecar)[config_dir]]["configMap"]["name"] == "lmtier-sidecar"
    assert sidecar["args"] == ["--config", extra["config"]]

    # the engine's last tier is this sidecar, on loopback, on the port it listens on
    server = cfg.server
    remote = TierURL.parse(cfg.store.tiers[-1])
    assert remote.scheme == "grpc" and remote.netloc == f"127.0.0.1:{server.port}"
    assert server.host == "127.0.0.1"
    assert ports_of(sidecar)["grpc"] == server.port
    assert ports_of(sidecar)["metrics"] == server.metrics_port
    assert ports_of(engine)["engine-metrics"] == cfg.store.metrics_port
    # the kubelet probes the pod's address: gRPC listens on loopback only, /readyz on all
    probe = sidecar["readinessProbe"]
    assert "grpc" not in probe and server.metrics_host == "0.0.0.0"
    assert probe["httpGet"]["path"] == "/readyz" and ports_of(sidecar)[probe["httpGet"]["port"]] == server.metrics_port
    # Services named lmtier-* would put LMTIER_* variables into the pod: off (and ignored)
    assert pod["enableServiceLinks"] is False

    # same-host fast path: one memory-backed /dev/shm in both containers, large enough
    # for the sidecar's memory tier (which lives there with a single tenant)
    assert server.shm_dir == "/dev/shm" and not server.tokens
    shm = volumes[mounts_of(engine)["/dev/shm"]]
    assert mounts_of(sidecar)["/dev/shm"] == mounts_of(engine)["/dev/shm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert parse_size(shm["emptyDir"]["sizeLimit"]) > memory_tier(server.tiers)
    assert pod["securityContext"]["runAsUser"] is not None  # one user: see test_..._run_as_one_user

    # the disk tier lies on the node-local NVMe volume
    disk = TierURL.parse(server.tiers[-1])
    assert disk.scheme == "file"
    mount = next(m for m in mounts_of(sidecar) if disk.path.startswith(m + "/") or disk.path == m)
    assert "hostPath" in volumes[mounts_of(sidecar)[mount]]

    # the memory limit covers the memory tier
    assert parse_size(sidecar["resources"]["limits"]["memory"]) >= memory_tier(server.tiers) + (512 << 20)


def test_the_server_agrees_with_lmtiers_configuration(tmp_path):
    cfg = config_of("server", "lmtier-server", tmp_path).server
    sts = one("StatefulSet", "server")
    pod = sts["spec"]["template"]["spec"]
    server = container_named(pod, "lmtier")
    assert ports_of(server) == {"grpc": cfg.port, "data": cfg.data_port, "metrics": cfg.metrics_port}
    assert server["readinessProbe"]["grpc"]["port"] == cfg.port
    service = one("Service", "server")
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == {
        "grpc": "grpc",
        "data": "data",  # other hosts' loads take the data channel: reachable through the Service
        "metrics": "metrics",
    }
    assert pod["enableServiceLinks"] is False  # its own Service, lmtier-server, would set LMTIER_SERVER_PORT
    assert parse_size(server["resources"]["limits"]["memory"]) >= memory_tier(cfg.tiers) + (512 << 20)
    disk = TierURL.parse(cfg.tiers[-1])
    claim = sts["spec"]["volumeClaimTemplates"][0]
    assert mounts_of(server)[disk.path] == claim["metadata"]["name"]
    assert parse_size(claim["spec"]["resources"]["requests"]["storage"]) >= parse_size(disk.options["size"])
    assert cfg.host == "0.0.0.0" and cfg.shm_dir == ""
    service = one("Service", "server")
    assert service["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
    monitor = one("ServiceMonitor", "monitoring")
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


def test_the_configuration_page_lists_every_setting():
    """docs/configuration.md: every engine setting in its engine table, every server setting
    in its server table."""
    from dataclasses import fields

    from lmtier.config import SERVER_EXTRA_KEYS, ServerConfig, StoreConfig

    page = (DEPLOY.parent / "docs" / "configuration.md").read_text()
    engine = page.split("\n## Engine side\n", 1)[1].split("\n## ", 1)[0]
    server = page.split("\n## Server\n", 1)[1].split("\n## ", 1)[0]
    missing = [n for n in (f.name for f in fields(StoreConfig)) if f"| `{n}`" not in engine]
    missing += [n for n in [f.name for f in fields(ServerConfig)] + sorted(SERVER_EXTRA_KEYS) if f"`{n}`" not in server]
    assert not missing, f"settings missing from docs/configuration.md's tables: {missing}"


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "engine.Dockerfile"])
def test_the_image_build_stage_has_all_it_needs_to_build_a_wheel_with_the_server(dockerfile, tmp_path):
    """What the Dockerfile copies into its build stage, and nothing else, builds a wheel
    that holds the server and the connectors (Docker itself is not needed to check that)."""
    import zipfile

    text = (DEPLOY / dockerfile).read_text()
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
    assert "lmtier/server/app.py" in names and "lmtier/connectors/vllm/__init__.py" in names


def test_kustomizations_are_read_in_full():
    """Each kustomization builds here, and its resources name what exists."""
    assert {k.name for k in KUSTOMIZATIONS} >= {"server", "sidecar", "redis-cluster", "monitoring", "production"}
    for directory in KUSTOMIZATIONS:
        assert kustomize(directory), directory


@pytest.mark.skipif(not (shutil.which("kustomize") or shutil.which("kubectl")), reason="no kustomize here")
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)))
def test_the_kustomize_reading_agrees_with_kubectl(directory):
    command = ["kustomize", "build"] if shutil.which("kustomize") else ["kubectl", "kustomize"]
    out = subprocess.run([*command, str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr

    def key(d: dict) -> tuple:
        return d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]

    real = sorted((d for d in yaml.safe_load_all(out.stdout) if d), key=key)
    assert [_unordered(d) for d in sorted(kustomize(directory), key=key)] == [_unordered(d) for d in real]


def _unordered(value):
    """``value`` with each list merged by key sorted on it: a strategic merge moves the
    items a patch names to the front of their list, which means nothing to Kubernetes."""
    if isinstance(value, dict):
        return {
            k: sorted((_unordered(i) for i in v), key=lambda i, k=k: str(i[merge_key(k, i)]))
            if k in MERGE_KEYS and isinstance(v, list)
            else _unordered(v)
            for k, v in value.items()
        }
    return [_unordered(i) for i in value] if isinstance(value, list) else value


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)))
def test_every_kustomization_builds_valid_resources(directory):
    for doc in kustomize(directory):
        if doc["kind"] in OPERATOR_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)))
def test_everything_referred_to_is_created_by_the_build_or_by_the_user(directory, tmp_path):
    """Each ConfigMap, Secret and Service a manifest names (env, envFrom, volumes, a
    StatefulSet's Service, hostnames in lmtier.yaml and in commands) is made by the
    kustomization that deploys it, or is in deploy/README.md's "What you create", with
    the keys used and in the namespace used; so is each namespace."""
    docs = kustomize(directory)
    theirs = what_you_create()

    def met(kind: str, name: str, key: str | None, namespace: str | None, who: str) -> None:
        made = find(docs, kind, name)
        if made is not None:
            assert made["metadata"].get("namespace") == namespace, f"{who}: {kind} {name} is in another namespace"
            if key is not None:
                assert key in {**made.get("data", {}), **made.get("stringData", {})}, f"{who}: {kind} {name}: no {key}"
            return
        assert (kind, name) in theirs, f"{who} needs the {kind} {name}: make it here or list it in deploy/README.md"
        documented = theirs[(kind, name)]
        if namespace is not None:
            assert documented["namespace"] == namespace, f"deploy/README.md creates {kind} {name} in another namespace"
        if key is not None:
            assert key in documented["keys"], f"{who} reads key {key} of {kind} {name}; deploy/README.md makes none"

    for doc in docs:
        namespace = doc["metadata"].get("namespace")
        who = f"{directory.name}: {doc['kind']} {doc['metadata']['name']}"
        if namespace is not None:
            met("Namespace", namespace, None, None, who)
        for kind, name, key in references(doc):
            met(kind, name, key, namespace, who)
        if doc["kind"] == "ConfigMap" and "lmtier.yaml" in doc.get("data", {}):
            for url in network_tiers(lmtier_config(doc, tmp_path)):
                for host, port in hosts(url):
                    if host not in ("127.0.0.1", "localhost", "[::1]"):
                        service_for(docs, host, port, namespace)
        # a StatefulSet's pods by name: POD-N.SERVICE in a command (the Redis Cluster's Job)
        for sts in (d for d in docs if d["kind"] == "StatefulSet"):
            name = sts["metadata"]["name"]
            for container in containers(doc):
                text = " ".join([*container.get("command", []), *container.get("args", [])])
                for index, service in re.findall(rf"\b{re.escape(name)}-(\d+)\.([a-z0-9-]+)", text):
                    assert int(index) < sts["spec"]["replicas"], f"{who}: {name}-{index} does not exist"
                    assert service == sts["spec"]["serviceName"], f"{who}: {name}'s pods are under {service}"
                    met("Service", service, None, namespace, who)


def test_what_you_create_is_what_the_overlay_reads():
    """The production overlay's tokens: the server's file and the sidecars' token come from
    the one Secret the README creates, in the overlay's namespace, with the keys used."""
    docs = built("overlays/production")
    namespace = yaml.safe_load((K8S / "overlays/production/kustomization.yaml").read_text())["namespace"]
    secret = what_you_create()[("Secret", "lmtier-tokens")]
    assert secret["namespace"] == namespace and secret["keys"] == {"tokens", "sidecar-token"}
    assert ("Namespace", namespace) in what_you_create()
    server = in_build(docs, "StatefulSet", "lmtier-server")
    assert ("Secret", "lmtier-tokens", "tokens") in references(server)
    sidecar = in_build(docs, "Deployment", "vllm-lmtier")
    env = {v["name"]: v for v in container_named(pod_spec(sidecar), "lmtier").get("env", [])}
    assert env["LMTIER_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "lmtier-tokens", "key": "sidecar-token"}
    # nothing committed holds a token: no Secret is in any build
    assert not [d for k in KUSTOMIZATIONS for d in kustomize(k) if d["kind"] == "Secret"]


def test_the_server_reads_its_tokens_from_the_mounted_secret():
    server = one("StatefulSet", "server")["spec"]["template"]["spec"]
    cm = one("ConfigMap", "server")
    token_file = yaml.safe_load(cm["data"]["lmtier.yaml"])["server"]["token_file"]
    volumes = {v["name"]: v for v in server["volumes"]}
    mount = next(
        m for m in container_named(server, "lmtier")["volumeMounts"] if token_file.startswith(m["mountPath"] + "/")
    )
    item = token_file[len(mount["mountPath"]) + 1 :]
    secret = volumes[mount["name"]]["secret"]
    assert {"key": "tokens", "path": item} in secret["items"]
    assert "tokens" in what_you_create()[("Secret", secret["secretName"])]["keys"]

"""deploy/ read as the tests need it: no cluster, no kustomize binary, no container engine.

- ``documents(path)``: the YAML documents of a manifest; ``one(kind, directory)``: the one
  object of that kind in a directory of deploy/k8s.
- ``kustomize(directory)``: the resources ``kustomize build`` makes, as far as these
  kustomizations use it; ``built(directory)`` under deploy/k8s, ``find`` and ``in_build``
  to pick one out of them.
- ``lmtier_config(configmap, tmp_path)`` and ``config_of(directory, name, tmp_path)``: a
  ConfigMap's lmtier.yaml loaded by lmtier's own loader.
- Pod helpers: ``pod_spec``, ``containers``, ``container_named``, ``ports_of``,
  ``mounts_of``, ``memory_tier``, ``split_image``.
- References: ``what_you_create`` (deploy/README.md's ``kubectl create`` commands),
  ``references`` (the ConfigMaps, Secrets and Services an object names), ``network_tiers``,
  ``hosts`` and ``service_for`` (the Service a tier's host reaches).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import yaml

from lmtier.config import Config, load
from lmtier.tiers.base import TierURL
from lmtier.units import parse_size

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S = DEPLOY / "k8s"
MANIFESTS = sorted(K8S.rglob("*.yaml"))


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


KUSTOMIZATIONS = sorted(p.parent for p in K8S.rglob("kustomization.yaml"))
# Files a kustomization names under patches: partial objects, validated once merged.
PATCHES = {
    (k / patch["path"]).resolve()
    for k in KUSTOMIZATIONS
    for patch in yaml.safe_load((k / "kustomization.yaml").read_text()).get("patches", [])
    if "path" in patch
}


def one(kind: str, directory: str) -> dict:
    found = [d for p in sorted((K8S / directory).glob("*.yaml")) for d in documents(p) if d["kind"] == kind]
    assert len(found) == 1, (kind, directory)
    return found[0]


def config_of(directory: str, name: str, tmp_path: Path) -> Config:
    cm = one("ConfigMap", directory)
    assert cm["metadata"]["name"] == name
    return lmtier_config(cm, tmp_path)


def lmtier_config(cm: dict, tmp_path: Path) -> Config:
    """Load a ConfigMap's lmtier.yaml with lmtier's own loader: unknown keys or bad values
    fail here as they would in the pod."""
    path = tmp_path / "lmtier.yaml"
    path.write_text(cm["data"]["lmtier.yaml"])
    data = yaml.safe_load(path.read_text())
    for key in ("token_file", "peer_token_file"):
        token_file = data.get("server", {}).pop(key, None)
        if token_file:  # a Secret in the pod; a stand-in here
            (tmp_path / key).write_text(f"{key}-secret=tenant\n")
            data["server"][key] = str(tmp_path / key)
            path.write_text(yaml.safe_dump(data))
    return load(path, env={})


def container_named(pod: dict, name: str) -> dict:
    return next(c for c in pod["containers"] if c["name"] == name)


def ports_of(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def mounts_of(container: dict) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def memory_tier(tiers) -> int:
    url = TierURL.parse(tiers[0])
    assert url.scheme == "cpu"
    return parse_size(url.options["size"])


# -- kustomize, as far as these kustomizations use it ---------------------------------------
# No kustomize binary runs in CI: `kustomize` below builds a directory from the fields
# these kustomizations use, and refuses any other field (a new one needs reading here
# first). tests/test_deploy.py::test_the_kustomize_reading_agrees_with_kubectl checks it against the real thing
# where one is installed.
KUSTOMIZE_FIELDS = {
    "apiVersion",
    "kind",
    "resources",
    "patches",
    "images",
    "labels",
    "namespace",
    "configMapGenerator",
    "secretGenerator",
}
# strategic merge: lists of these are merged item by item on the key, others replaced
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "imagePullSecrets": "name", "ports": "containerPort"}  # fmt: skip


def merge_key(field: str, item: dict) -> str:
    """The key a strategic merge matches ``field``'s items by: a container's ports by
    ``containerPort``, a Service's by ``port``."""
    return "port" if field == "ports" and "containerPort" not in item else MERGE_KEYS[field]


CLUSTER_KINDS = {"Namespace", "ClusterRole", "ClusterRoleBinding", "StorageClass", "CustomResourceDefinition"}


def kustomize(directory: Path) -> list[dict]:
    """The resources ``kustomize build directory`` makes."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unread = set(spec) - KUSTOMIZE_FIELDS
    assert not unread, f"{directory}: this test does not read {sorted(unread)} yet"
    docs: list[dict] = []
    for ref in spec.get("resources", []):
        path = directory / ref
        docs += kustomize(path) if path.is_dir() else copy.deepcopy(documents(path))
    for kind, generators in (("ConfigMap", "configMapGenerator"), ("Secret", "secretGenerator")):
        for gen in spec.get(generators, []):
            docs = _generate(directory, kind, gen, docs)
    for patch in spec.get("patches", []):
        assert set(patch) == {"path"}, f"{directory}: only strategic-merge patch files are read here"
        body = yaml.safe_load((directory / patch["path"]).read_text())
        target = find(docs, body["kind"], body["metadata"]["name"])
        assert target is not None, f"{directory}: {patch['path']} patches nothing"
        _merge(target, body)
    for labels in spec.get("labels", []):
        assert not labels.get("includeSelectors") and not labels.get("includeTemplates")
        for doc in docs:
            doc["metadata"].setdefault("labels", {}).update(labels["pairs"])
    if "namespace" in spec:
        for doc in docs:
            if doc["kind"] not in CLUSTER_KINDS:
                doc["metadata"]["namespace"] = spec["namespace"]
    for image in spec.get("images", []):
        for doc in docs:
            for container in containers(doc):
                name, tag = split_image(container["image"])
                if name == image["name"]:
                    container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    return docs


def _generate(directory: Path, kind: str, gen: dict, docs: list[dict]) -> list[dict]:
    data: dict[str, str] = {}
    for item in gen.get("files", []):
        key, _, source = item.rpartition("=")
        data[key or Path(source).name] = (directory / source).read_text()
    for item in gen.get("literals", []):
        key, _, value = item.partition("=")
        data[key] = value
    behavior = gen.get("behavior", "create")
    existing = find(docs, kind, gen["name"])
    if behavior == "create":
        # a created one is named NAME-HASH and the references to it follow: here it keeps NAME
        assert existing is None, f"{directory}: {kind} {gen['name']} made twice"
        docs = [*docs, {"apiVersion": "v1", "kind": kind, "metadata": {"name": gen["name"]}, "data": data}]
    else:
        assert existing is not None, f"{directory}: {behavior} of a {kind} {gen['name']} that no resource makes"
        existing["data"] = {**existing.get("data", {}), **data} if behavior == "merge" else data
    return docs


def find(docs: list[dict], kind: str, name: str) -> dict | None:
    return next((d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name), None)


def _merge(base: dict, patch: dict) -> None:
    for key, value in patch.items():
        if value is None:  # a strategic-merge patch deletes a field with null
            base.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        elif isinstance(value, list) and key in MERGE_KEYS and isinstance(base.get(key), list):
            for item in value:
                field = merge_key(key, item)
                match = next((b for b in base[key] if b.get(field) == item[field]), None)
                if match is None:
                    base[key].append(copy.deepcopy(item))
                else:
                    _merge(match, item)
        else:
            base[key] = copy.deepcopy(value)


def pod_spec(doc: dict) -> dict | None:
    spec = doc.get("spec", {})
    if doc["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    return spec.get("template", {}).get("spec")


def containers(doc: dict) -> list[dict]:
    pod = pod_spec(doc) or {}
    return [*pod.get("initContainers", []), *pod.get("containers", [])]


def split_image(ref: str) -> tuple[str, str]:
    """``name:tag`` split (a registry's port is part of the name)."""
    name, _, tag = ref.rpartition(":")
    return (name, tag) if name and "/" not in tag else (ref, "latest")


def built(directory: str) -> list[dict]:
    return kustomize(K8S / directory)


def in_build(docs: list[dict], kind: str, name: str) -> dict:
    found = find(docs, kind, name)
    assert found is not None, f"no {kind} {name} in the build"
    return found


# -- what the user creates: deploy/README.md, "What you create" -----------------------------
def what_you_create() -> dict[tuple[str, str], dict]:
    """(kind, name) -> {"namespace": ..., "keys": {...}} for each `kubectl create` there."""
    readme = (DEPLOY / "README.md").read_text()
    section = readme.split("\n## What you create\n", 1)[1].split("\n## ", 1)[0]
    commands = re.sub(r"\\\n\s*", " ", section)  # continued lines joined
    made: dict[tuple[str, str], dict] = {}
    for namespace in re.findall(r"^kubectl create namespace (\S+)$", commands, re.M):
        made[("Namespace", namespace)] = {"namespace": None, "keys": set()}
    for namespace, name, rest in re.findall(r"^kubectl (?:-n (\S+) )?create secret generic (\S+)(.*)$", commands, re.M):
        keys = set(re.findall(r"--from-(?:literal|file)=([\w.-]+)=", rest))
        made[("Secret", name)] = {"namespace": namespace or None, "keys": keys}
    return made


def references(doc: dict) -> list[tuple[str, str, str | None]]:
    """(kind, name, key or None) of each ConfigMap, Secret and Service ``doc`` refers to
    by name in its pod spec (env, envFrom, volumes, image pull secrets) or as a
    StatefulSet's governing Service."""
    refs: list[tuple[str, str, str | None]] = []
    if doc["kind"] == "StatefulSet":
        refs.append(("Service", doc["spec"]["serviceName"], None))
    pod = pod_spec(doc)
    if pod is None:
        return refs
    for secret in pod.get("imagePullSecrets", []):
        refs.append(("Secret", secret["name"], None))
    for container in containers(doc):
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                refs.append(("ConfigMap", source["configMapRef"]["name"], None))
            if "secretRef" in source:
                refs.append(("Secret", source["secretRef"]["name"], None))
        for var in container.get("env", []):
            ref = var.get("valueFrom", {})
            if "configMapKeyRef" in ref:
                refs.append(("ConfigMap", ref["configMapKeyRef"]["name"], ref["configMapKeyRef"]["key"]))
            if "secretKeyRef" in ref:
                refs.append(("Secret", ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"]))
    volumes = pod.get("volumes", [])
    sources = [s for v in volumes for s in v.get("projected", {}).get("sources", [])]
    for volume in [*volumes, *sources]:
        for kind, field, name_field in (("ConfigMap", "configMap", "name"), ("Secret", "secret", "secretName")):
            if field in volume:
                name = volume[field].get(name_field) or volume[field].get("name")
                items = volume[field].get("items", [])
                refs += [(kind, name, item["key"]) for item in items] or [(kind, name, None)]
    return refs


# hostnames a workload reaches other objects by: NAME[.NAMESPACE[.svc[.cluster.local]]]
SERVICE_HOST = re.compile(r"(?P<name>[a-z0-9-]+)(?:\.(?P<namespace>[a-z0-9-]+)(?:\.svc(?:\.cluster\.local)?)?)?\Z")
NETWORK_SCHEMES = {"grpc", "grpcs", "redis", "rediss", "redis+cluster"}


def service_for(docs: list[dict], host: str, port: int, namespace: str | None) -> dict:
    """The Service in ``docs`` a ``host:port`` in a pod of ``namespace`` reaches."""
    match = SERVICE_HOST.match(host)
    assert match, f"{host} is not a Service's DNS name"
    service = in_build(docs, "Service", match["name"])
    where = service["metadata"].get("namespace")
    assert (match["namespace"] or namespace) == where, f"{host}: the Service {match['name']} is in {where}"
    ports = {p["port"] for p in service["spec"]["ports"]}
    assert port in ports, f"{host}:{port}: the Service {match['name']} exposes {sorted(ports)}"
    return service


def network_tiers(config: Config) -> list[TierURL]:
    urls = [TierURL.parse(u) for u in [*config.store.tiers, *config.server.tiers]]
    return [u for u in urls if u.scheme in NETWORK_SCHEMES]


def hosts(url: TierURL) -> list[tuple[str, int]]:
    """(host, port) of each node a network tier URL names."""
    default = 6379 if url.scheme.startswith("redis") else 50051
    out = []
    for node in url.netloc.rpartition("@")[2].split(","):
        host, _, port = node.rpartition(":") if ":" in node else (node, "", "")
        out.append((host, int(port) if port else default))
    return out

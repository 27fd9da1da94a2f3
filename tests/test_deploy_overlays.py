"""deploy/k8s/overlays: each overlay's parts reach each other (the production sidecars their
Redis Cluster and shared server, the object-store server its bucket, the peers' pods each
other's sidecars), read with tests/manifests.py's own kustomize and lmtier's own
configuration loader."""

from __future__ import annotations

import yaml

from lmtier.tiers.base import TierURL, tier_class

from manifests import (
    K8S,
    built,
    container_named,
    hosts,
    in_build,
    lmtier_config,
    mounts_of,
    pod_spec,
    ports_of,
    service_for,
    what_you_create,
)


# -- the production overlay: the sidecars reach what the overlay deploys -------------------------
def test_the_production_sidecars_use_the_overlays_redis_cluster_and_shared_server(tmp_path):
    docs = built("overlays/production")
    namespace = yaml.safe_load((K8S / "overlays/production/kustomization.yaml").read_text())["namespace"]
    cm = in_build(docs, "ConfigMap", "lmtier-sidecar")
    cfg = lmtier_config(cm, tmp_path)

    # the engine still ends at its sidecar, on loopback; the sidecar's tiers go on
    engine_last = TierURL.parse(cfg.store.tiers[-1])
    assert engine_last.scheme == "grpc" and engine_last.netloc == f"127.0.0.1:{cfg.server.port}"
    tiers = {TierURL.parse(u).scheme: TierURL.parse(u) for u in cfg.server.tiers}
    assert list(tiers)[:2] == ["cpu", "file"]  # the node's own tiers first
    for url in tiers.values():
        assert set(url.options) <= set(tier_class(url.scheme).OPTIONS), url.url

    def serves(service: dict, workload: dict) -> bool:
        return service["spec"]["selector"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()

    # Redis Cluster: its headless Service, in the overlay's namespace, on the Redis port
    redis = in_build(docs, "StatefulSet", "redis-cluster")
    for host, port in hosts(tiers["redis+cluster"]):
        service = service_for(docs, host, port, namespace)
        assert serves(service, redis) and service["metadata"]["namespace"] == namespace
        assert port == ports_of(container_named(pod_spec(redis), "redis"))["redis"]

    # the shared server: its Service and gRPC port, the token from the Secret
    server = in_build(docs, "StatefulSet", "lmtier-server")
    ((host, port),) = hosts(tiers["grpc"])
    service = service_for(docs, host, port, namespace)
    assert serves(service, server) and service["metadata"]["namespace"] == namespace
    target = next(p["targetPort"] for p in service["spec"]["ports"] if p["port"] == port)
    assert (
        ports_of(container_named(pod_spec(server), "lmtier"))[target]
        == lmtier_config(in_build(docs, "ConfigMap", "lmtier-server"), tmp_path).server.port
    )
    token_env = tiers["grpc"].options.get("token_env", "LMTIER_TOKEN")
    sidecar = container_named(pod_spec(in_build(docs, "Deployment", "vllm-lmtier")), "lmtier")
    assert token_env in {v["name"] for v in sidecar["env"]} and "token" not in tiers["grpc"].options
    assert "readinessProbe" not in sidecar  # a shared tier down must not take the engines out of service


def test_the_object_store_overlay_gives_the_server_a_bucket_and_its_keys(tmp_path):
    from lmtier.tiers.base import check_tier_url

    docs = built("overlays/object-store")
    cm = in_build(docs, "ConfigMap", "lmtier-server")
    tiers = lmtier_config(cm, tmp_path).server.tiers
    assert [TierURL.parse(t).scheme for t in tiers] == ["cpu", "file", "s3"]  # the bucket last: the slowest
    check_tier_url(tiers[-1])  # a URL the tier takes, and no credentials in it
    assert "@" not in tiers[-1] and TierURL.parse(tiers[-1]).options.get("size")
    server = container_named(pod_spec(in_build(docs, "StatefulSet", "lmtier-server")), "lmtier")
    env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") for e in server["env"]}
    assert env["AWS_ACCESS_KEY_ID"] == env["AWS_SECRET_ACCESS_KEY"] == "lmtier-s3"  # where the AWS chain reads them


def test_the_peers_overlay_wires_each_pods_sidecar_to_the_others(tmp_path):
    """Each engine reads its peers through the headless Service of the engine pods, finds
    holders in the overlay's Redis, never asks its own sidecar (the pod's address), and
    holds the peers' token; each sidecar listens on the pod's address with tokens only,
    announces to the same Redis under the address the others dial."""
    docs = built("overlays/peers")
    namespace = yaml.safe_load((K8S / "overlays/peers/kustomization.yaml").read_text())["namespace"]
    cfg = lmtier_config(in_build(docs, "ConfigMap", "lmtier-sidecar"), tmp_path)
    peers = TierURL.parse(cfg.store.tiers[-1])
    assert peers.scheme == "peers" and set(peers.options) <= set(tier_class("peers").OPTIONS)
    pods = in_build(docs, "Deployment", "vllm-lmtier")
    labels = pods["spec"]["template"]["metadata"]["labels"]

    # the members: a headless Service over the engine pods, on the sidecar's gRPC port
    host, port = peers.options["dns"].rsplit(":", 1)
    service = service_for(docs, host, int(port), namespace)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"].items() <= labels.items()
    sidecar = container_named(pod_spec(pods), "lmtier")
    assert int(port) == cfg.server.port and ports_of(sidecar)["grpc"] == cfg.server.port
    assert ports_of(sidecar)["data"] == cfg.server.data_port  # the bulk channel across pods

    # the index: one Redis, the same for readers and the sidecars, a Service of the overlay
    assert peers.options["index"] == cfg.server.peer_index
    index = TierURL.parse(cfg.server.peer_index)
    (node,) = hosts(index)
    assert service_for(docs, *node, namespace)["spec"]["selector"].items() <= (
        in_build(docs, "Deployment", "lmtier-index")["spec"]["template"]["metadata"]["labels"].items()
    )

    # the address each sidecar announces is the one peers dial, and never asked by itself
    assert cfg.server.advertise == peers.options["advertise"] == "${POD_IP}:50051"
    for name in ("vllm", "lmtier"):
        env = {v["name"]: v for v in container_named(pod_spec(pods), name)["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"

    # open to the network with tokens only: the engine's own, and the peers' read-only one
    assert cfg.server.host == "0.0.0.0" and cfg.server.tokens and cfg.server.peer_tokens
    engine = {v["name"]: v for v in container_named(pod_spec(pods), "vllm")["env"]}
    assert engine["LMTIER_PEER_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "lmtier-peers", "key": "peer-token"}
    grpc_tier = TierURL.parse(cfg.store.tiers[1])
    assert engine[grpc_tier.options["token_env"]]["valueFrom"]["secretKeyRef"]["name"] == "lmtier-peers"
    assert "token" not in peers.options and "token" not in grpc_tier.options
    mounted = mounts_of(sidecar)
    secret = {v["name"]: v for v in pod_spec(pods)["volumes"]}[mounted["/etc/lmtier/tokens"]]["secret"]
    assert {i["key"] for i in secret["items"]} <= what_you_create()[("Secret", "lmtier-peers")]["keys"]

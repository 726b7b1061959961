"""deploy/k8s/multi-host.yaml: the two-host StatefulSet's args parse with ``sidecar serve``'s own flags into a
config whose rendezvous matches the manifest (nnodes = replicas, master address = pod 0's stable name in the
headless Service, master port = the rendezvous port the Service and container expose, node rank from the pod
index), and the API Service reaches node 0 only."""

from __future__ import annotations

import yaml
from test_deploy_files import K8S, serve_config

MANIFEST = K8S / "multi-host.yaml"


def _objects() -> dict[str, dict]:
    return {d["kind"] + "/" + d["metadata"]["name"]: d for d in yaml.safe_load_all(MANIFEST.read_text()) if d}


def _ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def _config(pod: dict, rank: int, tmp_path):
    """The config the container runs with on node ``rank``: its args, with the base's ConfigMap (the one its
    volume names) where --config points, and the node rank its pod-index label gives."""
    (container,) = pod["spec"]["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    vol = next(v for v in pod["spec"]["volumes"] if "configMap" in v)
    cms = [d for d in yaml.safe_load_all((K8S / "configmap.yaml").read_text()) if d]
    (cm,) = [d for d in cms if d["metadata"]["name"] == vol["configMap"]["name"]]
    files = {}
    for key, text in cm["data"].items():
        (tmp_path / key).write_text(text)
        files[f"{mounts[vol['name']]}/{key}"] = str(tmp_path / key)
    args = [files.get(a, a) for a in container["args"]]
    assert args != container["args"], "--config must name a file of the mounted ConfigMap"
    return serve_config(args, {"SIDECAR_ENGINE_NODE_RANK": str(rank)})


def test_statefulset_args_form_the_rendezvous_the_manifest_describes(tmp_path):
    objs = _objects()
    sts = objs["StatefulSet/sidecar-pp"]
    headless = objs[f"Service/{sts['spec']['serviceName']}"]
    pod = sts["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    rank_src = env["SIDECAR_ENGINE_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert rank_src == "metadata.labels['apps.kubernetes.io/pod-index']"
    ns = sts["metadata"]["namespace"]
    for index in range(sts["spec"]["replicas"]):
        cfg = _config(pod, index, tmp_path).engine
        assert cfg.node_rank == index
        assert cfg.nnodes == sts["spec"]["replicas"] == 2
        assert (cfg.tensor_parallel_size * cfg.pipeline_parallel_size) % cfg.nnodes == 0
        assert (
            cfg.master_addr
            == f"{sts['metadata']['name']}-0.{headless['metadata']['name']}.{ns}.svc.cluster.local"
        )
        assert cfg.master_port == _ports(container)["rendezvous"]
    (rdzv,) = headless["spec"]["ports"]
    assert rdzv["port"] == cfg.master_port and rdzv["targetPort"] == "rendezvous"
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    labels = pod["metadata"]["labels"]
    assert headless["spec"]["selector"].items() <= labels.items()
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_api_service_reaches_node_zero_on_the_served_ports(tmp_path):
    objs = _objects()
    sts = objs["StatefulSet/sidecar-pp"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    cfg = _config(sts["spec"]["template"], 0, tmp_path)
    api = objs["Service/sidecar-pp-api"]
    assert api["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == f"{sts['metadata']['name']}-0"
    ports = {p["name"]: p for p in api["spec"]["ports"]}
    assert _ports(container)["grpc"] == cfg.server.grpc_port == ports["grpc"]["port"]
    assert _ports(container)["http"] == cfg.server.http_port == ports["http"]["port"]
    assert all(p["targetPort"] in _ports(container) for p in ports.values())

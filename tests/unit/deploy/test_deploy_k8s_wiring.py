"""The Kubernetes Deployment, Services, PDB and HPA fit together and with the sidecar's config.

The config is the one the container would run with: its args, its env and the
ConfigMap file mounted where --config points, built by the real
load_config. Checked for the CPU base and the GPU overlay as kustomize renders them.
"""

from __future__ import annotations

import pytest
import yaml
from test_deploy_files import (
    K8S,
    K8S_GPU,
    POST_DRAIN_S,
    ROOT,
    by_kind,
    k8s_documents,
    pod_template,
    serve_config,
    sidecar_env,
)


@pytest.fixture(scope="module")
def overlays() -> dict[str, list[dict]]:
    return {"cpu": k8s_documents(K8S), "gpu": k8s_documents(K8S_GPU)}


def k8s_config(docs: list[dict], tmp_path):
    """Effective config of the Deployment's container: its args, env and the mounted ConfigMap."""
    pod = pod_template(docs)
    c = pod["spec"]["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    cm_vol = next(v for v in pod["spec"]["volumes"] if "configMap" in v)
    cm = by_kind(docs, "ConfigMap", cm_vol["configMap"]["name"])
    files = {}
    for key, text in cm["data"].items():
        local = tmp_path / key
        local.write_text(text)
        files[f"{mounts[cm_vol['name']].rstrip('/')}/{key}"] = str(local)
    args = [files.get(a, a) for a in c.get("args", [])]
    assert "--config" in args and args[args.index("--config") + 1] in files.values(), (
        f"--config must name a file of the mounted ConfigMap ({sorted(files)}), args={c.get('args')}"
    )
    env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    return serve_config(args, sidecar_env(env)), c, pod


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_k8s_deployment_wiring(overlays, variant, tmp_path):
    docs = overlays[variant]
    cfg, c, pod = k8s_config(docs, tmp_path)
    labels = pod["metadata"]["labels"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": cfg.server.grpc_port, "http": cfg.server.http_port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == cfg.server.grpc_port, probe
    ann = pod["metadata"]["annotations"]
    assert int(ann["prometheus.io/port"]) == cfg.server.http_port and ann["prometheus.io/path"] == "/metrics"
    # Drain fits inside the grace period; a draining pod is not restarted by its liveness probe.
    drain = c["lifecycle"]["preStop"]["sleep"]["seconds"] + cfg.server.shutdown_timeout_s + POST_DRAIN_S
    assert pod["spec"]["terminationGracePeriodSeconds"] > drain
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > cfg.server.shutdown_timeout_s + POST_DRAIN_S
    assert cfg.engine.device == ("cuda" if variant == "gpu" else "cpu")
    if variant == "gpu":
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1" and c["image"].endswith(":cuda")
    else:
        assert cfg.engine.kv_cache_memory_gb is not None, (
            "CPU pods must size the KV cache below their memory limit"
        )
    for res in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(c["resources"][res])
    sec = pod["spec"]["securityContext"]
    assert sec["runAsNonRoot"] and sec["runAsUser"] == 10001  # the uid the Dockerfiles create
    for kind, name in (
        ("Service", "sidecar-headless"),
        ("Service", "sidecar"),
        ("PodDisruptionBudget", "sidecar"),
    ):
        obj = by_kind(docs, kind, name)
        sel = obj["spec"]["selector"]
        sel = sel.get("matchLabels", sel)
        assert sel and all(labels.get(k) == v for k, v in sel.items()), (
            f"{kind} {name} selects no sidecar pod"
        )
    headless = by_kind(docs, "Service", "sidecar-headless")["spec"]
    assert headless["clusterIP"] == "None"
    assert [(p["port"], p["targetPort"]) for p in headless["ports"]] == [(cfg.server.grpc_port, "grpc")]
    http = {
        p["name"]: (p["port"], p["targetPort"]) for p in by_kind(docs, "Service", "sidecar")["spec"]["ports"]
    }
    assert http["http"] == (cfg.server.http_port, "http")


def test_docs_name_the_headless_target_and_hpa_targets_the_deployment(overlays):
    docs = overlays["cpu"]
    svc = by_kind(docs, "Service", "sidecar-headless")
    ns = svc["metadata"]["namespace"]
    port = svc["spec"]["ports"][0]["port"]
    target = f"dns:///{svc['metadata']['name']}.{ns}.svc.cluster.local:{port}"
    assert target in (ROOT / "docs/DEPLOY.md").read_text()
    assert target in (K8S / "service-headless.yaml").read_text()
    hpa = yaml.safe_load((K8S / "hpa.yaml").read_text())
    deploy = by_kind(docs, "Deployment", "sidecar")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deploy["metadata"]["name"]
    assert hpa["metadata"]["namespace"] == deploy["metadata"]["namespace"] == ns

"""Kubernetes manifests validate against the Kubernetes OpenAPI schemas (strict: unknown fields fail).

Schemas come from the kubernetes-validate package (bundled, offline). The
kustomizations are rendered with `kubectl kustomize` when kubectl is installed
(it is on this project's machines) and the rendered objects are validated too,
so the GPU overlay's patches are checked as applied.
"""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml
from test_deploy_files import K8S, K8S_GPU, ROOT, k8s_documents, k8s_files, kubectl_available

# Oldest supported minor version the manifests target (the preStop sleep action needs 1.30+) and the newest known.
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())


def _docs(path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", [p for p in k8s_files() if p.parent == K8S], ids=lambda p: p.name)
def test_manifest_files_validate(path, version):
    for doc in _docs(path):
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("directory", [K8S, K8S_GPU], ids=["base", "gpu"])
def test_rendered_kustomizations_validate(directory, version):
    """Rendered with kubectl kustomize when available; otherwise the base's files (the GPU overlay needs kustomize)."""
    if directory == K8S_GPU and not kubectl_available():
        docs = [d for p in k8s_files() if p.parent == K8S_GPU for d in _docs(p)]
        assert (
            docs
        )  # patches are partial objects: only their kinds and names can be checked without kustomize
        return
    docs = k8s_documents(directory)
    assert {d["kind"] for d in docs} >= {
        "Namespace",
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
    }
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_validator_rejects_misspelled_and_mistyped_fields():
    deploy = next(d for d in _docs(K8S / "deployment.yaml") if d["kind"] == "Deployment")
    typo = copy.deepcopy(deploy)
    typo["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grcp"] = {"port": 50051}
    with pytest.raises(kubernetes_validate.ValidationError, match="grcp"):
        kubernetes_validate.validate(typo, VERSIONS[0], strict=True)
    wrong_type = copy.deepcopy(deploy)
    wrong_type["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, VERSIONS[0], strict=True)


def test_every_manifest_is_in_a_kustomization_or_documented():
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    doc = (ROOT / "docs/DEPLOY.md").read_text()
    for path in k8s_files():
        if path.parent == K8S and path.name not in listed:
            assert f"deploy/k8s/{path.name}" in doc, f"{path.name} is neither applied by -k nor documented"

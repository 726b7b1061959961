"""The deployment files agree with the code they deploy.

Checked against the real sources, not copies of their values: `sidecar serve
--help` and its argument parser, load_config (so every SIDECAR_* variable and
YAML key is a real config field), the Java SidecarProperties source, the
Prometheus metric names the server actually renders, and the files on disk.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import re
import subprocess

import pytest
import yaml
from test_deploy_files import (
    CONTEXT,
    DOCKERFILES,
    K8S,
    K8S_GPU,
    POST_DRAIN_S,
    ROOT,
    compose_env,
    container_ports,
    dashboard_metric_names,
    exported_metric_names,
    image_config,
    k8s_documents,
    load_compose,
    parse_dockerfile,
    pod_template,
    serve_help_flags,
    sidecar_env,
)

SIDECAR_SERVICES = ("sidecar", "sidecar-gpu")
SIDECAR_DOCKERFILES = {"sidecar": "deploy/Dockerfile", "sidecar-gpu": "deploy/Dockerfile.cuda"}


@pytest.fixture(scope="module")
def help_flags() -> set[str]:
    return serve_help_flags()


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose()


@pytest.fixture(scope="module")
def overlays() -> dict[str, list[dict]]:
    return {"cpu": k8s_documents(K8S), "gpu": k8s_documents(K8S_GPU)}


def test_referenced_files_exist(compose):
    for kind, path in DOCKERFILES.items():
        df = parse_dockerfile(path)
        for copy in df.copies():
            if copy.from_stage is None:
                for src in copy.sources:
                    assert (CONTEXT / src).exists(), f"{path.relative_to(ROOT)}: COPY source {src} missing"
    for name, svc in compose["services"].items():
        if "build" in svc:
            ctx = ROOT / svc["build"]["context"]
            assert ctx.is_dir() and (ctx / svc["build"]["dockerfile"]).is_file(), f"compose {name}: build"
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith((".", "/")):
                assert (ROOT / src).exists(), f"compose {name}: bind source {src} missing"
            else:
                assert src in compose["volumes"], f"compose {name}: volume {src} not declared"
    for d in (K8S, K8S_GPU):
        kust = yaml.safe_load((d / "kustomization.yaml").read_text())
        for ref in kust.get("resources", []) + [p["path"] for p in kust.get("patches", [])]:
            assert (d / ref).exists(), f"{d.relative_to(ROOT)}/kustomization.yaml: {ref} missing"
    # The chat-demo image builds the Maven module named in its Dockerfile.
    demo = parse_dockerfile(DOCKERFILES["chat-demo"])
    run = " ".join(demo.runs(demo.stages[0]))
    module = re.search(r"-pl (\S+)", run).group(1)
    assert (ROOT / "java-client" / module / "pom.xml").is_file()
    assert f"<module>{module}</module>" in (ROOT / "java-client" / "pom.xml").read_text()
    artifact = re.search(r"target/(\S+?)-\*", run).group(1)
    assert f"<artifactId>{artifact}</artifactId>" in (ROOT / "java-client" / module / "pom.xml").read_text()


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last matching pattern wins; a match on a parent directory excludes
    everything under it. fnmatch's `*` also crosses `/`, which covers the `**/x` patterns used here."""
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat.lstrip("!").strip("/")
        if any(
            fnmatch.fnmatchcase(c, pat) or fnmatch.fnmatchcase(c, pat.removeprefix("**/")) for c in candidates
        ):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_every_copied_file():
    patterns = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert _dockerignored("java-client/sidecar-client/target/x.class", patterns)  # the reader works
    assert _dockerignored(".git/HEAD", patterns) and not _dockerignored("sidecar/cli.py", patterns)
    for kind, path in DOCKERFILES.items():
        for copy in parse_dockerfile(path).copies():
            if copy.from_stage is not None:
                continue
            for src in copy.sources:
                files = [f for f in tracked if f == src or f.startswith(src.rstrip("/") + "/")] or [src]
                kept = [f for f in files if not _dockerignored(f, patterns)]
                assert kept == files, f"{kind}: .dockerignore drops {sorted(set(files) - set(kept))[:5]}"


def test_every_serve_flag_used_exists(compose, overlays, help_flags):
    used: dict[str, list[str]] = {}
    for kind in ("cpu", "cuda"):
        df = parse_dockerfile(DOCKERFILES[kind])
        used[f"Dockerfile {kind}"] = df.entrypoint[2:] + df.cmd
    for name in SIDECAR_SERVICES:
        used[f"compose {name}"] = compose["services"][name].get("command", [])
    for variant, docs in overlays.items():
        used[f"k8s {variant}"] = pod_template(docs)["spec"]["containers"][0].get("args", [])
    assert any(used.values())
    for where, args in used.items():
        for a in args:
            if a.startswith("--"):
                assert a.split("=")[0] in help_flags, f"{where}: {a} is not a `sidecar serve` flag"


def test_every_sidecar_env_var_is_a_config_field(compose, overlays):
    from sidecar.config import load_config

    sources: dict[str, dict[str, str]] = {}
    for kind in ("cpu", "cuda"):
        sources[f"Dockerfile {kind}"] = sidecar_env(parse_dockerfile(DOCKERFILES[kind]).env)
    for name in SIDECAR_SERVICES:
        sources[f"compose {name}"] = sidecar_env(compose_env(compose["services"][name]))
    for variant, docs in overlays.items():
        c = pod_template(docs)["spec"]["containers"][0]
        sources[f"k8s {variant}"] = {
            e["name"]: e.get("value", "") for e in c.get("env", []) if e["name"].startswith("SIDECAR_")
        }
    assert sources["compose sidecar"], "compose configures the sidecar through SIDECAR_* variables"
    for where, env in sources.items():
        for key, value in env.items():
            try:
                load_config(env={key: value})  # unknown field or unparsable value -> ValueError naming it
            except ValueError as exc:
                pytest.fail(f"{where}: {key}={value!r}: {exc}")


def _healthcheck_module():
    spec = importlib.util.spec_from_file_location("sidecar_healthcheck", ROOT / "deploy" / "healthcheck.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_images_expose_and_probe_the_configured_ports():
    from sidecar.config import ServerConfig

    defaults = ServerConfig()
    for kind in ("cpu", "cuda"):
        cfg = image_config(kind)
        df = parse_dockerfile(DOCKERFILES[kind])
        assert sorted(df.expose) == sorted([cfg.server.grpc_port, cfg.server.http_port])
        assert (cfg.server.grpc_port, cfg.server.http_port) == (defaults.grpc_port, defaults.http_port)
        assert cfg.server.host == "0.0.0.0", "a container must listen beyond its loopback"
        # The healthcheck script is the one the image copies and reads the image's config file.
        _, hc = df.healthcheck
        assert hc[1] in df.container_path_map() and df.container_path_map()[hc[1]].name == "healthcheck.py"
        config_arg = df.cmd[df.cmd.index("--config") + 1]
        assert config_arg in df.container_path_map()
        assert _healthcheck_module().DEFAULT_CONFIG == config_arg, (
            "the probe must read the file the server reads"
        )


def test_compose_sidecars_publish_the_ports_they_serve(compose):
    for name in SIDECAR_SERVICES:
        svc = compose["services"][name]
        assert svc["build"]["dockerfile"] == SIDECAR_DOCKERFILES[name]
        kind = "cpu" if name == "sidecar" else "cuda"
        cfg = image_config(kind, sidecar_env(compose_env(svc)))
        assert sorted(container_ports(svc)) == sorted([cfg.server.grpc_port, cfg.server.http_port]), name
        assert svc["healthcheck"]["test"][1:] == parse_dockerfile(DOCKERFILES[kind]).healthcheck[1], name
        grace = float(svc["stop_grace_period"].rstrip("s"))
        assert grace > cfg.server.shutdown_timeout_s + POST_DRAIN_S, f"{name}: stop_grace_period too short"
    gpu = compose["services"]["sidecar-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert image_config("cuda", sidecar_env(compose_env(gpu))).engine.device == "cuda"


def _java_properties(source: str) -> set[str]:
    """Relaxed-binding paths (lowercase, no dashes) of the fields of SidecarProperties and its nested classes."""
    paths, stack, depth = set(), [], 0
    for line in source.splitlines():
        m = re.match(r"\s*public static class (\w+)", line)
        if m:
            stack.append((m.group(1).lower(), depth + 1))
        f = re.match(r"\s*private\s+(?:final\s+)?[\w<>, ?]+\s+(\w+)\s*[=;]", line)
        if f and depth >= 1:
            prefix = ".".join(name for name, d in stack if d <= depth)
            paths.add(f"{prefix}.{f.group(1).lower()}" if prefix else f.group(1).lower())
        depth += line.count("{") - line.count("}")
        stack = [(n, d) for n, d in stack if d <= depth]
    return paths


def test_chat_demo_settings_are_sidecar_properties(compose):
    src = (
        ROOT
        / "java-client/sidecar-spring-boot-starter/src/main/java/dev/sidecar/spring/SidecarProperties.java"
    )
    text = src.read_text()
    assert 'PREFIX = "sidecar.client"' in text
    known = _java_properties(text)
    assert {"target", "apikey", "deadline", "chat.maxtokens"} <= known, known
    demo = compose["services"]["chat-demo"]
    env = compose_env(demo)
    assert env["SIDECAR_CLIENT_TARGET"] == "dns:///sidecar:50051"
    for key in env:
        if key.startswith("SIDECAR_CLIENT_"):
            # Spring maps an env var by lowercasing it and turning "_" into "."; dashes are dropped.
            path = key[len("SIDECAR_CLIENT_") :].lower().replace("_", ".")
            assert path in known, (
                f"compose chat-demo: {key} binds to no SidecarProperties field ({sorted(known)})"
            )
    app_yml = yaml.safe_load(
        (ROOT / "java-client/examples/chat-demo/src/main/resources/application.yml").read_text()
    )

    def walk(node, prefix=""):
        for k, v in node.items():
            p = f"{prefix}.{k}" if prefix else k
            yield from walk(v, p) if isinstance(v, dict) else [p]

    for p in walk(app_yml["sidecar"]["client"]):
        assert p.replace("-", "").lower() in known, f"application.yml sidecar.client.{p} is not a property"
    # The demo listens where the image and compose say it does.
    port = app_yml["server"]["port"]
    assert parse_dockerfile(DOCKERFILES["chat-demo"]).expose == [port]
    assert container_ports(demo) == [port]
    # The target names the compose sidecar's gRPC port, and the demo waits for it to be healthy.
    host, tport = env["SIDECAR_CLIENT_TARGET"].removeprefix("dns:///").split(":")
    assert host in compose["services"] and int(tport) == image_config("cpu").server.grpc_port
    assert demo["depends_on"][host]["condition"] == "service_healthy"


def test_prometheus_scrapes_every_compose_sidecar(compose):
    from sidecar.server.openai.api import create_app
    from tests.unit.server.test_openai_support import FakeService

    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "sidecar")
    routes = {getattr(r, "path", None) for r in create_app(FakeService()).routes}
    assert job["metrics_path"] in routes
    sd = job["dns_sd_configs"][0]
    assert sorted(sd["names"]) == sorted(SIDECAR_SERVICES)
    for name in sd["names"]:
        svc = compose["services"][name]
        cfg = image_config("cpu" if name == "sidecar" else "cuda", sidecar_env(compose_env(svc)))
        assert sd["port"] == cfg.server.http_port and sd["port"] in container_ports(svc)
    mounts = [v for v in compose["services"]["prometheus"]["volumes"] if "prometheus.yml" in v]
    assert mounts and mounts[0].split(":")[0] == "./deploy/prometheus/prometheus.yml"


def _rendered_metric_names() -> set[str]:
    from sidecar.server.metrics import Metrics

    m = Metrics(lambda: {"num_running": 1}, lambda: {"lookups": 1})
    return exported_metric_names(m.render()[0].decode())


def test_dashboard_and_autoscaler_use_real_metric_names(compose):
    names = _rendered_metric_names()
    dash_path = ROOT / "deploy/grafana/dashboards/llm-sidecar.json"
    dash = yaml.safe_load(dash_path.read_text())
    used = dashboard_metric_names(dash)
    for required in (
        "sidecar_time_to_first_token_seconds_bucket",
        "sidecar_time_per_output_token_seconds_bucket",
        "sidecar_generation_tokens_total",
        "sidecar_kv_cache_usage_ratio",
        "sidecar_prefix_cache_hits_total",
        "sidecar_semantic_cache_hits_total",
    ):
        assert required in used, f"dashboard lacks {required}"
    assert used <= names, f"dashboard queries metrics the sidecar does not export: {sorted(used - names)}"
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = ds["datasources"][0]["uid"]
    assert {p["datasource"]["uid"] for p in dash["panels"]} == {uid}
    # Grafana reads the dashboard from where compose mounts it.
    prov = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/llm-sidecar.yml").read_text())
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"])
    assert mounts["./deploy/grafana/dashboards"] == prov["providers"][0]["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    hpa = yaml.safe_load((K8S / "hpa.yaml").read_text())
    for metric in hpa["spec"]["metrics"]:
        if metric["type"] == "Pods":
            assert metric["pods"]["metric"]["name"] in names

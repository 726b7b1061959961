"""docker-compose.yml is a valid Compose file.

`docker compose config` is the authority when the Compose CLI plugin is
installed (then its resolved services and environment must also equal what
the other deploy tests read). Where the plugin is missing (a docker CLI alone,
no engine, is the usual case on the project's machines) the file is checked
against the Compose Specification's JSON schema (vendored by check-jsonschema,
no network) and the cross-references `config` resolves are checked by hand.
The schema check runs in both cases.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_deploy_files import COMPOSE, ROOT, compose_env, load_compose

PROFILES = ("gpu", "grafana", "fleet")


def _compose_cli() -> bool:
    try:
        out = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0


def _schema_check(path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_compose_file_matches_the_compose_spec_schema():
    out = _schema_check(COMPOSE)
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_schema_check_rejects_a_broken_file(tmp_path):
    broken = tmp_path / "compose.yml"
    broken.write_text(COMPOSE.read_text().replace("condition: service_healthy", "condition: when_ready"))
    out = _schema_check(broken)
    assert out.returncode != 0 and "when_ready" in out.stdout + out.stderr


def test_compose_config__docker_cli_when_installed_else_structural():
    """`docker compose config` for every profile if the plugin exists; else what it would resolve."""
    if _compose_cli():
        # Only PATH/HOME: the file's own defaults apply, as in load_compose() with an empty env.
        env = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
        for args in ([], *[["--profile", p] for p in PROFILES]):
            out = subprocess.run(
                ["docker", "compose", "-f", str(COMPOSE), *args, "config", "--quiet"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
                env=env,
            )
            assert out.returncode == 0, out.stderr
        out = subprocess.run(
            [
                "docker",
                "compose",
                "-f",
                str(COMPOSE),
                *[a for p in PROFILES for a in ("--profile", p)],
                "config",
                "--format",
                "json",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert out.returncode == 0, out.stderr
        resolved = json.loads(out.stdout)["services"]
        ours = load_compose()["services"]
        # The reader the consistency tests use sees the same services and environment as Compose.
        assert set(resolved) == set(ours)
        for name, svc in ours.items():
            assert (resolved[name].get("environment") or {}) == compose_env(svc), name
        return
    c = load_compose()
    services = c["services"]
    assert {"sidecar", "chat-demo", "prometheus"} <= {n for n, s in services.items() if "profiles" not in s}
    assert {p for s in services.values() for p in s.get("profiles", [])} == set(PROFILES)
    for name, svc in services.items():
        assert "image" in svc or "build" in svc, f"{name}: neither image nor build"
        for dep, spec in (
            (svc.get("depends_on") or {}).items()
            if isinstance(svc.get("depends_on"), dict)
            else ((d, {}) for d in svc.get("depends_on", []))
        ):
            assert dep in services, f"{name}: depends_on unknown service {dep}"
            # A service without a profile must not wait for one that only runs under a profile.
            assert "profiles" in svc or "profiles" not in services[dep], f"{name} -> {dep}"
            if spec.get("condition") == "service_healthy":
                assert "healthcheck" in services[dep], f"{name}: {dep} has no healthcheck"
        for vol in svc.get("volumes", []):
            src = str(vol).split(":")[0]
            assert src.startswith((".", "/")) or src in (c.get("volumes") or {}), (
                f"{name}: undeclared volume {src}"
            )
        for port in svc.get("ports", []):
            host, container = str(port).rsplit(":", 1)
            assert 0 < int(host.rsplit(":", 1)[-1]) < 65536 and 0 < int(container) < 65536
    published = [str(p).rsplit(":", 1)[0] for s in services.values() for p in s.get("ports", [])]
    assert len(published) == len(set(published)), f"two services publish one host port: {published}"


@pytest.mark.parametrize(
    "var,expected", [("SIDECAR_MODEL", "/models/qwen"), ("SIDECAR_TARGET", "dns:///sidecar-gpu:50051")]
)
def test_compose_variables_reach_the_containers(var, expected):
    c = load_compose({var: expected})
    env = {**c["services"]["sidecar"]["environment"], **c["services"]["chat-demo"]["environment"]}
    assert expected in env.values()

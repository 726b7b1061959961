"""deploy/healthcheck.py (the images' HEALTHCHECK) against a real gRPC health server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from test_deploy_files import ROOT

SCRIPT = ROOT / "deploy" / "healthcheck.py"


@pytest.fixture()
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(None)


def _probe(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**clean, **(env or {})},
    )


def test_serving_is_healthy_and_not_serving_is_not(health_server):
    servicer, port = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    out = _probe("--target", f"127.0.0.1:{port}")
    assert out.returncode == 1 and "NOT_SERVING" in out.stderr
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    out = _probe("--target", f"127.0.0.1:{port}")
    assert out.returncode == 0, out.stderr


def test_port_comes_from_the_config_file_then_env(health_server, tmp_path):
    servicer, port = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(f"server:\n  grpc_port: {port}\n")
    assert _probe("--config", str(cfg)).returncode == 0
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    out = _probe("--config", str(cfg), env={"SIDECAR_SERVER_GRPC_PORT": str(closed)})
    assert out.returncode == 1 and f"127.0.0.1:{closed}" in out.stderr and "UNAVAILABLE" in out.stderr
    out = _probe("--config", str(tmp_path / "missing.yaml"), env={"SIDECAR_SERVER_GRPC_PORT": str(port)})
    assert out.returncode == 0, out.stderr


def test_bad_config_is_unhealthy_with_the_field_named(tmp_path):
    out = _probe("--config", str(tmp_path / "none.yaml"), env={"SIDECAR_SERVER_GRPC_PORT": "http"})
    assert out.returncode == 1 and "server.grpc_port" in out.stderr

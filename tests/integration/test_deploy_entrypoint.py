"""The CPU image's command, run outside Docker: it serves, its HEALTHCHECK agrees, SIGTERM stops it cleanly.

ENTRYPOINT, CMD, ENV and HEALTHCHECK are read from deploy/Dockerfile, not
restated here. Only what a container provides differently is substituted, each
the way a user would do it with the image:
- files the image COPYs from the repository are used from the repository;
- the /models and /data volumes are temporary directories;
- `sidecar` / `python` are this virtualenv's (the image's /opt/venv);
- SIDECAR_SERVER_HOST / _GRPC_PORT / _HTTP_PORT pick loopback and free ports
  (what `docker run -p` would map), SIDECAR_ENGINE_MODEL=demo and
  SIDECAR_ENGINE_DEMO_DIR reuse the test session's demo model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pbg

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "deploy_files", ROOT / "tests" / "unit" / "deploy" / "test_deploy_files.py"
)
deploy_files = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = deploy_files  # dataclasses look their module up there
_spec.loader.exec_module(deploy_files)

START_TIMEOUT_S = float(os.environ.get("SIDECAR_TEST_START_TIMEOUT", "300"))
VOLUMES = ("/models", "/data")  # container-only directories: temp dirs stand in for them


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _host_argv(argv: list[str], paths: dict[str, Path]) -> list[str]:
    """Container argv -> host argv: the venv's executables, repository copies of COPYed files."""
    venv_bin = Path(sys.executable).parent
    head, rest = argv[0], argv[1:]
    if head == "python":
        exe = [sys.executable]
    elif (venv_bin / head).exists():
        exe = [str(venv_bin / head)]
    else:
        exe = [sys.executable, "-m", head]
    return exe + [str(paths.get(a, a)) for a in rest]


def _host_env(image_env: dict[str, str], volume_root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    for key, value in image_env.items():
        if key == "PATH":  # the image's PATH puts /opt/venv/bin first: the venv is already ours
            continue
        for vol in VOLUMES:
            if value == vol or value.startswith(vol + "/"):
                value = str(volume_root / value.lstrip("/"))
        env[key] = value
    return env


@pytest.fixture(scope="module")
def image():
    df = deploy_files.parse_dockerfile(deploy_files.DOCKERFILES["cpu"])
    assert df.entrypoint and df.healthcheck[1], "the CPU image needs an ENTRYPOINT and a HEALTHCHECK"
    return df


@pytest.fixture(scope="module")
def container(image, tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("container")
    for vol in VOLUMES:
        (root / vol.lstrip("/")).mkdir()
    grpc_port, http_port = _free_port(), _free_port()
    env = _host_env(image.env, root)
    env.update(
        SIDECAR_SERVER_HOST="127.0.0.1",
        SIDECAR_SERVER_GRPC_PORT=str(grpc_port),
        SIDECAR_SERVER_HTTP_PORT=str(http_port),
        SIDECAR_ENGINE_MODEL="demo",
        SIDECAR_ENGINE_DEMO_DIR=str(demo_dir),
        PYTHONUNBUFFERED="1",
    )
    paths = image.container_path_map()
    argv = _host_argv(image.entrypoint + image.cmd, paths)
    log_path = root / "container.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    ctx = dict(
        proc=proc,
        env=env,
        grpc=f"127.0.0.1:{grpc_port}",
        http=f"http://127.0.0.1:{http_port}",
        log=log_path,
        healthcheck=_host_argv(image.healthcheck[1], paths),
    )
    try:
        _wait_serving(ctx)
        yield ctx
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _health(target: str) -> int:
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def _wait_serving(ctx: dict) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if ctx["proc"].poll() is not None:
            pytest.fail(f"entrypoint exited with {ctx['proc'].returncode}:\n{ctx['log'].read_text()[-4000:]}")
        try:
            if _health(ctx["grpc"]) == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    pytest.fail(f"not SERVING within {START_TIMEOUT_S}s:\n{ctx['log'].read_text()[-4000:]}")


def _run_healthcheck(ctx: dict) -> subprocess.CompletedProcess:
    return subprocess.run(ctx["healthcheck"], env=ctx["env"], capture_output=True, text=True, timeout=30)


def test_entrypoint_serves_grpc_and_http(container):
    with grpc.insecure_channel(container["grpc"]) as ch:
        r = pbg.InferenceStub(ch).Generate(
            pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True)),
            timeout=60,
        )
    assert r.usage.completion_tokens == 4 and r.model == "demo"
    assert httpx.get(container["http"] + "/health", timeout=10).json() == {"status": "serving"}
    metrics = httpx.get(container["http"] + "/metrics", timeout=10).text
    dash = json.loads((ROOT / "deploy/grafana/dashboards/llm-sidecar.json").read_text())
    # What Prometheus scrapes from this process carries every series the dashboard queries.
    missing = deploy_files.dashboard_metric_names(dash) - deploy_files.exported_metric_names(metrics)
    assert not missing, f"/metrics of the image's command lacks {sorted(missing)}"
    generated = re.search(r"^sidecar_generation_tokens_total ([0-9.e+]+)$", metrics, re.M)
    assert generated and float(generated.group(1)) >= 4
    # The image's CMD asks for JSON logs: the readiness line is one JSON object.
    lines = [json.loads(x) for x in container["log"].read_text().splitlines() if x.startswith("{")]
    assert any(x.get("msg") == "ready" and x.get("grpc_port") for x in lines)


def test_healthcheck_command_reports_serving_then_stopped(container):
    out = _run_healthcheck(container)
    assert out.returncode == 0, out.stderr
    proc = container["proc"]
    proc.send_signal(signal.SIGTERM)  # what `docker stop` sends (STOPSIGNAL) to PID 1, the sidecar itself
    assert proc.wait(60) == 0
    out = _run_healthcheck(container)
    assert out.returncode == 1 and "UNAVAILABLE" in out.stderr

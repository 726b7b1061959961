"""Real `sidecar serve` subprocesses on free ports, for gRPC and HTTP integration tests.

``start_sidecar(*extra_args)`` is a context manager yielding a ``Sidecar`` with
``grpc_target``, ``http_base``, ports and the process; it waits for health
SERVING and stops the process (SIGTERM, then SIGKILL) on exit. Later flags
override the defaults (argparse keeps the last value), e.g.
``start_sidecar("--http-port", "-1", "--api-key", "k:t")``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_ARGS = (
    "--model",
    "demo",
    "--device",
    "cpu",
    "--host",
    "127.0.0.1",
    "--grpc-port",
    "0",
    "--http-port",
    "0",
    "--log-level",
    "warning",
)
START_TIMEOUT_S = float(os.environ.get("SIDECAR_TEST_START_TIMEOUT", "300"))


@dataclass
class Sidecar:
    proc: subprocess.Popen
    grpc_port: int
    http_port: Optional[int]
    log_path: pathlib.Path
    port_file: pathlib.Path

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self, service: str = "") -> int:
        with grpc.insecure_channel(self.grpc_target) as ch:
            return (
                health_pb2_grpc.HealthStub(ch)
                .Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                .status
            )

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait; SIGKILL if it does not exit in time. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def _wait_port_file(proc: subprocess.Popen, port_file: pathlib.Path, log_path: pathlib.Path) -> dict:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"sidecar exited with {proc.returncode} during startup:\n{log_path.read_text()[-4000:]}"
            )
        if port_file.exists():
            return json.loads(port_file.read_text())
        time.sleep(0.05)
    raise RuntimeError(f"sidecar did not listen within {START_TIMEOUT_S}s:\n{log_path.read_text()[-4000:]}")


def _wait_serving(sc: Sidecar) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if sc.proc.poll() is not None:
            raise RuntimeError(f"sidecar exited with {sc.proc.returncode} while loading:\n{sc.log()[-4000:]}")
        try:
            if sc.health() == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"sidecar not SERVING within {START_TIMEOUT_S}s:\n{sc.log()[-4000:]}")


@contextlib.contextmanager
def start_sidecar(
    *extra_args: str, env: Optional[dict] = None, wait_serving: bool = True, semantic_cache: bool = False
) -> Iterator[Sidecar]:
    """Start `sidecar serve` on free ports; the semantic cache (embedder load) only when asked for."""
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="sidecar-test-"))
    port_file, log_path = workdir / "ports.json", workdir / "sidecar.log"
    cache_args = () if semantic_cache else ("--no-semantic-cache",)
    cmd = [
        sys.executable,
        "-m",
        "sidecar",
        "serve",
        *DEFAULT_ARGS,
        *cache_args,
        "--port-file",
        str(port_file),
        *extra_args,
    ]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as log_fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log_fh, stderr=subprocess.STDOUT)
    sc = None
    try:
        ports = _wait_port_file(proc, port_file, log_path)
        assert ports["pid"] == proc.pid
        sc = Sidecar(proc, ports["grpc_port"], ports["http_port"], log_path, port_file)
        if wait_serving:
            _wait_serving(sc)
        yield sc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    here = pathlib.Path(__file__).parent
    for item in items:
        if here in pathlib.Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def sidecar_launcher():
    """The ``start_sidecar`` context manager, for module-scoped server fixtures in any test file."""
    return start_sidecar

"""Workload, clients and server launcher for ``sidecar bench serve``.

Each client call returns a ``Result`` measured on the client: arrival of every
chunk that carries tokens (TTFT, inter-token latencies) and the end (E2E).
Only the wire API is used (gRPC stubs or the OpenAI HTTP API).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

_WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact system program question night home water room mother "
    "area money story month lot right study book job word business issue side kind head house service "
    "friend father power hour game line end member law car city community name team minute idea body "
    "information back parent face level office door health art war history party result change morning "
    "reason research girl guy moment air teacher force education"
).split()


@dataclass
class Spec:
    prompt: str
    max_tokens: int
    shared_prefix: bool


@dataclass
class Result:
    ok: bool
    start: float
    ttft_s: float = float("nan")
    e2e_s: float = float("nan")
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""
    server_total_ms: Optional[float] = None  # engine-side arrival-to-completion, gRPC only

    @property
    def tpot_s(self) -> float:
        if self.output_tokens <= 1:
            return float("nan")
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def make_workload(
    n: int,
    seed: int,
    prompt_words: tuple[int, int],
    max_tokens: tuple[int, int],
    shared_ratio: float,
    shared_words: int,
) -> list[Spec]:
    """Deterministic mix of prompt/output lengths; ``shared_ratio`` of prompts start with one shared prefix."""
    rng = random.Random(seed)
    prefix = " ".join(rng.choice(_WORDS) for _ in range(shared_words))
    specs = []
    for i in range(n):
        body = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(*prompt_words)))
        shared = rng.random() < shared_ratio
        specs.append(
            Spec(
                prompt=f"{prefix} {body}" if shared else f"request {i}: {body}",
                max_tokens=rng.randint(*max_tokens),
                shared_prefix=shared,
            )
        )
    return specs


class GrpcClient:
    def __init__(self, target: str, api_key: Optional[str]) -> None:
        import grpc

        from sidecar.v1 import sidecar_pb2, sidecar_pb2_grpc

        self.pb = sidecar_pb2
        self.grpc = grpc
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = sidecar_pb2_grpc.InferenceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    def _req(self, spec: Spec, temperature: float, ignore_eos: bool, seed: int):
        pb = self.pb
        return pb.GenerateRequest(
            prompt=spec.prompt,
            cache_control=pb.CACHE_CONTROL_SKIP,
            sampling=pb.SamplingParams(
                max_tokens=spec.max_tokens, temperature=temperature, seed=seed, ignore_eos=ignore_eos
            ),
        )

    async def stream(self, spec: Spec, temperature: float, ignore_eos: bool, seed: int) -> Result:
        res = Result(ok=False, start=time.perf_counter())
        last = None
        try:
            async for chunk in self.stub.GenerateStream(
                self._req(spec, temperature, ignore_eos, seed), metadata=self.metadata
            ):
                now = time.perf_counter()
                if chunk.token_ids:
                    if last is None:
                        res.ttft_s = now - res.start
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    res.output_tokens += len(chunk.token_ids)
                if chunk.finish_reason:
                    res.server_total_ms = chunk.timing.total_ms
            res.e2e_s = time.perf_counter() - res.start
            res.ok = True
        except self.grpc.aio.AioRpcError as exc:
            res.error = exc.code().name
        return res

    async def unary(self, spec: Spec) -> Result:
        """One round trip: client-measured E2E and the server's own arrival-to-completion time."""
        res = Result(ok=False, start=time.perf_counter())
        try:
            r = await self.stub.Generate(self._req(spec, 0.0, True, 0), metadata=self.metadata)
            res.e2e_s = time.perf_counter() - res.start
            res.ok, res.output_tokens, res.server_total_ms = True, len(r.token_ids), r.timing.total_ms
        except self.grpc.aio.AioRpcError as exc:
            res.error = exc.code().name
        return res

    async def close(self) -> None:
        await self.channel.close()


class OpenAIClient:
    """Streams /v1/completions over HTTP (SSE) with httpx."""

    def __init__(self, base_url: str, api_key: Optional[str], model: str) -> None:
        import httpx

        self.httpx = httpx
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
        self.client = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=600, limits=limits)
        self.model = model

    async def stream(self, spec: Spec, temperature: float, ignore_eos: bool, seed: int) -> Result:
        body = {
            "model": self.model,
            "prompt": spec.prompt,
            "max_tokens": spec.max_tokens,
            "stream": True,
            "temperature": temperature,
            "seed": seed,
            "ignore_eos": ignore_eos,
            "stream_options": {"include_usage": True},
        }
        res = Result(ok=False, start=time.perf_counter())
        last, chunks = None, 0
        try:
            async with self.client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    res.error = f"HTTP {resp.status_code}"
                    await resp.aread()
                    return res
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    now = time.perf_counter()
                    if data.get("usage"):
                        res.output_tokens = data["usage"].get("completion_tokens", res.output_tokens)
                    if data.get("choices") and data["choices"][0].get("text"):
                        chunks += 1
                        if last is None:
                            res.ttft_s = now - res.start
                        else:
                            res.itl_s.append(now - last)
                        last = now
            res.output_tokens = res.output_tokens or chunks
            res.e2e_s = time.perf_counter() - res.start
            res.ok = True
        except self.httpx.HTTPError as exc:
            res.error = type(exc).__name__
        return res

    async def close(self) -> None:
        await self.client.aclose()


@contextlib.contextmanager
def launch(model: str, extra_args: list[str], timeout_s: float = 600.0) -> Iterator[dict]:
    """Start ``sidecar serve`` on free ports; yield its port-file dict; SIGTERM (then SIGKILL) on exit."""
    work = tempfile.mkdtemp(prefix="sidecar-bench-serve-")
    port_file, log_path = os.path.join(work, "ports.json"), os.path.join(work, "serve.log")
    cmd = [
        sys.executable,
        "-m",
        "sidecar",
        "serve",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--grpc-port",
        "0",
        "--http-port",
        "0",
        "--port-file",
        port_file,
        "--log-level",
        "warning",
        *extra_args,
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        ports = _wait_ready(proc, port_file, log_path, timeout_s)
        yield ports
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(work, ignore_errors=True)


def _wait_ready(proc: subprocess.Popen, port_file: str, log_path: str, timeout_s: float) -> dict:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sidecar exited with {proc.returncode}:\n{open(log_path).read()[-3000:]}")
        if os.path.exists(port_file):
            ports = json.load(open(port_file))
            with grpc.insecure_channel(f"127.0.0.1:{ports['grpc_port']}") as ch:
                try:
                    status = (
                        health_pb2_grpc.HealthStub(ch)
                        .Check(health_pb2.HealthCheckRequest(), timeout=5)
                        .status
                    )
                except grpc.RpcError:
                    status = None
            if status == health_pb2.HealthCheckResponse.SERVING:
                return ports
        time.sleep(0.2)
    raise RuntimeError(
        f"sidecar not ready within {timeout_s}s; its log ends:\n{open(log_path).read()[-3000:]}"
    )

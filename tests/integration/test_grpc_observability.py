"""One process serves gRPC and HTTP over one engine; Prometheus metrics and JSON logs with request ids."""

from __future__ import annotations

import json
import re
import time

import grpc
import httpx
import pytest

from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pbg


@pytest.fixture(scope="module")
def server(sidecar_launcher):
    with sidecar_launcher("--num-kv-blocks", "128", "--log-json", "--log-level", "info") as sc:
        yield sc


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_target) as ch:
        yield pbg.InferenceStub(ch)


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} missing from /metrics"
    return float(m.group(1))


def test_port_file_has_both_ports(server):
    ports = json.loads(server.port_file.read_text())
    assert ports == {"grpc_port": server.grpc_port, "http_port": server.http_port, "pid": server.proc.pid}
    assert server.http_port > 0 and server.http_port != server.grpc_port


def test_grpc_and_http_share_one_engine(server, stub):
    before = stub.GetStats(pb.GetStatsRequest()).generation_tokens
    r = httpx.post(
        f"{server.http_base}/v1/completions",
        timeout=120,
        json={"model": "demo", "prompt": "shared engine", "max_tokens": 5, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    stub.Generate(
        pb.GenerateRequest(prompt="shared engine", sampling=pb.SamplingParams(max_tokens=5, ignore_eos=True))
    )
    # Stats are a snapshot the engine thread refreshes after each step: poll until it settles.
    for _ in range(200):
        stats = stub.GetStats(pb.GetStatsRequest())
        if stats.num_running == 0 and stats.generation_tokens >= before + 10:
            break
        time.sleep(0.05)
    assert stats.generation_tokens == before + 10


def test_prometheus_metrics(server, stub):
    stub.Generate(
        pb.GenerateRequest(prompt="metrics please", sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True))
    )
    with pytest.raises(grpc.RpcError):
        stub.Generate(pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(top_p=2)))
    for _ in range(200):  # let the engine's stats snapshot settle first
        stats = stub.GetStats(pb.GetStatsRequest())
        if stats.num_running == 0:
            break
        time.sleep(0.05)
    text = httpx.get(f"{server.http_base}/metrics", timeout=30).text
    assert metric(text, "sidecar_time_to_first_token_seconds_count") >= 1
    assert metric(text, "sidecar_time_per_output_token_seconds_count") >= 1
    assert metric(text, "sidecar_e2e_request_latency_seconds_count") >= 1
    assert metric(text, "sidecar_request_queue_time_seconds_count") >= 1
    assert metric(text, "sidecar_request_success_total", '{finish_reason="length"}') >= 1
    assert metric(text, "sidecar_request_errors_total", '{code="invalid_argument"}') >= 1
    assert metric(text, "sidecar_kv_cache_total_blocks") == stats.num_kv_blocks
    assert metric(text, "sidecar_generation_tokens_total") == stats.generation_tokens
    assert metric(text, "sidecar_prompt_tokens_total") == stats.prompt_tokens
    for name in (
        "sidecar_num_requests_running",
        "sidecar_num_requests_waiting",
        "sidecar_kv_cache_usage_ratio",
        "sidecar_kv_cache_free_blocks",
        "sidecar_prefix_cache_queries_total",
        "sidecar_prefix_cache_hits_total",
        "sidecar_preemptions_total",
    ):
        metric(text, name)


def test_json_logs_carry_request_ids(server, stub):
    stub.Generate(
        pb.GenerateRequest(prompt="log me", request_id="trace-42", sampling=pb.SamplingParams(max_tokens=2))
    )
    with pytest.raises(grpc.RpcError):
        stub.Generate(
            pb.GenerateRequest(prompt="x", request_id="trace-43", sampling=pb.SamplingParams(top_k=-1))
        )
    for _ in range(100):
        records = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
        done = [r for r in records if r.get("request_id") == "trace-42" and r["msg"] == "request finished"]
        refused = [r for r in records if r.get("request_id") == "trace-43" and r["msg"] == "request refused"]
        if done and refused:
            break
        time.sleep(0.05)
    assert done and done[0]["completion_tokens"] >= 1 and done[0]["level"] == "info"
    assert (
        refused
        and refused[0]["code"] == "invalid_argument"
        and refused[0]["error"].startswith("sampling.top_k:")
    )

"""Bounded-KV decoding over the wire of a real ``sidecar serve --kv-budget`` (demo model): per-request
``kv_budget`` / ``kv_eviction`` in the OpenAI body and gRPC SamplingParams; bad values name their field."""

from __future__ import annotations

import grpc
import openai
import pytest
from openai import OpenAI

from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pbg

PROMPT = "A long conversation in a bounded KV budget"


@pytest.fixture(scope="module")
def server(sidecar_launcher):
    with sidecar_launcher("--kv-budget", "64", "--kv-eviction", "streaming") as sc:
        yield sc


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.http_base}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_target) as ch:
        yield pbg.InferenceStub(ch)


def test_budgeted_requests_generate_past_their_budget(client, stub):
    for extra in ({}, {"kv_budget": 48, "kv_eviction": "h2o"}):
        r = client.completions.create(
            model="demo", prompt=PROMPT, max_tokens=90, extra_body={"ignore_eos": True, **extra}
        )
        assert r.usage.completion_tokens == 90 and r.choices[0].finish_reason == "length"
    g = stub.Generate(
        pb.GenerateRequest(
            prompt=PROMPT,
            sampling=pb.SamplingParams(max_tokens=90, ignore_eos=True, kv_budget=48, kv_eviction="h2o"),
        ),
        timeout=120,
    )
    assert len(g.token_ids) == 90


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"kv_budget": 20}, "kv_budget"),
        ({"kv_eviction": "lru"}, "kv_eviction"),
        ({"kv_budget": 0}, "kv_budget"),
    ],
)
def test_bad_budgets_are_400_naming_the_field(client, extra, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, extra_body=extra)
    assert field in e.value.body["message"]


@pytest.mark.parametrize(
    "sampling, field",
    [(pb.SamplingParams(kv_budget=20), "kv_budget"), (pb.SamplingParams(kv_eviction="lru"), "kv_eviction")],
)
def test_bad_budgets_are_invalid_argument_over_grpc(stub, sampling, field):
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=sampling), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()

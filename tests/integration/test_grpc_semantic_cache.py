"""Semantic cache and embeddings through the gRPC API (cache enabled, real embedder)."""

from __future__ import annotations

import math
import time

import grpc
import httpx
import pytest

from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pbg

A = (("authorization", "Bearer key-a"),)
B = (("authorization", "Bearer key-b"),)


@pytest.fixture(scope="module")
def server(sidecar_launcher):
    with sidecar_launcher(
        "--num-kv-blocks",
        "128",
        "--cache-threshold",
        "0.85",
        "--api-key",
        "key-a:tenant-a",
        "--api-key",
        "key-b:tenant-b",
        semantic_cache=True,
    ) as sc:
        yield sc


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_target) as ch:
        yield pbg.InferenceStub(ch)


def ask(prompt, cc=pb.CACHE_CONTROL_DEFAULT, **sampling):
    sampling.setdefault("max_tokens", 8)
    return pb.GenerateRequest(prompt=prompt, cache_control=cc, sampling=pb.SamplingParams(**sampling))


def wait_entries(stub, n, metadata=A):
    for _ in range(400):
        s = stub.GetStats(pb.GetStatsRequest(), metadata=metadata)
        if s.semantic_cache_entries >= n:
            return s
        time.sleep(0.05)
    pytest.fail(f"cache never held {n} entries: {s}")


def test_model_info_reports_cache_and_embedder(stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=A)
    assert (
        info.semantic_cache
        and info.embedding_model == "all-MiniLM-L6-v2"
        and info.embedding_dimensions == 384
    )


def test_miss_then_exact_hit_unary_and_streamed(stub):
    q = "What is the capital of France?"
    first = stub.Generate(ask(q), metadata=A)
    assert first.cache.status == pb.CACHE_STATUS_MISS
    before = wait_entries(stub, 1)
    hit = stub.Generate(ask(q), metadata=A)
    assert hit.cache.status == pb.CACHE_STATUS_HIT_EXACT and hit.cache.similarity == pytest.approx(1.0)
    assert hit.text == first.text and list(hit.token_ids) == list(first.token_ids)
    assert hit.usage.completion_tokens == first.usage.completion_tokens
    assert hit.finish_reason == first.finish_reason
    chunks = list(stub.GenerateStream(ask(q), metadata=A))
    assert "".join(c.delta for c in chunks) == first.text
    assert (
        chunks[0].cache.status == pb.CACHE_STATUS_HIT_EXACT
        and chunks[-1].finish_reason == first.finish_reason
    )
    after = stub.GetStats(pb.GetStatsRequest(), metadata=A)
    assert after.semantic_cache_hits >= before.semantic_cache_hits + 2
    # The model did not run for the hits.
    assert after.generation_tokens == before.generation_tokens


def test_similar_question_is_a_semantic_hit(stub):
    q = "How many legs does a spider have?"
    first = stub.Generate(ask(q), metadata=A)
    wait_entries(stub, 2)
    hit = stub.Generate(ask("How many legs does a spider have"), metadata=A)
    assert hit.cache.status in (pb.CACHE_STATUS_HIT_SEMANTIC, pb.CACHE_STATUS_HIT_EXACT)
    assert hit.text == first.text and hit.cache.matched_query


def test_cache_control_and_bypass_reasons(stub):
    q = "Name a primary color."
    with pytest.raises(grpc.RpcError) as exc:
        stub.Generate(ask(q, pb.CACHE_CONTROL_ONLY), metadata=A)
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND and "semantic cache miss" in exc.value.details()
    skipped = stub.Generate(ask(q, pb.CACHE_CONTROL_SKIP), metadata=A)
    assert skipped.cache.status == pb.CACHE_STATUS_BYPASS and skipped.cache.bypass_reason == "skip"
    sampled = stub.Generate(ask(q, temperature=0.7, seed=1), metadata=A)
    assert sampled.cache.status == pb.CACHE_STATUS_BYPASS and sampled.cache.bypass_reason == "sampled"
    n = stub.GetStats(pb.GetStatsRequest(), metadata=A).semantic_cache_entries
    refreshed = stub.Generate(ask(q, pb.CACHE_CONTROL_REFRESH), metadata=A)
    assert refreshed.cache.status == pb.CACHE_STATUS_BYPASS
    wait_entries(stub, n + 1)
    only = stub.Generate(ask(q, pb.CACHE_CONTROL_ONLY), metadata=A)
    assert only.cache.status == pb.CACHE_STATUS_HIT_EXACT and only.text == refreshed.text


def test_tenants_do_not_share_cache_entries(stub):
    q = "Which planet is known as the red planet?"
    n = stub.GetStats(pb.GetStatsRequest(), metadata=A).semantic_cache_entries
    stub.Generate(ask(q), metadata=A)
    wait_entries(stub, n + 1)
    assert stub.Generate(ask(q, pb.CACHE_CONTROL_ONLY), metadata=A).cache.status == pb.CACHE_STATUS_HIT_EXACT
    with pytest.raises(grpc.RpcError) as exc:
        stub.Generate(ask(q, pb.CACHE_CONTROL_ONLY), metadata=B)
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND


def test_chat_cache_hit(stub):
    req = pb.ChatRequest(
        messages=[pb.ChatMessage(role="user", content="Say hello to the team")],
        sampling=pb.SamplingParams(max_tokens=6),
    )
    first = stub.Chat(req, metadata=A)
    assert first.cache.status == pb.CACHE_STATUS_MISS
    for _ in range(200):
        hit = stub.Chat(req, metadata=A)
        if hit.cache.status != pb.CACHE_STATUS_MISS:
            break
        time.sleep(0.05)
    assert hit.cache.status == pb.CACHE_STATUS_HIT_EXACT and hit.text == first.text


def test_embed(stub):
    r = stub.Embed(pb.EmbedRequest(inputs=["hello world", "goodbye"]), metadata=A)
    assert r.dimensions == 384 and len(r.embeddings) == 2 and r.model == "all-MiniLM-L6-v2"
    for e in r.embeddings:
        assert math.isclose(sum(v * v for v in e.values), 1.0, rel_tol=1e-3)
    assert r.prompt_tokens >= 4
    with pytest.raises(grpc.RpcError) as exc:
        stub.Embed(pb.EmbedRequest(inputs=["x"], model="other-embedder"), metadata=A)
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as exc:
        stub.Embed(pb.EmbedRequest(inputs=["ok", ""]), metadata=A)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and exc.value.details().startswith(
        "inputs[1]:"
    )


def test_cache_counters_in_metrics(server, stub):
    stats = stub.GetStats(pb.GetStatsRequest(), metadata=A)
    text = httpx.get(f"{server.http_base}/metrics", timeout=30).text
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line.startswith("sidecar_semantic_cache")
    }
    assert values["sidecar_semantic_cache_lookups_total"] == stats.semantic_cache_lookups > 0
    hits = (
        values['sidecar_semantic_cache_hits_total{kind="exact"}']
        + values['sidecar_semantic_cache_hits_total{kind="semantic"}']
    )
    assert hits == stats.semantic_cache_hits > 0
    assert values["sidecar_semantic_cache_entries"] == stats.semantic_cache_entries > 0
    assert values["sidecar_semantic_cache_bypasses_total"] >= 2  # skip and sampled above

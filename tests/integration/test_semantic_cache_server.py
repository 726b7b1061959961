"""Semantic cache through a real `sidecar serve` over gRPC: hits, streamed replay, only-mode, tenants."""

from __future__ import annotations

import time

import grpc
import pytest

from sidecar.bench.semantic_cache_grpc import serve
from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pbg

ALICE = (("authorization", "Bearer key-alice"),)
BOB = (("authorization", "Bearer key-bob"),)


@pytest.fixture(scope="module")
def stub():
    args = (
        "--device",
        "cpu",
        "--num-kv-blocks",
        "64",
        "--max-num-seqs",
        "4",
        "--http-port",
        "-1",
        "--api-key",
        "key-alice:alice",
        "--api-key",
        "key-bob:bob",
    )
    with serve("demo", extra_args=args, timeout_s=300) as target, grpc.insecure_channel(target) as ch:
        yield pbg.InferenceStub(ch)


def req(prompt, control=pb.CACHE_CONTROL_DEFAULT, max_tokens=12, **kw):
    return pb.GenerateRequest(
        prompt=prompt,
        cache_control=control,
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw),
    )


def until_cached(stub, prompt, md=ALICE, timeout=30.0):
    """The store runs after the response; poll with only-mode until the answer is served."""
    end = time.monotonic() + timeout
    while True:
        try:
            return stub.Generate(req(prompt, pb.CACHE_CONTROL_ONLY), metadata=md, timeout=30)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND
            assert time.monotonic() < end, "generated answer was never stored"
            time.sleep(0.05)


def test_repeated_question_is_an_exact_hit_with_the_same_answer(stub):
    q = "How do I check which process is using port 8080?"
    first = stub.Generate(req(q), metadata=ALICE, timeout=120)
    assert first.cache.status == pb.CACHE_STATUS_MISS
    until_cached(stub, q)
    again = stub.Generate(req(q), metadata=ALICE, timeout=30)
    assert again.cache.status == pb.CACHE_STATUS_HIT_EXACT
    assert again.text == first.text and list(again.token_ids) == list(first.token_ids)
    assert again.finish_reason == first.finish_reason == pb.FINISH_REASON_LENGTH
    assert again.usage.completion_tokens == first.usage.completion_tokens


def test_paraphrase_is_a_semantic_hit_and_near_miss_is_not(stub):
    q = "How can I clear the browser cache in Chrome?"
    first = stub.Generate(req(q), metadata=ALICE, timeout=120)
    until_cached(stub, q)
    hit = stub.Generate(req("How do I clear the cache in Chrome?"), metadata=ALICE, timeout=30)
    assert hit.cache.status == pb.CACHE_STATUS_HIT_SEMANTIC
    assert hit.cache.similarity >= 0.95 and hit.cache.matched_query == q
    assert hit.text == first.text
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(
            req("How can I clear the browser cache in Firefox?", pb.CACHE_CONTROL_ONLY),
            metadata=ALICE,
            timeout=30,
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_streaming_hit_is_replayed_as_a_stream(stub):
    q = "What is the default port for PostgreSQL?"
    first = stub.Generate(req(q), metadata=ALICE, timeout=120)
    until_cached(stub, q)
    chunks = list(stub.GenerateStream(req(q), metadata=ALICE, timeout=30))
    assert chunks and chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert "".join(c.delta for c in chunks) == first.text
    assert [t for c in chunks for t in c.token_ids] == list(first.token_ids)
    assert any(c.cache.status == pb.CACHE_STATUS_HIT_EXACT for c in chunks)


def test_only_mode_miss_is_not_found_and_runs_nothing(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(
            req("A question nobody asked before: why is the sky green?", pb.CACHE_CONTROL_ONLY),
            metadata=ALICE,
            timeout=30,
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "cache miss" in err.value.details()


def test_tenants_do_not_share_answers(stub):
    q = "Who wrote Pride and Prejudice?"
    stub.Generate(req(q), metadata=ALICE, timeout=120)
    until_cached(stub, q)
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(req(q, pb.CACHE_CONTROL_ONLY), metadata=BOB, timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    own = stub.Generate(req(q), metadata=BOB, timeout=120)
    assert own.cache.status == pb.CACHE_STATUS_MISS


def test_sampled_request_bypasses(stub):
    r = stub.Generate(
        req("Who wrote Pride and Prejudice?", temperature=0.8, seed=1), metadata=ALICE, timeout=120
    )
    assert r.cache.status == pb.CACHE_STATUS_BYPASS and r.cache.bypass_reason

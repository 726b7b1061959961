"""gRPC API against a real `sidecar serve --model demo`: results, streaming, errors, deadlines, cancellation."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pbg

NUM_BLOCKS = 128
MAX_MESSAGE = 64 * 1024


@pytest.fixture(scope="module")
def server(sidecar_launcher):
    with sidecar_launcher(
        "--num-kv-blocks",
        str(NUM_BLOCKS),
        "--block-size",
        "16",
        "--max-num-seqs",
        "16",
        "--max-message-bytes",
        str(MAX_MESSAGE),
        "--http-port",
        "-1",
    ) as sc:
        yield sc


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_target) as ch:
        yield pbg.InferenceStub(ch)


def wait_all_blocks_free(stub, timeout=30.0) -> pb.EngineStats:
    """Poll GetStats until no request holds a block (the pool is whole again)."""
    end = time.monotonic() + timeout
    while True:
        s = stub.GetStats(pb.GetStatsRequest())
        if s.num_free_kv_blocks == s.num_kv_blocks and s.num_running == 0 and s.num_waiting == 0:
            return s
        if time.monotonic() > end:
            pytest.fail(f"KV blocks not returned: {s}")
        time.sleep(0.05)


def gen(prompt="The quick brown fox", max_tokens=8, **sampling):
    return pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens, **sampling))


def test_health_serving_and_reflection(server):
    assert server.health("") == health_pb2.HealthCheckResponse.SERVING
    assert server.health("sidecar.v1.Inference") == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(server.grpc_target) as ch:
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(
            refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        )
    names = {s.name for s in resp.list_services_response.service}
    assert {"sidecar.v1.Inference", "grpc.health.v1.Health"} <= names


def reflection_v1(target: str, *requests: reflection_pb2.ServerReflectionRequest) -> list:
    """Ask ``grpc.reflection.v1`` (what grpcurl and current grpc-java try first). Its messages are the
    v1alpha ones on the wire, so v1alpha's classes encode them; only the method path differs."""
    with grpc.insecure_channel(target) as ch:
        call = ch.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        return list(call(iter(requests), timeout=10))


def test_reflection_v1_lists_services_and_describes_a_method(server):
    listed, described = reflection_v1(
        server.grpc_target,
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="sidecar.v1.Inference.Generate"),
    )
    names = {s.name for s in listed.list_services_response.service}
    assert {
        "sidecar.v1.Inference",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in described.file_descriptor_response.file_descriptor_proto
    ]
    (ours,) = [f for f in files if f.package == "sidecar.v1"]
    (inference,) = [s for s in ours.service if s.name == "Inference"]
    methods = {m.name: m for m in inference.method}
    assert methods["Generate"].input_type == ".sidecar.v1.GenerateRequest"
    assert methods["Generate"].output_type == ".sidecar.v1.Completion"
    assert methods["ChatStream"].server_streaming
    # The messages a describe needs next are in the same file.
    assert "GenerateRequest" in {m.name for m in ours.message_type}


def test_unary_generate_fills_usage_timing_and_text(stub):
    r = stub.Generate(gen(max_tokens=6, ignore_eos=True))
    assert r.request_id and r.model == "demo"
    assert len(r.token_ids) == 6 and r.finish_reason == pb.FINISH_REASON_LENGTH
    tok = stub.Tokenize(pb.TokenizeRequest(text="The quick brown fox", add_special_tokens=True))
    assert r.usage.prompt_tokens == tok.count
    assert r.usage.completion_tokens == 6 and r.usage.total_tokens == tok.count + 6
    assert 0 < r.timing.ttft_ms <= r.timing.total_ms and r.timing.queue_ms >= 0
    assert r.cache.status == pb.CACHE_STATUS_BYPASS and r.cache.bypass_reason == "disabled"
    # The text is the detokenized ids.
    again = stub.Generate(gen(max_tokens=6, ignore_eos=True))
    assert again.text == r.text and list(again.token_ids) == list(r.token_ids)  # greedy is deterministic


def test_stream_deltas_concatenate_to_unary_text_same_seed(stub):
    req = gen(
        prompt="Once upon a time", max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True
    )
    unary = stub.Generate(req)
    chunks = list(stub.GenerateStream(req))
    assert "".join(c.delta for c in chunks) == unary.text
    assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids)
    last = chunks[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.usage.completion_tokens == 12
    assert last.timing.total_ms > 0 and last.HasField("cache") and chunks[0].HasField("cache")
    assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    assert all(not c.HasField("usage") for c in chunks[:-1])


def test_chat_unary_and_stream_agree(stub):
    req = pb.ChatRequest(
        messages=[
            pb.ChatMessage(role="system", content="Be brief."),
            pb.ChatMessage(role="user", content="Hi there"),
        ],
        sampling=pb.SamplingParams(max_tokens=8, ignore_eos=True),
    )
    unary = stub.Chat(req)
    chunks = list(stub.ChatStream(req))
    assert "".join(c.delta for c in chunks) == unary.text
    tok = stub.Tokenize(pb.TokenizeRequest(messages=req.messages))
    assert unary.usage.prompt_tokens == tok.count and unary.usage.completion_tokens == 8


def test_logprobs_and_stop_token_ids(stub):
    r = stub.Generate(gen(max_tokens=4, logprobs=2, ignore_eos=True))
    assert len(r.logprobs) == 4
    assert [lp.token_id for lp in r.logprobs] == list(r.token_ids)
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in r.logprobs)
    stop_at = r.token_ids[1]
    s = stub.Generate(gen(max_tokens=4, stop_token_ids=[stop_at], ignore_eos=True))
    assert s.finish_reason == pb.FINISH_REASON_STOP and s.token_ids[-1] == stop_at


def test_model_info_and_stats(stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.model == "demo" and info.block_size == 16
    # The engine may keep one block back (a null block for padding).
    assert NUM_BLOCKS - 1 <= info.num_kv_blocks <= NUM_BLOCKS
    assert info.vocab_size > 0 and info.max_model_len > 0 and info.prefix_caching and info.version
    assert info.semantic_cache is False
    before = stub.GetStats(pb.GetStatsRequest())
    stub.Generate(gen(max_tokens=3, ignore_eos=True))
    after = wait_all_blocks_free(stub)
    assert after.num_kv_blocks == info.num_kv_blocks
    assert after.generation_tokens >= before.generation_tokens + 3
    assert after.prompt_tokens > before.prompt_tokens


BAD_REQUESTS = [
    (gen(temperature=-1), grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature:"),
    (gen(top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p:"),
    (gen(top_k=-1), grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_k:"),
    (gen(min_p=2), grpc.StatusCode.INVALID_ARGUMENT, "sampling.min_p:"),
    (gen(repetition_penalty=0), grpc.StatusCode.INVALID_ARGUMENT, "sampling.repetition_penalty:"),
    (gen(presence_penalty=3), grpc.StatusCode.INVALID_ARGUMENT, "sampling.presence_penalty:"),
    (gen(frequency_penalty=-3), grpc.StatusCode.INVALID_ARGUMENT, "sampling.frequency_penalty:"),
    (gen(max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens:"),
    (gen(logprobs=21), grpc.StatusCode.INVALID_ARGUMENT, "sampling.logprobs:"),
    (gen(stop=["x"] * 17), grpc.StatusCode.INVALID_ARGUMENT, "sampling.stop:"),
    (gen(stop=[""]), grpc.StatusCode.INVALID_ARGUMENT, "sampling.stop:"),
    (gen(stop_token_ids=[10**9]), grpc.StatusCode.INVALID_ARGUMENT, "sampling.stop_token_ids:"),
    (pb.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "prompt: exactly one of"),
    (
        pb.GenerateRequest(prompt="a", prompt_token_ids=[1]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt: exactly one",
    ),
    (pb.GenerateRequest(prompt_token_ids=[10**9]), grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids:"),
    (pb.GenerateRequest(prompt="a", request_id="r" * 129), grpc.StatusCode.INVALID_ARGUMENT, "request_id:"),
    (pb.GenerateRequest(prompt="a", cache_control=7), grpc.StatusCode.INVALID_ARGUMENT, "cache_control:"),
    (
        pb.GenerateRequest(prompt="a", model="gpt-4"),
        grpc.StatusCode.NOT_FOUND,
        "model: unknown model 'gpt-4'",
    ),
    (pb.GenerateRequest(prompt="word " * 5000), grpc.StatusCode.INVALID_ARGUMENT, "prompt:"),
    (
        pb.GenerateRequest(prompt="a", cache_control=pb.CACHE_CONTROL_ONLY),
        grpc.StatusCode.NOT_FOUND,
        "semantic cache miss",
    ),
]


@pytest.mark.parametrize("req, code, message", BAD_REQUESTS, ids=[m for _, _, m in BAD_REQUESTS])
def test_invalid_generate_requests(stub, req, code, message):
    for call in (stub.Generate, lambda r: list(stub.GenerateStream(r))):
        with pytest.raises(grpc.RpcError) as exc:
            call(req)
        assert exc.value.code() == code
        assert message in exc.value.details()


BAD_CHATS = [
    ([], "messages: at least one message"),
    ([("robot", "x")], "messages[0].role: must be one of"),
    ([("user", "q"), ("assistant", "a")], "messages: the last message must be from the user"),
]


@pytest.mark.parametrize("messages, message", BAD_CHATS, ids=[m for _, m in BAD_CHATS])
def test_invalid_chat_requests(stub, messages, message):
    req = pb.ChatRequest(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages])
    with pytest.raises(grpc.RpcError) as exc:
        stub.Chat(req)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in exc.value.details()


def test_tokenize_and_embed_errors(stub):
    with pytest.raises(grpc.RpcError) as exc:
        stub.Tokenize(pb.TokenizeRequest())
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and exc.value.details().startswith("text:")
    with pytest.raises(grpc.RpcError) as exc:
        stub.Embed(pb.EmbedRequest())
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and exc.value.details().startswith("inputs:")


def test_oversized_message_is_resource_exhausted(stub):
    with pytest.raises(grpc.RpcError) as exc:
        stub.Generate(pb.GenerateRequest(prompt="x" * (MAX_MESSAGE + 10)))
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in exc.value.details()
    stub.Generate(gen(max_tokens=1))  # the server is fine afterwards


def test_deadline_exceeded_frees_blocks(stub):
    long = gen(prompt="deadline " * 40, max_tokens=1800, ignore_eos=True)
    with pytest.raises(grpc.RpcError) as exc:
        stub.Generate(long, timeout=0.5)
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(grpc.RpcError) as exc:
        list(stub.GenerateStream(long, timeout=0.5))
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_all_blocks_free(stub)


def test_cancel_mid_stream_under_load_frees_blocks_and_spares_others(stub):
    others_req = gen(
        prompt="Other streams keep going", max_tokens=24, temperature=0.7, seed=7, ignore_eos=True
    )
    expected = stub.Generate(others_req).text
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def other(i: int) -> None:
        try:
            results[i] = "".join(c.delta for c in stub.GenerateStream(others_req))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=other, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    cancelled = []
    for _ in range(4):
        call = stub.GenerateStream(gen(prompt="cancel me " * 20, max_tokens=1800, ignore_eos=True))
        for i, _chunk in enumerate(call):
            if i == 2:
                break
        call.cancel()
        cancelled.append(call)
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert results == {0: expected, 1: expected, 2: expected}
    for call in cancelled:
        assert call.code() == grpc.StatusCode.CANCELLED
    stats = wait_all_blocks_free(stub)
    assert stats.num_running == 0


def test_duplicate_request_ids_do_not_collide(stub):
    req = pb.GenerateRequest(prompt="same id", request_id="my-id", sampling=pb.SamplingParams(max_tokens=3))
    a = stub.Generate.future(req)
    b = stub.Generate.future(req)
    ra, rb = a.result(60), b.result(60)
    assert ra.request_id.startswith("my-id") and rb.request_id.startswith("my-id")
    assert ra.text == rb.text


def test_reasoning_effort_on_a_model_that_does_not_think_is_accepted_and_said_so(stub):
    req = pb.ChatRequest(
        messages=[pb.ChatMessage(role="user", content="hi")],
        sampling=pb.SamplingParams(max_tokens=4),
        reasoning_effort="high",
    )
    reply, call = stub.Chat.with_call(req)
    assert ("x-sidecar-reasoning", "unsupported") in call.initial_metadata()
    assert reply.reasoning == "" and reply.usage.reasoning_tokens == 0 and reply.usage.completion_tokens == 4
    assert not stub.GetModelInfo(pb.GetModelInfoRequest()).reasoning
    streamed = stub.ChatStream(req)
    assert ("x-sidecar-reasoning", "unsupported") in streamed.initial_metadata()
    assert "".join(c.delta for c in streamed) == reply.text
    req.reasoning_effort = "extreme"
    with pytest.raises(grpc.RpcError) as e:
        stub.Chat(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(
        "reasoning_effort:"
    )

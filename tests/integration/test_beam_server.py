"""Beam search over the wire of a real ``sidecar serve`` (demo model): OpenAI ``use_beam_search`` with
``n`` / ``best_of`` / ``length_penalty`` (completions and chat), gRPC ``sampling.beam_width``; refused
options name their field."""

from __future__ import annotations

import grpc
import openai
import pytest
from openai import OpenAI

from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pbg

PROMPT = "Beam search keeps several hypotheses"


@pytest.fixture(scope="module")
def server(sidecar_launcher):
    with sidecar_launcher() as sc:
        yield sc


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.http_base}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_target) as ch:
        yield pbg.InferenceStub(ch)


def beam_completion(client: OpenAI, **extra):
    body = {"use_beam_search": True, "ignore_eos": True, **extra}
    n = body.pop("n", None)
    return client.completions.create(model="demo", prompt=PROMPT, max_tokens=8, n=n, extra_body=body)


def test_completions_return_the_n_best_hypotheses(client, stub):
    four = beam_completion(client, n=4)
    two = beam_completion(client, n=2, best_of=4)
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    texts = [c.text for c in four.choices]
    assert len(set(texts)) == 4  # distinct hypotheses, best first
    assert [c.text for c in two.choices] == texts[:2]  # the same 4 beams, the 2 best returned
    assert all(c.finish_reason == "length" for c in four.choices)
    assert four.usage.completion_tokens == 4 * 8 and two.usage.completion_tokens == 2 * 8
    # gRPC: the best hypothesis of the same beam search
    r = stub.Generate(
        pb.GenerateRequest(
            prompt=PROMPT, sampling=pb.SamplingParams(max_tokens=8, beam_width=4, ignore_eos=True)
        ),
        timeout=120,
    )
    assert r.text == texts[0]
    # a length penalty changes the ranking key, and is accepted
    assert len(beam_completion(client, n=2, best_of=4, length_penalty=0.5).choices) == 2


def test_chat_with_beam_search(client, stub):
    r = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        n=3,
        extra_body={"use_beam_search": True, "ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices) and r.usage.completion_tokens == 3 * 6
    g = stub.Chat(
        pb.ChatRequest(
            messages=[pb.ChatMessage(role="user", content="hi")],
            sampling=pb.SamplingParams(max_tokens=6, beam_width=3, ignore_eos=True),
        ),
        timeout=120,
    )
    assert g.text == r.choices[0].message.content  # the best of the same 3 beams


@pytest.mark.parametrize(
    "extra,field",
    [
        ({"temperature": 0.8}, "temperature"),
        ({"top_p": 0.5}, "top_p"),
        ({"n": 3, "best_of": 2}, "n"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"guided_regex": "[a-z]+"}, "guided_regex"),
    ],
)
def test_refused_beam_options_name_the_field(client, extra, field):
    with pytest.raises(openai.BadRequestError, match=field):
        beam_completion(client, **extra)


def test_best_of_without_beam_search_is_refused(client):
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, extra_body={"best_of": 2})


def test_grpc_beam_with_sampling_is_invalid_argument(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(
            pb.GenerateRequest(
                prompt=PROMPT, sampling=pb.SamplingParams(max_tokens=4, beam_width=2, temperature=0.7)
            ),
            timeout=60,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature" in err.value.details()


def test_beam_search_with_tools_is_refused(client):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            tools=[tool],
            extra_body={"use_beam_search": True},
        )


def test_grpc_beam_with_response_format_is_invalid_argument(stub):
    fmt = pb.ResponseFormat(type=pb.ResponseFormat.TYPE_JSON_OBJECT)
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(
            pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(beam_width=2), response_format=fmt),
            timeout=60,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "response_format" in err.value.details()

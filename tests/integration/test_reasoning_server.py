"""A thinking model served for real: the demo checkpoint with Qwen3's thinking chat template, its replies
held to a think block and an answer by a regex (the weights are random), read with the official openai
client and over gRPC; the semantic cache returns both parts; logit_bias forces and bans tokens."""

from __future__ import annotations

import pathlib
import re
import shutil

import grpc
import openai
import pytest

from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pbg

TEMPLATE = pathlib.Path(__file__).resolve().parents[1] / "templates" / "qwen3.jinja"
THINK = r"<think>[a-z]{2,8}</think>\n\n[a-z]{2,8}"


@pytest.fixture(scope="module")
def server(sidecar_launcher, demo_dir, tmp_path_factory):
    model = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(demo_dir, model)
    (model / "chat_template.jinja").write_text(TEMPLATE.read_text())
    with sidecar_launcher("--model", str(model), "--served-model-name", "demo", semantic_cache=True) as sc:
        yield sc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.http_base + "/v1", api_key="unused")


def ask(client, question, **extra):
    extra.setdefault("guided_regex", THINK)
    return client.chat.completions.with_raw_response.create(
        model="demo", messages=[{"role": "user", "content": question}], max_tokens=40, extra_body=extra
    )


def test_reasoning_content_usage_and_a_cache_hit_with_both_parts(client):
    raw = ask(client, "What is two plus three?")
    r = raw.parse()
    msg = r.choices[0].message
    assert re.fullmatch("[a-z]{2,8}", msg.reasoning_content) and re.fullmatch("[a-z]{2,8}", msg.content)
    n = r.usage.completion_tokens_details.reasoning_tokens
    assert 0 < n < r.usage.completion_tokens and raw.headers["x-sidecar-cache"] == "miss"
    again = ask(client, "What is two plus three?")
    m2 = again.parse().choices[0].message
    assert again.headers["x-sidecar-cache"] == "hit"
    assert (m2.reasoning_content, m2.content) == (msg.reasoning_content, msg.content)
    assert again.parse().usage.completion_tokens_details.reasoning_tokens == n


def test_streamed_reasoning_deltas_equal_the_unary_split(client):
    unary = ask(client, "Name a colour.", cache_control="skip").parse().choices[0].message
    stream = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=40,
        stream=True,
        extra_body={"guided_regex": THINK, "cache_control": "skip"},
    )
    reasoning, content = "", ""
    for chunk in stream:
        d = chunk.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
    assert (reasoning, content) == (unary.reasoning_content, unary.content)


def test_thinking_off_by_template_kwargs_or_effort(client):
    on = ask(client, "Say hi.", guided_regex="[a-z]{2,8}", cache_control="skip").parse()
    off = ask(
        client,
        "Say hi.",
        guided_regex="[a-z]{2,8}",
        cache_control="skip",
        chat_template_kwargs={"enable_thinking": False},
    ).parse()
    effort = client.chat.completions.with_raw_response.create(
        model="demo",
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=8,
        reasoning_effort="minimal",
        extra_body={"guided_regex": "[a-z]{2,8}", "cache_control": "skip"},
    )
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # the empty block is in the prompt
    assert effort.parse().usage.prompt_tokens == off.usage.prompt_tokens
    assert "x-sidecar-reasoning" not in effort.headers
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "x"}], reasoning_effort="maximal"
        )
    assert e.value.body["param"] == "reasoning_effort"


def test_grpc_reasoning_fields_and_model_info(server):
    with grpc.insecure_channel(server.grpc_target) as ch:
        stub = pbg.InferenceStub(ch)
        info = stub.GetModelInfo(pb.GetModelInfoRequest())
        assert info.reasoning and info.tool_call_format == "hermes" and info.dtype_reason
        assert (info.architecture, info.kv_cache_dtype) == ("Qwen2ForCausalLM", info.dtype)
        req = pb.ChatRequest(
            messages=[pb.ChatMessage(role="user", content="Pick a word.")],
            sampling=pb.SamplingParams(max_tokens=40),
            response_format=pb.ResponseFormat(type=pb.ResponseFormat.TYPE_REGEX, regex=THINK),
            cache_control=pb.CACHE_CONTROL_SKIP,
        )
        c = stub.Chat(req)
        assert re.fullmatch("[a-z]{2,8}", c.reasoning) and re.fullmatch("[a-z]{2,8}", c.text)
        assert 0 < c.usage.reasoning_tokens < c.usage.completion_tokens
        chunks = list(stub.ChatStream(req))
        assert "".join(x.reasoning_delta for x in chunks) == c.reasoning
        assert "".join(x.delta for x in chunks) == c.text


def test_logit_bias_forces_over_http_and_bans_over_grpc(client, server, demo_dir):
    from transformers import AutoTokenizer

    forced = client.completions.create(
        model="demo", prompt="hello", max_tokens=5, logit_bias={"42": 100}, extra_body={"ignore_eos": True}
    )
    assert forced.choices[0].text == AutoTokenizer.from_pretrained(demo_dir).decode([42] * 5)
    with grpc.insecure_channel(server.grpc_target) as ch:
        stub = pbg.InferenceStub(ch)
        gen = pb.GenerateRequest(prompt="hello", cache_control=pb.CACHE_CONTROL_SKIP)
        gen.sampling.max_tokens, gen.sampling.ignore_eos = 6, True
        plain = list(stub.Generate(gen).token_ids)
        gen.sampling.logit_bias[plain[0]] = -100.0
        banned = list(stub.Generate(gen).token_ids)
        assert plain[0] not in banned and len(banned) == 6


def test_models_and_the_start_line_say_what_runs(client, server):
    m = client.models.list().data[0].model_dump()
    assert (m["architecture"], m["quantization"], m["device"]) == ("Qwen2ForCausalLM", "none", "cpu")
    assert m["reasoning"] is True and m["tool_call_format"] == "hermes" and m["dtype"]
    line = next(x for x in server.log().splitlines() if x.startswith("sidecar: serving demo"))
    assert f"arch=Qwen2ForCausalLM, dtype={m['dtype']}, quantization=none" in line
    assert line.endswith("tool calls=hermes, reasoning)")

"""A harmony model's forced tool calls served for real: a tiny random gpt-oss checkpoint whose tokenizer has
gpt-oss's harmony special tokens, with the harmony chat template, called with the official openai client and
over gRPC. Under tool_choice required or a named function the reply is a commentary-channel call to an
allowed tool with arguments valid against its schema, unary and streamed; none gives no call; an unknown
tool name is refused naming tool_choice. The random weights would ramble in an analysis message for ever,
so a logit bias on ``<|end|>`` closes one at once wherever the grammar lets the model open it."""

from __future__ import annotations

import json
import pathlib

import grpc
import jsonschema
import openai
import pytest

from sidecar.server.harmony import MARKERS
from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pbg
from tests.unit.model.family_checkpoints import build_family_checkpoint

TEMPLATE = pathlib.Path(__file__).resolve().parents[1] / "templates" / "harmony.jinja"
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Lima"]}, "metric": {"type": "boolean"}},
    "required": ["city", "metric"],
}
ALARM = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "alarm", "description": "Set the alarm", "parameters": ALARM}},
]
SCHEMAS = {"weather": WEATHER, "alarm": ALARM}
MESSAGES = [{"role": "user", "content": "Is it cold in Oslo?"}]


@pytest.fixture(scope="module")
def served(sidecar_launcher, demo_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("harmony")
    tok = AutoTokenizer.from_pretrained(str(demo_dir))
    tok.add_special_tokens({"additional_special_tokens": list(MARKERS) + ["<|return|>"]})
    tok.save_pretrained(root / "tokenizer")
    two = {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}
    model = build_family_checkpoint("gpt_oss", root / "model", root / "tokenizer", **two)
    (model / "chat_template.jinja").write_text(TEMPLATE.read_text())
    with sidecar_launcher("--model", str(model), "--served-model-name", "gpt-oss") as sc:
        yield sc, tok.convert_tokens_to_ids("<|end|>")


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].http_base + "/v1", api_key="unused")


def ask(client, served, choice, **kw):
    kw = {"max_tokens": 100, **kw}
    return client.chat.completions.create(
        model="gpt-oss",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=choice,
        logit_bias={str(served[1]): 100},
        extra_body={"cache_control": "skip"},
        **kw,
    )


def check_call(name, arguments, allowed):
    assert name in allowed
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_unary_and_a_named_tool_streamed_give_one_valid_call(client, served):
    r = ask(client, served, "required")
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content in (None, "")
    check_call(call.function.name, call.function.arguments, ("weather", "alarm"))
    name, args, finish = "", "", None
    for chunk in ask(client, served, {"type": "function", "function": {"name": "alarm"}}, stream=True):
        d = chunk.choices[0].delta if chunk.choices else None
        for c in (d.tool_calls or []) if d else []:
            name += c.function.name or ""
            args += c.function.arguments or ""
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    check_call(name, args, ("alarm",))
    assert finish == "tool_calls"


def test_none_gives_no_call_and_an_unknown_tool_is_refused(client, served):
    r = ask(client, served, "none", max_tokens=12)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason != "tool_calls"
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, served, {"type": "function", "function": {"name": "nope"}})
    assert "tool_choice" in str(e.value) and "nope" in str(e.value)


def test_grpc_required_and_named_calls(served):
    sc, end_id = served
    tools = [pb.Tool(name=n, parameters=json.dumps(s)) for n, s in SCHEMAS.items()]
    with grpc.insecure_channel(sc.grpc_target) as ch:
        stub = pbg.InferenceStub(ch)
        for mode, name, allowed, stream in (
            (pb.ToolChoice.MODE_REQUIRED, "", ("weather", "alarm"), True),
            (pb.ToolChoice.MODE_FUNCTION, "weather", ("weather",), False),
        ):
            req = pb.ChatRequest(
                messages=[pb.ChatMessage(role="user", content="Is it cold in Oslo?")],
                sampling=pb.SamplingParams(max_tokens=100, logit_bias={end_id: 100.0}),
                tools=tools,
                tool_choice=pb.ToolChoice(mode=mode, function_name=name),
                cache_control=pb.CACHE_CONTROL_SKIP,
            )
            if stream:
                chunks = list(stub.ChatStream(req))
                calls = [c for chunk in chunks for c in chunk.tool_calls]
                finish = chunks[-1].finish_reason
            else:
                r = stub.Chat(req)
                calls, finish = list(r.tool_calls), r.finish_reason
            assert finish == pb.FINISH_REASON_TOOL_CALLS and len(calls) == 1
            check_call(calls[0].name, calls[0].arguments, allowed)

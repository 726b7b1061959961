"""Structured output and tool calling through the OpenAI HTTP API of a real ``sidecar serve``
(random demo model, CPU), called with the ``openai`` package exactly as users call OpenAI."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -99, "maximum": 99},
                "b": {"type": "integer", "minimum": -99, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}


class Forecast(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    temperature_c: int = Field(ge=-60, le=60)
    sunny: bool
    summary: str = Field(max_length=20)


@pytest.fixture(scope="module")
def server(sidecar_launcher):
    with sidecar_launcher() as sc:
        yield sc


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.http_base}/v1", api_key="unused", max_retries=0, timeout=120)


def user(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


def test_parse_with_a_pydantic_response_format(client):
    for seed in range(3):
        r = client.chat.completions.parse(
            model="demo",
            messages=user("Weather in Paris?"),
            response_format=Forecast,
            max_tokens=120,
            temperature=1.0,
            seed=seed,
        )
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(msg.parsed, Forecast), msg.content
        assert Forecast.model_validate_json(msg.content) == msg.parsed


def test_json_object_and_regex_and_choice(client):
    r = client.chat.completions.create(
        model="demo",
        messages=user("json please"),
        max_tokens=200,
        response_format={"type": "json_object"},
        temperature=0.0,
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a prefix of JSON that starts an object
        assert r.choices[0].message.content.startswith("{")
    r = client.chat.completions.create(
        model="demo", messages=user("code?"), max_tokens=20, extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"}
    )
    assert r.choices[0].finish_reason == "stop"
    assert len(r.choices[0].message.content) == 6 and r.choices[0].message.content[3] == "-"
    r = client.completions.create(
        model="demo", prompt="yes or no?", max_tokens=10, extra_body={"guided_choice": ["yes", "no", "maybe"]}
    )
    assert r.choices[0].text in ("yes", "no", "maybe") and r.choices[0].finish_reason == "stop"


def test_required_tool_call_has_schema_valid_arguments(client):
    for seed in range(4):
        r = client.chat.completions.create(
            model="demo",
            messages=user("Weather in Oslo and 2+3?"),
            tools=[WEATHER, ADD],
            tool_choice="required",
            max_tokens=200,
            temperature=1.0,
            seed=seed,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert "<tool_call>" not in (choice.message.content or "")


def test_named_tool_choice_and_single_call(client):
    r = client.chat.completions.create(
        model="demo",
        messages=user("add"),
        tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "add"}},
        parallel_tool_calls=False,
        max_tokens=100,
    )
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "add"
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS["add"])


def test_streamed_tool_call_in_openai_chunk_shape(client):
    stream = client.chat.completions.create(
        model="demo",
        messages=user("Weather in Lima?"),
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=120,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        ch = chunk.choices[0]
        for d in ch.delta.tool_calls or []:  # accumulate as OpenAI clients do
            c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = d.id or c["id"]
            c["name"] += d.function.name or ""
            c["arguments"] += d.function.arguments or ""
        finish = ch.finish_reason or finish
    assert finish == "tool_calls" and calls
    for c in calls.values():
        assert c["name"] == "get_weather" and c["id"]
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS["get_weather"])


def test_tool_results_continue_the_conversation(client):
    messages = user("Weather in Paris?") + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    r = client.chat.completions.create(model="demo", messages=messages, tools=[WEATHER], max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 0


def test_bad_schema_and_bad_tool_choice_are_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="demo",
            messages=user("x"),
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "frobnicate"}, "strict": True},
            },
        )
    assert e.value.body["param"].startswith("response_format")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="demo",
            messages=user("x"),
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert e.value.body["param"] == "tool_choice"

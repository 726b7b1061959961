"""/v1/responses against a real `sidecar serve` on the demo model, through the official `openai` client
and LangChain's ``ChatOpenAI(use_responses_api=True)``.

The demo model writes random text: the tests assert structure (items, events, ids, usage), and the
validity of what the grammar binds (forced tool calls, json_schema output), never wording.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import openai
import pytest
from langchain_openai import ChatOpenAI
from openai import OpenAI

KEY_A, KEY_B = "key-a", "key-b"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    "strict": True,
}
FORECAST = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "temperature_c": {"type": "integer", "minimum": -60, "maximum": 60},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "temperature_c", "sunny"],
    "additionalProperties": False,
}
# Long enough to fill several KV blocks, so a follow-up that replays it hits the prefix cache.
LONG = "Tell me about the history of the river towns along the coast, one town at a time. " * 6


@pytest.fixture(scope="module")
def server(sidecar_launcher):
    with sidecar_launcher("--api-key", f"{KEY_A}:tenant-a", "--api-key", f"{KEY_B}:tenant-b") as sc:
        yield sc


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.http_base}/v1", api_key=KEY_A, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def other(server) -> OpenAI:
    return OpenAI(base_url=f"{server.http_base}/v1", api_key=KEY_B, max_retries=0, timeout=120)


def _check_usage(r) -> None:
    u = r.usage
    assert u.input_tokens > 0 and u.output_tokens > 0
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert 0 <= u.input_tokens_details.cached_tokens <= u.input_tokens


def test_plain_response_shape_and_store(client):
    r = client.responses.create(model="demo", input="Hello there", max_output_tokens=8, metadata={"k": "v"})
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "demo"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.metadata == {"k": "v"} and r.store is True and r.max_output_tokens == 8
    [msg] = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.content[0].type == "output_text" and r.output_text == msg.content[0].text
    _check_usage(r)
    assert r.usage.output_tokens == 8
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage == r.usage
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


def test_store_false_is_not_retrievable(client):
    r = client.responses.create(model="demo", input="hi", max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_stream_event_sequence(client):
    events = list(
        client.responses.create(
            model="demo", input="Hello", instructions="Be brief.", max_output_tokens=6, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert events[-4].text == text == final.output_text
    assert final.id == events[0].response.id and final.instructions == "Be brief."
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}
    _check_usage(final)
    assert client.responses.retrieve(final.id).output_text == text


def _calls(r) -> list:
    calls = [o for o in r.output if o.type == "function_call"]
    for c in calls:
        assert c.id.startswith("fc_") and c.call_id.startswith("call_") and c.status == "completed"
        jsonschema.validate(json.loads(c.arguments), WEATHER["parameters"])
    return calls


def test_required_tool_call_is_schema_valid(client):
    for seed_text in ("Weather in Oslo?", "And in Lima?"):
        r = client.responses.create(
            model="demo", input=seed_text, tools=[WEATHER], tool_choice="required", max_output_tokens=200
        )
        assert r.status == "completed" and r.tool_choice == "required"
        assert _calls(r) and all(c.name == "get_weather" for c in _calls(r))
        assert r.tools[0].name == "get_weather"


def test_streamed_tool_call_events(client):
    events = list(
        client.responses.create(
            model="demo",
            input="Weather?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            parallel_tool_calls=False,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == done.arguments and done.name == "get_weather"
    jsonschema.validate(json.loads(done.arguments), WEATHER["parameters"])
    [call] = _calls(events[-1].response)
    assert call.id == done.item_id and call.arguments == done.arguments


def test_json_schema_output(client):
    fmt = {"type": "json_schema", "name": "forecast", "schema": FORECAST, "strict": True}
    r = client.responses.create(model="demo", input="Forecast for Paris as JSON", text={"format": fmt})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), FORECAST)
    r = client.responses.create(model="demo", input="JSON please", text={"format": {"type": "json_object"}})
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict)


def test_function_call_round_trip_stateless_and_stateful(client):
    first = client.responses.create(
        model="demo", input=LONG, tools=[WEATHER], tool_choice="required", max_output_tokens=200
    )
    [call, *_] = _calls(first)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}
    # Stateless: the caller sends the whole conversation, the model's items included.
    items = [{"role": "user", "content": LONG}, *[o.model_dump(exclude_none=True) for o in first.output]]
    r = client.responses.create(model="demo", input=[*items, result], tools=[WEATHER], max_output_tokens=4)
    assert r.status in ("completed", "incomplete") and r.output
    _check_usage(r)
    # Stateful: the same conversation from the store; the replayed prefix comes from the KV cache.
    r2 = client.responses.create(
        model="demo", previous_response_id=first.id, input=[result], tools=[WEATHER], max_output_tokens=4
    )
    assert r2.previous_response_id == first.id
    assert r2.usage.input_tokens == r.usage.input_tokens
    assert r2.usage.input_tokens_details.cached_tokens > 0


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model="demo", input=LONG, max_output_tokens=4)
    second = client.responses.create(
        model="demo", previous_response_id=first.id, input="And then?", max_output_tokens=4
    )
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16
    third = client.responses.create(
        model="demo", previous_response_id=second.id, input="More.", max_output_tokens=4
    )
    assert third.usage.input_tokens > second.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="demo", previous_response_id="resp_nope", input="x")
    assert err.value.body["param"] == "previous_response_id"


def test_tenants_never_see_each_other(client, other):
    mine = client.responses.create(model="demo", input="secret", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    with pytest.raises(openai.BadRequestError):
        other.responses.create(model="demo", previous_response_id=mine.id, input="x")
    assert client.responses.retrieve(mine.id).id == mine.id  # untouched by the other tenant's delete


def test_reasoning_effort_is_accepted(client):
    r = client.responses.create(model="demo", input="hi", reasoning={"effort": "low"}, max_output_tokens=2)
    assert r.reasoning.effort == "low"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"frobnicate": 1}, "frobnicate"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, None),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ],
)
def test_bad_fields_get_openai_errors_naming_them(server, extra, param):
    body = {"model": "demo", "input": "hi", "max_output_tokens": 2, **extra}
    r = httpx.post(
        f"{server.http_base}/v1/responses",
        json=body,
        headers={"authorization": f"Bearer {KEY_A}"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    expected = param or "input[0].content[0].type"
    assert err["param"] == expected and expected in err["message"]


def _metric(base: str, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+-]+)$", httpx.get(f"{base}/metrics", timeout=10).text, re.M)
    assert m, name
    return float(m.group(1))


# A reply that cannot end before max_tokens: the grammar allows no end of the string before 5000
# characters, so only an abort ends the request within the test's window.
ENDLESS = {"type": "object", "properties": {"s": {"type": "string", "minLength": 5000}}, "required": ["s"]}


@pytest.mark.parametrize(
    "path, body",
    [
        (
            "/v1/responses",
            {
                "input": "go " * 100,
                "max_output_tokens": 3000,
                "text": {"format": {"type": "json_schema", "name": "endless", "schema": ENDLESS}},
            },
        ),
        (
            "/v1/messages",
            {
                "messages": [{"role": "user", "content": "go " * 100}],
                "max_tokens": 3000,
                "tools": [{"name": "endless", "input_schema": ENDLESS}],
                "tool_choice": {"type": "tool", "name": "endless"},
            },
        ),
    ],
)
def test_a_client_leaving_a_stream_aborts_it_and_frees_its_blocks(server, path, body):
    base = server.http_base
    total = _metric(base, "sidecar_kv_cache_total_blocks")
    body = {
        "model": "demo",
        "stream": True,
        "temperature": 0.0,
        **body,
    }  # greedy: the demo model loops, never ends
    with httpx.stream(
        "POST", base + path, json=body, headers={"authorization": f"Bearer {KEY_A}"}, timeout=60
    ) as r:
        assert r.status_code == 200
        # The first event: the request is admitted (a tool call streams only once whole); the engine's
        # snapshot shows it running from its next step on.
        lines = r.iter_lines()  # held: a dropped line iterator would close the stream here already
        while not next(lines).startswith("data: "):
            pass
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _metric(base, "sidecar_num_requests_running") != 1:
            time.sleep(0.1)
        assert _metric(base, "sidecar_num_requests_running") == 1
        assert _metric(base, "sidecar_kv_cache_free_blocks") < total
    # The grammar keeps the reply going to max_tokens: only an abort ends it within this window.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (
        _metric(base, "sidecar_num_requests_running") or _metric(base, "sidecar_kv_cache_free_blocks") < total
    ):
        time.sleep(0.1)
    assert _metric(base, "sidecar_num_requests_running") == 0
    assert _metric(base, "sidecar_kv_cache_free_blocks") == total


def test_langchain_responses_api(server):
    llm = ChatOpenAI(
        model="demo",
        base_url=f"{server.http_base}/v1",
        api_key=KEY_A,
        use_responses_api=True,
        max_tokens=6,
        max_retries=0,
    )
    msg = llm.invoke("Hello")
    assert isinstance(msg.text, str) and msg.usage_metadata["output_tokens"] == 6
    chunks = list(llm.stream("Hello"))
    full = chunks[0]
    for c in chunks[1:]:
        full += c
    assert isinstance(full.text, str) and full.usage_metadata["output_tokens"] == 6
    call = ChatOpenAI(
        model="demo", base_url=f"{server.http_base}/v1", api_key=KEY_A, use_responses_api=True, max_retries=0
    ).bind_tools([WEATHER], tool_choice="required")
    out = call.invoke("Weather in Oslo?")
    assert out.tool_calls and out.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(out.tool_calls[0]["args"], WEATHER["parameters"])

"""/v1/messages against a real `sidecar serve` on the demo model, through the official `anthropic` SDK.

The demo model writes random text: the tests assert structure (blocks, events, ids, usage, stop
reasons) and the validity of grammar-bound tool input, never wording.
"""

from __future__ import annotations

import anthropic
import httpx
import jsonschema
import pytest

KEY = "anthropic-key"
WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server(sidecar_launcher):
    with sidecar_launcher("--api-key", f"{KEY}:anthropic") as sc:
        yield sc


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.http_base, api_key=KEY, max_retries=0, timeout=120)


def _usage(m) -> None:
    u = m.usage
    assert u.output_tokens > 0 and u.input_tokens + u.cache_read_input_tokens > 0
    assert u.cache_creation_input_tokens == 0


def test_message_shape(client):
    m = client.messages.create(
        model="demo",
        max_tokens=8,
        system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 20},  # the SDK's create no longer names them
    )
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == "demo"
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None and m.usage.output_tokens == 8
    assert [b.type for b in m.content] == ["text"]
    _usage(m)


def test_stop_sequence_is_reported(client):
    # Greedy on the same prompt: learn the reply, then stop on a piece of it.
    args = dict(
        model="demo", messages=[{"role": "user", "content": "Count"}], extra_body={"temperature": 0.0}
    )
    full = client.messages.create(max_tokens=24, **args).content[0].text
    stop = full.strip()[len(full.strip()) // 2 :][:2]
    assert stop, full
    m = client.messages.create(max_tokens=24, stop_sequences=[stop, "\x00never"], **args)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert stop not in m.content[0].text and full.startswith(m.content[0].text)


def test_stream_events(client):
    with client.messages.stream(
        model="demo", max_tokens=6, messages=[{"role": "user", "content": "Hello"}]
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert deltas and all(d.delta.type == "text_delta" and d.index == 0 for d in deltas)
    assert "".join(d.delta.text for d in deltas) == final.content[0].text
    assert events[0].message.id == final.id and events[-2].delta.stop_reason == "max_tokens"
    assert events[-2].usage.output_tokens == 6 == final.usage.output_tokens


def test_tool_use_round_trip(client):
    m = client.messages.create(
        model="demo",
        max_tokens=200,
        tools=[WEATHER],
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
    )
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and all(u.id.startswith("toolu_") and u.name == "get_weather" for u in uses)
    for u in uses:
        jsonschema.validate(u.input, WEATHER["input_schema"])
    results = [{"type": "tool_result", "tool_use_id": u.id, "content": '{"temp": 21}'} for u in uses]
    follow = client.messages.create(
        model="demo",
        max_tokens=4,
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": m.content},
            {"role": "user", "content": results},
        ],
    )
    assert follow.stop_reason in ("max_tokens", "end_turn", "tool_use") and follow.content
    _usage(follow)


def test_streamed_tool_use(client):
    with client.messages.stream(
        model="demo",
        max_tokens=200,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Weather?"}],
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    [use] = [b for b in final.content if b.type == "tool_use"]
    jsonschema.validate(use.input, WEATHER["input_schema"])
    starts = [e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use"]
    json_deltas = [
        e for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert len(starts) == 1 and starts[0].content_block.id == use.id and json_deltas
    assert final.stop_reason == "tool_use"


def test_errors_in_anthropic_shape_and_keys(server, client):
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="demo", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="nope", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert err.value.body["error"]["type"] == "not_found_error"
    bad = anthropic.Anthropic(base_url=server.http_base, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        bad.messages.create(model="demo", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert err.value.body["error"]["type"] == "authentication_error"
    url, msg = f"{server.http_base}/v1/messages", {"role": "user", "content": "x"}
    for body, field in (
        ({"model": "demo", "messages": [msg]}, "max_tokens"),
        ({"model": "demo", "max_tokens": 2, "messages": [msg], "frobnicate": 1}, "frobnicate"),
        (
            {
                "model": "demo",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": [{"type": "image"}]}],
            },
            "messages[0].content[0].type",
        ),
        (
            {"model": "demo", "max_tokens": 2, "messages": [msg, {"role": "assistant", "content": "y"}]},
            "messages",
        ),
    ):
        r = httpx.post(url, json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=60)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["message"].startswith(field), r.text

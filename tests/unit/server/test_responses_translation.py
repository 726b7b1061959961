"""Responses and Messages translation without a server: input items -> chat messages, events -> output
items and stream events (text before and after tool calls, whitespace, empty replies)."""

from __future__ import annotations

import json

import pytest

from sidecar.server.cache_step import CacheInfo
from sidecar.server.openai.anthropic import MessageBuilder, MessagesRequest, chat_messages
from sidecar.server.openai.responses import ResponseBuilder, input_messages
from sidecar.server.service import Event
from sidecar.server.validation import ServiceError


def ev(delta: str, calls=(), finished=False, reason=None, n=1) -> Event:
    return Event("r", delta, [], None, finished, reason, "", list(range(n)), 5, n, 2, None, None, None,
                 CacheInfo(), list(calls))  # fmt: skip


CALL = {"id": "call_abc", "name": "f", "arguments": '{"x": 1}', "index": 0, "type": "function"}


def test_input_items_become_chat_messages_with_calls_and_results():
    history = [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c0", "name": "g", "arguments": "{}"}]}
    ]
    items = [
        {"type": "function_call_output", "call_id": "c0", "output": "earlier"},
        {"role": "developer", "content": "sys"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                         {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "t", "annotations": []}], "id": "m"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc", "status": "completed"},
        {"type": "function_call", "call_id": "c2", "name": "h", "arguments": "{}"},
        {"type": "reasoning", "id": "rs", "summary": []},
        {"type": "function_call_output", "call_id": "c2", "output": "two"},
    ]  # fmt: skip
    assert input_messages(items, history) == [
        {"role": "tool", "tool_call_id": "c0", "content": "earlier", "name": "g"},
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "a\nb"},
        {
            "role": "assistant",
            "content": "t",
            "tool_calls": [
                {"id": "c1", "name": "f", "arguments": "{}"},
                {"id": "c2", "name": "h", "arguments": "{}"},
            ],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "two", "name": "h"},
    ]
    assert input_messages("hi", []) == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "item, field",
    [
        ({"role": "user", "content": "x", "extra": 1}, "input[0].extra"),
        ({"role": "robot", "content": "x"}, "input[0].role"),
        ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input[0].content[0].type"),
        ({"type": "function_call", "call_id": "c", "name": "f"}, "input[0].arguments"),
        ({"type": "item_reference", "id": "x"}, "input[0].type"),
    ],
)
def test_bad_input_items_name_their_field(item, field):
    with pytest.raises(ServiceError) as err:
        input_messages([item], [])
    assert err.value.field == field


def _kinds(events: list[dict]) -> list[str]:
    return [e["type"] for e in events]


def test_response_events_for_text_then_call_then_text():
    b = ResponseBuilder({"id": "resp_1"})
    out = b.start() + b.feed(ev("  ")) + b.feed(ev("Hi")) + b.feed(ev("", [CALL]))
    out += b.feed(ev(" after", finished=True, reason="tool_calls", n=4))
    assert _kinds(out) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    final = out[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call", "message"]
    assert final["output"][0]["content"][0]["text"] == "  Hi"  # leading whitespace kept with the text
    assert final["output"][1]["call_id"] == "call_abc" and final["output"][1]["arguments"] == '{"x": 1}'
    assert final["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2},
                              "output_tokens": 4, "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": 9}  # fmt: skip
    calls = [{"id": "call_abc", "name": "f", "arguments": '{"x": 1}'}]
    assert b.messages() == [{"role": "assistant", "content": "  Hi after", "tool_calls": calls}]


def test_whitespace_before_a_call_is_no_message_and_an_empty_reply_is_one():
    b = ResponseBuilder({"id": "resp_2"})
    b.feed(ev("\n", [CALL], finished=True, reason="tool_calls"))
    assert [o["type"] for o in b.output] == ["function_call"]
    b = ResponseBuilder({"id": "resp_3"})
    out = b.feed(ev("", finished=True, reason="length"))
    assert _kinds(out)[-1] == "response.incomplete" and b.snapshot()["incomplete_details"]
    assert b.output[0]["content"] == [{"type": "output_text", "text": "", "annotations": []}]


def test_anthropic_blocks_become_chat_messages():
    body = MessagesRequest(
        model="m",
        max_tokens=4,
        system=[{"type": "text", "text": "s1"}, {"type": "text", "text": "s2"}],
        messages=[
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "x"},
                                              {"type": "text", "text": "let me"},
                                              {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": "ok"}]},
                                         {"type": "text", "text": "thanks"}]},
        ],
    )  # fmt: skip
    assert chat_messages(body) == [
        {"role": "system", "content": "s1\ns2"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "let me", "tool_calls": [{"id": "t1", "name": "f", "arguments": '{"a": 1}'}]},
        {"role": "tool", "tool_call_id": "t1", "content": "ok", "name": "f"},
        {"role": "user", "content": "thanks"},
    ]  # fmt: skip


def test_anthropic_events_and_stop_sequence():
    b = MessageBuilder("msg_1", "m", ["END"], lambda ids: ["x", "EN", "D"][: len(ids)])
    out = b.start(ev("")) + b.feed(ev("Hi")) + b.feed(ev("", [CALL], finished=True, reason="tool_calls", n=3))
    assert _kinds(out) == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    assert out[5]["delta"] == {"type": "input_json_delta", "partial_json": '{"x": 1}'}
    assert b.message()["content"][1] == {
        "type": "tool_use",
        "id": "toolu_abc",
        "name": "f",
        "input": {"x": 1},
    }
    assert b.message()["stop_reason"] == "tool_use" and b.message()["usage"]["cache_read_input_tokens"] == 2
    s = MessageBuilder("msg_2", "m", ["END"], lambda ids: ["x", "EN", "D"][: len(ids)])
    s.feed(ev("x", finished=True, reason="stop", n=3))
    assert (s.stop_reason, s.stop_sequence) == ("stop_sequence", "END")
    e = MessageBuilder("msg_3", "m", ["END"], lambda ids: ["x"] * len(ids))
    e.feed(ev("x", finished=True, reason="stop", n=3))
    assert (e.stop_reason, e.stop_sequence) == ("end_turn", None)
    assert json.loads(json.dumps(b.message()))  # plain JSON throughout


@pytest.mark.parametrize("effort, sent", [(None, None), ("none", "none"), ("low", "low"), ("xhigh", "high")])
def test_reasoning_effort_reaches_the_chat_request(effort, sent):
    from sidecar.server.openai.responses import generation_request
    from sidecar.server.openai.responses_models import ResponsesRequest

    body = ResponsesRequest(model="m", input="hi", reasoning=None if effort is None else {"effort": effort})
    req = generation_request(body, "r", [{"role": "user", "content": "hi"}], 64)
    assert req.reasoning_effort == sent


def test_a_think_block_becomes_a_reasoning_item_before_the_message():
    import dataclasses

    b = ResponseBuilder({"id": "resp_1"})
    b.start()
    think = [dataclasses.replace(ev(""), reasoning_delta=d) for d in ("Let me ", "see.")]
    events = [e for x in think for e in b.feed(x)]
    events += b.feed(ev("Paris"))
    events += b.feed(dataclasses.replace(ev("", finished=True, reason="stop", n=3), reasoning_tokens=2))
    kinds = [e["type"] for e in events]
    assert kinds[:3] == [
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
    ]
    assert kinds[3:5] == ["response.reasoning_text.done", "response.output_item.done"]
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
    done = events[-1]["response"]
    assert [o["type"] for o in done["output"]] == ["reasoning", "message"]
    assert done["output"][0]["content"] == [{"type": "reasoning_text", "text": "Let me see."}]
    assert done["output"][1]["content"][0]["text"] == "Paris"
    assert done["usage"]["output_tokens_details"]["reasoning_tokens"] == 2
    assert [e["sequence_number"] for e in events] == sorted(e["sequence_number"] for e in events)
    assert b.messages() == [{"role": "assistant", "content": "Paris"}]

"""Tool-call text handling shared by both transports: streaming parser, rendering, grammar, cache keys."""

from __future__ import annotations

import json

import pytest

from sidecar.config import CacheConfig
from sidecar.engine.request import SamplingParams
from sidecar.engine.structured import Constraint
from sidecar.server.cache_step import CacheStep
from sidecar.server.service import GenerationRequest
from sidecar.server.tools import (
    MAX_PARALLEL_CALLS,
    TOKENS_PER_CALL,
    ToolCallParser,
    ToolSpec,
    close_objects,
    default_tool_max_tokens,
    parse_tool_calls,
    render_messages,
    tool_constraint,
)
from sidecar.server.validation import ServiceError

ADD = ToolSpec("add", "adds", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
ADD_OPEN = ToolSpec(
    "add", "adds", {"type": "object", "properties": {"a": {"type": "integer"}}}
)  # as clients send
TEXT = (
    'Sure. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "add", '
    '"arguments": {"a": 2}}</tool_call>'
)


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_streaming_parser_emits_content_and_whole_calls_whatever_the_chunking(step):
    p = ToolCallParser()
    content, calls = "", []
    for i in range(0, len(TEXT), step):
        c, new = p.feed(TEXT[i : i + step])
        assert "<" not in c  # a possible marker start is held back, never leaked as content
        content += c
        calls += new
    content += p.finish()
    assert content == "Sure. "  # the newline between the calls separates them: it is not content
    assert [(c["name"], json.loads(c["arguments"]), c["index"]) for c in calls] == [
        ("add", {"a": 1}, 0),
        ("add", {"a": 2}, 1),
    ]
    assert len({c["id"] for c in calls}) == 2


def test_text_that_only_looks_like_a_call_stays_content():
    assert parse_tool_calls("a <b> c <tool_ca") == ("a <b> c <tool_ca", [])
    assert parse_tool_calls("x <tool_call>not json</tool_call> y") == (
        "x <tool_call>not json</tool_call> y",
        [],
    )
    assert parse_tool_calls('x <tool_call>{"name": "add"') == ('x <tool_call>{"name": "add"', [])


def _feed_in_chunks(text: str, step: int) -> tuple[ToolCallParser, str, list]:
    """The parser after ``text`` fed ``step`` characters at a time, its content and its calls."""
    p = ToolCallParser()
    content, calls = "", []
    for i in range(0, len(text), step):
        c, new = p.feed(text[i : i + step])
        content += c
        calls += new
    return p, content + p.finish(), calls


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_an_argument_holding_the_end_marker_stays_in_its_call(step):
    # Copied from data: the argument's text contains the end marker (and a start marker, and braces).
    args = {"a": 'see </tool_call> and <tool_call>{"x": 1}</tool_call> here'}
    text = "ok " + "<tool_call>" + json.dumps({"name": "add", "arguments": args}) + "</tool_call>"
    _, content, calls = _feed_in_chunks(text, step)
    assert content == "ok "
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("add", args)]


def test_a_json_value_not_followed_by_the_end_marker_is_text():
    assert parse_tool_calls('<tool_call>{"name": "add"} tail') == ('<tool_call>{"name": "add"} tail', [])
    assert parse_tool_calls('<tool_call>{"nom": 1}</tool_call>') == ('<tool_call>{"nom": 1}</tool_call>', [])


def test_default_template_renders_tools_calls_and_results():
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+1?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "name": "add", "arguments": '{"a": 1}'}],
        },
        {"role": "tool", "content": "2", "tool_call_id": "c1"},
    ]
    out, tpl_tools = render_messages(msgs, [ADD], template_has_tools=False)
    assert tpl_tools is None
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\nYou can call functions.")
    assert '"name": "add"' in out[0]["content"]
    assert out[2] == {
        "role": "assistant",
        "content": '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
    }
    assert out[3] == {"role": "user", "content": "<tool_response>\n2\n</tool_response>"}
    out, tpl_tools = render_messages(msgs, [ADD], template_has_tools=True)
    assert tpl_tools[0]["function"]["name"] == "add"
    assert out[2]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 1}}
    assert out[3]["tool_call_id"] == "c1"


def test_tool_grammar_choices():
    assert tool_constraint([ADD], "none", True, None) is None
    assert tool_constraint([ADD], "auto", True, None).lazy_trigger == "<tool_call>"
    assert tool_constraint([ADD], "required", True, None).lazy_trigger is None
    with pytest.raises(ServiceError, match="^response_format: "):
        tool_constraint([ADD], "required", True, Constraint("json_object"))
    with pytest.raises(ServiceError, match="^response_format: "):
        tool_constraint([ADD], "auto", True, Constraint("regex", "a+"))


class _Cache:
    def record_bypass(self, reason):
        pass


def _settings(**kw) -> str:
    req = GenerationRequest(messages=[{"role": "user", "content": "add 1"}], **kw)
    return CacheStep(_Cache(), None, CacheConfig()).plan("t", req, req.params, "m").scope.settings


def test_cache_keys_include_output_constraint_and_tools():
    plain = _settings()
    with_tools = _settings(tools=[ADD], tool_choice="auto")
    other_tools = _settings(tools=[ToolSpec("sub", "", ADD.parameters)], tool_choice="auto")
    required = _settings(tools=[ADD], tool_choice="required")
    schema = _settings(params=SamplingParams(structured={"type": "object"}))
    keys = [plain, with_tools, other_tools, required, schema]
    assert len(set(keys)) == len(keys)
    assert _settings(tools=[ADD], tool_choice="none") == plain  # tools not offered: same answer as without
    assert _settings(tools=[ADD], tool_choice="auto") == with_tools  # deterministic


def test_client_schemas_without_additional_properties_are_closed():
    pydantic_like = {
        "type": "object",
        "title": "Weather",
        "properties": {
            "city": {"type": "string"},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
            "tags": {"type": "array", "items": {"properties": {"k": {"type": "string"}}}},
            "alt": {"anyOf": [{"$ref": "#/$defs/Loc"}, {"type": "null"}]},
        },
        "$defs": {"Loc": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        "required": ["city"],
    }
    closed = close_objects(pydantic_like)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["where"]["additionalProperties"] is False
    assert closed["properties"]["tags"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["Loc"]["additionalProperties"] is False
    assert "additionalProperties" not in pydantic_like  # the client's schema is not changed
    opened = close_objects(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}
    )
    assert opened["additionalProperties"] is True  # the per-request opt-out
    parts = close_objects(
        {"allOf": [{"type": "object", "properties": {"a": {}}}, {"type": "object", "properties": {"b": {}}}]}
    )
    assert all("additionalProperties" not in p for p in parts["allOf"])  # each member is only a part


def test_forced_calls_get_a_bounded_default_max_tokens():
    assert default_tool_max_tokens("auto", True) is None
    assert default_tool_max_tokens("required", False) == TOKENS_PER_CALL
    assert default_tool_max_tokens("required", True) == TOKENS_PER_CALL * MAX_PARALLEL_CALLS
    assert default_tool_max_tokens("function:add", True) == TOKENS_PER_CALL


@pytest.fixture(scope="module")
def matcher_for(demo_dir):
    import llguidance.hf
    from llguidance import LLMatcher
    from transformers import AutoTokenizer

    from sidecar.engine.structured import grammar_for

    hf = AutoTokenizer.from_pretrained(demo_dir)
    lltok = llguidance.hf.from_tokenizer(hf)

    def accepts(c: Constraint, text: str) -> bool:
        m = LLMatcher(lltok, grammar_for(c), log_level=0)
        ids = hf.encode(text, add_special_tokens=False)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    return accepts


def test_required_calls_close_and_end(matcher_for):
    one = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    c = tool_constraint([ADD_OPEN], "required", True, None)
    assert matcher_for(c, one)
    assert not matcher_for(c, one.replace('{"a": 1}', '{"a": 1, "b": 2}'))  # no invented property
    assert matcher_for(c, "\n".join([one] * MAX_PARALLEL_CALLS))
    assert not matcher_for(c, "\n".join([one] * (MAX_PARALLEL_CALLS + 1)))  # the turn ends
    assert matcher_for(c, one + "\n")  # the newline the model writes after a call may end the turn
    single = tool_constraint([ADD_OPEN], "required", False, None)
    assert matcher_for(single, one) and not matcher_for(single, one + "\n" + one)
    assert not matcher_for(single, one + "\n")
    named = tool_constraint([ADD_OPEN], "function:add", True, None)
    assert matcher_for(named, one) and not matcher_for(named, one + "\n" + one)


def test_tool_grammars_end_where_the_model_stops_calling():
    for choice in ("required", "function:add"):
        c = tool_constraint([ADD], choice, True, None)
        assert c.open_end and c.end_on_repeat
    auto = tool_constraint([ADD], "auto", True, None)
    assert auto.open_end and not auto.end_on_repeat  # its first unit starts inside the marker
    assert (
        tool_constraint([ADD], "required", True, None).key()
        != Constraint("lark", tool_constraint([ADD], "required", True, None).value).key()
    )  # the end rules are part of the constraint's identity


CALL_A1 = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
CALL_A2 = '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_a_repeated_call_ends_the_reply_and_is_dropped(step):
    same_reordered = '<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>'  # equal as JSON values
    text = (
        CALL_A1 + "\n" + CALL_A2 + "\n" + same_reordered + "\n" + '<tool_call>{"name": "add", "arguments": '
        '{"a": 3}}</tool_call> tail'
    )
    p, content, calls = _feed_in_chunks(text, step)
    assert [json.loads(c["arguments"]) for c in calls] == [{"a": 1}, {"a": 2}]  # nothing after the repeat
    assert content == "" and p.ended
    assert [c["index"] for c in calls] == [0, 1]


def test_calls_that_differ_are_all_kept():
    other_tool = CALL_A1.replace('"add"', '"sub"')
    content, calls = parse_tool_calls(CALL_A1 + "\n" + other_tool + "\n" + CALL_A2 + "\n")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("add", {"a": 1}),
        ("sub", {"a": 1}),
        ("add", {"a": 2}),
    ]
    assert content == ""


def test_text_after_a_call_keeps_its_inner_whitespace():
    assert parse_tool_calls(CALL_A1 + "\n\nso  it is\n")[0] == "so  it is\n"

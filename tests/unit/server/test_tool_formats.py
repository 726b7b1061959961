"""Tool-call formats per model family, chosen from the families' chat templates (written here as test data
from their published conventions): detection, rendering, streaming parsers, and the grammar round trip --
the demo model, held to each format's grammar, writes calls that parse back into OpenAI tool calls."""

from __future__ import annotations

import asyncio
import json
import pathlib

import pytest
from transformers import PreTrainedTokenizerFast

from sidecar.engine.request import SamplingParams
from sidecar.server import tool_formats as tf
from sidecar.server.tools import ToolSpec, make_parser, parse_tool_calls, render_messages, tool_constraint

TEMPLATES = pathlib.Path(__file__).resolve().parents[2] / "templates"
ADD = ToolSpec(
    "add",
    "adds",
    {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a"],
    },
)
NEG = ToolSpec(
    "neg", "negates", {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]}
)
FORMATS = [tf.HERMES, tf.PHI4, tf.LLAMA3, tf.LLAMA3_TAG, tf.MISTRAL]


def template(name: str) -> str:
    return (TEMPLATES / name).read_text()


def test_each_family_template_selects_its_format():
    assert tf.detect(template("qwen3.jinja")) is tf.HERMES
    assert tf.detect(template("llama3_1.jinja")) is tf.LLAMA3_TAG
    assert tf.detect(template("mistral_v3.jinja")) is tf.MISTRAL
    assert tf.detect(template("phi4_mini.jinja")) is tf.PHI4
    assert tf.detect("{{ messages }}") is tf.HERMES  # no convention shown: the documented default
    assert tf.tools_in_system(tf.PHI4, template("phi4_mini.jinja"))


WRITTEN = {
    "hermes": 'Sure. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n'
    '<tool_call>{"name": "neg", "arguments": {"x": true}}</tool_call>',
    "phi4": 'Sure. <|tool_call|>{"name": "add", "arguments": {"a": 1}}<|/tool_call|>\n'
    '<|tool_call|>{"name": "neg", "arguments": {"x": true}}<|/tool_call|>',
    "llama3_json": '{"name": "add", "parameters": {"a": 1}}; {"name": "neg", "parameters": {"x": true}}',
    "llama3_tag": '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "neg", "parameters": {"x": true}}',
    "mistral": 'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, {"name": "neg", "arguments": {"x": true}}]',
}


def _key(fmt: tf.ToolFormat) -> str:
    return "llama3_tag" if fmt is tf.LLAMA3_TAG else fmt.name


@pytest.mark.parametrize("fmt", FORMATS, ids=_key)
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streaming_parsers_give_content_and_calls_whatever_the_chunking(fmt, step):
    text = WRITTEN[_key(fmt)]
    p = make_parser(fmt)
    content, calls = "", []
    for i in range(0, len(text), step):
        c, new = p.feed(text[i : i + step])
        content, calls = content + c, calls + new
    content += p.finish()
    calls += p.late
    assert content == ("" if fmt.name == "llama3_json" else "Sure. ")
    assert [(c["name"], json.loads(c["arguments"]), c["index"]) for c in calls] == [
        ("add", {"a": 1}, 0),
        ("neg", {"x": True}, 1),
    ]


@pytest.mark.parametrize("fmt", [tf.LLAMA3, tf.LLAMA3_TAG, tf.MISTRAL], ids=_key)
def test_text_that_is_not_calls_stays_content(fmt):
    for text in ("The answer is {a}.", "{not json", '{"name": 3}', "[TOOL_CALLS] oops"):
        assert parse_tool_calls(text, fmt) == (text, [])
    repeat = '{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"a": 1}}'
    if fmt.name == "llama3_json":
        assert len(parse_tool_calls(repeat, fmt)[1]) == 1  # a repeat ends the list


@pytest.mark.parametrize("name", ["qwen3.jinja", "llama3_1.jinja", "mistral_v3.jinja", "phi4_mini.jinja"])
def test_each_template_renders_the_tools_and_an_earlier_call(name, demo_dir):
    from sidecar.engine.chat_template import encode_chat

    tok = PreTrainedTokenizerFast.from_pretrained(demo_dir)
    tok.chat_template = template(name)
    fmt = tf.detect(tok.chat_template)
    msgs = [
        {"role": "user", "content": "add 1"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "abcdefghi", "name": "add", "arguments": '{"a": 1}'}],
        },
        {"role": "tool", "content": "1", "tool_call_id": "abcdefghi"},
        {"role": "user", "content": "again"},
    ]
    has_tools = "tools" in tok.chat_template and "tool_calls" in tok.chat_template
    out, tpl_tools = render_messages(msgs, [ADD], has_tools, fmt, tf.tools_in_system(fmt, tok.chat_template))
    text = tok.decode(encode_chat(tok, out, tpl_tools))
    assert '"add"' in text and "adds" in text  # the tool list reached the prompt
    assert '"a": 1' in text  # and so did the earlier call


# -- the grammar round trip --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(demo_dir):
    from sidecar import LLM

    return LLM(model=str(demo_dir), seed=0, max_num_seqs=8)


@pytest.mark.parametrize("fmt", FORMATS, ids=_key)
def test_required_calls_in_every_format_always_parse(fmt, llm):
    cases = [("required", True), ("required", False), ("function:neg", True)]
    cons = [tool_constraint([ADD, NEG], choice, parallel, None, fmt) for choice, parallel in cases]
    params = [
        SamplingParams(max_tokens=160, temperature=1.0, seed=s, structured=c) for c in cons for s in (1, 2)
    ]
    outs = llm.generate(["call something"] * len(params), params)
    for out, p, (choice, parallel) in zip(outs, params, [c for c in cases for _ in (1, 2)]):
        assert out.finish_reason == "stop", out.text
        content, calls = parse_tool_calls(out.text, fmt)
        assert calls and content.strip() == "", out.text
        assert len(calls) == 1 or parallel
        for c in calls:
            args = json.loads(c["arguments"])
            assert (c["name"], set(args)) in (("add", {"a"}), ("neg", {"x"}))
            assert choice != "function:neg" or c["name"] == "neg"


@pytest.mark.parametrize("fmt", FORMATS, ids=_key)
def test_auto_calls_that_begin_are_completed_and_parse(fmt, llm):
    c = tool_constraint([ADD, NEG], "auto", True, None, fmt)
    # Random weights seldom begin a call on their own, so the grammar is walked over a written call and
    # over free text; then whatever the model writes under it parses.
    from llguidance import LLMatcher

    from sidecar.engine.structured import grammar_for

    grammar = grammar_for(c)
    err = LLMatcher.validate_grammar(grammar)
    assert not err or err.startswith("WARNING"), err
    lltok = llm.engine.structured._tokenizer()
    tok = llm.engine.tokenizer
    for text, ok in ((WRITTEN[_key(fmt)].removeprefix("Sure. "), True), ("Plain words here.", True)):
        m = LLMatcher(lltok, grammar)
        ids = tok.encode(text, add_special_tokens=False)
        assert (m.validate_tokens(ids) == len(ids)) is ok, text
    outs = llm.generate(
        ["hi"] * 2, [SamplingParams(max_tokens=40, temperature=1.0, seed=s, structured=c) for s in (3, 4)]
    )
    for out in outs:
        content, calls = parse_tool_calls(out.text, fmt)
        assert calls or content == out.text


def test_a_marker_that_is_a_special_token_is_the_token_in_the_grammar(demo_dir):
    import llguidance.hf
    from llguidance import LLMatcher

    from sidecar.engine.structured import grammar_for

    tok = PreTrainedTokenizerFast.from_pretrained(demo_dir)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    tid = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    c = tool_constraint([ADD], "required", False, None, tf.MISTRAL, {"[TOOL_CALLS]": tid})
    m = LLMatcher(lltok, grammar_for(c))
    assert m.validate_tokens([tid]) == 1 and m.consume_token(tid)
    rest = tok.encode(' [{"name": "add", "arguments": {"a": 7}}]', add_special_tokens=False)
    assert m.validate_tokens(rest) == len(rest)
    text = tok.decode([tid] + rest, skip_special_tokens=False)
    assert [json.loads(x["arguments"]) for x in parse_tool_calls(text, tf.MISTRAL)[1]] == [{"a": 7}]


def test_the_service_parses_a_llama3_reply_into_calls_at_its_end():
    from test_reasoning import ThinkingEngine, chat
    from test_service import collect, service

    pieces = ["<|python_tag|>", '{"name": "add", ', '"parameters": {"a": 4}}']
    eng = ThinkingEngine(pieces, template=template("llama3_1.jinja"))
    svc = service(eng)
    events = asyncio.run(collect(svc, chat(tools=[ADD], tool_choice="required")))
    assert eng.rendered[0].count('"name": "add"') == 1  # the template listed the tool
    assert [(c["name"], json.loads(c["arguments"])) for e in events for c in e.tool_calls] == [
        ("add", {"a": 4})
    ]
    assert events[-1].finish_reason == "tool_calls" and events[-1].text == ""
    assert "".join(e.delta_text for e in events) == ""
    assert svc.model_info()["tool_call_format"] == "llama3_json"

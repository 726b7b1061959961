"""gpt-oss's harmony replies: the parser splits analysis-channel text into reasoning and the final channel
into the answer whatever the chunking, drops headers and markers, turns commentary-channel calls to
``functions.NAME`` into tool calls when the request offers tools, passes a plain reply through; the service
does it on a harmony template, keeping special tokens in the reply text, sending reasoning_effort to the
template's own variable, and holding a reply to one call of an allowed tool under tool_choice required or a
named function (a grammar walked here over written replies with the tokenizer's harmony special tokens)."""

from __future__ import annotations

import asyncio
import json
import pathlib

import pytest
from test_reasoning import ThinkingEngine, chat
from test_service import collect, service

from sidecar.server.harmony import MARKERS, HarmonyParser, is_harmony, tool_constraint
from sidecar.server.service import ServiceError
from sidecar.server.tools import ToolSpec

HARMONY = (pathlib.Path(__file__).resolve().parents[2] / "templates" / "harmony.jinja").read_text()
REPLY = (
    "<|channel|>analysis<|message|>2 + 3 is 5.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>The sum is 5.<|return|>"
)
TOOL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json<|message|>{"city": "Oslo"}'
    "<|call|>"
)


def feed(text: str, step: int, calls: bool = False) -> HarmonyParser:
    p = HarmonyParser(lambda ids: [str(i) for i in ids], calls)
    r, c = [], []
    for i in range(0, len(text), step):
        a, b = p.feed(text[i : i + step])
        r.append(a)
        c.append(b)
    a, b = p.finish()
    assert "".join(r) + a == p.reasoning and "".join(c) + b == p.content
    return p


@pytest.mark.parametrize("step", [1, 2, 3, 5, 7, 1000])
def test_the_parser_splits_channels_whatever_the_chunking(step):
    p = feed(REPLY, step)
    assert (p.reasoning, p.content) == ("2 + 3 is 5.", "The sum is 5.")
    t = feed(TOOL, step)  # a tool call's arguments are neither reasoning nor answer
    assert (t.reasoning, t.content, t.channel, t.recipient) == (
        "Need the weather.",
        "",
        "commentary",
        "functions.weather",
    )
    assert (feed("Just text <|x", step).content, feed("Just text", step).reasoning) == ("Just text <|x", "")
    cut = feed("<|channel|>analysis<|message|>still thinking <|en", step)  # cut by max_tokens
    assert (cut.reasoning, cut.content) == ("still thinking <|en", "")


def test_reasoning_tokens_are_the_analysis_message():
    pieces = ["<|channel|>", "analysis", "<|message|>", "a", "b", "<|end|>", "<|start|>", "assistant"]
    pieces += ["<|channel|>", "final", "<|message|>", "ok", "<|return|>"]
    p = HarmonyParser(lambda ids: [pieces[i] for i in ids])
    p.feed("".join(pieces))
    p.finish()
    assert p.count_tokens(list(range(len(pieces)))) == 4  # a, b, <|end|> and the <|message|> opening them
    plain = HarmonyParser(lambda ids: [pieces[i] for i in ids])
    plain.feed("<|channel|>final<|message|>ok")
    assert plain.count_tokens([0, 9, 2, 11]) == 0


def test_the_service_splits_harmony_replies_and_keeps_special_tokens():
    assert is_harmony(HARMONY)
    pieces = [
        "<|channel|>",
        "analysis",
        "<|message|>",
        "2 + 3",
        " is 5.",
        "<|end|>",
        "<|start|>",
        "assistant",
    ]
    pieces += ["<|channel|>", "final", "<|message|>", "Five", ".", "<|return|>"]
    eng = ThinkingEngine(pieces, template=HARMONY)
    events = asyncio.run(collect(service(eng), chat(reasoning_effort="high")))
    last = events[-1]
    assert (last.reasoning_text, last.text, last.reasoning_tokens) == ("2 + 3 is 5.", "Five.", 4)
    assert "".join(e.delta_text for e in events) == "Five."
    assert "".join(e.reasoning_delta for e in events) == "2 + 3 is 5."
    assert eng.calls[0][1].skip_special_tokens is False
    assert eng.kwargs == [{"reasoning_effort": "high"}] and "Reasoning: high" in eng.rendered[0]
    assert eng.rendered[0].endswith("<|start|>assistant")
    asyncio.run(collect(service(eng), chat(reasoning_effort="none")))  # no harmony level: the default
    assert eng.kwargs[1] == {} and "Reasoning: medium" in eng.rendered[1]


def test_the_service_returns_harmony_tool_calls_and_refuses_forcing_one():
    spec = ToolSpec(
        "weather", "The weather in a city", {"type": "object", "properties": {"city": {"type": "string"}}}
    )
    pieces = ["<|channel|>", "analysis", "<|message|>", "Need it.", "<|end|>", "<|start|>", "assistant"]
    pieces += ["<|channel|>", "commentary to=functions.weather", " <|constrain|>", "json", "<|message|>"]
    pieces += ['{"city": ', '"Oslo"}', "<|call|>"]
    eng = ThinkingEngine(pieces, template=HARMONY)
    events = asyncio.run(collect(service(eng), chat(tools=[spec], tool_choice="auto")))
    calls = [c for e in events for c in e.tool_calls]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("weather", {"city": "Oslo"})]
    assert events[-1].finish_reason == "tool_calls" and events[-1].text == ""
    assert events[-1].reasoning_text == "Need it."
    assert "functions.weather: The weather in a city" in eng.rendered[0]
    assert eng.calls[0][1].structured is None  # no grammar: the channel carries the call
    said = ["<|channel|>", "commentary", "<|message|>", "Checking.", "<|end|>", "<|start|>", "assistant"]
    eng = ThinkingEngine(pieces[:7] + said + pieces[7:], template=HARMONY)
    for choice in ("required", "function:weather"):  # a forced call: the call grammar, then the same parse
        events = asyncio.run(collect(service(eng), chat(tools=[spec], tool_choice=choice)))
        grammar = eng.calls[-1][1].structured
        assert grammar.kind == "lark" and '" to=functions.weather "' in grammar.value
        assert [c["name"] for e in events for c in e.tool_calls] == ["weather"]
        assert events[-1].text == "Checking."  # the preamble is the reply's content
    with pytest.raises(ServiceError) as e:
        asyncio.run(collect(service(eng), chat(tools=[spec], tool_choice="function:nope")))
    assert e.value.field == "tool_choice" and "nope" in str(e.value)


def test_a_call_closed_by_an_end_of_sequence_token_is_a_call():
    # gpt-oss's <|call|> is one of its end tokens, so it never reaches the text; a body cut by max_tokens
    # (or holding no complete JSON value) stays no call
    spec = ToolSpec("weather", "", {"type": "object", "properties": {"city": {"type": "string"}}})
    head = ["<|channel|>", "commentary to=functions.weather", " <|constrain|>", "json", "<|message|>"]
    for body, calls in ((['{"city": ', '"Oslo"}'], 1), (['{"city": ', '"Os'], 0)):
        eng = ThinkingEngine(head + body, template=HARMONY)
        events = asyncio.run(collect(service(eng), chat(tools=[spec], tool_choice="auto")))
        assert len([c for e in events for c in e.tool_calls]) == calls
        assert events[-1].finish_reason == ("tool_calls" if calls else "stop")


@pytest.mark.parametrize("as_special", [True, False])
def test_the_forced_call_grammar_takes_reasoning_a_preamble_then_one_valid_call(demo_dir, as_special):
    import llguidance.hf
    from llguidance import LLMatcher
    from transformers import PreTrainedTokenizerFast

    from sidecar.engine.structured import grammar_for

    tok = PreTrainedTokenizerFast.from_pretrained(demo_dir)
    if as_special:  # gpt-oss's tokenizer: each marker one special token; else they are spelled as text
        tok.add_special_tokens({"additional_special_tokens": list(MARKERS) + ["<|return|>"]})
    special = {m: tok.convert_tokens_to_ids(m) for m in MARKERS} if as_special else {}
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    add = ToolSpec("add", "", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    neg = ToolSpec("neg", "", {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]})
    think = "<|channel|>analysis<|message|>I should add.<|end|><|start|>assistant"
    call = "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}<|call|>"
    said = "<|channel|>commentary<|message|>Adding it up.<|end|><|start|>assistant"
    for choice, text, ok in (
        ("required", think + call.format("add", '{"a": 7}'), True),
        ("required", call.format("neg", '{"x": 1.5}'), True),
        ("function:neg", call.format("neg", '{"x": 2}'), True),
        ("function:neg", call.format("add", '{"a": 7}'), False),  # not the named tool
        ("required", call.format("add", '{"a": "seven"}'), False),  # arguments off the schema
        ("required", call.format("add", '{"a": 7, "b": 1}'), False),  # an undeclared property
        ("required", "<|channel|>final<|message|>No.<|return|>", False),  # an answer, not a call
        ("required", think, False),  # reasoning alone is not a reply
        ("required", think + said + call.format("add", '{"a": 7}'), True),  # a preamble before the call
        ("function:neg", said + call.format("neg", '{"x": 2}'), True),
        ("required", said, False),  # a preamble alone is not a call
        ("required", said + said + call.format("add", '{"a": 7}'), False),  # one preamble
        ("required", said + think + call.format("add", '{"a": 7}'), False),  # reasoning comes first
    ):
        m = LLMatcher(lltok, grammar_for(tool_constraint([add, neg], choice, None, special)))
        ids = tok.encode(text, add_special_tokens=False)
        whole = m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()
        assert whole is ok, (choice, text)

"""Thinking models: the reasoning parser (whatever the chunking), the service's split of reasoning from
the answer and from tool calls, chat_template_kwargs and reasoning_effort reaching the template, and the
OpenAI shapes (message.reasoning_content, delta.reasoning_content, usage reasoning_tokens)."""

from __future__ import annotations

import asyncio
import json
import pathlib
from typing import Any, AsyncIterator

import pytest
from fastapi.testclient import TestClient
from transformers import PreTrainedTokenizerFast

from sidecar.engine.chat_template import encode_chat
from sidecar.engine.request import RequestOutput, SamplingParams
from sidecar.server.openai.api import create_app
from sidecar.engine.structured import Constraint
from sidecar.server.reasoning import ReasoningParser, opens_block, think_first, thinks
from sidecar.server.service import GenerationRequest, ServiceError
from sidecar.server.tools import ToolSpec, tool_constraint
from test_service import ScriptedEngine, collect, service

TEMPLATES = pathlib.Path(__file__).resolve().parents[2] / "templates"
QWEN3 = (TEMPLATES / "qwen3.jinja").read_text()
R1 = (TEMPLATES / "deepseek_r1.jinja").read_text()
REPLY = "<think>\nadd them: 2 + 3\n</think>\n\nThe sum is 5."


def feed(text: str, step: int, opened: bool = False) -> tuple[str, str, ReasoningParser]:
    p = ReasoningParser(opened, lambda ids: [str(i) for i in ids])
    r, c = "", ""
    for i in range(0, len(text), step):
        dr, dc = p.feed(text[i : i + step])
        assert "</" not in dr and "think>" not in dc  # a possible marker is held back, never leaked
        r, c = r + dr, c + dc
    dr, dc = p.finish()
    return r + dr, c + dc, p


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_reasoning_and_answer_split_whatever_the_chunking(step):
    r, c, _ = feed(REPLY, step)
    assert (r, c) == ("\nadd them: 2 + 3\n", "The sum is 5.")


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_replies_without_a_block_opened_prompts_and_unclosed_blocks(step):
    assert feed("Just 5 < 6.", step)[:2] == ("", "Just 5 < 6.")  # no block: all answer
    assert feed("  <thin", step)[:2] == ("", "  <thin")  # a marker that never completes is text
    assert feed("sum it</think>5", step, opened=True)[:2] == ("sum it", "5")  # the prompt opened the block
    assert feed("<think>still going", step)[:2] == ("still going", "")  # cut by max_tokens: reasoning


def test_reasoning_tokens_count_up_to_the_token_that_closes_the_block():
    strs = {1: "<", 2: "think", 3: ">a", 4: "b</", 5: "think>", 6: "ok"}
    p = ReasoningParser(False, lambda ids: [strs[i] for i in ids])
    for i in strs:
        p.feed(strs[i])
    assert p.count_tokens(list(strs)) == 5 and (p.reasoning, p.content) == ("ab", "ok")
    assert p.count_tokens(list(strs) * 40) == 5  # read a slice at a time, stops at the close
    opened = ReasoningParser(False, lambda ids: [strs[i] for i in ids])
    opened.feed("<think>ab")
    assert opened.count_tokens([1, 2, 3, 4]) == 4  # still open: all of it
    plain = ReasoningParser(False, lambda ids: [strs[i] for i in ids])
    plain.feed("ok")
    assert plain.count_tokens([6]) == 0


def test_thinking_templates_are_told_apart_and_open_blocks_seen():
    assert thinks(QWEN3) and thinks(R1) and not thinks("{{ messages }}")
    assert opens_block("<|im_start|>assistant\n<think>\n") and not opens_block("<think>\n\n</think>\n\n")


# -- the service over a scripted engine --------------------------------------------------------------
class ThinkingEngine(ScriptedEngine):
    """Renders with a real chat template (Qwen3's by default) and replies with ``pieces``, one token each."""

    def __init__(self, pieces: list[str], template: str = QWEN3) -> None:
        super().__init__(list(range(1, len(pieces) + 1)), max_model_len=4096)
        self.pieces = pieces
        self.chat_template = template
        self.rendered: list[str] = []
        self.kwargs: list[dict] = []

    def encode_chat(self, messages: list[dict], tools: Any = None, template_kwargs: Any = None) -> list[int]:
        from jinja2 import Environment

        kw = dict(template_kwargs or {})
        self.kwargs.append(kw)
        text = (
            Environment()
            .from_string(self.chat_template)
            .render(messages=messages, tools=tools, add_generation_prompt=True, **kw)
        )
        self.rendered.append(text)
        return [ord(c) for c in text]

    async def compile_grammar(self, c: Any) -> None:  # the tool grammar is checked by the real engine
        return None

    def token_strings(self, ids: list[int]) -> list[str]:
        return [chr(i) if i > len(self.pieces) else self.pieces[i - 1] for i in ids]

    async def generate(self, prompt: list[int], params: SamplingParams, **kw: Any) -> AsyncIterator:
        self.calls.append((prompt, params))
        for n in range(1, len(self.pieces) + 1):
            await asyncio.sleep(0)
            done = n == len(self.pieces)
            yield RequestOutput(
                kw["request_id"],
                None,
                prompt,
                list(range(1, n + 1)),
                "".join(self.pieces[:n]),
                [n],
                self.pieces[n - 1],
                done,
                "stop" if done else None,
            )


PIECES = ["<think>", "\nplan", " <tool_call>{}</tool_call>", "\n", "</think>", "\n\n", "Five", "."]


def chat(**kw: Any) -> GenerationRequest:
    return GenerationRequest(messages=[{"role": "user", "content": "2+3?"}], params=SamplingParams(), **kw)


def test_service_splits_reasoning_counts_its_tokens_and_keeps_the_answer():
    eng = ThinkingEngine(PIECES)
    events = asyncio.run(collect(service(eng), chat()))
    last = events[-1]
    assert last.reasoning_text == "\nplan <tool_call>{}</tool_call>\n" and last.text == "Five."
    assert "".join(e.reasoning_delta for e in events) == last.reasoning_text
    assert "".join(e.delta_text for e in events) == "Five."
    assert last.reasoning_tokens == 5 and last.completion_tokens == len(PIECES)


def test_a_tool_call_inside_reasoning_is_not_a_call_one_after_it_is():
    call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    eng = ThinkingEngine(["<think>", "try " + call, "</think>", "\n", call])
    spec = ToolSpec("add", "", {"type": "object", "properties": {"a": {"type": "integer"}}})
    events = asyncio.run(collect(service(eng), chat(tools=[spec], tool_choice="auto")))
    calls = [c for e in events for c in e.tool_calls]
    assert events[-1].reasoning_text == "try " + call
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("add", {"a": 1})]
    assert events[-1].finish_reason == "tool_calls" and events[-1].text == ""


def test_reasoning_effort_and_template_kwargs_reach_the_template():
    eng = ThinkingEngine(["Five."])
    svc = service(eng)
    asyncio.run(collect(svc, chat(reasoning_effort="none")))
    asyncio.run(collect(svc, chat(reasoning_effort="high")))
    asyncio.run(collect(svc, chat(chat_template_kwargs={"enable_thinking": False}, reasoning_effort="high")))
    assert eng.kwargs == [{"enable_thinking": False}, {"enable_thinking": True}, {"enable_thinking": False}]
    assert eng.rendered[0].endswith("<think>\n\n</think>\n\n") and eng.rendered[1].endswith("assistant\n")
    last = asyncio.run(collect(svc, chat(reasoning_effort="minimal")))[-1]
    assert (last.text, last.reasoning_text, last.reasoning_tokens) == ("Five.", "", 0)


def test_a_prompt_that_opens_the_block_makes_the_reply_start_in_reasoning():
    eng = ThinkingEngine(["sum", "</think>", "5"], template=R1)
    last = asyncio.run(collect(service(eng), chat()))[-1]
    assert (last.reasoning_text, last.text, last.reasoning_tokens) == ("sum", "5", 2)


def test_a_model_that_does_not_think_passes_text_through_and_ignores_the_effort():
    eng = ThinkingEngine(["<think>", "x"], template="{% for m in messages %}{{ m.content }}{% endfor %}")
    last = asyncio.run(collect(service(eng), chat(reasoning_effort="low")))[-1]
    assert (last.text, last.reasoning_text) == ("<think>x", "") and eng.kwargs == [{}]


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        (
            {"chat_template_kwargs": {"add_generation_prompt": False}},
            "chat_template_kwargs.add_generation_prompt",
        ),
        ({"chat_template_kwargs": {"x": "y" * 5000}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ],
)
def test_bad_reasoning_fields_are_refused_naming_them(kw, field):
    eng = ThinkingEngine(["x"])
    with pytest.raises(ServiceError) as e:
        asyncio.run(collect(service(eng), chat(**kw)))
    assert e.value.code == "invalid_argument" and e.value.field == field and eng.calls == []


def test_the_real_tokenizer_renders_the_thinking_switch(demo_dir):
    tok = PreTrainedTokenizerFast.from_pretrained(demo_dir)
    tok.chat_template = QWEN3
    msgs = [{"role": "user", "content": "hi"}]
    on, off = encode_chat(tok, msgs), encode_chat(tok, msgs, template_kwargs={"enable_thinking": False})
    assert tok.decode(off[len(on) :]) == "<think>\n\n</think>\n\n" and off[: len(on)] == on


# -- OpenAI shapes over HTTP -------------------------------------------------------------------------
def test_http_reasoning_content_streaming_deltas_usage_and_the_unsupported_header():
    eng = ThinkingEngine(PIECES)
    svc = service(eng)
    client = TestClient(create_app(svc))
    body = {"messages": [{"role": "user", "content": "2+3?"}], "max_tokens": 20}
    r = client.post("/v1/chat/completions", json=dict(body, reasoning_effort="medium"))
    msg = r.json()["choices"][0]["message"]
    assert msg == {
        "role": "assistant",
        "content": "Five.",
        "reasoning_content": "\nplan <tool_call>{}</tool_call>\n",
    }
    assert r.json()["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}
    assert "x-sidecar-reasoning" not in r.headers  # this model thinks
    r = client.post(
        "/v1/chat/completions", json=dict(body, stream=True, stream_options={"include_usage": True})
    )
    chunks = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == "Five."
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}
    eng.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    r = client.post("/v1/chat/completions", json=dict(body, reasoning_effort="low"))
    assert r.status_code == 200 and r.headers["x-sidecar-reasoning"] == "unsupported"
    r = client.post("/v1/chat/completions", json=dict(body, reasoning_effort="max"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


# -- output constraints on thinking models -------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CONSTRAINTS = [
    (lambda: Constraint("json", SCHEMA), '{"a": 12}', '{"b": 1}'),
    (lambda: Constraint("regex", "[0-9]{2}/x"), "42/x", "4x"),
    (lambda: Constraint("choice", ["yes", "no"]), "no", "maybe"),
    (
        lambda: tool_constraint([ToolSpec("add", "", SCHEMA)], "required", False, None),
        '<tool_call>{"name": "add", "arguments": {"a": 3}}</tool_call>',
        '<tool_call>{"name": "sub", "arguments": {"a": 3}}</tool_call>',
    ),
]


@pytest.mark.parametrize("opened", [True, False])
@pytest.mark.parametrize("make, good, bad", CONSTRAINTS)
def test_a_constraint_lets_the_think_block_come_first(opened, make, good, bad, demo_dir):
    import llguidance.hf
    from llguidance import LLMatcher

    from sidecar.engine.structured import grammar_for

    tok = PreTrainedTokenizerFast.from_pretrained(demo_dir)
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    grammar = grammar_for(think_first(make(), opened))
    block = ("" if opened else "<think>") + "plan: <tool_call> {x} </think\n</think>\n\n"

    def walk(text: str) -> tuple[bool, bool]:  # (every token allowed, the grammar may end there)
        m = LLMatcher(lltok, grammar)
        ids = tok.encode(text, add_special_tokens=False)
        ok = m.validate_tokens(ids) == len(ids)
        return ok, ok and m.consume_tokens(ids) and m.is_accepting()

    assert walk(block + good) == (True, True)
    assert walk(block + bad)[1] is False  # the answer still follows the constraint
    assert walk(good) == ((True, False) if opened else (True, True))  # an opened block must close first


def test_the_service_wraps_a_thinking_models_constraint_and_splits_the_reply():
    eng = ThinkingEngine(["plan", "</think>", '{"a": 1}'], template=R1)
    req = chat()
    req.params = SamplingParams(structured=Constraint("json", SCHEMA).with_origin("response_format"))
    last = asyncio.run(collect(service(eng), req))[-1]
    sent = eng.calls[0][1].structured
    assert sent.kind == "lark" and "THINK_" in sent.value and sent.origin == "response_format"
    assert (last.reasoning_text, last.text) == ("plan", '{"a": 1}')
    lazy = ThinkingEngine(["x"])  # Qwen3: the block is optional; a lazy tool grammar is left as it is
    spec = ToolSpec("add", "", SCHEMA)
    asyncio.run(collect(service(lazy), chat(tools=[spec], tool_choice="auto")))
    assert "THINK_" not in lazy.calls[0][1].structured.value
    whole = ThinkingEngine(["<think>", "a", "</think>", "b"])  # a constraint that writes the block itself
    req = chat()
    req.params = SamplingParams(structured=Constraint("regex", "<think>[a-z]</think>[a-z]"))
    last = asyncio.run(collect(service(whole), req))[-1]
    assert whole.calls[0][1].structured.kind == "regex" and (last.reasoning_text, last.text) == ("a", "b")

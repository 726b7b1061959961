"""Where a tool-call reply ends: the grammar's end rules (``open_end``, ``end_on_repeat``) on real matchers,
the sampler turning a refused token into the end where the grammar may end, and the default model
(SmolLM2-135M-Instruct) ending a required-call reply after its call instead of repeating it."""

from __future__ import annotations

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.engine.grammar_state import GrammarState
from sidecar.engine.request import Request
from sidecar.engine.structured import Constraint
from sidecar.server.tools import (
    ToolSpec,
    default_tool_max_tokens,
    parse_tool_calls,
    render_messages,
    tool_constraint,
)

ADD = ToolSpec("add", "", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
CALL_1 = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
CALL_2 = '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'


@pytest.fixture(scope="module")
def demo(demo_dir):
    return LLM(model=str(demo_dir), dtype="float32")


def _state(llm: LLM, c: Constraint) -> GrammarState:
    sd = llm.engine.structured
    return GrammarState(sd.compiled(c).deep_copy(), c.lazy_trigger, c.open_end, c.end_on_repeat)


def _feed(llm: LLM, g: GrammarState, text: str) -> None:
    lltok = llm.engine.structured._tokenizer()
    for t in llm.engine.tokenizer.encode(text, add_special_tokens=False):
        assert g.matcher.consume_token(t), text
        g.advance(lltok.decode_bytes([t]))


def test_units_are_calls_and_a_repeat_ends_the_output(demo):
    g = _state(demo, tool_constraint([ADD], "required", True, None))
    assert not g.open_here()  # a call is required: masked from the first token
    _feed(demo, g, CALL_1)
    assert g.open_here() and not g.needs_mask() and not g.ended  # the model decides: another call or the end
    _feed(demo, g, "\n")
    assert g.open_here() and g.unit is None  # the separator belongs to no unit
    _feed(demo, g, CALL_2)
    assert not g.ended and g.units == {CALL_1.encode(), CALL_2.encode()}
    _feed(demo, g, "\n" + CALL_1[:-3])
    assert not g.ended and g.needs_mask()  # not a unit until the call is complete
    _feed(demo, g, CALL_1[-3:])
    assert g.ended


def test_without_the_rules_the_grammar_is_masked_where_it_may_end(demo):
    c = tool_constraint([ADD], "required", True, None)
    g = _state(demo, Constraint(c.kind, c.value))
    _feed(demo, g, CALL_1 + "\n" + CALL_1)
    assert g.needs_mask() and not g.open_here() and not g.ended


def test_a_token_refused_where_an_open_grammar_may_end_becomes_the_end(demo):
    eng = demo.engine
    sd = eng.structured
    tok = eng.tokenizer
    x, comma, q = (tok.encode(s, add_special_tokens=False)[0] for s in ("x", ",", "Q"))
    for open_end, expect_end in ((True, True), (False, False)):
        req = Request(
            f"open-{open_end}",
            [1, 2, 3],
            SamplingParams(structured=Constraint("lark", 'start: "x" ("," "x")*', open_end=open_end)),
        )
        sd.attach(req.request_id, req.params.structured)
        try:

            def step(favoured: int) -> int:
                logits = torch.zeros(1, eng.vocab_size)
                logits[0, comma] = 1.0  # the grammar's choice under a mask where it may go on or end
                logits[0, favoured] = 100.0
                return sd.sample(eng.sampler, logits, [req], sd.start_masks([req.request_id]))[0][0]

            assert step(q) == x  # not where the grammar may end: masked as always
            assert (sd.start_masks([req.request_id]) is None) == open_end  # may end here: unmasked if open
            assert step(comma) == comma  # the model's own choice, allowed: it goes on
            assert step(q) == x
            got = step(q)  # refused where the grammar may end
            assert (got in eng.eos_token_ids) == expect_end and (got == comma) != expect_end
        finally:
            sd.release(req.request_id)


@pytest.fixture(scope="module")
def smollm2():
    return LLM(kv_cache_memory_gb=0.1, max_num_seqs=4)


WEATHER = ToolSpec(
    "get_weather",
    "Get the current weather in a city.",
    {"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"},
)  # LangChain's


def _prompt(llm: LLM, question: str) -> list[int]:
    msgs, _ = render_messages([{"role": "user", "content": question}], [WEATHER], False)
    return llm.engine.encode_chat(msgs)


def test_default_model_ends_a_required_reply_after_its_call(smollm2):
    prompts = [
        _prompt(smollm2, q)
        for q in ("What is the weather in Paris?", "Weather in Tokyo please", "Is it raining in London?")
    ]
    for parallel in (True, False):
        c = tool_constraint([WEATHER], "required", parallel, None)
        params = SamplingParams(max_tokens=default_tool_max_tokens("required", parallel), structured=c)
        for out in smollm2.generate(prompts, params):
            content, calls = parse_tool_calls(out.text)
            assert out.finish_reason == "stop" and content == "", out.text
            assert len(calls) == 1 and calls[0]["name"] == "get_weather", out.text


def test_default_model_forced_to_go_on_stops_at_its_first_repeated_call(smollm2):
    # A grammar that makes a newline commit to another call (no open end): the model repeats its call;
    # the repeat rule ends the output right after the first repeat.
    c = tool_constraint([WEATHER], "required", True, None)
    forced = Constraint("lark", c.value.replace(' "\\n"?', ""), end_on_repeat=True)
    out = smollm2.generate(
        [_prompt(smollm2, "What is the weather in Paris?")], SamplingParams(max_tokens=400, structured=forced)
    )[0]
    first = out.text.split("\n")[0]
    assert out.finish_reason == "stop" and out.text == first + "\n" + first, out.text
    content, calls = parse_tool_calls(out.text)
    assert len(calls) == 1 and content == ""

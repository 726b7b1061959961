"""Guided decoding in the engine (demo model, random weights): every output follows its constraint,
grammar state is per request, freed on finish/abort, survives preemption, and costs nothing when
no request in the batch is constrained."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.config import EngineConfig
from sidecar.engine.engine import LLMEngine
from sidecar.engine.request import Request
from sidecar.engine.structured import Constraint
from sidecar.server.tools import ToolSpec, parse_tool_calls, tool_constraint

# Bounded everywhere (string lengths, numbers, array sizes) so random weights finish well within max_tokens.
HIDDEN = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 10000},
        "name": {"type": "string", "maxLength": 10},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"active": {"type": "boolean"}, "role": {"enum": ["admin", "user"]}},
            "required": ["active", "role"],
            "additionalProperties": False,
        },
        "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 6}]},
    },
    "required": ["id", "name", "score", "tags", "owner", "note"],
    "additionalProperties": False,
}
WEATHER = ToolSpec(
    "get_weather",
    "weather",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
)
ADD = ToolSpec(
    "add",
    "",
    {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a"],
        "additionalProperties": False,
    },
)
TOOL_SCHEMAS = {"get_weather": WEATHER.parameters, "add": ADD.parameters}


@pytest.fixture(scope="module")
def llm(demo_dir):
    return LLM(model=str(demo_dir), dtype="float32")


def pool_whole(engine: LLMEngine) -> bool:
    return (
        not engine.requests
        and not engine.structured.registry
        and engine.kv.num_free_blocks() == engine.kv.num_blocks
    )


def test_hundred_requests_with_a_hidden_schema_all_validate(llm):
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=i, structured=HIDDEN) for i in range(100)]
    outs = llm.generate([f"record {i}:" for i in range(100)], params)
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), HIDDEN)
    assert len({o.text for o in outs}) > 50  # sampled, so the grammar did not force one answer
    assert pool_whole(llm.engine)


def test_choice_regex_and_json_object(llm):
    outs = llm.generate(
        ["a", "b", "c"],
        [
            SamplingParams(max_tokens=10, structured=["alpha", "beta", "gamma"]),
            SamplingParams(max_tokens=20, structured=r"[0-9]{3}-[a-z]{2}"),
            SamplingParams(max_tokens=300, temperature=0.8, seed=3, structured=Constraint("json_object")),
        ],
    )
    assert outs[0].text in ("alpha", "beta", "gamma") and outs[0].finish_reason == "stop"
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[1].text)
    if outs[2].finish_reason == "stop":
        assert isinstance(json.loads(outs[2].text), dict)
    else:
        assert outs[2].text.startswith("{")


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_always_gives_schema_valid_arguments(llm, parallel):
    c = tool_constraint([WEATHER, ADD], "required", parallel, None)
    params = [SamplingParams(max_tokens=150, temperature=1.0, seed=i, structured=c) for i in range(20)]
    for o in llm.generate([f"call {i}" for i in range(20)], params):
        text = o.text
        if o.finish_reason == "length":  # max_tokens cut a further call short: the complete ones are checked
            text = text[: text.rfind("<tool_call")]
        content, calls = parse_tool_calls(text)
        assert calls and content.strip() == "", o.text
        assert parallel or len(calls) == 1
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), TOOL_SCHEMAS[call["name"]])


def test_named_tool_choice_calls_that_tool(llm):
    c = tool_constraint([WEATHER, ADD], "function:add", True, None)
    for o in llm.generate(["x", "y"], SamplingParams(max_tokens=60, temperature=1.0, seed=5, structured=c)):
        _, calls = parse_tool_calls(o.text)
        assert [x["name"] for x in calls] == ["add"]


def test_auto_tool_choice_is_lazy_and_any_call_is_valid(llm):
    eng = llm.engine
    c = tool_constraint([WEATHER], "auto", True, None)
    before = eng.structured.num_masks
    gen_before = eng.counters["generation_tokens"]
    outs = llm.generate(
        [f"chat {i}" for i in range(8)], SamplingParams(max_tokens=60, temperature=1.0, seed=11, structured=c)
    )
    generated = eng.counters["generation_tokens"] - gen_before
    # Free text is checked token by token, masked only where a call marker may be forming.
    assert eng.structured.num_masks - before < generated
    for o in outs:
        content, calls = parse_tool_calls(o.text)
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), WEATHER.parameters)
        if o.finish_reason == "stop":
            assert "<tool_call>" not in content


def test_a_lazily_checked_token_the_grammar_refuses_is_resampled_under_the_mask(llm):
    eng = llm.engine
    sd = eng.structured
    req = Request(
        "lazy-1",
        [1, 2, 3],
        SamplingParams(structured=Constraint("lark", "start: /[a-z]*/", lazy_trigger="<")),
    )
    sd.attach(req.request_id, req.params.structured)
    try:
        upper = eng.tokenizer.encode("Q", add_special_tokens=False)[0]
        logits = torch.zeros(1, eng.vocab_size)
        logits[0, upper] = 100.0  # the unmasked choice is outside the grammar
        assert sd.start_masks([req.request_id]) is None  # lazy: no mask before the trigger
        resampled = sd.num_resampled
        ids, _ = sd.sample(eng.sampler, logits, [req], None)
        assert ids[0] != upper and sd.num_resampled == resampled + 1
        assert re.fullmatch(r"[a-z]*", eng.tokenizer.decode(ids)) or ids[0] in eng.eos_token_ids
    finally:
        sd.release(req.request_id)


def test_grammar_state_survives_preemption(demo_dir):
    prompts = [f"order number {i} with a long description of the customer's request" for i in range(12)]
    # Greedy: the same text with or without preemption. No free-length numbers: greedy may repeat digits.
    schema = {k: v for k, v in HIDDEN.items() if k != "properties" and k != "required"}
    schema["properties"] = {k: v for k, v in HIDDEN["properties"].items() if k != "score"}
    schema["required"] = [k for k in HIDDEN["required"] if k != "score"]
    params = SamplingParams(max_tokens=120, structured=schema)
    roomy = LLM(model=str(demo_dir), dtype="float32", block_size=8, num_kv_blocks=512)
    tight = LLM(model=str(demo_dir), dtype="float32", block_size=8, num_kv_blocks=24)
    ref = roomy.generate(prompts, params)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.text for o in outs] == [o.text for o in ref]
    for o in outs:
        jsonschema.validate(json.loads(o.text), schema)
    assert pool_whole(tight.engine)


def test_grammar_state_is_freed_on_abort_and_on_rejection(demo_dir):
    eng = LLMEngine(EngineConfig(model=str(demo_dir), num_kv_blocks=64))
    eng.add_request("a", "hello", SamplingParams(max_tokens=50, structured=HIDDEN))
    eng.add_request("b", "hello", SamplingParams(max_tokens=50, structured=["x", "y"]))
    assert set(eng.structured.registry) == {"a", "b"}
    eng.step()
    eng.abort("a")
    while eng.has_unfinished_requests():
        eng.step()
    assert pool_whole(eng)
    with pytest.raises(ValueError, match="^structured: "):
        eng.add_request("c", "hello", SamplingParams(structured={"type": "object", "minProperties": "two"}))
    with pytest.raises(ValueError, match="^structured: "):
        SamplingParams(structured=42)
    assert pool_whole(eng) and "c" not in eng.requests


def test_unconstrained_batches_compute_no_masks(llm):
    eng = llm.engine
    before = eng.structured.num_masks
    llm.generate(["free text", "more free text"], SamplingParams(max_tokens=8))
    assert eng.structured.num_masks == before
    assert eng.structured.start_masks(["any"]) is None  # empty registry: one check, nothing else


def test_masks_on_the_worker_thread_equal_masks_computed_inline(llm):
    sd = llm.engine.structured
    prompts = [f"row {i}" for i in range(4)]
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=2, structured=HIDDEN)
    saved = sd.overlap
    try:
        sd.overlap = False
        inline = [(o.text, o.finish_reason) for o in llm.generate(prompts, params)]
        sd.overlap = True  # what an accelerator-backed runner uses
        overlapped = [(o.text, o.finish_reason) for o in llm.generate(prompts, params)]
    finally:
        sd.overlap = saved
    assert inline == overlapped
    done = [t for t, reason in inline if reason == "stop"]  # a long number may run into max_tokens
    assert done
    for t in done:
        jsonschema.validate(json.loads(t), HIDDEN)

"""Grammar work cannot stall the server or pass for a valid answer: checked off the event loop, once per
distinct constraint, within a size budget; compiled once per content in the engine; a grammar that breaks
while decoding ends its request with an error, never with "stop"."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
from fastapi.testclient import TestClient

from sidecar import SamplingParams
from sidecar.config import EngineConfig
from sidecar.engine.engine import LLMEngine
from sidecar.engine import grammar_compile
from sidecar.engine.async_engine import AsyncEngine
from sidecar.engine.request import FinishReason
from sidecar.engine.structured import Constraint
from sidecar.server import structured_check
from sidecar.server.openai.api import create_app
from sidecar.server.structured_check import MAX_CONSTRAINT_CHARS, check_constraint
from sidecar.server.validation import ServiceError
from test_openai_support import FakeService

SCHEMA = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}


def wide_schema(n: int) -> dict:
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {f"k{i}": {"type": "integer"}},
                "required": [f"k{i}"],
                "additionalProperties": False,
            }
            for i in range(n)
        ]
    }


@pytest.fixture
def compiles(monkeypatch):
    """Per compile: whether it ran on a thread with a running event loop."""
    seen: list[bool] = []
    real = structured_check._verdict

    def verdict(c):
        try:
            asyncio.get_running_loop()
            seen.append(True)
        except RuntimeError:
            seen.append(False)
        return real(c)

    monkeypatch.setattr(structured_check, "_verdict", verdict)
    structured_check._verdicts.clear()
    return seen


def test_http_checks_a_schema_once_for_n_choices_and_off_the_event_loop(compiles):
    svc = FakeService()
    client = TestClient(create_app(svc))
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "n": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
    }
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert len(svc.requests) == 4 and all(r.params.structured.value == SCHEMA for r in svc.requests)
    assert compiles == [False]  # four choices, one compile, on a worker thread (no event loop there)
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert len(compiles) == 1  # the same schema again: remembered


def test_a_constraint_over_the_size_budget_is_refused_naming_the_field_before_compiling(compiles):
    big = wide_schema(3000)
    with pytest.raises(ServiceError) as err:
        check_constraint(Constraint("json", big), "guided_json")
    assert err.value.field == "guided_json" and str(MAX_CONSTRAINT_CHARS) in err.value.message
    assert compiles == []
    client = TestClient(create_app(FakeService()))
    r = client.post("/v1/completions", json={"model": "demo", "prompt": "x", "guided_json": big})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json"


def test_a_bad_grammar_is_refused_and_the_verdict_remembered(compiles):
    for _ in range(3):
        with pytest.raises(ServiceError) as err:
            check_constraint(Constraint("regex", "(unclosed"), "guided_regex")
        assert err.value.field == "guided_regex"
    assert len(compiles) == 1


@pytest.fixture(scope="module")
def engine(demo_dir):
    return LLMEngine(EngineConfig(model=str(demo_dir), num_kv_blocks=64))


def run_all(eng: LLMEngine) -> dict:
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


def test_the_engine_compiles_one_grammar_for_many_requests(engine):
    sd = engine.structured
    sd.compiler.clear()
    before = sd.compiler.num_compiled
    params = SamplingParams(max_tokens=12, structured=SCHEMA)
    for i in range(4):
        engine.add_request(f"same{i}", "hello", params)
    assert len(sd.compiler) == 1 and sd.compiler.num_compiled == before + 1
    assert len({id(sd.registry[f"same{i}"].matcher) for i in range(4)}) == 4  # each request its own state
    outs = run_all(engine)
    assert {o.finish_reason for o in outs.values()} <= {"stop", "length"}
    assert not engine.requests and not sd.registry and not sd.failed


def test_rows_in_one_grammar_state_share_one_mask_per_step(engine):
    sd = engine.structured
    masks, steps = sd.num_masks, engine.counters["num_steps"]
    for i in range(4):  # greedy, one prompt: the four rows stay in one state
        engine.add_request(f"greedy{i}", "hello", SamplingParams(max_tokens=8, structured=SCHEMA))
    outs = run_all(engine)
    assert len({tuple(o.token_ids) for o in outs.values()}) == 1
    assert sd.num_masks - masks == engine.counters["num_steps"] - steps  # one mask per step, not four
    masks, steps = sd.num_masks, engine.counters["num_steps"]
    for i in range(4):  # sampled with their own seeds: the rows part ways, and so do their masks
        engine.add_request(
            f"seeded{i}", "hello", SamplingParams(max_tokens=8, structured=SCHEMA, temperature=1.0, seed=i)
        )
    outs = run_all(engine)
    assert len({tuple(o.token_ids) for o in outs.values()}) > 1
    assert sd.num_masks - masks > engine.counters["num_steps"] - steps
    for o in outs.values():  # each still inside the grammar (a valid prefix, or the whole of it)
        assert sd.compiled(Constraint("json", SCHEMA)).deep_copy().consume_tokens(o.token_ids)


BREAKING = pytest.mark.parametrize(
    "structured", ["(x{1000}){1000}", wide_schema(2500)], ids=["regex", "anyOf"]
)


@BREAKING
def test_a_grammar_that_breaks_its_limits_on_the_first_tokens_is_refused_before_decoding(engine, structured):
    for _ in range(2):  # the second time from the remembered verdict
        with pytest.raises(ValueError, match="^structured: cannot be enforced: "):
            engine.add_request("refused", "hello", SamplingParams(max_tokens=40, structured=structured))
        assert not engine.requests and not engine.structured.registry
    assert engine.kv.num_free_blocks() == engine.kv.num_blocks


def test_a_grammar_over_the_compile_budget_is_refused(engine, monkeypatch):
    monkeypatch.setattr(grammar_compile, "COMPILE_BUDGET_S", -1.0)
    engine.structured.compiler.clear()
    with pytest.raises(ValueError, match="^structured: too complex: compiling it took"):
        engine.add_request("costly", "hello", SamplingParams(max_tokens=4, structured=SCHEMA))
    monkeypatch.undo()
    engine.structured.compiler.clear()
    assert engine.structured.compiled(Constraint("json", SCHEMA)) is not None


@BREAKING
def test_a_grammar_that_breaks_while_decoding_ends_with_an_error_not_stop(engine, structured, monkeypatch):
    monkeypatch.setattr(grammar_compile, "PROBE_TOKENS", 0)  # no walk: the break happens while decoding
    engine.structured.compiler.clear()
    engine.add_request("broken", "hello", SamplingParams(max_tokens=40, structured=structured))
    out = run_all(engine)["broken"]
    engine.structured.compiler.clear()
    assert out.finish_reason == FinishReason.ABORT
    assert out.abort_reason.startswith("error: structured: cannot be enforced: ")
    assert not engine.requests and not engine.structured.registry and not engine.structured.failed
    assert engine.kv.num_free_blocks() == engine.kv.num_blocks


def test_grammars_compile_on_a_thread_below_the_step_loops_priority(engine):
    ae = AsyncEngine(engine)  # not started: only its grammar thread is used
    try:
        nice = ae._grammar_pool.submit(
            lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        ).result()
        assert nice > os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        asyncio.run(
            ae.compile_grammar(Constraint("json", SCHEMA))
        )  # compiled there, the engine's cache holds it
        with pytest.raises(ValueError, match="^structured: cannot be enforced"):
            asyncio.run(ae.compile_grammar(Constraint("regex", "(x{1000}){1000}")))
    finally:
        ae._grammar_pool.shutdown()

"""Grammar work cannot stall the server or pass for a valid answer: checked off the event loop, once per
distinct constraint, within a size budget; compiled once per content in the engine; a grammar that breaks
while decoding ends its request with an error, never with "stop"."""
from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from sidecar import SamplingParams
from sidecar.config import EngineConfig
from sidecar.engine.engine import LLMEngine
from sidecar.engine.request import FinishReason
from sidecar.engine.structured import Constraint
from sidecar.server import structured_check
from sidecar.server.openai.api import create_app
from sidecar.server.structured_check import MAX_CONSTRAINT_CHARS, check_constraint
from sidecar.server.validation import ServiceError
from test_openai_support import FakeService

SCHEMA = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}


def wide_schema(n: int) -> dict:
    return {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"],
                       "additionalProperties": False} for i in range(n)]}


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
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}
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
    sd._compiled.clear()
    params = SamplingParams(max_tokens=12, structured=SCHEMA)
    for i in range(4):
        engine.add_request(f"same{i}", "hello", params)
    assert len(sd._compiled) == 1
    assert len({id(sd.registry[f"same{i}"].matcher) for i in range(4)}) == 4  # each request its own state
    outs = run_all(engine)
    assert {o.finish_reason for o in outs.values()} <= {"stop", "length"}
    assert not engine.requests and not sd.registry and not sd.failed


@pytest.mark.parametrize("structured", ["(x{1000}){1000}", wide_schema(2500)], ids=["regex", "anyOf"])
def test_a_grammar_that_breaks_while_decoding_ends_with_an_error_not_stop(engine, structured):
    engine.add_request("broken", "hello", SamplingParams(max_tokens=40, structured=structured))
    out = run_all(engine)["broken"]
    assert out.finish_reason == FinishReason.ABORT
    assert out.abort_reason.startswith("error: structured: cannot be enforced: ")
    assert not engine.requests and not engine.structured.registry and not engine.structured.failed
    assert engine.kv.num_free_blocks() == engine.kv.num_blocks

"""OpenAI adapter over a fake service: translation, validation, errors, streaming, disconnects."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from sidecar.server.openai.api import HttpSettings, create_app
from sidecar.server.validation import ServiceError
from test_openai_support import FakeService, asgi_call, expected_text


@pytest.fixture
def svc() -> FakeService:
    return FakeService()


@pytest.fixture
def client(svc: FakeService) -> TestClient:
    return TestClient(create_app(svc))


def chat_body(**kw):
    return {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **kw}


def sse_events(text: str) -> list:
    lines = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_chat_unary_shape_usage_and_cache_header(client, svc):
    svc.cache_status = "miss"
    r = client.post("/v1/chat/completions", json=chat_body(seed=5))
    assert r.status_code == 200
    assert r.headers["x-sidecar-cache"] == "miss"
    d = r.json()
    assert d["object"] == "chat.completion" and d["model"] == "demo"
    assert d["choices"][0]["message"] == {"role": "assistant", "content": expected_text(5, 3)}
    assert d["choices"][0]["finish_reason"] == "length"
    assert d["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 3,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    [req] = svc.requests
    assert req.messages == [{"role": "user", "content": "hi"}] and req.params.seed == 5


def test_chat_translation_of_sampling_fields_and_roles(client, svc):
    body = chat_body(
        temperature=0.7,
        top_p=0.9,
        top_k=-1,
        min_p=0.1,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        stop="END",
        max_tokens=None,
        max_completion_tokens=2,
        priority=3,
        cache_control="skip",
        cache_salt="s",
        speculative=False,
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ],
    )
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    [req] = svc.requests
    p = req.params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.7, 0.9, 0, 0.1, 1.1)
    assert (p.presence_penalty, p.frequency_penalty, p.stop, p.max_tokens) == (0.5, -0.5, ["END"], 2)
    assert (req.priority, req.cache_control, req.cache_salt, req.model) == (3, "skip", "s", "demo")
    assert p.speculative is False  # the per-request opt-out of speculative decoding
    assert req.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}]


def test_default_max_tokens_chat_uses_context_completions_use_16(client, svc):
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    client.post("/v1/completions", json={"prompt": "x"})
    assert [r.params.max_tokens for r in svc.requests] == [40, 16]


def test_n_choices_run_with_distinct_seeds(client, svc):
    r = client.post("/v1/chat/completions", json=chat_body(n=3, seed=10, temperature=1.0))
    d = r.json()
    assert [c["index"] for c in d["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in d["choices"]] == [expected_text(s, 3) for s in (10, 11, 12)]
    assert sorted(q.params.seed for q in svc.requests) == [10, 11, 12]
    # prompt tokens count once, completions add up
    assert d["usage"]["prompt_tokens"] == 2 and d["usage"]["completion_tokens"] == 9


def test_completions_batch_of_prompts_and_token_ids(client, svc):
    r = client.post("/v1/completions", json={"prompt": ["ab", "cde"], "n": 2, "seed": 1, "max_tokens": 2})
    d = r.json()
    assert d["object"] == "text_completion"
    assert [c["text"] for c in d["choices"]] == [expected_text(s, 2) for s in (1, 2, 1, 2)]
    assert [q.prompt for q in svc.requests] == ["ab", "ab", "cde", "cde"]
    assert d["usage"]["prompt_tokens"] == 5 and d["usage"]["completion_tokens"] == 8
    svc.requests.clear()
    client.post("/v1/completions", json={"prompt": [[1, 2], [3]], "max_tokens": 1})
    client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1})
    assert [q.prompt_token_ids for q in svc.requests] == [[1, 2], [3], [5, 6, 7]]


@pytest.mark.parametrize(
    "field,value",
    [
        ("prediction", {"type": "content", "content": "x"}),
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("audio", {"voice": "x"}),
    ],
)
def test_unsupported_chat_fields_are_refused_by_name(client, svc, field, value):
    r = client.post("/v1/chat/completions", json=chat_body(**{field: value}))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and err["code"] == "unsupported_parameter"
    assert svc.requests == []


@pytest.mark.parametrize("field,value", [("echo", True), ("suffix", "x"), ("best_of", 2), ("best_of", True)])
def test_unsupported_completion_fields_are_refused_by_name(client, field, value):
    r = client.post("/v1/completions", json={"prompt": "x", field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_every_unknown_or_unsupported_field_is_named(client):
    err = client.post(
        "/v1/chat/completions", json=chat_body(functions=[{"name": "f"}], audio={"voice": "x"}, echo=False)
    ).json()["error"]
    assert err["message"] == "functions, audio: not supported by this server" and err["param"] == "functions"
    err = client.post("/v1/completions", json={"prompt": "x", "tempreature": 1, "max_token": 2}).json()[
        "error"
    ]
    assert err["message"] == "tempreature, max_token: unknown fields" and err["param"] == "tempreature"


def test_logit_bias_reaches_the_sampling_params_of_chat_and_completions(client, svc):
    assert (
        client.post("/v1/chat/completions", json=chat_body(logit_bias={"5": 2.5, "7": -100})).status_code
        == 200
    )
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "logit_bias": {"9": 100}})
    assert r.status_code == 200
    assert [q.params.logit_bias for q in svc.requests] == [{5: 2.5, 7: -100.0}, {9: 100.0}]


@pytest.mark.parametrize(
    "bias, words",
    [
        ({"x": 1}, "keys must be token ids"),
        ({"-3": 1}, "keys must be token ids"),
        ({"5": 101}, "must be in [-100, 100]"),
        ({"5": "1"}, "logit_bias"),
        ({str(i): 1 for i in range(1025)}, "at most 1024 entries"),
    ],
)
def test_invalid_logit_bias_is_400_naming_the_field(client, svc, bias, words):
    for path, body in (
        ("/v1/chat/completions", chat_body(logit_bias=bias)),
        ("/v1/completions", {"prompt": "x", "logit_bias": bias}),
    ):
        r = client.post(path, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"].startswith("logit_bias") and words in err["message"]
    assert svc.requests == []


def test_feature_off_values_of_unsupported_fields_are_accepted(client):
    r = client.post(
        "/v1/chat/completions",
        json=chat_body(tools=[], logit_bias={}, response_format={"type": "text"}, tool_choice="none"),
    )
    assert r.status_code == 200
    r = client.post("/v1/completions", json={"prompt": "x", "echo": False, "best_of": 1, "max_tokens": 1})
    assert r.status_code == 200


@pytest.mark.parametrize(
    "body,param",
    [
        (chat_body(temperature=-1), "temperature"),
        (chat_body(temperature="1"), "temperature"),
        (chat_body(n=0), "n"),
        (chat_body(max_tokens=0), "max_tokens"),
        (chat_body(top_p=1.5), "top_p"),
        (chat_body(stop=["a"] * 17), "stop"),
        (chat_body(top_logprobs=2), "top_logprobs"),
        (chat_body(stream_options={"include_usage": True}), "stream_options"),
        (chat_body(messages=[]), "messages"),
        (chat_body(messages=[{"role": "function", "content": "x"}]), "messages[0].role"),
        (chat_body(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id"),
        (chat_body(messages=[{"role": "assistant"}]), "messages[0].content"),
        (chat_body(response_format={"type": "json_schema"}), "response_format.json_schema"),
        (chat_body(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice"),
        (
            chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
            "messages[0].content[0].type",
        ),
        (chat_body(frobnicate=1), "frobnicate"),
        ({"model": "demo"}, "messages"),
    ],
)
def test_bad_values_and_unknown_fields_are_400_naming_the_field(client, svc, body, param):
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param + ":")
    assert err["type"] == "invalid_request_error"
    assert svc.requests == []


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", b"null", b'"text"'])
def test_malformed_bodies_are_400(client, raw):
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("body:")


def test_auth_model_and_service_errors_map_to_openai_statuses():
    svc = FakeService(api_key="k")
    c = TestClient(create_app(svc))
    r = c.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert c.get("/v1/models").status_code == 401
    auth = {"authorization": "Bearer k"}
    r = c.post("/v1/chat/completions", json=chat_body(model="other"), headers=auth)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    svc.fail_before_first = ServiceError(
        "rate_limited", "rate limit exceeded; retry in 1.200s", retry_after_s=1.2
    )
    r = c.post("/v1/chat/completions", json=chat_body(stream=True), headers=auth)
    assert r.status_code == 429 and r.headers["retry-after"] == "2"
    svc.fail_before_first = ServiceError("invalid_argument", "sampling.stop_token_ids: must be token ids")
    r = c.post("/v1/chat/completions", json=chat_body(), headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"
    assert r.json()["error"]["message"].startswith("stop_token_ids:")
    svc.fail_before_first = None
    svc.serving, svc.draining = False, True
    r = c.post("/v1/completions", json={"prompt": "x"}, headers=auth)
    assert r.status_code == 503
    h = c.get("/health")
    assert h.status_code == 503 and h.json()["status"] == "draining"
    svc.serving = True
    assert c.get("/health").status_code == 200


def test_streaming_chat_deltas_join_to_the_unary_text(client, svc):
    unary = client.post("/v1/chat/completions", json=chat_body(seed=3, max_tokens=5)).json()
    svc.cache_status = "hit_exact"
    r = client.post(
        "/v1/chat/completions",
        json=chat_body(seed=3, max_tokens=5, stream=True, stream_options={"include_usage": True}),
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-sidecar-cache"] == "hit"
    chunks = sse_events(r.text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    joined = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert joined == unary["choices"][0]["message"]["content"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


def test_streaming_completions_with_n_and_logprobs(client):
    r = client.post(
        "/v1/completions",
        json={"prompt": "x", "n": 2, "seed": 0, "max_tokens": 3, "stream": True, "logprobs": 1},
    )
    chunks = sse_events(r.text)
    texts = {0: "", 1: ""}
    offsets = {0: [], 1: []}
    for c in chunks:
        ch = c["choices"][0]
        texts[ch["index"]] += ch["text"]
        if ch["logprobs"]:
            offsets[ch["index"]] += ch["logprobs"]["text_offset"]
            assert (
                ch["logprobs"]["top_logprobs"][0] == {"<1000>": -0.25}
                or ch["logprobs"]["tokens"][0] != "<1000>"
            )
    assert texts == {0: expected_text(0, 3), 1: expected_text(1, 3)}
    assert offsets[0] == [0, len(" w0_0"), len(" w0_0 w0_1")]


def test_chat_logprobs_shape(client):
    d = client.post(
        "/v1/chat/completions", json=chat_body(logprobs=True, top_logprobs=2, max_tokens=2)
    ).json()
    content = d["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["<1000>", "<1001>"]
    assert content[0]["bytes"] == list(b"<1000>") and content[0]["logprob"] == -0.25
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["<1000>", "<7>"]


def test_error_after_stream_started_is_an_sse_error_then_done(client, svc):
    svc.fail_after_tokens = (2, ServiceError("deadline_exceeded", "deadline exceeded; request aborted"))
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=5, stream=True))
    assert r.status_code == 200
    chunks = sse_events(r.text)
    assert chunks[-1]["error"]["code"] == "deadline_exceeded"
    assert svc.live == set()


def test_one_failing_choice_cancels_its_siblings(client, svc):
    svc.fail_after_tokens = (1, ServiceError("internal", "request aborted: boom"))
    r = client.post("/v1/chat/completions", json=chat_body(n=3, max_tokens=4))
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert svc.live == set()


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_closes_every_engine_request(svc, stream):
    svc.token_delay_s = 0.01
    app = create_app(svc)
    body = json.dumps(chat_body(n=2, max_tokens=200, stream=stream)).encode()

    async def call_then_look():
        res = await asgi_call(
            app, "POST", "/v1/chat/completions", body, disconnect_after_chunks=2 if stream else 0
        )
        await asyncio.sleep(0.05)  # a few loop turns, far less than the 2 s the requests would run
        # Looked at inside the loop: asyncio.run's own cleanup must not be what closes them.
        return res, set(svc.live), list(svc.closed_early)

    res, live, closed = asyncio.run(call_then_look())
    assert len(svc.requests) == 2
    assert live == set()
    assert sorted(closed) == sorted(q.request_id for q in svc.requests)
    if stream:
        assert res["status"] == 200 and b"[DONE]" not in res["body"]


def test_embeddings_float_and_base64(client, svc):
    d = client.post("/v1/embeddings", json={"input": ["ab", "c"], "model": "all-MiniLM-L6-v2"}).json()
    assert [e["embedding"] for e in d["data"]] == [[2.0, 0.5, -1.0], [1.0, 0.5, -1.0]]
    assert d["usage"] == {"prompt_tokens": 3, "total_tokens": 3} and d["model"] == "all-MiniLM-L6-v2"
    d = client.post("/v1/embeddings", json={"input": "abc", "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(d["data"][0]["embedding"]), dtype="<f4")
    assert vec.tolist() == [3.0, 0.5, -1.0]
    r = client.post("/v1/embeddings", json={"input": [[1, 2]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    r = client.post("/v1/embeddings", json={"input": "x", "model": "nope"})
    assert r.status_code == 404
    r = client.post("/v1/embeddings", json={"input": ["a", " "]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert r.json()["error"]["message"].startswith("input[1]:")
    r = client.post("/v1/embeddings", json={"input": "x", "dimensions": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"


def test_models_metrics_and_unknown_routes(client, svc):
    d = client.get("/v1/models").json()
    assert [m["id"] for m in d["data"]] == ["demo", "all-MiniLM-L6-v2"]
    assert d["data"][0]["max_model_len"] == 40
    assert client.get("/v1/models/demo").json()["id"] == "demo"
    assert client.get("/v1/models/other").status_code == 404
    m = client.get("/metrics")
    assert m.status_code == 200 and "sidecar_kv_cache_free_blocks" in m.text
    r = client.get("/v1/nope")
    assert r.status_code == 404 and "error" in r.json()
    assert client.get("/v1/chat/completions").status_code == 405


def test_openapi_documents_400_not_422(client):
    spec = client.get("/openapi.json").json()
    responses = spec["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "422" not in responses and "400" in responses


def test_oversized_bodies_are_refused_before_reaching_the_service(svc):
    c = TestClient(create_app(svc, max_body_bytes=2048))
    big = chat_body(messages=[{"role": "user", "content": "x" * 4000}])
    r = c.post("/v1/chat/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no content-length: counted while read
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 500
        yield b'"}'

    r = c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code in (400, 413) and "error" in r.json()
    assert svc.requests == []
    assert c.post("/v1/chat/completions", json=chat_body()).status_code == 200


def test_requests_and_refusals_are_counted_in_the_shared_metrics(svc):
    from prometheus_client import generate_latest

    from sidecar.server.metrics import Metrics

    svc.metrics = Metrics(lambda: {})
    c = TestClient(create_app(svc, settings=HttpSettings(metrics=svc.metrics)))
    c.post("/v1/chat/completions", json=chat_body())
    c.post("/v1/chat/completions", json=chat_body(temperature=-1))
    c.post("/v1/completions", json={"prompt": "x", "model": "nope"})
    text = generate_latest(svc.metrics.registry).decode()
    assert 'sidecar_requests_total{api="openai",method="chat.completions"} 2.0' in text
    assert 'sidecar_requests_total{api="openai",method="completions"} 1.0' in text
    assert 'sidecar_request_errors_total{code="invalid_argument"} 1.0' in text
    assert 'sidecar_request_errors_total{code="not_found"} 1.0' in text

"""The OpenAI HTTP API of a real ``sidecar serve`` (demo model, CPU), called with the ``openai`` package."""

from __future__ import annotations

import re
import threading
import time

import httpx
import openai
import pytest
from openai import OpenAI


@pytest.fixture(scope="module")
def server(sidecar_launcher):
    with sidecar_launcher() as sc:
        yield sc


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.http_base}/v1", api_key="unused", max_retries=0, timeout=120)


def metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def chat(client: OpenAI, **kw):
    args = dict(
        model="demo", messages=[{"role": "user", "content": "Tell me about paged attention."}], max_tokens=12
    )
    args.update(kw)
    return client.chat.completions.create(**args)


def test_chat_completion_and_usage(client):
    r = chat(client)
    assert r.object == "chat.completion" and r.model == "demo"
    c = r.choices[0]
    assert c.message.role == "assistant" and c.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens == 12 if c.finish_reason == "length" else r.usage.completion_tokens <= 12
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_repeated_prompt_reports_prefix_cache_hits(client):
    long_system = "You are a careful assistant. " * 8  # several full KV blocks
    msgs = [{"role": "system", "content": long_system}, {"role": "user", "content": "hi"}]
    chat(client, messages=msgs, max_tokens=2)
    r = chat(client, messages=msgs, max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens > 0


def test_completions_text_token_ids_and_batch(client):
    r = client.completions.create(model="demo", prompt="The sidecar", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.usage.completion_tokens <= 5
    ids = client.completions.create(model="demo", prompt=[[72, 101, 108], [108, 111]], max_tokens=3)
    assert [c.index for c in ids.choices] == [0, 1]
    batch = client.completions.create(
        model="demo", prompt=["The sidecar", "Other"], max_tokens=5, temperature=0
    )
    assert batch.choices[0].text == r.choices[0].text  # greedy: batching does not change the answer


def test_streaming_deltas_join_to_unary_text_for_the_same_seed(client, server):
    unary = chat(client, temperature=0.9, seed=123, max_tokens=16)
    stream = chat(
        client, temperature=0.9, seed=123, max_tokens=16, stream=True, stream_options={"include_usage": True}
    )
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(parts) == unary.choices[0].message.content
    assert finish == unary.choices[0].finish_reason
    assert usage.completion_tokens == unary.usage.completion_tokens

    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="demo", prompt="Once", max_tokens=8, temperature=0.7, seed=9, stream=True
        )
        if c.choices
    )
    assert (
        text
        == client.completions.create(model="demo", prompt="Once", max_tokens=8, temperature=0.7, seed=9)
        .choices[0]
        .text
    )


def test_streaming_response_carries_cache_header(server):
    body = {"model": "demo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{server.http_base}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["x-sidecar-cache"] == "bypass"  # the test server runs without the semantic cache
        assert r.read().decode().rstrip().endswith("data: [DONE]")


def test_n_choices_use_seed_plus_index(client):
    r = chat(client, n=3, temperature=1.0, seed=5, max_tokens=10)
    assert [c.index for c in r.choices] == [0, 1, 2]
    singles = [
        chat(client, temperature=1.0, seed=5 + i, max_tokens=10).choices[0].message.content for i in range(3)
    ]
    assert [c.message.content for c in r.choices] == singles


def test_penalties_and_vllm_extras_are_honoured(client):
    quick = client.with_options(timeout=60)
    plain = chat(quick, max_tokens=12, extra_body={"ignore_eos": True})
    penalised = chat(
        quick,
        max_tokens=12,
        presence_penalty=2.0,
        frequency_penalty=2.0,
        extra_body={"repetition_penalty": 5.0, "top_k": -1, "min_p": 0.0, "ignore_eos": True},
    )
    assert plain.usage.completion_tokens == penalised.usage.completion_tokens == 12
    r = chat(quick, max_tokens=4, temperature=0.5, seed=3, extra_body={"top_k": 5, "min_p": 0.05})
    assert r.choices[0].finish_reason in ("stop", "length")


def test_logprobs(client):
    r = chat(client, logprobs=True, top_logprobs=3, max_tokens=4)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    c = client.completions.create(model="demo", prompt="abc", max_tokens=3, logprobs=2)
    assert len(c.choices[0].logprobs.tokens) == c.usage.completion_tokens


def test_models_and_embeddings(client):
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == "demo"
    assert client.models.retrieve("demo").id == "demo"
    e = client.embeddings.create(model=ids[-1], input=["a cat", "a dog", "a cat"])
    vecs = [d.embedding for d in e.data]  # the client asks for base64 and decodes it
    assert len(vecs) == 3 and len(vecs[0]) == 384
    assert vecs[0] == pytest.approx(vecs[2], abs=1e-6) and vecs[0] != pytest.approx(vecs[1], abs=1e-3)
    assert e.usage.prompt_tokens > 0


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"logit_bias": {"x": 10}}, "logit_bias"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frobnicate"}, "strict": True},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"extra_body": {"not_a_field": 1}}, "not_a_field"),
    ],
)
def test_bad_requests_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == param


def test_bad_token_id_and_unknown_model(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo", prompt=[10**9], max_tokens=2)
    assert e.value.body["param"] == "prompt_token_ids"
    with pytest.raises(openai.NotFoundError) as e:
        chat(client, model="gpt-4o")
    assert e.value.body["code"] == "model_not_found"


def test_malformed_json_is_400(server):
    r = httpx.post(
        f"{server.http_base}/v1/chat/completions",
        content=b"{oops",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_client_disconnect_aborts_the_request_and_frees_blocks(server):
    base = server.http_base
    total = metric(base, "sidecar_kv_cache_total_blocks")
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "go " * 100}],
        "max_tokens": 3000,
        "stream": True,
        "temperature": 0.8,
        "seed": 1,
    }
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            got += line.startswith("data: ")
            if got >= 3:
                break
        assert metric(base, "sidecar_num_requests_running") == 1
        assert metric(base, "sidecar_kv_cache_free_blocks") < total
    # 3000 tokens take far longer than this window on CPU: only an abort frees the blocks in time.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if (
            metric(base, "sidecar_num_requests_running") == 0
            and metric(base, "sidecar_kv_cache_free_blocks") == total
        ):
            break
        time.sleep(0.1)
    assert metric(base, "sidecar_num_requests_running") == 0
    assert metric(base, "sidecar_kv_cache_free_blocks") == total


def test_health_and_metrics(server):
    assert httpx.get(f"{server.http_base}/health").status_code == 200
    text = httpx.get(f"{server.http_base}/metrics").text
    assert "sidecar_prompt_tokens" in text
    # the HTTP adapter counts into the same registry as gRPC (earlier tests in this module made chat calls)
    assert re.search(r'^sidecar_requests_total\{api="openai",method="chat.completions"\} [1-9]', text, re.M)
    assert re.search(r'^sidecar_request_errors_total\{code="invalid_argument"\} [1-9]', text, re.M)


def test_auth_rate_limit_and_drain(sidecar_launcher):
    # A short shutdown timeout bounds the drain: the long stream below is aborted after 5 s.
    with sidecar_launcher(
        "--api-key",
        "a",
        "--api-key",
        "b",
        "--rate-limit-rps",
        "0.2",
        "--rate-limit-burst",
        "1",
        "--shutdown-timeout",
        "5",
    ) as sc:
        url = f"{sc.http_base}/v1"
        with pytest.raises(openai.AuthenticationError):
            OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        a = OpenAI(base_url=url, api_key="a", max_retries=0, timeout=120)
        assert chat(a, max_tokens=2).choices  # the burst of one
        with pytest.raises(openai.RateLimitError) as e:
            chat(a, max_tokens=2)
        assert int(e.value.response.headers["retry-after"]) >= 1

        # Drain: a long stream from key b keeps the engine busy while SIGTERM arrives.
        b = OpenAI(base_url=url, api_key="b", max_retries=0, timeout=120)
        stream = chat(b, max_tokens=2000, stream=True, extra_body={"ignore_eos": True})
        first = next(iter(stream))
        assert first.choices
        seen = {}

        def drain_probe():
            time.sleep(0.5)
            seen["health"] = httpx.get(f"{sc.http_base}/health", timeout=10).status_code
            try:
                chat(a, max_tokens=2)
            except openai.APIStatusError as exc:
                seen["status"] = exc.status_code

        sc.signal()
        t = threading.Thread(target=drain_probe)
        t.start()
        t.join(60)
        stream.close()
        assert seen == {"health": 503, "status": 503}

"""Two `sidecar serve` replicas sharing one Redis cache tier, over the OpenAI HTTP API: cross-replica
hits, tenant isolation, a burst of identical requests running one generation, back-to-back recall
equal to paused recall, and a Redis outage that fails no request."""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import re
import time

import httpx
import pytest

DATA = pathlib.Path(__file__).resolve().parents[2] / "sidecar" / "bench" / "data" / "semantic_pairs.jsonl"
ALICE = {"authorization": "Bearer key-alice"}
BOB = {"authorization": "Bearer key-bob"}


@pytest.fixture(scope="module")
def fleet(sidecar_launcher, module_redis_server):
    args = (
        "--cache-backend",
        module_redis_server.url,
        "--num-kv-blocks",
        "128",
        "--max-num-seqs",
        "8",
        "--grpc-port",
        "0",
        "--api-key",
        "key-alice:alice",
        "--api-key",
        "key-bob:bob",
    )
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(sidecar_launcher(*args, semantic_cache=True))
        b = stack.enter_context(sidecar_launcher(*args, semantic_cache=True))
        yield a.http_base, b.http_base, module_redis_server


def chat(base, question, headers=ALICE, max_tokens=8, **kw):
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **kw,
    }
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=120)


def metric(base, name):
    text = httpx.get(f"{base}/metrics", timeout=30).text
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def until_hit(base, question, headers=ALICE, timeout=10.0):
    """Ask with cache_control=only (a miss generates and stores nothing) until the cache answers."""
    end = time.monotonic() + timeout
    while True:
        r = chat(base, question, headers, cache_control="only")
        if r.status_code == 200 or time.monotonic() > end:
            return r
        assert r.status_code == 404, r.text
        time.sleep(0.05)


def test_a_paraphrase_on_b_hits_what_a_stored(fleet):
    a, b, _ = fleet
    first = chat(a, "How can I clear the browser cache in Chrome?")
    assert first.status_code == 200 and first.headers["x-sidecar-cache"] == "miss"
    hit = until_hit(b, "How do I clear the cache in Chrome?")
    assert hit.headers["x-sidecar-cache"] == "hit"
    assert hit.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]


def test_tenant_b_never_sees_tenant_a_entries(fleet):
    a, b, _ = fleet
    first = chat(a, "What is the office wifi password?")
    assert first.headers["x-sidecar-cache"] == "miss"
    assert until_hit(b, "What is the office wifi password?").headers["x-sidecar-cache"] == "hit"
    other = chat(b, "What is the office wifi password?", headers=BOB)
    assert other.status_code == 200 and other.headers["x-sidecar-cache"] == "miss"


def test_a_burst_of_identical_requests_runs_one_generation(fleet):
    a, _, _ = fleet
    before = metric(a, "sidecar_engine_requests_finished_total")
    coalesced = metric(a, "sidecar_cache_coalesced_total")

    async def burst():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=60)) as client:
            body = {
                "model": "demo",
                "messages": [{"role": "user", "content": "Explain the burst test."}],
                "max_tokens": 48,
                "temperature": 0,
                "ignore_eos": True,
            }
            return await asyncio.gather(
                *[client.post(f"{a}/v1/chat/completions", json=body, headers=ALICE) for _ in range(50)]
            )

    rs = asyncio.run(burst())
    assert [r.status_code for r in rs] == [200] * 50
    answers = {r.json()["choices"][0]["message"]["content"] for r in rs}
    assert len(answers) == 1
    time.sleep(0.5)  # the engine thread's counters are read at scrape time
    assert metric(a, "sidecar_engine_requests_finished_total") - before == 1
    followed = metric(a, "sidecar_cache_coalesced_total") - coalesced
    hits = sum(r.headers["x-sidecar-cache"] == "hit" for r in rs)
    assert followed + hits == 49  # everyone but the leader followed it or hit what it stored
    assert sum(r.headers.get("x-sidecar-coalesced") == "true" for r in rs) == followed


def test_streaming_followers_get_the_whole_answer(fleet):
    _, b, _ = fleet

    async def burst():
        body = {
            "model": "demo",
            "messages": [{"role": "user", "content": "Stream the burst answer."}],
            "max_tokens": 160,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }

        async def one(client):
            async with client.stream("POST", f"{b}/v1/chat/completions", json=body, headers=ALICE) as r:
                assert r.status_code == 200
                text = ""
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        if chunk["choices"]:
                            text += chunk["choices"][0]["delta"].get("content") or ""
                return text, r.headers.get("x-sidecar-coalesced")

        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[one(client) for _ in range(10)])

    before = metric(b, "sidecar_engine_requests_finished_total")
    results = asyncio.run(burst())
    assert len({text for text, _ in results}) == 1 and results[0][0]
    time.sleep(0.5)
    assert metric(b, "sidecar_engine_requests_finished_total") - before == 1
    assert any(flag == "true" for _, flag in results)


def _pairs(n):
    seen, out = set(), []
    for line in DATA.read_text().splitlines():
        p = json.loads(line)
        if p["label"] == "hit" and p["query"] not in seen and p["cached"] not in seen:
            seen.update((p["query"], p["cached"]))
            out.append(p)
        if len(out) == n:
            break
    return out


def test_back_to_back_recall_equals_paused_recall(fleet):
    a, _, _ = fleet
    pairs = _pairs(8)

    def recall(pause_s, max_tokens):  # max_tokens gives each run its own cache scope
        hits = 0
        for p in pairs:
            assert chat(a, p["cached"], max_tokens=max_tokens).status_code == 200
            time.sleep(pause_s)
            hits += chat(a, p["query"], max_tokens=max_tokens).headers["x-sidecar-cache"] == "hit"
        return hits / len(pairs)

    back_to_back = recall(0.0, 5)
    paused = recall(1.0, 6)
    assert paused > 0.5
    assert back_to_back == paused


def test_redis_stopped_mid_run_fails_no_request(fleet):
    a, b, redis = fleet
    assert chat(a, "What time does support open?").status_code == 200
    redis.stop()
    try:
        codes = []
        for i in range(6):
            for base in (a, b):
                codes.append(chat(base, f"Outage question number {i}?").status_code)
                codes.append(chat(base, "What time does support open?").status_code)
        assert codes == [200] * len(codes)
        # Local tiers still serve what this replica stored during the outage.
        assert chat(a, "Outage question number 0?").headers["x-sidecar-cache"] == "hit"
    finally:
        redis.start()
    # Back: what a stored during the outage reaches b.
    assert until_hit(b, "Outage question number 5?", timeout=30).headers["x-sidecar-cache"] == "hit"

"""The Redis tier of the semantic cache against a real redis-server (started by the ``redis_server``
fixture): replicas mirror each other through the stream, TTL is the key's expiry, tenants stay apart,
malformed entries are skipped and counted, and an outage degrades to local operation then resyncs."""

import asyncio
import time

import pytest

from sidecar.cache.embedder import Embedder
from sidecar.cache.redis_store import decode_entry
from sidecar.cache.semantic import CacheScope, SemanticCache
from sidecar.config import CacheConfig


@pytest.fixture(scope="module")
def embedder():
    emb = Embedder("all-MiniLM-L6-v2", device="cpu")
    yield emb
    emb.close()


@pytest.fixture
def replicas(embedder, redis_server):
    made = []

    def make(**cfg):
        c = SemanticCache(CacheConfig(backend=redis_server.url, **cfg), embedder=embedder)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def scope(query, tenant="t1"):
    return CacheScope(tenant=tenant, model="m", settings="greedy", context="", query=query)


def wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    return cond()


def lookup(cache, query, tenant="t1"):
    return asyncio.run(cache.lookup(scope(query, tenant)))


def store(cache, query, answer, tenant="t1"):
    asyncio.run(cache.store(scope(query, tenant), answer, [7, 8], "stop", 5, 2))


def test_a_store_on_one_replica_is_served_by_the_others(replicas):
    a, b = replicas(), replicas()  # b is running: it learns through the stream
    store(a, "How do I reset my password?", "Use the reset link.")
    hit = wait_for(lambda: lookup(b, "How can I reset my password?"))
    assert hit.kind == "semantic" and hit.text == "Use the reset link." and hit.token_ids == [7, 8]
    c = replicas()  # a fresh replica loads the entry at start
    assert lookup(c, "how do i reset my password").kind == "exact"
    assert b.stats()["remote_puts"] == 1 and b.stats()["backend_up"] == 1


def test_ttl_is_the_key_expiry(replicas, redis_server):
    a = replicas(ttl_s=2.0)
    store(a, "What is the refund window?", "30 days.")
    keys = redis_server.client().keys("sidecar:cache:*:e:*")
    assert len(keys) == 1
    assert 0 < redis_server.client().ttl(keys[0]) <= 2
    time.sleep(2.2)
    assert redis_server.client().keys("sidecar:cache:*:e:*") == []
    assert lookup(a, "What is the refund window?") is None  # the mirror does not serve it either
    assert lookup(replicas(ttl_s=2.0), "What is the refund window?") is None


def test_tenants_stay_apart_across_replicas(replicas):
    a, b = replicas(), replicas()
    store(a, "What is our VPN address?", "vpn.a.example", tenant="tenant-a")
    assert wait_for(lambda: lookup(b, "What is our VPN address?", tenant="tenant-a")).text == "vpn.a.example"
    assert lookup(b, "What is our VPN address?", tenant="tenant-b") is None
    assert lookup(b, "What's our VPN address?", tenant="tenant-b") is None


def test_malformed_entries_are_skipped_and_counted(replicas, redis_server):
    a = replicas()
    store(a, "Where is the office?", "Berlin.")
    r = redis_server.client()
    (good,) = r.keys("sidecar:cache:*:e:*")
    ns = good.decode().rsplit(":e:", 1)[0] + ":"
    r.set(ns + "e:garbage", b"\xff not json")
    r.set(ns + "e:short", good_value_with_short_vector(r.get(good)))
    b = replicas()  # loads two malformed entries and one good one
    assert b.stats()["malformed"] == 2 and b.stats()["entries"] == 1
    r.xadd(ns + "log", {"op": "put", "src": "elsewhere", "k": "x", "e": b"{}"})
    r.xadd(ns + "log", {"op": "nonsense", "src": "elsewhere"})
    assert wait_for(lambda: b.stats()["malformed"] == 4)
    assert lookup(b, "Where is the office?").text == "Berlin."  # it keeps serving


def good_value_with_short_vector(raw: bytes) -> bytes:
    import base64
    import json

    d = json.loads(raw)
    d["v"] = base64.b64encode(b"\x00" * 16).decode()
    return json.dumps(d).encode()


def test_oversized_entries_are_not_written(replicas, redis_server):
    a = replicas()
    store(a, "Write the whole manual", "x" * 600_000)
    assert redis_server.client().keys("sidecar:cache:*:e:*") == []
    assert a.stats()["oversized"] == 1
    assert lookup(a, "Write the whole manual").text.startswith("xxx")  # still served locally


def test_redis_outage_serves_locally_then_resyncs(replicas, redis_server):
    a, b = replicas(), replicas()
    store(a, "What are the opening hours?", "9 to 5.")
    assert wait_for(lambda: lookup(b, "What are the opening hours?"))
    redis_server.stop()
    # Down: stores succeed locally, hits keep coming from the local tiers.
    store(a, "Is there parking nearby?", "Yes, on Main Street.")
    assert lookup(a, "Is there parking nearby?").text == "Yes, on Main Street."
    assert lookup(b, "What are the opening hours?").text == "9 to 5."
    assert wait_for(lambda: a.stats()["backend_up"] == 0 and b.stats()["backend_up"] == 0)
    assert a.stats()["backend_pending"] == 1
    redis_server.start()  # back, empty (no persistence): a re-sends what it kept, b resyncs
    assert wait_for(lambda: lookup(b, "Is there parking nearby?"), timeout=20).text == "Yes, on Main Street."
    # a re-sends its kept entry before it reloads its mirror and counts itself up (b can see the entry first)
    assert wait_for(
        lambda: a.stats()["backend_up"] == 1 and a.stats()["resyncs"] >= 1 and b.stats()["resyncs"] >= 1
    )
    assert a.stats()["backend_pending"] == 0
    c = replicas()
    assert lookup(c, "Is there parking nearby?") is not None


def test_start_without_redis_then_it_appears(embedder, redis_server):
    redis_server.stop()
    a = SemanticCache(CacheConfig(backend=redis_server.url), embedder=embedder)
    try:
        store(a, "Who answers the phone?", "Reception.")
        assert lookup(a, "Who answers the phone?").text == "Reception."
        redis_server.start()
        keys = wait_for(lambda: redis_server.client().keys("sidecar:cache:*:e:*"), timeout=20)
        entry = decode_entry(redis_server.client().get(keys[0]), embedder.dim)
        assert entry.text == "Reception." and entry.query == "Who answers the phone?"
    finally:
        a.close()


def test_backend_url_is_checked():
    for bad, word in [
        ("http://x:1/0", "redis://"),
        ("redis://:secret@h:6379/0", "SIDECAR_REDIS_PASSWORD"),
        ("redis://h:6379/zero", "number"),
        ("redis:///0", "host"),
    ]:
        with pytest.raises(ValueError, match=word) as err:
            CacheConfig(backend=bad)
        assert str(err.value).startswith("cache.backend:")
    assert CacheConfig(backend="rediss://cache.internal:6380/1").backend == "rediss://cache.internal:6380/1"


def test_the_flag_reaches_the_config_and_the_metrics_show_the_tier(replicas, redis_server):
    import argparse

    from sidecar.server.flags import add_config_arguments, config_from_args
    from sidecar.server.metrics import Metrics

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--cache-backend", redis_server.url]), env={})
    assert cfg.cache.backend == redis_server.url
    assert config_from_args(parser.parse_args([]), env={}).cache.backend is None
    a = replicas()
    text = Metrics(lambda: {}, a.stats).render()[0].decode()
    assert "sidecar_semantic_cache_backend_up 1.0" in text
    assert "sidecar_semantic_cache_malformed_total 0.0" in text

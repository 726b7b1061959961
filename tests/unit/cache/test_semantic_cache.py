"""SemanticCache behaviour with the real bundled embedding model (loaded once per module)."""

import asyncio
import sqlite3

import numpy as np
import pytest

from sidecar.cache.embedder import Embedder
from sidecar.cache.semantic import CacheScope, SemanticCache
from sidecar.config import CacheConfig


@pytest.fixture(scope="module")
def embedder():
    emb = Embedder("all-MiniLM-L6-v2", device="cpu")
    yield emb
    emb.close()


class Clock:
    def __init__(self, t=1_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


def scope(query, tenant="t1", model="m", settings="temperature=0", context=""):
    return CacheScope(tenant=tenant, model=model, settings=settings, context=context, query=query)


def run(coro):
    return asyncio.run(coro)


async def put(cache, query, answer="answer", **kw):
    await cache.store(scope(query, **kw), answer, [5, 6, 7], "stop", 11, 3)


@pytest.fixture
def make(embedder, tmp_path):
    caches = []

    def _make(clock=None, **cfg):
        c = SemanticCache(CacheConfig(**cfg), embedder=embedder, clock=clock or Clock())
        caches.append(c)
        return c

    yield _make
    for c in caches:
        c.close()


def test_embedder_contract(embedder):
    v = embedder.embed(["How do I reset my password?", "hello"])
    assert v.shape == (2, embedder.dim) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert embedder.count_tokens(["hello world"]) == 4  # [CLS] hello world [SEP]


def test_aembed_batches_concurrent_callers(embedder):
    texts = [f"question number {i}" for i in range(8)]

    async def go():
        before = embedder.batches
        outs = await asyncio.gather(*[embedder.aembed([t]) for t in texts])
        return outs, embedder.batches - before

    outs, batches = run(go())
    assert batches < len(texts)  # at least two callers shared a forward pass
    expected = embedder.embed(texts)
    assert np.allclose(np.concatenate(outs), expected, atol=1e-5)


def test_exact_hit_ignores_case_and_trailing_punctuation(make):
    cache = make()

    async def go():
        await put(cache, "How do I reset my password?", "Open Settings > Security.")
        return await cache.lookup(scope("  how do I reset my PASSWORD "))

    hit = run(go())
    assert hit.kind == "exact" and hit.similarity == 1.0
    assert hit.text == "Open Settings > Security." and hit.token_ids == [5, 6, 7]
    assert (hit.prompt_tokens, hit.completion_tokens, hit.finish_reason) == (11, 3, "stop")
    s = cache.stats()
    assert (s["lookups"], s["exact_hits"], s["semantic_hits"], s["stores"], s["entries"]) == (1, 1, 0, 1, 1)


def test_semantic_hit_for_a_paraphrase(make):
    cache = make()

    async def go():
        await put(cache, "How can I clear the browser cache in Chrome?")
        return await cache.lookup(scope("How do I clear the cache in Chrome?"))

    hit = run(go())
    assert hit is not None and hit.kind == "semantic"
    assert 0.95 <= hit.similarity < 1.0
    assert hit.matched_query == "How can I clear the browser cache in Chrome?"
    assert cache.stats()["semantic_hits"] == 1


@pytest.mark.parametrize(
    "stored,asked",
    [
        ("Is port 6379 open by default?", "Is port 6379 closed by default?"),
        ("what is 2+3", "what is 2+4"),
        ("Can I return an item after 30 days?", "Can I return an item after 60 days?"),
        ("Why is my WiFi working?", "Why is my WiFi not working?"),
    ],
)
def test_guard_refuses_near_misses_above_threshold(make, embedder, stored, asked):
    a, b = embedder.embed([stored, asked])
    # A threshold the pair clears, so only the guard stands between them.
    assert float(a @ b) >= 0.75
    cache = make(threshold=0.75)

    async def go():
        await put(cache, stored)
        return await cache.lookup(scope(asked))

    assert run(go()) is None
    s = cache.stats()
    assert s["guard_rejections"] == 1 and s["misses"] == 1


def test_without_guard_the_near_miss_would_hit(make):
    cache = make(threshold=0.9, guard=False)

    async def go():
        await put(cache, "Is port 6379 open by default?")
        return await cache.lookup(scope("Is port 6379 closed by default?"))

    assert run(go()) is not None  # shows the guard test above is not vacuous


def test_tenants_never_see_each_other(make):
    cache = make()

    async def go():
        await put(cache, "How do I reset my password?", "tenant one's answer", tenant="one")
        return (
            await cache.lookup(scope("How do I reset my password?", tenant="two")),
            await cache.lookup(scope("What are the steps to reset my password?", tenant="two")),
            await cache.lookup(scope("How do I reset my password?", tenant="one")),
        )

    exact_other, semantic_other, own = run(go())
    assert exact_other is None and semantic_other is None
    assert own.text == "tenant one's answer"


@pytest.mark.parametrize(
    "other",
    [
        {"context": "system: answer in French"},
        {"settings": "temperature=0;max_tokens=16"},
        {"model": "other-model"},
    ],
)
def test_scope_isolation(make, other):
    cache = make()

    async def go():
        await put(cache, "How do I reset my password?")
        return await cache.lookup(scope("How do I reset my password?", **other))

    assert run(go()) is None


def test_ttl_expiry_with_injected_clock(make):
    clock = Clock()
    cache = make(clock=clock, ttl_s=60)

    async def go():
        await put(cache, "How do I reset my password?")
        clock.t += 59
        first = await cache.lookup(scope("How do I reset my password?"))
        clock.t += 2
        second = await cache.lookup(scope("How do I reset my password?"))
        third = await cache.lookup(scope("What are the steps to reset my password?"))
        return first, second, third

    first, second, third = run(go())
    assert first is not None and second is None and third is None
    s = cache.stats()
    assert s["entries"] == 0 and s["expired"] == 1


def test_lru_eviction_keeps_recently_used(make):
    clock = Clock()
    cache = make(clock=clock, max_entries=2)

    async def go():
        await put(cache, "What is the capital of Australia?", "Canberra")
        clock.t += 1
        await put(cache, "Who wrote Pride and Prejudice?", "Jane Austen")
        clock.t += 1
        assert await cache.lookup(scope("What is the capital of Australia?"))  # now most recent
        await put(cache, "How many bones are in the human body?", "206")
        return [
            await cache.lookup(scope(q))
            for q in (
                "What is the capital of Australia?",
                "Who wrote Pride and Prejudice?",
                "How many bones are in the human body?",
            )
        ]

    aus, pride, bones = run(go())
    assert aus.text == "Canberra" and pride is None and bones.text == "206"
    s = cache.stats()
    assert s["entries"] == 2 and s["evictions"] == 1
    # The evicted entry is gone from the vector index too: a paraphrase cannot find it.
    assert run(cache.lookup(scope("Who is the author of Pride and Prejudice?"))) is None


def test_restore_replaces_the_same_question(make):
    cache = make()

    async def go():
        await put(cache, "How do I reset my password?", "old")
        await put(cache, "how do i reset my password", "new")
        return await cache.lookup(scope("How do I reset my password?"))

    assert run(go()).text == "new"
    assert cache.stats()["entries"] == 1


def test_only_completed_generations_are_stored(make):
    cache = make()

    async def go():
        await cache.store(scope("How do I reset my password?"), "partial", [1], "abort", 3, 1)
        return await cache.lookup(scope("How do I reset my password?"))

    assert run(go()) is None
    s = cache.stats()
    assert s["entries"] == 0 and s["store_refused"] == 1 and s["stores"] == 0


def test_bypass_is_counted(make):
    cache = make()
    cache.record_bypass("sampled")
    cache.record_bypass("skip")
    assert cache.stats()["bypasses"] == 2


def test_persistence_across_restart(embedder, tmp_path):
    path = str(tmp_path / "cache.db")
    clock = Clock()
    cache = SemanticCache(CacheConfig(path=path), embedder=embedder, clock=clock)

    async def fill():
        await put(cache, "How can I clear the browser cache in Chrome?", "Settings > Privacy")
        await put(cache, "Who wrote Pride and Prejudice?", "Jane Austen", tenant="t2")

    run(fill())
    cache.close()
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"

    reopened = SemanticCache(CacheConfig(path=path), embedder=embedder, clock=clock)
    try:
        assert reopened.stats()["entries"] == 2
        hit = run(reopened.lookup(scope("How do I clear the cache in Chrome?")))
        assert hit.kind == "semantic" and hit.text == "Settings > Privacy"
        assert run(reopened.lookup(scope("Who wrote Pride and Prejudice?"))) is None  # other tenant
        assert (
            run(reopened.lookup(scope("Who wrote Pride and Prejudice?", tenant="t2"))).text == "Jane Austen"
        )
    finally:
        reopened.close()

    # Entries that expired while the process was down are dropped on start.
    clock.t += CacheConfig().ttl_s + 1
    later = SemanticCache(CacheConfig(path=path), embedder=embedder, clock=clock)
    try:
        assert later.stats()["entries"] == 0
    finally:
        later.close()


def test_hnsw_index_serves_hits_and_forgets_evicted(make):
    clock = Clock()
    cache = make(clock=clock, hnsw_min_entries=2, max_entries=3)
    questions = [
        "What is the capital of Australia?",
        "Who wrote Pride and Prejudice?",
        "How many bones are in the human body?",
        "Who painted the Mona Lisa?",
    ]

    async def go():
        for q in questions:
            await put(cache, q, q.upper())
            clock.t += 1
        return (
            await cache.lookup(scope("Who was the painter of the Mona Lisa?")),
            await cache.lookup(scope("What's the capital of Australia?")),
        )

    mona, australia = run(go())
    assert mona.kind == "semantic" and mona.text == "WHO PAINTED THE MONA LISA?"
    assert australia is None  # evicted (LRU) before the lookup
    assert cache._scopes[next(iter(cache._scopes))].kind == "hnsw"


def test_unusable_path_names_the_setting(embedder, tmp_path):
    with pytest.raises(ValueError, match="cache.path"):
        SemanticCache(CacheConfig(path=str(tmp_path / "no" / "such" / "dir" / "c.db")), embedder=embedder)
    bad = tmp_path / "garbage.db"
    bad.write_bytes(b"this is not a database" * 100)
    with pytest.raises(ValueError, match="cache.path"):
        SemanticCache(CacheConfig(path=str(bad)), embedder=embedder)


def test_count_tokens_while_embedding_in_the_worker(embedder):
    # Counting runs on the caller's thread while the worker tokenizes; neither may fail.
    texts = [f"a somewhat longer sentence number {i} about caching and tokenizers" for i in range(64)]

    async def go():
        work = asyncio.ensure_future(asyncio.gather(*[embedder.aembed([t]) for t in texts]))
        counts = []
        while not work.done():
            counts.append(embedder.count_tokens(texts[:8]))
            await asyncio.sleep(0)
        return await work, counts

    outs, counts = run(go())
    assert len(outs) == 64 and counts and len(set(counts)) == 1


def test_embeddings_equal_sentence_transformers_encode(embedder):
    texts = ["How do I reset my password?", "hello", "Which process listens on port 8080 on Linux?"]
    ours = embedder.embed(texts)
    ref = embedder._model.encode(
        texts, convert_to_numpy=True, normalize_embeddings=True, show_progress_bar=False
    )
    ref = np.asarray(ref, dtype=np.float32)
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    assert np.allclose(ours, ref, atol=1e-3)
    assert np.min(np.sum(ours * ref, axis=1)) > 0.9999


def test_large_scopes_are_looked_up_off_the_loop_and_hits_are_touched_behind(embedder, tmp_path):
    path = str(tmp_path / "cache.db")
    clock = Clock()
    cache = SemanticCache(CacheConfig(path=path), embedder=embedder, clock=clock)
    long_context = "earlier turn " * 1000  # over the inline size: hashed and searched in a worker thread
    try:
        run(
            put(
                cache,
                "How can I clear the browser cache in Chrome?",
                "Settings > Privacy",
                context=long_context,
            )
        )
        run(put(cache, "How can I clear the browser cache in Chrome?", "short scope"))
        clock.t += 50
        hit = run(cache.lookup(scope("How do I clear the cache in Chrome?", context=long_context)))
        assert hit.kind == "semantic" and hit.text == "Settings > Privacy"
        clock.t += 50
        assert run(cache.lookup(scope("How can I clear the browser cache in chrome"))).text == "short scope"
    finally:
        cache.close()  # waits for the writes queued behind the hits
    rows = sorted(sqlite3.connect(path).execute("SELECT text, last_access FROM entries").fetchall())
    assert rows == [("Settings > Privacy", clock.t - 50), ("short scope", clock.t)]


def test_a_memory_only_cache_keeps_no_second_copy_of_its_entries(make, tmp_path):
    from sidecar.cache.backend import MemoryBackend, SqliteBackend

    mem = make()
    assert isinstance(mem._backend, MemoryBackend) and mem._store is None
    run(put(mem, "How do I reset my password?", answer="use the reset link"))
    hit = run(mem.lookup(scope("How do I reset my password?")))
    assert hit is not None and hit.text == "use the reset link"
    assert mem.stats()["entries"] == 1 and mem.stats()["quarantined"] == 0
    filed = make(path=str(tmp_path / "c.db"))  # with a path the entries persist in SQLite, as before
    assert isinstance(filed._backend, SqliteBackend)

"""In-flight coalescing and visible-at-once stores, through the real service, engine (demo model) and
semantic cache (bundled embedder)."""

import asyncio

import pytest

from sidecar.cache.embedder import Embedder
from sidecar.cache.semantic import CacheScope, SemanticCache
from sidecar.config import CacheConfig, EngineConfig, SidecarConfig
from sidecar.engine.async_engine import AsyncEngine
from sidecar.engine.request import SamplingParams
from sidecar.server.service import Caller, GenerationRequest, InferenceService, ServiceError


@pytest.fixture(scope="module")
def embedder():
    emb = Embedder("all-MiniLM-L6-v2", device="cpu")
    yield emb
    emb.close()


def _req(prompt, control="default", max_tokens=48, timeout_s=None):
    return GenerationRequest(
        prompt=prompt,
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        cache_control=control,
        timeout_s=timeout_s,
    )


async def _service(demo_dir, embedder):
    cfg = SidecarConfig()
    cfg.engine = EngineConfig(model=str(demo_dir), num_kv_blocks=128, max_num_seqs=4)
    cfg.cache = CacheConfig()
    engine = await asyncio.to_thread(AsyncEngine.from_config, cfg.engine)
    engine.start()
    svc = InferenceService(cfg)
    svc.attach(engine, SemanticCache(cfg.cache, embedder=embedder))  # the module owns the embedder
    return svc, engine


async def _close(svc, engine):
    await svc.close()
    await engine.shutdown()


def _finished(engine) -> int:
    return engine.engine.counters["num_requests_finished"]


async def _settled(engine, want: int) -> int:
    for _ in range(200):  # the engine thread counts a finish right after handing the output over
        if _finished(engine) >= want:
            break
        await asyncio.sleep(0.01)
    return _finished(engine)


def _pool_whole(engine) -> bool:
    e = engine.engine
    return not e.requests and e.kv.num_free_blocks() == e.kv.num_blocks


async def _collect(svc, req, started=None, stop_after=None):
    """(deltas, last event) of one call; ``started`` is set at its first event."""
    deltas, last = [], None
    agen = svc.generate(Caller(), req)
    try:
        async for ev in agen:
            deltas.append(ev.delta_text)
            last = ev
            if started is not None:
                started.set()
            if stop_after is not None and len(deltas) >= stop_after:
                return deltas, last
    finally:
        await agen.aclose()
    return deltas, last


def test_followers_share_one_generation_unary_and_streaming(demo_dir, embedder):
    async def main():
        svc, engine = await _service(demo_dir, embedder)
        try:
            before = _finished(engine)
            started = asyncio.Event()
            leader = asyncio.create_task(_collect(svc, _req("tell me a story about ships"), started))
            await started.wait()  # the leader is generating: followers arrive mid-flight
            followers = [
                asyncio.create_task(_collect(svc, _req("tell me a story about ships"))) for _ in range(5)
            ]
            (ldeltas, lev), *rest = await asyncio.gather(leader, *followers)
            assert lev.finished and lev.completion_tokens == 48 and not lev.cache.coalesced
            for deltas, ev in rest:
                assert ev.text == lev.text and ev.token_ids == lev.token_ids
                assert "".join(deltas) == ev.text  # the output so far, then live deltas, adds up
                assert ev.cache.coalesced and ev.cache.status == "miss"
            assert await _settled(engine, before + 1) == before + 1
            await asyncio.sleep(0.05)
            assert _finished(engine) == before + 1  # exactly one generation
            assert svc.cache_step.stats()["coalesced"] == 5
            assert len(svc.cache_step.coalescer) == 0  # every flight is forgotten
            assert _pool_whole(engine)
        finally:
            await _close(svc, engine)

    asyncio.run(main())


def test_leader_cancel_hands_the_generation_to_a_follower(demo_dir, embedder):
    async def main():
        svc, engine = await _service(demo_dir, embedder)
        try:
            _, ref = await _collect(svc, _req("count the waves", control="skip", max_tokens=64))
            follower = None
            agen = svc.generate(Caller(), _req("count the waves", max_tokens=64))
            n = 0
            async for lev in agen:  # the leader reads a few events, then goes once a follower joined
                n += 1
                if follower is None:
                    follower = asyncio.create_task(_collect(svc, _req("count the waves", max_tokens=64)))
                if n >= 2 and svc.cache_step.stats()["coalesced"] == 1:
                    break
            assert not lev.finished
            await agen.aclose()  # its engine request is aborted; the follower takes over
            deltas, ev = await follower
            assert ev.finished and ev.finish_reason == "length"
            assert ev.text == ref.text and "".join(deltas) == ref.text  # nothing lost or repeated
            assert ev.cache.coalesced
            await asyncio.sleep(0.1)
            assert _pool_whole(engine) and len(svc.cache_step.coalescer) == 0
            probe = _req("count the waves", max_tokens=64)
            hit = await svc.cache_step.cache.lookup(
                svc.cache_step.plan("", probe, probe.params, svc.model_name).scope
            )
            assert hit is not None and hit.text == ref.text  # the follower that took over stored it
        finally:
            await _close(svc, engine)

    asyncio.run(main())


def test_follower_deadline_does_not_end_the_leader(demo_dir, embedder):
    async def main():
        svc, engine = await _service(demo_dir, embedder)
        try:
            started = asyncio.Event()
            leader = asyncio.create_task(_collect(svc, _req("a long answer please", max_tokens=400), started))
            await started.wait()
            with pytest.raises(ServiceError) as err:
                await _collect(svc, _req("a long answer please", max_tokens=400, timeout_s=0.05))
            assert err.value.code == "deadline_exceeded"
            _, ev = await leader
            assert ev.finished and ev.completion_tokens == 400
        finally:
            await _close(svc, engine)

    asyncio.run(main())


def test_skip_bypasses_coalescing(demo_dir, embedder):
    async def main():
        svc, engine = await _service(demo_dir, embedder)
        try:
            before = _finished(engine)
            results = await asyncio.gather(
                *[_collect(svc, _req("skip me", control="skip")) for _ in range(3)]
            )
            assert all(not ev.cache.coalesced for _, ev in results)
            assert await _settled(engine, before + 3) == before + 3
            assert svc.cache_step.stats()["coalesced"] == 0
        finally:
            await _close(svc, engine)

    asyncio.run(main())


def test_answer_is_visible_the_moment_it_returns(demo_dir, embedder):
    async def main():
        svc, engine = await _service(demo_dir, embedder)
        try:
            cache = svc.cache_step.cache
            lookups = cache.stats()["lookups"]
            _, first = await _collect(svc, _req("How do I reset my password?"))
            # No pause: the exact and the similarity tier both have it already.
            _, again = await _collect(svc, _req("how do I reset my password"))
            assert again.cache.status == "hit_exact" and again.text == first.text
            _, para = await _collect(svc, _req("How can I reset my password?"))
            assert para.cache.status == "hit_semantic" and para.text == first.text
            assert cache.stats()["lookups"] == lookups + 3
        finally:
            await _close(svc, engine)

    asyncio.run(main())


def test_store_reuses_the_lookup_embedding(demo_dir, embedder):
    async def main():
        cache = SemanticCache(CacheConfig(), embedder=embedder)
        try:
            s = CacheScope("t", "m", "s", "", "What is the capital of France?")
            await cache.store(s, "Paris", [1], "stop", 3, 1)
            calls = []
            real = embedder.aembed

            async def counting(texts):
                calls.append(list(texts))
                return await real(texts)

            embedder.aembed = counting
            try:
                s2 = CacheScope("t", "m", "s", "", "Name the capital city of Germany")
                assert await cache.lookup(s2) is None  # embedded once, for the similarity tier
                e = cache.insert(s2, "Berlin", [2], "stop", 3, 1, await cache.query_vector(s2))
                await asyncio.wrap_future(cache.persist(e))
            finally:
                embedder.aembed = real
            assert len(calls) == 1
            hit = await cache.lookup(CacheScope("t", "m", "s", "", "name the capital city of germany"))
            assert hit is not None and hit.text == "Berlin"
        finally:
            cache.close()

    asyncio.run(main())


def test_concurrent_identical_queries_embed_once_and_a_cancelled_caller_does_not_cancel_it(embedder):
    async def main():
        cache = SemanticCache(CacheConfig(), embedder=embedder)
        try:
            await cache.store(
                CacheScope("t", "m", "s", "", "What is the capital of France?"), "Paris", [1], "stop", 3, 1
            )
            calls = []
            real = embedder.aembed
            release = asyncio.Event()

            async def counting(texts):
                calls.append(list(texts))
                await release.wait()  # the embedding stays in flight until every caller has come
                return await real(texts)

            embedder.aembed = counting
            try:
                s = CacheScope("t", "m", "s", "", "Which city is the capital of France?")
                first = asyncio.create_task(cache.lookup(s))
                while not calls:  # until the first caller has started the embedding
                    await asyncio.sleep(0.0005)
                others = [asyncio.create_task(cache.lookup(s)) for _ in range(9)]
                await asyncio.sleep(0)
                first.cancel()  # the embedding it started goes on for the others
                await asyncio.sleep(0)
                release.set()
                results = await asyncio.wait_for(asyncio.gather(*others), 60)
            finally:
                embedder.aembed = real
            assert len(calls) == 1
            assert len({None if r is None else r.text for r in results}) == 1
        finally:
            cache.close()

    asyncio.run(main())

"""Speculative decoding (n-gram prompt lookup) through the whole engine: exactness, resources, limits."""

from __future__ import annotations

import random

import pytest

from sidecar import LLM, SamplingParams
from sidecar.config import EngineConfig
from sidecar.engine.block_pool import hash_block
from sidecar.engine.spec.state import SpecState


def make_llm(model_dir, spec, **kw):
    kw.setdefault("block_size", 8)
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("dtype", "float32")
    return LLM(
        model=str(model_dir),
        speculative=spec,
        speculative_max_batch=kw.pop("max_batch", 1024),
        **kw,
    )


def repetitive_prompts(n: int, seed: int = 0, vocab: int = 250) -> list[list[int]]:
    """Half copy-heavy (a repeated random phrase: the n-gram table predicts them), half random."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            phrase = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 10))]
            out.append((phrase * 8)[: rng.randint(8, 70)])
        else:
            out.append([rng.randrange(3, vocab) for _ in range(rng.randint(3, 70))])
    return out


def pool_whole(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.requests and not eng.kv.req_blocks
    assert eng.kv.num_free_blocks() == eng.kv.num_blocks
    assert all(b.ref_cnt == 0 for b in eng.kv.pool.blocks[1:])


def spec_counts(llm: LLM) -> tuple[int, int]:
    s = llm.stats()
    return s["spec_decode_proposed_tokens"], s["spec_decode_accepted_tokens"]


GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def greedy_off(demo_dir):
    prompts = repetitive_prompts(64)
    llm = make_llm(demo_dir, None)
    return prompts, [o.token_ids for o in llm.generate(prompts, GREEDY)]


def test_greedy_identical_on_and_off_64_prompts(demo_dir, greedy_off):
    prompts, ref = greedy_off
    llm = make_llm(demo_dir, "ngram")
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    proposed, accepted = spec_counts(llm)
    assert accepted > 100 and proposed > accepted  # exercised, with both accepts and rejects
    s = llm.stats()
    assert s["spec_decode_verifications"] == sum(s["spec_decode_acceptance_hist"])
    assert s["spec_decode_emitted_tokens"] == s["spec_decode_verifications"] + accepted
    pool_whole(llm)


@pytest.mark.parametrize("budget,blocks", [(3, 256), (2048, 24)])
def test_greedy_identical_under_small_budget_and_preemption(demo_dir, greedy_off, budget, blocks):
    prompts, ref = greedy_off
    llm = make_llm(demo_dir, "ngram", max_num_batched_tokens=budget, num_kv_blocks=blocks)
    sizes = []
    orig = llm.engine.scheduler.schedule

    def schedule():
        out = orig()
        sizes.append((out.num_batched_tokens, sum(s.num_spec_tokens for s in out.scheduled)))
        return out

    llm.engine.scheduler.schedule = schedule
    outs = llm.generate(prompts[:16], GREEDY)
    assert [o.token_ids for o in outs] == ref[:16]
    assert max(n for n, _ in sizes) <= budget  # proposed tokens are counted in the step's budget
    assert any(k for _, k in sizes)
    if blocks < 256:
        assert llm.stats()["num_preemptions"] > 0
    pool_whole(llm)


def test_blocks_of_rejected_tokens_returned_and_never_hashed(demo_dir):
    llm = make_llm(demo_dir, "ngram")
    eng = llm.engine
    prompts = repetitive_prompts(12, seed=3)
    ids = [eng.add_request(None, p, GREEDY) for p in prompts]
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        for r in eng.scheduler.running:  # after every step: blocks cover exactly the computed tokens
            assert len(eng.kv.req_blocks[r.request_id]) == -(-r.num_computed_tokens // 8)
    # Every prefix-cache key is a chain over real (prompt + accepted) tokens only.
    valid = set()
    for rid in ids:
        toks = done[rid].prompt_token_ids + done[rid].token_ids
        parent = None
        for i in range(len(toks) // 8):
            parent = hash_block(parent, tuple(toks[i * 8 : (i + 1) * 8]), None)
            valid.add(parent)
    assert eng.kv.pool.cached and set(eng.kv.pool.cached) <= valid
    assert spec_counts(llm)[1] > 0
    pool_whole(llm)


def test_max_tokens_stop_strings_and_logprobs_match_off(demo_dir):
    prompts = repetitive_prompts(8, seed=5)
    params = [SamplingParams(max_tokens=m, ignore_eos=True, logprobs=2) for m in (1, 2, 3, 5, 8, 13, 21, 34)]
    base = make_llm(demo_dir, None).generate(prompts, params)
    llm = make_llm(demo_dir, "ngram")
    outs = llm.generate(prompts, params)
    for p, a, b in zip(params, base, outs):
        assert b.token_ids == a.token_ids and len(b.token_ids) == p.max_tokens
        assert [lp.token_id for lp in b.logprobs] == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
    # A stop string cuts the text and drops the tokens verified after it.
    stops = [
        SamplingParams(max_tokens=40, ignore_eos=True, stop=[o.text[3:5]]) for o in base if len(o.text) > 6
    ]
    sp = [p for p, o in zip(prompts, base) if len(o.text) > 6]
    want = make_llm(demo_dir, None).generate(sp, stops)
    got = llm.generate(sp, stops)
    assert [(o.text, o.token_ids, o.finish_reason) for o in got] == [
        (o.text, o.token_ids, o.finish_reason) for o in want
    ]
    assert spec_counts(llm)[1] > 0
    pool_whole(llm)


def test_abort_during_speculation_frees_everything(demo_dir):
    llm = make_llm(demo_dir, "ngram")
    eng = llm.engine
    ids = [
        eng.add_request(None, p, SamplingParams(max_tokens=200, ignore_eos=True))
        for p in repetitive_prompts(6, seed=7)
    ]
    for _ in range(6):
        eng.step()
    assert spec_counts(llm)[0] > 0
    for rid in ids:
        eng.abort(rid)
    outs = eng.step()
    assert {o.request_id for o in outs if o.finished and o.finish_reason == "abort"} == set(ids)
    pool_whole(llm)


def test_opt_out_structured_penalties_seeded_sampling_and_large_batch_do_not_speculate(demo_dir):
    prompts = repetitive_prompts(4, seed=9)
    llm = make_llm(demo_dir, "ngram")
    llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True, speculative=False))
    llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=1.2))
    llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, seed=1))
    out = llm.generate(prompts[:1], SamplingParams(max_tokens=20, structured=["yes", "no"]))[0]
    assert out.text in ("yes", "no")
    assert spec_counts(llm) == (0, 0)
    big = make_llm(demo_dir, "ngram", max_batch=4)
    big.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert spec_counts(big) == (0, 0)  # 4 running requests reach speculative_max_batch
    big.generate(prompts[:3], SamplingParams(max_tokens=20, ignore_eos=True))
    assert spec_counts(big)[0] > 0
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="yes")


def test_adaptive_k_follows_acceptance_and_backs_off():
    st = SpecState([1.0, 1.15, 1.3, 1.45, 1.6])
    k0 = st.choose_k()
    for _ in range(6):
        st.update(4, 4)  # everything accepted: k grows to the maximum
    assert st.choose_k() == 4 > k0
    for _ in range(10):
        st.update(4, 1)  # one in four: shorter proposals pay better
    assert 1 <= st.choose_k() < 4
    for _ in range(10):
        st.update(1, 0)
    assert st.choose_k() == 0 and st.cooldown == 2  # not worth it: off for 2 steps, then a k=1 probe
    assert [st.choose_k(), st.choose_k()] == [0, 1]
    st.update(1, 0)  # failed probe: off for longer
    assert st.cooldown == 4
    assert [st.choose_k() for _ in range(4)] == [0, 0, 0, 1]
    free = SpecState([1.0] * 5)  # verification free (e.g. a memory-bound GPU): always speculate
    for _ in range(10):
        free.update(4, 0)
    assert free.choose_k() >= 1


@pytest.mark.parametrize(
    "field,kw",
    [
        ("speculative", dict(speculative="bogus")),
        ("speculative", dict(speculative="draft:")),
        ("speculative", dict(speculative="draft: ")),
        ("num_speculative_tokens", dict(speculative="ngram", num_speculative_tokens=0)),
        ("speculative_max_batch", dict(speculative="ngram", speculative_max_batch=0)),
        ("speculative_token_cost", dict(speculative_token_cost=-1)),
    ],
)
def test_config_errors_name_the_field(field, kw):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="demo", **kw)


def test_spec_metrics_exposed_from_engine_stats(demo_dir):
    from sidecar.server.metrics import Metrics

    llm = make_llm(demo_dir, "ngram")
    llm.generate(repetitive_prompts(4, seed=2), SamplingParams(max_tokens=30, ignore_eos=True))
    s = llm.stats()
    text = Metrics(llm.stats).render()[0].decode()
    assert f"sidecar_spec_decode_proposed_tokens_total {float(s['spec_decode_proposed_tokens'])}" in text
    assert f"sidecar_spec_decode_accepted_tokens_total {float(s['spec_decode_accepted_tokens'])}" in text
    assert f"sidecar_spec_decode_acceptance_count {float(s['spec_decode_verifications'])}" in text
    assert f"sidecar_spec_decode_acceptance_sum {float(s['spec_decode_accepted_tokens'])}" in text
    assert (
        f'sidecar_spec_decode_acceptance_bucket{{le="0"}} {float(s["spec_decode_acceptance_hist"][0])}'
        in text
    )


def test_measured_price_never_makes_longer_proposals_cheaper():
    from sidecar.engine.kv_cache import KVCacheManager
    from sidecar.engine.spec.decoder import SpecDecoder

    class NoisyRunner:
        num_blocks = 64
        timed: list = []

        def time_decode_rows(self, rows):
            self.timed = list(rows)
            # a neighbour disturbed the 1- and 3-token runs; past 5 rows each row costs 2 ms
            return [
                {1: 0.010, 2: 0.009, 3: 0.013, 4: 0.012, 5: 0.020}.get(r, 0.010 + 0.002 * r) for r in rows
            ]

    cfg = EngineConfig(model="demo", speculative="ngram", num_speculative_tokens=4, speculative_max_batch=4)
    runner = NoisyRunner()
    spec = SpecDecoder(cfg, KVCacheManager(64, 16), 512, runner)
    assert spec.costs == pytest.approx([1.0, 1.0, 1.3, 1.3, 2.0])
    # Batches up to 3 requests: a batch of 3 verifying k tokens each runs 3 (k + 1) rows, up to 15.
    assert (
        runner.timed[:5] == [1, 2, 3, 4, 5]
        and runner.timed[-1] == 15
        and runner.timed == sorted(runner.timed)
    )
    t = lambda r: 0.010 + 0.002 * r  # noqa: E731 (exact at measured counts, and linear between them)
    assert spec.batch_costs[1] == spec.costs
    assert spec.batch_costs[3] == pytest.approx([1.0] + [t(3 * (k + 1)) / 0.013 for k in range(1, 5)])
    assert len(spec.batch_costs) == 4  # a batch of 4 does not speculate


def test_verification_steps_replay_from_c_with_plain_decodes_tokens(demo_dir):
    """On CPU a verification step is a decode step of one row per token: it goes through the C replay (a step of
    1 + k rows for one request verifying k tokens) and its tokens are plain decoding's."""
    prompts = [p for p in repetitive_prompts(8, seed=3) if len(p) > 16][:3]
    kw = dict(dtype="bfloat16", max_num_seqs=4, speculative_token_cost=0.0)
    plain = make_llm(demo_dir, None, **kw)
    llm = make_llm(demo_dir, "ngram", num_speculative_tokens=3, **kw)
    runner = llm.engine.runner
    assert runner.cpu_plans.replays(), llm.engine.model_info["cpu_decode_replay_reason"]
    buckets: list[int] = []
    run = runner.cpu_plans.run
    runner.cpu_plans.run = lambda bucket: buckets.append(bucket) or run(bucket)
    for p in prompts:  # one request at a time: each of its steps after the prompt decodes or verifies
        assert llm.generate([p], GREEDY)[0].token_ids == plain.generate([p], GREEDY)[0].token_ids
    proposed, accepted = spec_counts(llm)
    assert proposed > 0 and accepted > 0
    assert set(buckets) > {1}  # verifications replayed as steps of 1 + k rows
    pool_whole(llm)

"""Bounded-KV decoding (engine/kv_evict.py): budgets, streaming and h2o eviction, sliding-window models."""

from __future__ import annotations

import random

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.engine.kv_cache import KVCacheManager
from sidecar.engine.kv_evict import budget_policy, step_blocks
from sidecar.engine.kv_scores import SlotScores
from sidecar.engine.request import Request

BS = 8


def hf_greedy(model_dir, prompt: list[int], max_new: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        g = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return g[0, len(prompt) :].tolist()


def prompt_of(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 900) for _ in range(n)]


def lowest_of(score: dict[int, float], seen: list | None = None):
    """A ``KVCacheManager.lowest_blocks`` over fixed block scores (``seen`` collects each call's ``now``)."""

    def lowest(ids: list[int], now: int, k: int) -> list[int]:
        if seen is not None:
            seen.append(now)
        return sorted(range(len(ids)), key=lambda j: (score[ids[j]], j))[:k]

    return lowest


def assert_pool_whole(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.requests
    assert eng.kv.num_free_blocks() == eng.kv.num_blocks
    assert not eng.kv.req_blocks
    assert all(b.ref_cnt == 0 for b in eng.kv.pool.blocks[1:])


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["llama"]


@pytest.mark.parametrize("kind", ["streaming", "h2o"])
def test_budget_above_context_equals_full_cache_and_hf(llama, kind):
    prompt, new = prompt_of(37), 24
    full = LLM(model=str(llama), dtype="float32", block_size=BS)
    want = full.generate([prompt], SamplingParams(max_tokens=new, ignore_eos=True))[0].token_ids
    assert want == hf_greedy(llama, prompt, new)
    llm = LLM(model=str(llama), dtype="float32", block_size=BS, kv_budget=256, kv_eviction=kind)
    out = llm.generate([prompt], SamplingParams(max_tokens=new, ignore_eos=True))[0]
    assert out.token_ids == want
    assert llm.engine.kv.num_evicted_blocks == 0
    # The same through a per-request budget on an engine without one.
    per_request = SamplingParams(max_tokens=new, ignore_eos=True, kv_budget=256, kv_eviction=kind)
    assert full.generate([prompt], per_request)[0].token_ids == want
    assert_pool_whole(llm)


def _run_tracking(llm: LLM, rid: str, budget_blocks: int, window_blocks: int, streaming: bool, stop_at=None):
    """Step the engine until ``rid`` finishes (or ``stop_at`` steps), checking after every step that its table
    holds at most ``budget_blocks`` blocks, its first block is the sequence's first block, and its last
    ``window_blocks`` blocks (for streaming: every block after the sinks) are its most recent ones."""
    eng = llm.engine
    logical: dict[int, int] = {}  # block id -> the logical block (position // BS) written into it
    prev: list[int] = []
    steps, done = 0, None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == rid and out.finished:
                done = out
        steps += 1
        req = eng.requests.get(rid)
        if req is None:
            continue
        table = eng.kv.block_ids(req)
        assert len(table) <= budget_blocks
        c = req.num_computed_tokens
        assert -(-(c - req.kv_evicted) // BS) == len(table)  # the kept tokens fill the table, in order
        last = (c - 1) // BS
        for j, b in enumerate(table):  # blocks new to the table were appended at its end
            if b not in prev:
                logical[b] = last - (len(table) - 1 - j)
        prev = table
        assert logical[table[0]] == 0, "the sink block was evicted"
        recent = table[1:] if streaming else table[-window_blocks:]
        assert [logical[b] for b in recent] == list(range(last - len(recent) + 1, last + 1))
        if stop_at is not None and steps >= stop_at:
            return None
    return done


@pytest.mark.parametrize("kind", ["streaming", "h2o"])
def test_small_budget_bounds_blocks_past_the_pool(llama, kind):
    # A pool of 11 usable blocks (88 tokens) and a sequence of 40 + 150 tokens under a 32-token budget.
    llm = LLM(model=str(llama), dtype="float32", block_size=BS, num_kv_blocks=12)
    assert llm.engine.max_model_len == 88
    params = SamplingParams(max_tokens=150, ignore_eos=True, kv_budget=32, kv_eviction=kind)
    rid = llm.engine.add_request(None, prompt_of(40), params)
    policy = llm.engine.requests[rid].kv_policy
    assert (policy.budget_blocks, policy.sink_blocks, policy.window_blocks) == (4, 1, 1)
    out = _run_tracking(llm, rid, 4, policy.window_blocks, kind == "streaming")
    assert out.finish_reason == "length" and len(out.token_ids) == 150
    assert llm.engine.scheduler.num_preemptions == 0
    assert llm.engine.kv.num_evicted_blocks >= (190 - 32) // BS
    assert_pool_whole(llm)


def test_h2o_window_and_abort_return_every_block(llama):
    llm = LLM(model=str(llama), dtype="float32", block_size=BS, num_kv_blocks=12)
    params = SamplingParams(max_tokens=200, ignore_eos=True, kv_budget=64, kv_eviction="h2o")
    rid = llm.engine.add_request(None, prompt_of(50, seed=3), params)
    policy = llm.engine.requests[rid].kv_policy
    assert (policy.budget_blocks, policy.window_blocks) == (8, 3)
    assert _run_tracking(llm, rid, 8, 3, False, stop_at=40) is None
    assert llm.engine.requests[rid].kv_evicted > 0
    llm.engine.abort(rid)
    llm.engine.step()
    assert_pool_whole(llm)


def _manager_with(table_blocks: int, kind: str, budget: int):
    kv = KVCacheManager(32, 4, enable_caching=False)
    req = Request("r", list(range(100)), SamplingParams())
    req.kv_policy = budget_policy(kind, budget, 4)
    assert kv.allocate_slots(req, table_blocks * 4)
    req.num_computed_tokens = table_blocks * 4
    return kv, req


def test_h2o_evicts_the_lowest_scored_block_outside_sinks_and_window():
    kv, req = _manager_with(6, "h2o", 24)  # 6 blocks of 4: sinks 1, window 2, blocks 1..3 evictable
    table = kv.block_ids(req)
    # The sink (0) and the window (4, 5) score lowest of all but are never candidates; block 2 is the least
    # attended candidate.
    score = {table[0]: 0.0, table[1]: 5.0, table[2]: 1.0, table[3]: 3.0, table[4]: 9.0, table[5]: 0.0}
    kv.lowest_blocks = lowest_of(score)
    free_before = kv.num_free_blocks()
    assert kv.evict(req, 1) == 1
    assert kv.block_ids(req) == [table[0], table[1], table[3], table[4], table[5]]
    assert req.kv_evicted == 4 and kv.num_free_blocks() == free_before + 1
    assert kv.allocate_slots(req, 1)
    assert len(kv.block_ids(req)) == 6
    # Next in line: block 3 (score 3) before block 1 (score 5) and block 4 (9, out of the window now).
    req.num_computed_tokens += 4  # the new block filled
    kv.evict(req, 1)
    assert kv.block_ids(req)[:3] == [table[0], table[1], table[4]]


def test_streaming_evicts_the_oldest_and_caps_a_prompt_chunk():
    kv, req = _manager_with(6, "streaming", 24)
    table = kv.block_ids(req)
    # 40 new tokens: at most (budget 6 + 3 evictable) * 4 - 24 kept = 12 fit this step, after every
    # evictable block goes.
    assert kv.evict(req, 40) == 12
    assert kv.block_ids(req) == [table[0], table[4], table[5]]
    assert req.kv_evicted == 12


def test_h2o_caps_a_prompt_chunk_to_leave_candidates():
    # 16 blocks of 4 under a 64-token budget: sinks 1, window 7, 8 candidates, of which one step evicts
    # at most 2 (a quarter), each time the 2 least attended.
    kv, req = _manager_with(16, "h2o", 64)
    table = kv.block_ids(req)
    assert step_blocks(req.kv_policy) == 2
    score = {b: 10.0 - i for i, b in enumerate(table)}  # later candidates are attended less
    seen = []
    kv.lowest_blocks = lowest_of(score, seen)
    # 40 new tokens: streaming would empty the 8 candidates and take 32; h2o takes 2 blocks' worth.
    assert kv.evict(req, 40) == 8
    assert kv.block_ids(req) == table[:7] + table[9:]
    assert req.kv_evicted == 8 and seen == [64]
    kv2, req2 = _manager_with(16, "streaming", 64)
    assert kv2.evict(req2, 40) == 32 and len(kv2.block_ids(req2)) == 8


def test_slot_scores_rank_by_attention_per_query():
    scores = SlotScores(4 * 2, 2, torch.device("cpu"))
    got = scores.for_step(torch.tensor([0, 1, 2, 3, 4, 5]), torch.tensor([0, 1, 2, 3, 4, 5]))
    # Blocks 0, 1, 2 hold positions 0-1, 2-3, 4-5; each received a total of 4 by the time 10 tokens ran.
    got[:6] = torch.tensor([3.0, 1.0, 2.0, 2.0, 1.0, 3.0])
    # Per query: block 0 (3/10 + 1/9) / 2, block 1 (2/8 + 2/7) / 2, block 2 (1/6 + 3/5) / 2.
    want = [(0.3 + 1 / 9) / 2, (0.25 + 2 / 7) / 2, (1 / 6 + 0.6) / 2]
    assert scores.block_scores([0, 1, 2], 10).tolist() == pytest.approx(want)
    # Ranked on the tensor, lowest first; only the asked-for indices come back.
    assert scores.lowest([2, 1, 0], 10, 2) == [2, 1] and scores.lowest([0, 1, 2], 10, 0) == []
    # A slot written again restarts: received 0, its position the new token's.
    scores.for_step(torch.tensor([0]), torch.tensor([10]))
    assert scores.received[0] == 0 and scores.written_at[0] == 10
    assert scores.block_scores([0], 12).tolist() == pytest.approx([(0 / 2 + 1 / 11) / 2])
    fresh = SlotScores(8, 2, torch.device("cpu"))
    assert fresh.block_scores([1, 2], 5).tolist() == [0.0, 0.0]
    assert fresh.lowest([3, 1, 2], 5, 2) == [0, 1]  # a tie: the earlier index first


def test_scores_sum_to_queries_times_heads_and_layers(llama):
    llm = LLM(model=str(llama), dtype="float32", block_size=BS, kv_budget=256, kv_eviction="h2o")
    eng = llm.engine
    rid = eng.add_request(None, prompt_of(21), SamplingParams(max_tokens=5, ignore_eos=True))
    req = eng.requests[rid]
    a = eng.loaded.args
    for _ in range(3):
        eng.step()
        slots = [b * BS + i for b in eng.kv.block_ids(req) for i in range(BS)][: req.num_computed_tokens]
        total = eng.runner.kv_scores[slots].sum().item()
        # Every query row of every head of every layer spreads a weight of one over its keys.
        assert total == pytest.approx(a.num_layers * a.num_heads * req.num_computed_tokens, rel=1e-4)
    eng.abort(rid)
    eng.step()


def test_evicted_sequence_never_publishes_stale_blocks(llama):
    prompt = prompt_of(40, seed=5)
    llm = LLM(model=str(llama), dtype="float32", block_size=BS)
    a = llm.generate([prompt], SamplingParams(max_tokens=60, ignore_eos=True, kv_budget=32))[0]
    assert llm.engine.kv.num_evicted_blocks > 0
    follow = prompt + a.token_ids
    hits_before = llm.engine.kv.prefix_hits
    b = llm.generate([follow], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    # Only the blocks written before the first eviction (the first 32-token chunk) were published.
    assert llm.engine.kv.prefix_hits - hits_before <= 32
    fresh = LLM(model=str(llama), dtype="float32", block_size=BS, enable_prefix_caching=False)
    assert (
        b.token_ids == fresh.generate([follow], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
    )
    assert_pool_whole(llm)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, demo_dir):
    import shutil

    import transformers as tf

    from tests.conftest import TINY

    out = tmp_path_factory.mktemp("mistral_window") / "m"
    cfg = tf.MistralConfig(
        **TINY,
        vocab_size=len(tf.AutoTokenizer.from_pretrained(str(demo_dir))),
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=None,
        tie_word_embeddings=False,
        sliding_window=20,
    )
    torch.manual_seed(1)
    tf.MistralForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    for f in demo_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def test_sliding_window_model_frees_blocks_outside_the_window(windowed):
    prompt, new = prompt_of(30, seed=7), 50
    llm = LLM(model=str(windowed), dtype="float32", block_size=BS)
    eng = llm.engine
    rid = eng.add_request(None, prompt, SamplingParams(max_tokens=new, ignore_eos=True))
    req = eng.requests[rid]
    assert req.kv_policy.kind == "window"
    out, most = None, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
        if rid in eng.requests:
            most = max(most, len(eng.kv.block_ids(req)))
    # A window of 20 keys spans at most 4 blocks of 8; one more holds the next token's block.
    assert most <= 5 and req.kv_evicted > 0
    assert out.token_ids == hf_greedy(windowed, prompt, new)
    assert_pool_whole(llm)
    with pytest.raises(ValueError, match="^kv_budget:"):
        eng.add_request(None, prompt, SamplingParams(kv_budget=64))


def test_bad_budgets_are_refused_naming_the_field(llama):
    with pytest.raises(ValueError, match="^kv_budget:"):
        SamplingParams(kv_budget=0)
    with pytest.raises(ValueError, match="^kv_eviction:"):
        SamplingParams(kv_eviction="lru")
    with pytest.raises(ValueError, match="^kv_budget:"):
        SamplingParams(beam_width=2, kv_budget=64)
    with pytest.raises(ValueError, match="^kv_budget:"):
        LLM(model=str(llama), dtype="float32", block_size=BS, kv_budget=16)
    llm = LLM(model=str(llama), dtype="float32", block_size=BS)
    with pytest.raises(ValueError, match="^kv_budget: must be at least 24 tokens"):
        llm.generate([[5, 6, 7]], SamplingParams(kv_budget=23))
    with pytest.raises(ValueError, match="^kv_eviction: needs a kv_budget"):
        llm.generate([[5, 6, 7]], SamplingParams(kv_eviction="h2o"))
    assert_pool_whole(llm)

"""Greedy float32 output equals HF transformers generate, token for token, in every scheduling regime."""

from __future__ import annotations

import random

import pytest
import torch

from sidecar import LLM, SamplingParams

MAX_NEW = 12


def hf_greedy(model_dir, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # compare full-length continuations
    return hf_generate(hf, prompts, max_new)


def hf_generate(hf, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy continuations of ``max_new`` tokens of each prompt (one at a time) by the HF model ``hf``."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            g = hf.generate(
                torch.tensor([p]),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(g[0, len(p) :].tolist())
    return outs


def make_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_pool_whole(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.requests
    assert eng.kv.num_free_blocks() == eng.kv.num_blocks
    assert not eng.kv.req_blocks
    assert all(b.ref_cnt == 0 for b in eng.kv.pool.blocks[1:])


GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def references(tiny_models):
    prompts = make_prompts(16, 900, 3, 70)
    return prompts, {k: hf_greedy(d, prompts) for k, d in tiny_models.items()}


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_single_request_matches_hf(tiny_models, references, kind):
    prompts, ref = references
    llm = LLM(model=str(tiny_models[kind]), dtype="float32")
    out = llm.generate([prompts[0]], GREEDY)[0]
    assert out.token_ids == ref[kind][0]
    assert out.finish_reason == "length"
    assert_pool_whole(llm)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_concurrent_mixed_lengths_match_hf(tiny_models, references, kind):
    prompts, ref = references
    llm = LLM(model=str(tiny_models[kind]), dtype="float32")
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref[kind]
    assert_pool_whole(llm)


@pytest.mark.parametrize("budget", [7, 32])
def test_chunked_prefill_small_budget_matches_hf(tiny_models, references, budget):
    prompts, ref = references
    llm = LLM(model=str(tiny_models["qwen2"]), dtype="float32", max_num_batched_tokens=budget, block_size=8)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref["qwen2"]
    assert llm.engine.counters["num_steps"] > MAX_NEW  # prompts really were split across steps
    assert_pool_whole(llm)


@pytest.mark.parametrize("caching", [True, False])
def test_forced_preemption_matches_hf(tiny_models, references, caching):
    prompts, ref = references
    # 24 usable blocks of 8 tokens cannot hold 16 requests of up to 82 tokens at once.
    llm = LLM(
        model=str(tiny_models["llama"]),
        dtype="float32",
        block_size=8,
        num_kv_blocks=25,
        enable_prefix_caching=caching,
    )
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == ref["llama"]
    assert_pool_whole(llm)


def test_requests_arriving_while_others_decode(tiny_models, references):
    prompts, ref = references
    llm = LLM(model=str(tiny_models["mistral"]), dtype="float32")
    eng = llm.engine
    done = {}
    pending = list(enumerate(prompts))
    ids = {}
    steps = 0
    while pending or eng.has_unfinished_requests():
        if pending and steps % 3 == 0:  # a new arrival every third step
            i, p = pending.pop(0)
            ids[eng.add_request(f"r{i}", p, GREEDY)] = i
        for out in eng.step():
            if out.finished:
                done[ids[out.request_id]] = out.token_ids
        steps += 1
    assert [done[i] for i in range(len(prompts))] == ref["mistral"]
    assert_pool_whole(llm)


def test_prefix_caching_identical_to_no_caching(tiny_models):
    shared = make_prompts(1, 900, 40, 40, seed=3)[0]
    tails = make_prompts(8, 900, 1, 20, seed=4)
    prompts = [shared + t for t in tails]
    outs = {}
    for caching in (True, False):
        llm = LLM(
            model=str(tiny_models["qwen2"]), dtype="float32", block_size=8, enable_prefix_caching=caching
        )
        first = llm.generate(prompts[:1], GREEDY)
        rest = llm.generate(prompts[1:], GREEDY)
        outs[caching] = [o.token_ids for o in first + rest]
        if caching:
            assert all(o.num_cached_tokens == 40 for o in rest)
        else:
            assert all(o.num_cached_tokens == 0 for o in rest)
        assert_pool_whole(llm)
    assert outs[True] == outs[False]

"""KV groups (engine/kv_groups.py, kv_grouped.py): Gemma 2's sliding layers and Llama 4's chunked layers keep
their own block tables and give back the blocks their window or chunk has passed. Greedy float32 equal to HF
transformers with prompts and generations many windows long, chunked prefill across window and chunk edges,
a tight pool (preemption), freed blocks overwritten with other data, prefix-cache hits after the window's
blocks were freed; the sliding group's blocks per sequence stay bounded; the pool whole after each run."""

from __future__ import annotations

import pytest
import torch

from sidecar import LLM, SamplingParams
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy
from tests.unit.model.family_checkpoints import build_family_checkpoint
from tests.unit.model.llama4_checkpoints import build_llama4_checkpoint

NEW = 16
GREEDY = SamplingParams(max_tokens=NEW, ignore_eos=True)
# Windows of 8 tokens and chunks of 16: prompts of several windows, generations crossing more.
PROMPTS = [[5 + (11 * i + 5 * j) % 700 for j in range(n)] for i, n in enumerate([37, 52, 23])]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("kv_groups")
    return {
        "gemma2": build_family_checkpoint("gemma2", root / "gemma2", demo_dir),
        "llama4": build_llama4_checkpoint("llama4", root / "llama4", demo_dir),
    }


@pytest.fixture(scope="module")
def refs(dirs):
    return {k: hf_greedy(d, PROMPTS, NEW) for k, d in dirs.items()}


def _scribble_freed(llm: LLM) -> list[int]:
    """Overwrite every block the moment its last reference goes (prefix caching is off, so no freed block is
    legitimately read again): a path reading a freed table entry as data would see other numbers."""
    pool, caches = llm.engine.kv.pool, llm.engine.runner.kv_caches
    free, seen = pool.free, []

    def scribbling_free(blocks):
        blocks = list(blocks)
        free(blocks)
        for b in blocks:
            if b.ref_cnt == 0:
                seen.append(b.block_id)
                for cache in caches:
                    for t in cache:
                        t[b.block_id] = (torch.randn_like(t[b.block_id], dtype=torch.float32) * 50).to(
                            t.dtype
                        )

    pool.free = scribbling_free
    return seen


@pytest.mark.parametrize("kind,pages", [("gemma2", 16), ("llama4", 28)])
def test_groups_free_out_of_window_blocks_and_match_hf(dirs, refs, kind, pages):
    llm = LLM(
        model=str(dirs[kind]),
        dtype="float32",
        block_size=8,
        num_kv_blocks=pages,
        max_num_batched_tokens=10,  # prompt chunks end inside windows and chunks
        enable_prefix_caching=False,
    )
    kv = llm.engine.kv
    assert kv.plan is not None and {g.kind for g in kv.groups} >= {"full"}
    scribbled = _scribble_freed(llm)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == refs[kind]
    assert kv.num_released_blocks > 0 and scribbled
    assert llm.engine.scheduler.num_preemptions > 0  # the pages cannot hold every sequence at once
    assert_pool_whole(llm)


def test_sliding_group_blocks_stay_bounded_over_a_long_generation(dirs):
    llm = LLM(model=str(dirs["gemma2"]), dtype="float32", block_size=8, max_num_batched_tokens=8)
    kv, eng = llm.engine.kv, llm.engine
    sliding = [i for i, g in enumerate(kv.groups) if g.kind == "sliding"]
    bound = max(kv.groups[i].max_blocks(8, 1) for i in sliding)
    groups = eng.model_info["cache_groups"]  # what /v1/models reports
    assert [(g["kind"], g["layers"], g.get("window")) for g in groups] == [
        ("attention", 2, None),
        ("sliding_attention", 2, 8),
    ]
    assert groups[1]["max_blocks_per_sequence"] == bound == 2 and groups[0]["max_blocks_per_sequence"] is None
    eng.add_request("long", PROMPTS[1], SamplingParams(max_tokens=60, ignore_eos=True))
    held = []
    while eng.requests:
        eng.step()
        req = eng.requests.get("long")
        if req is not None and req.num_computed_tokens >= len(PROMPTS[1]):  # decoding
            held.append(kv.held_blocks(req))
    assert len(held) >= 50
    assert max(h[i] for h in held for i in sliding) <= bound  # ceil(8 / 8) + 1 pages however long
    assert max(h[0] for h in held) >= 13  # the full group keeps every block
    assert_pool_whole(llm)


def test_prefix_hit_after_window_blocks_were_freed(dirs, refs):
    llm = LLM(model=str(dirs["gemma2"]), dtype="float32", block_size=8, max_num_batched_tokens=16)
    first = llm.generate(PROMPTS[1:2], GREEDY)[0]
    assert llm.engine.kv.num_released_blocks > 0
    again = llm.generate(PROMPTS[1:2], GREEDY)[0]
    assert first.token_ids == again.token_ids == refs["gemma2"][1]
    assert again.num_cached_tokens >= 48
    assert_pool_whole(llm)


def test_int8_kv_and_beam_search_through_groups_agree_with_one_table(dirs, monkeypatch):
    """An int8 cache and beam search (forks sharing pages, copy-on-write per group) through the groups compute
    what the single-table layout (groups off) does."""
    assert_groups_agree_with_one_table(dirs["gemma2"], PROMPTS, GREEDY, 12, monkeypatch)


def assert_groups_agree_with_one_table(path, prompts, greedy, beam_tokens: int, monkeypatch, **kw) -> None:
    """Greedy generations of ``prompts`` and a 3-beam search of the second, with an int8 cache, give the same
    tokens and scores with KV groups as with the groups off; the pool whole after each."""
    from sidecar import BeamSearchParams
    from sidecar.engine import kv_budget

    outs = {}
    for grouped in (True, False):
        if not grouped:
            monkeypatch.setattr(kv_budget, "plan_groups", lambda *a: (None, "off for the comparison"))
        llm = LLM(model=str(path), dtype="float32", block_size=8, kv_cache_dtype="int8", **kw)
        assert (llm.engine.runner.kv_plan is not None) == grouped
        params = BeamSearchParams(beam_width=3, max_tokens=beam_tokens, ignore_eos=True)
        beams = llm.beam_search([prompts[1]], params)
        outs[grouped] = (
            [o.token_ids for o in llm.generate(prompts, greedy)],
            [(b.token_ids, round(b.cum_logprob, 4)) for b in beams[0].sequences],
        )
        assert_pool_whole(llm)
    assert outs[True] == outs[False]
    assert len(outs[True][1]) == 3 and len({tuple(t) for t, _ in outs[True][1]}) == 3


def test_a_kv_budget_is_refused_for_a_grouped_model(dirs):
    """Llama 4 has no sliding window, but its chunked layers page a group that a budget would not bound."""
    with pytest.raises(ValueError, match="kv_budget: not available .* chunked"):
        LLM(model=str(dirs["llama4"]), dtype="float32", kv_budget=64)
    llm = LLM(model=str(dirs["llama4"]), dtype="float32")
    with pytest.raises(ValueError, match="kv_budget"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, kv_budget=64))
    assert_pool_whole(llm)

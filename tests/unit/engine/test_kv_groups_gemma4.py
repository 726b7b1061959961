"""KV groups for Gemma 4 (engine/kv_groups.py): its sliding layers (2 KV heads of 16) and full layers (1 KV head
of 32) page groups on cache tensors of their own shape, and the layers sharing an earlier layer's KV
(``kv_source``) keep no cache and attend through their source's group. Two tiny checkpoints: five layers
(groups of one layer) and eight (groups of two, a reader on each group's second tensor). Greedy float32
equal to HF transformers with a window of 6 shorter than the prompts, prompt chunks ending inside windows,
a tight pool (preemption), freed blocks overwritten with other data, a prefix-cache hit after the window's
blocks were given back, aborts mid-prompt and mid-generation, n-gram verification rows, int8 KV and beam
forks; the sliding groups' blocks per sequence bounded while the full group keeps every one; the pool whole
after each run."""

from __future__ import annotations

import json

import pytest

from sidecar import LLM, SamplingParams
from sidecar.engine.kv_budget import kv_bytes_per_block
from sidecar.engine.kv_groups import NULL, KVGroup, plan_groups
from sidecar.model.args import ModelArgs
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy
from tests.unit.engine.test_kv_groups import _scribble_freed, assert_groups_agree_with_one_table
from tests.unit.model.family_checkpoints import assert_not_degenerate
from tests.unit.model.gemma4_checkpoints import build_gemma4_checkpoint

NEW = 8
GREEDY = SamplingParams(max_tokens=NEW, ignore_eos=True)
PROMPTS = [[5 + (11 * i + 5 * j) % 700 for j in range(n)] for i, n in enumerate([30, 44, 19])]
S, F = "sliding_attention", "full_attention"
SLIDING, FULL = (2, 16), (1, 32)  # (KV heads, head size) of each kind's caches


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("kv_groups_gemma4")
    return {
        # layers 3 and 4 read layers 2's and 1's KV
        "five": build_gemma4_checkpoint(root / "five", demo_dir),
        # layers 6 and 7 read layers 4's and 5's KV; two sliding and two full layers per kind keep KV each
        "eight": build_gemma4_checkpoint(
            root / "eight", demo_dir, seed=1, num_hidden_layers=8, layer_types=[S, S, F, S, S, F, S, F]
        ),
    }


@pytest.fixture(scope="module")
def refs(dirs):
    out = {k: hf_greedy(d, PROMPTS, NEW) for k, d in dirs.items()}
    for r in out.values():
        assert_not_degenerate(r)  # else equality would not exercise the layers
    return out


def _args(d) -> ModelArgs:
    return ModelArgs.from_hf_config(json.loads((d / "config.json").read_text()))


def test_plan_groups_by_kind_and_shape_with_readers_in_their_sources_group(dirs):
    plan, reason = plan_groups(_args(dirs["five"]))
    assert reason is None and plan.per_group == 1 and plan.shapes == (SLIDING, FULL)
    assert plan.groups == (
        KVGroup("full", None, (1,), FULL, ((4, 1),)),
        KVGroup("sliding", 6, (0,), SLIDING),
        KVGroup("sliding", 6, (2,), SLIDING, ((3, 2),)),
    )
    assert plan.group_of() == [1, 0, 2, 2, 0]
    assert plan.storage_of() == [0, 1, 0, 0, 1]  # one tensor of each shape
    plan, _ = plan_groups(_args(dirs["eight"]))
    assert plan.per_group == 2 and plan.shapes == (SLIDING, FULL)
    assert plan.groups == (
        KVGroup("full", None, (2, 5), FULL, ((7, 5),)),
        KVGroup("sliding", 6, (0, 1), SLIDING),
        KVGroup("sliding", 6, (3, 4), SLIDING, ((6, 4),)),
    )
    assert plan.group_of() == [1, 1, 0, 2, 2, 0, 2, 0]
    # sliding tensors 0, 1; full tensors 2, 3; a reader on its source's
    assert plan.storage_of() == [0, 1, 2, 0, 1, 3, 1, 3]
    _, reason = plan_groups(_args(dirs["eight"]), tp_pp=2)
    assert "tensor / pipeline parallel" in reason


@pytest.mark.parametrize("kind", ["five", "eight"])
def test_groups_free_out_of_window_blocks_and_match_hf(dirs, refs, kind):
    llm = LLM(
        model=str(dirs[kind]),
        dtype="float32",
        block_size=8,
        num_kv_blocks=16,
        max_num_batched_tokens=10,  # prompt chunks end inside windows
        enable_prefix_caching=False,
    )
    eng, kv = llm.engine, llm.engine.kv
    plan = kv.plan
    assert plan is not None and [g.kind for g in kv.groups] == ["full", "sliding", "sliding"]
    # one cache per layer keeping KV, on per_group tensors of each shape; a block pages one group's layers
    caches = eng.runner.kv_caches
    assert len(caches) == {"five": 3, "eight": 6}[kind]
    assert len({id(k) for k, _ in caches}) == 2 * plan.per_group
    assert {tuple(k.shape[2:]) for k, _ in caches} == {SLIDING, FULL}
    page = 2 * 8 * plan.per_group * (2 * 16 + 32) * 4
    assert kv_bytes_per_block(eng.loaded, 8, plan=plan) == page
    info = eng.model_info["cache_groups"]
    assert [(g["kind"], g["layers"], g.get("shared_layers"), g["head_dim"]) for g in info] == [
        ("attention", plan.per_group, 1, 32),
        ("sliding_attention", plan.per_group, None, 16),
        ("sliding_attention", plan.per_group, 1, 16),
    ]
    assert all(g["block_bytes"] == page for g in info)
    scribbled = _scribble_freed(llm)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == refs[kind]
    assert kv.num_released_blocks > 0 and scribbled
    assert eng.scheduler.num_preemptions > 0  # the pages cannot hold every sequence at once
    assert_pool_whole(llm)


def test_prefix_hit_after_window_blocks_were_given_back(dirs, refs):
    llm = LLM(
        model=str(dirs["eight"]), dtype="float32", block_size=8, num_kv_blocks=64, max_num_batched_tokens=16
    )
    kv = llm.engine.kv
    first = llm.generate(PROMPTS[1:2], GREEDY)[0]
    assert kv.num_released_blocks > 0
    again = llm.generate(PROMPTS[1:2], GREEDY)[0]
    assert first.token_ids == again.token_ids == refs["eight"][1]
    assert again.num_cached_tokens >= 40
    assert_pool_whole(llm)


def test_hit_serves_each_group_its_own_blocks(dirs):
    """A finished sequence's blocks stay cached per group: a hit takes the full group's whole chain and a
    sliding group's blocks from the one its next query sees, ``NULL`` before; no block twice."""
    from sidecar.engine.request import Request

    llm = LLM(
        model=str(dirs["five"]), dtype="float32", block_size=8, num_kv_blocks=64, max_num_batched_tokens=16
    )
    kv = llm.engine.kv
    llm.generate(PROMPTS[1:2], SamplingParams(max_tokens=2, ignore_eos=True))
    req = Request("probe", list(PROMPTS[1]), GREEDY)
    hits, n = kv.get_computed_blocks(req)
    assert n == 40  # five blocks of the 44-token prompt (its last token is recomputed)
    full, *sliding = hits.per_group
    assert NULL not in [b.block_id for b in full] and len(full) == 5
    for g in sliding:  # a query at 40 sees 35..40: blocks 4 and 5, of which the hit holds 4
        assert [b.block_id for b in g[:4]] == [NULL] * 4 and g[4].block_id != NULL
    ids = [b.block_id for h in hits.per_group for b in h if b.block_id != NULL]
    assert len(ids) == len(set(ids)) == 7
    assert_pool_whole(llm)


def test_sliding_blocks_stay_bounded_and_aborts_return_every_block(dirs):
    llm = LLM(
        model=str(dirs["five"]), dtype="float32", block_size=8, num_kv_blocks=64, max_num_batched_tokens=8
    )
    kv, eng = llm.engine.kv, llm.engine
    sliding = [i for i, g in enumerate(kv.groups) if g.kind == "sliding"]
    bound = kv.groups[sliding[0]].max_blocks(8, 1)
    eng.add_request("long", PROMPTS[1], SamplingParams(max_tokens=30, ignore_eos=True))
    eng.add_request("mid-prompt", PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True))
    eng.add_request("mid-output", PROMPTS[2], SamplingParams(max_tokens=30, ignore_eos=True))
    held = []
    while eng.requests:
        eng.step()
        reqs = eng.requests
        if "mid-prompt" in reqs and 8 <= reqs["mid-prompt"].num_computed_tokens < len(PROMPTS[0]):
            eng.abort("mid-prompt")  # its prompt chunked, part of it computed
        if "mid-output" in reqs and reqs["mid-output"].num_computed_tokens > len(PROMPTS[2]) + 10:
            eng.abort("mid-output")
        req = reqs.get("long")
        if req is not None and req.num_computed_tokens >= len(PROMPTS[1]):  # decoding
            held.append(kv.held_blocks(req))
    assert len(held) >= 25
    assert max(h[i] for h in held for i in sliding) <= bound == 2  # ceil(6 / 8) + 1 pages however long
    assert max(h[0] for h in held) >= 9  # the full group keeps every block
    assert_pool_whole(llm)


def test_int8_kv_and_beam_search_through_groups_agree_with_one_table(dirs, monkeypatch):
    """An int8 cache (scales at each shape) and beam search (forks sharing pages, copy-on-write per group)
    through the groups compute what the single-table layout (groups off) does."""
    assert_groups_agree_with_one_table(dirs["eight"], PROMPTS, GREEDY, 8, monkeypatch, num_kv_blocks=64)


def test_ngram_verification_rows_through_the_groups_match_hf(dirs):
    """n-gram proposals verified in rows of every group (a reader's too) and their rejected tails trimmed
    from every group's table: the tokens are HF's."""
    from tests.unit.engine.test_spec_engine import repetitive_prompts, spec_counts

    prompts = [p for p in repetitive_prompts(8, seed=3) if len(p) > 16][:2]  # copy-heavy, beyond the window
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ref = hf_greedy(dirs["five"], prompts, 16)
    llm = LLM(
        model=str(dirs["five"]),
        dtype="float32",
        block_size=8,
        num_kv_blocks=64,
        speculative="ngram",
        num_speculative_tokens=3,
        speculative_token_cost=0.0,
        enable_prefix_caching=False,
    )
    assert [llm.generate([p], params)[0].token_ids for p in prompts] == ref
    assert spec_counts(llm)[0] > 0 and llm.engine.kv.num_released_blocks > 0
    assert_pool_whole(llm)

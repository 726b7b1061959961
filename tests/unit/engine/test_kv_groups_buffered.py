"""KV groups through the persistent decode buffers (input_buffers.py): a grouped model's pure-decode steps
carry every group's slots and block tables in the buffers, so they take the buffered step, the overlapped
step and, on the CPU, the decode replay. Greedy float32 equal to HF transformers over generations many
windows and chunks long with freed blocks overwritten; in bfloat16 the replay is on, and replayed decoding
equals the same engine's eager buffered decoding and its unbuffered (per-step tensors) decoding."""

from __future__ import annotations

import pytest

from sidecar import LLM, SamplingParams
from sidecar.model.kernels.cpu import replay
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy
from tests.unit.engine.test_kv_groups import _scribble_freed
from tests.unit.engine.test_spec_engine import repetitive_prompts, spec_counts
from tests.unit.model.family_checkpoints import build_family_checkpoint
from tests.unit.model.llama4_checkpoints import build_llama4_checkpoint

NEW = 40  # five windows of 8 tokens, more than two chunks of 16
GREEDY = SamplingParams(max_tokens=NEW, ignore_eos=True)
PROMPTS = [[5 + (11 * i + 5 * j) % 700 for j in range(n)] for i, n in enumerate([21, 34, 9])]
# Lengths that end requests at different steps: the replayed batch shrinks from 3 rows to 1.
UNEVEN = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (NEW, NEW - 9, NEW - 17)]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, demo_dir):
    root = tmp_path_factory.mktemp("kv_groups_buffered")
    return {
        "gemma3": build_family_checkpoint("gemma3", root / "gemma3", demo_dir),
        "llama4": build_llama4_checkpoint("llama4", root / "llama4", demo_dir),
    }


def _count_buffered_steps(llm: LLM) -> list[int]:
    """Rows of every step that went through the decode buffers."""
    runner, seen = llm.engine.runner, []
    decode_rows = runner.decode_rows

    def counting(rows, *args, **kw):
        assert all(len(r.group_tables) == len(llm.engine.kv.groups) - 1 for r in rows)
        seen.append(len(rows))
        return decode_rows(rows, *args, **kw)

    runner.decode_rows = counting
    return seen


@pytest.mark.parametrize("kind,overlap", [("gemma3", False), ("gemma3", True), ("llama4", False)])
def test_grouped_decode_steps_go_through_the_buffers_and_match_hf(dirs, kind, overlap):
    llm = LLM(
        model=str(dirs[kind]),
        dtype="float32",
        block_size=8,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
        overlap_steps=overlap,
    )
    kv, runner = llm.engine.kv, llm.engine.runner
    assert kv.plan is not None and len(kv.groups) > 1 and runner.buffered
    assert runner.inputs.num_groups == len(kv.groups)
    scribbled = _scribble_freed(llm)
    steps = _count_buffered_steps(llm)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(dirs[kind], PROMPTS, NEW)
    assert kv.num_released_blocks > 0 and scribbled  # windows / chunks passed: blocks freed and overwritten
    assert len(steps) >= NEW - 1 and max(steps) == len(PROMPTS)  # the decode steps took the buffers
    assert_pool_whole(llm)


@pytest.mark.skipif(replay.unavailable_reason() is not None, reason="replay needs the C kernels")
def test_grouped_bf16_decode_replays_exactly_as_eager(dirs):
    llm = LLM(
        model=str(dirs["gemma3"]), dtype="bfloat16", block_size=8, max_num_seqs=4, enable_prefix_caching=False
    )
    runner, plans = llm.engine.runner, llm.engine.runner.cpu_plans
    assert llm.engine.kv.plan is not None and runner.buffered
    assert plans.reason is None and plans.enabled and plans.replays()
    assert llm.engine.model_info["cpu_decode_replay"] is True
    timed = runner.time_decode_rows([1, 3], repeats=1)  # speculation's cost probe: rows on one table
    assert timed is not None and len(timed) == 2 and all(t > 0 for t in timed)
    scribbled = _scribble_freed(llm)
    runs: list[int] = []
    run = plans.run
    plans.run = lambda bucket: runs.append(bucket) or run(bucket)
    replayed = [o.token_ids for o in llm.generate(PROMPTS, UNEVEN)]
    assert [len(t) for t in replayed] == [p.max_tokens for p in UNEVEN]
    assert len(runs) >= NEW - 1 and set(runs) == {1, 2, 3} and scribbled
    assert set(runs) <= set(plans.recorded) and not plans.eager_sizes  # every step replayed
    plans.disable("compared with eager steps")
    assert [o.token_ids for o in llm.generate(PROMPTS, UNEVEN)] == replayed  # buffered, eager
    runner.buffered = False  # per-step tensors (group_step.attach_groups)
    assert [o.token_ids for o in llm.generate(PROMPTS, UNEVEN)] == replayed
    assert_pool_whole(llm)


@pytest.mark.skipif(replay.unavailable_reason() is not None, reason="replay needs the C kernels")
def test_grouped_verification_steps_replay_with_plain_decodes_tokens(dirs):
    """n-gram verification rows (one per proposed token, each at its own position) take the buffers with
    their slot in every group, and are replayed: the tokens are plain decoding's."""
    prompts = [p for p in repetitive_prompts(6, seed=3) if len(p) > 16][:2]
    kw = dict(model=str(dirs["gemma3"]), dtype="bfloat16", block_size=8, enable_prefix_caching=False)
    plain = LLM(**kw)
    llm = LLM(speculative="ngram", num_speculative_tokens=3, speculative_token_cost=0.0, **kw)
    plans = llm.engine.runner.cpu_plans
    assert plans.replays(), plans.reason
    runs: list[int] = []
    run = plans.run
    plans.run = lambda bucket: runs.append(bucket) or run(bucket)
    for p in prompts:  # one request at a time: each step after the prompt decodes or verifies
        assert llm.generate([p], GREEDY)[0].token_ids == plain.generate([p], GREEDY)[0].token_ids
    proposed, accepted = spec_counts(llm)
    assert proposed > 0 and accepted > 0
    assert set(runs) > {1}  # verifications replayed as steps of 1 + k rows
    assert_pool_whole(llm)

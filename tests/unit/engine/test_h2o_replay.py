"""Scored (h2o) decode steps through the CPU decode replay (``engine/cpu_graphs.py``): a replayed scored step
gives the eager step's hidden states and adds the same attention scores, bit for bit, and h2o decoding with
replays equals h2o decoding without them token for token, evictions included."""

from __future__ import annotations

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.engine.input_buffers import DecodeRow
from sidecar.model.kernels.cpu import replay

pytestmark = pytest.mark.skipif(
    replay.unavailable_reason() is not None, reason="replay needs the C kernels (a C compiler with OpenMP)"
)

BS = 8


@pytest.fixture(scope="module")
def engines(demo_dir):
    kw = dict(model=str(demo_dir), dtype="bfloat16", block_size=BS, num_kv_blocks=64, max_num_seqs=2)
    return LLM(**kw), LLM(enforce_eager=True, **kw)


def test_the_self_check_replays_the_scored_form(engines):
    plans = engines[0].engine.runner.cpu_plans
    assert plans.enabled and plans.scored_reason is None, plans.scored_reason
    assert engines[1].engine.runner.cpu_plans.scored_reason is not None  # enforce_eager: nothing replayed


def test_the_self_check_compares_the_scores_a_replay_adds(engines):
    plans = engines[0].engine.runner.cpu_plans
    # a scored step of one padded row, recorded from zeroed scores as the self-check does
    with torch.inference_mode():
        plans.inputs.fill_padding(1, plans.inputs.max_blocks)
        plans.inputs.scores = plans.scores
        plans.stage(1)
        plans._seed_states(1)
        eager = plans.body(1).clone()
        plans._eager_states, plans._eager_scores = plans._stepped_states(1), plans.scores.clone()
        assert plans._eager_scores.any()
        _, plan = replay.record(lambda: plans.body(1))
        assert plans._check_plan(plan, eager, 1) is None  # re-zeroed, replayed: the eager bits and scores
        plans.inputs.scores = None
        _, unscored = replay.record(lambda: plans.body(1))  # the same step not passing the scores
        plans.inputs.scores = plans.scores
        assert "adds other attention scores" in plans._check_plan(unscored, eager, 1)
        plans.inputs.scores = None
        plans.scores.zero_()


def _step(runner, rows: list[DecodeRow], replays: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One scored decode step of ``rows`` over fixed KV (blocks 1-7) and scores: (logits, the score vector
    before the step, after it)."""
    gen = torch.Generator().manual_seed(1)
    for k, v in runner.kv_caches:
        for t in (k, v):
            t[1:8].copy_(torch.randn(t[1:8].shape, generator=gen).to(t.dtype))
    runner.kv_scores.copy_(torch.rand(runner.kv_scores.shape, generator=gen))
    start = runner.kv_scores.clone()
    plans = runner.cpu_plans
    on = plans.enabled
    plans.enabled = replays
    try:
        logits = runner.decode_rows(rows, list(range(len(rows))), scored=True).clone()
    finally:
        plans.enabled = on
    return logits, start, runner.kv_scores.clone()


def test_a_scored_step_replayed_equals_the_eager_one(engines):
    runner = engines[0].engine.runner
    plans = runner.cpu_plans
    # two sequences: blocks 1-3 (the token at position 20) and 4-5 (position 9)
    rows = [DecodeRow(11, 20, 3 * BS + 4, 21, [1, 2, 3]), DecodeRow(12, 9, 5 * BS + 1, 10, [4, 5])]
    replayed, start, replayed_scores = _step(runner, rows, replays=True)
    assert 2 in plans.recorded_scored  # planned when first seen, and replayed
    eager, _, eager_scores = _step(runner, rows, replays=False)
    assert torch.equal(replayed, eager)
    assert torch.equal(replayed_scores, eager_scores)
    assert not torch.equal(eager_scores, start)
    # The step reset the slots it wrote, then every head of every layer gave each row's keys a weight of one.
    a = engines[0].engine.loaded.args
    start[[r.slot for r in rows]] = 0.0
    keys = [r.table[p // BS] * BS + p % BS for r in rows for p in range(r.ctx_len)]
    added = eager_scores - start
    assert added[keys].sum().item() == pytest.approx(len(rows) * a.num_layers * a.num_heads, rel=1e-3)
    others = torch.ones_like(added, dtype=torch.bool)
    others[keys] = False
    assert torch.equal(added[others], torch.zeros_like(added[others]))


def test_h2o_with_replays_equals_h2o_without(engines):
    fast, eager = engines
    prompts = [[3 + i % 50 for i in range(40)], [7 + (3 * i) % 60 for i in range(29)]]
    params = SamplingParams(max_tokens=40, ignore_eos=True, kv_budget=32, kv_eviction="h2o", logprobs=1)
    for llm in engines:  # the same start (another test leaves its own)
        llm.engine.runner.kv_scores.zero_()
    got = fast.generate(prompts, params)
    want = eager.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]
    assert fast.engine.kv.num_evicted_blocks > 0
    assert fast.engine.kv.num_evicted_blocks == eager.engine.kv.num_evicted_blocks
    plans = fast.engine.runner.cpu_plans
    assert plans.recorded_scored and plans.enabled  # the scored steps were replayed
    # the same scores from the same steps: every eviction chose the same blocks
    assert torch.equal(fast.engine.runner.kv_scores, eager.engine.runner.kv_scores)
    for eng in (fast.engine, eager.engine):
        assert not eng.requests and eng.kv.num_free_blocks() == eng.kv.num_blocks

"""CPU decode replays of a hybrid model (Qwen3.5: gated DeltaNet layers among gated attention layers;
``engine/cpu_graphs.py``): the self-check replays its steps, the linear layers' state slots read from the
persistent decode buffers, and replayed decoding equals eager decoding token for token and log-probability for
log-probability over shrinking batches, preemption and prefix hits (float32 HF equality: test_hybrid_vs_hf.py,
whose float32 products stay outside our kernels, so those steps run eagerly). A step that cannot be replayed
runs eagerly with its reason."""

from __future__ import annotations

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.model.kernels.cpu import replay
from tests.unit.model.family_checkpoints import build_family_checkpoint
from tests.unit.model.test_hybrid_vs_hf import BASE, EXTRA, PROMPTS, assert_slots_whole

pytestmark = pytest.mark.skipif(
    replay.unavailable_reason() is not None, reason="replay needs the C kernels (a C compiler with OpenMP)"
)

LENS = [5, 9, 13, 4, 7, 11]  # the batch shrinks as the requests finish


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory, demo_dir):
    # value heads of 16 (4 x 16 = 64 channels): every product of the tiny model takes our bf16 kernel
    out = tmp_path_factory.mktemp("hybrid_replay") / "qwen3_5"
    return build_family_checkpoint("qwen3_5", out, demo_dir, linear_value_head_dim=16)


def _run(llm: LLM, prompts, lens) -> list[tuple[list[int], list[float], int]]:
    sp = [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0) for n in lens]
    outs = llm.generate(prompts, sp)
    return [(o.token_ids, [t.logprob for t in o.logprobs], o.num_cached_tokens) for o in outs]


@pytest.fixture
def replays(monkeypatch) -> list[int]:
    """The batch size of every replayed step."""
    seen: list[int] = []
    plan_replay = replay.Plan.replay

    def counted(plan, arena):
        seen.append(plan._out[2][0])
        return plan_replay(plan, arena)

    monkeypatch.setattr(replay.Plan, "replay", counted)
    return seen


@pytest.mark.parametrize(
    "kw",
    [
        dict(block_size=8, max_num_seqs=4),
        # 15 usable blocks of 8 tokens (bytes for two state slots) cannot hold two of the longer requests at
        # once: preemption, chunked prompts
        dict(block_size=8, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=4),
    ],
    ids=["batches", "preemption"],
)
def test_replayed_decoding_equals_eager_decoding(hybrid_dir, kw, replays):
    fast = LLM(model=str(hybrid_dir), dtype="bfloat16", **kw)
    eager = LLM(model=str(hybrid_dir), dtype="bfloat16", enforce_eager=True, **kw)
    info = fast.engine.model_info
    assert info["cpu_decode_replay"] is True, info["cpu_decode_replay_reason"]
    assert info["cpu_decode_planned"] is True, info["cpu_decode_planned_reason"]
    plans = fast.engine.runner.cpu_plans
    assert plans.recorded == [1, 2, 3, 4] and not plans.eager_sizes
    assert eager.engine.model_info["cpu_decode_replay"] is False
    replays.clear()
    got = _run(fast, PROMPTS, LENS)
    assert got == _run(eager, PROMPTS, LENS)
    if "num_kv_blocks" in kw:  # fewer state slots than sequences: decode steps of one or two rows
        assert fast.engine.runner.states.slots == 2 and plans.recorded == [1, 2, 3, 4]
        assert fast.engine.scheduler.num_preemptions > 0 and set(replays) == {1, 2}
    else:
        assert set(replays) >= {1, 2, 3, 4}  # decode steps of every batch size were replays
    for llm in (fast, eager):
        assert_slots_whole(llm)


def test_prefix_hits_restore_states_that_replayed_steps_left(hybrid_dir, replays):
    fast = LLM(model=str(hybrid_dir), dtype="bfloat16", block_size=8, max_num_seqs=2)
    eager = LLM(model=str(hybrid_dir), dtype="bfloat16", block_size=8, max_num_seqs=2, enforce_eager=True)
    first = _run(fast, [BASE], [8])
    assert first == _run(eager, [BASE], [8])
    # a next turn hits up to decode's checkpoint at 72: a state a replayed step wrote
    prompts = [BASE + EXTRA, BASE + first[0][0] + EXTRA[:5]]
    replays.clear()
    got = _run(fast, prompts, [8, 8])
    assert replays and got == _run(eager, prompts, [8, 8])
    assert [n for _, _, n in got] == [64, 72]
    for llm in (fast, eager):
        assert_slots_whole(llm)


def test_the_self_check_compares_the_states_a_replay_leaves(hybrid_dir, monkeypatch):
    from sidecar.engine.cpu_graphs import CpuDecodePlans

    llm = LLM(model=str(hybrid_dir), dtype="bfloat16", max_num_seqs=2)
    plans = llm.engine.runner.cpu_plans
    states = llm.engine.runner.states
    assert plans.enabled and all(not t[:2].any() for t in states.conv + states.recurrent)  # left at rest
    # a step of one padded row (state slot 0), recorded over seeded states as the self-check does
    with torch.inference_mode():
        plans.inputs.fill_padding(1, plans.inputs.max_blocks)
        plans.stage(1)
        plans._seed_states(1)
        eager = plans.body(1).clone()
        plans._eager_states = plans._stepped_states(1)
        _, plan = replay.record(lambda: plans.body(1))
        assert plans._check_plan(plan, eager, 1) is None  # reseeded, replayed: the eager bits and states
        plans._eager_states[-1][0, 0, 0, 0] += 1  # a replay leaving a state the eager step did not
        assert "other linear-attention states" in plans._check_plan(plan, eager, 1)
    # unseeded (the rows still on slots 0..bucket-1), the replay steps the states the eager step left (the same
    # padded token again: the gated norm's output may round alike, the states do not): replays stay off
    monkeypatch.setattr(
        CpuDecodePlans,
        "_seed_states",
        lambda self, bucket, zero=False: self.inputs.state_slots[:bucket].copy_(torch.arange(bucket)),
    )
    assert "a replayed step of 1 rows" in plans.self_check()
    assert not plans.enabled and plans.info()["cpu_decode_replay"] is False and not plans.replays()


def test_a_linear_layer_off_our_kernel_keeps_steps_eager_with_its_reason(hybrid_dir, monkeypatch, caplog):
    from sidecar.model import deltanet

    monkeypatch.setattr(deltanet, "_checked", {"reason": "off for this test"})  # decode rows on torch
    with caplog.at_level("INFO", logger="sidecar.engine"):
        llm = LLM(model=str(hybrid_dir), dtype="bfloat16", max_num_seqs=2)
    info = llm.engine.model_info
    assert info["cpu_decode_replay"] is False and "outside our kernels" in info["cpu_decode_replay_reason"]
    assert "CPU decode replays off, steps run eagerly" in caplog.text
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4, ignore_eos=True))
    assert all(len(o.token_ids) == 4 for o in outs) and llm.engine.runner.cpu_plans.recorded == []
    assert_slots_whole(llm)

"""CPU decode replays per pipeline stage (engine/pp_replay.py): each stage replays its share of a pure-decode
step from C, stage 0 from the embedded tokens and the later stages from the stream they receive. Replays are
checked in bfloat16, as the whole model's are (float32 layers take oneDNN paths a one-row replay refuses): two
stages replaying (and three: a middle stage) give the tokens of one process running eagerly, through
preemption, chunked prefill and two micro-batches a step, with every stage's replay count rising; a hybrid
model's stages carry their state slots through their replays. In float32 every stage refuses, each naming
why, and the tokens are HF's."""

from __future__ import annotations

import pytest

from sidecar import LLM, SamplingParams
from sidecar.engine import pp_replay
from tests.unit.engine.test_pipeline_hybrid import PROMPTS as HYBRID_PROMPTS
from tests.unit.engine.test_pipeline_hybrid import _whole
from tests.unit.engine.test_pipeline_parallel import _checkpoint, _pool_whole, _prompts
from tests.unit.model.family_checkpoints import build_family_checkpoint

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
# seven requests of up to 48 tokens in 120 (15 usable 8-token blocks): preemption; prompts in chunks
KW = dict(block_size=8, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=8)


def _tokens(llm: LLM, prompts, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


def _assert_replaying(llm: LLM) -> None:
    info = llm.engine.model_info
    assert info["cpu_decode_replay"] is True, info["cpu_decode_replay_reason"]
    assert info["cpu_decode_replay_stages"] == {0: "", 1: ""}


@pytest.fixture(scope="module")
def llama(tmp_path_factory, demo_dir):
    path, hf = _checkpoint("llama", 3, tmp_path_factory.mktemp("ppr") / "llama", demo_dir)
    return path, _prompts(hf.config.vocab_size), hf


def test_two_stages_replaying_give_the_eager_tokens(llama):
    path, prompts, _ = llama
    ref = LLM(model=str(path), dtype="bfloat16", enforce_eager=True, **KW)
    expected = _tokens(ref, prompts)
    llm = LLM(model=str(path), dtype="bfloat16", pipeline_parallel_size=2, pipeline_micro_batches=2, **KW)
    pp = llm.engine.tp
    try:
        _assert_replaying(llm)
        assert llm.engine.runner.cpu_plans.reason == "pipeline_parallel_size 2"  # the driver itself is eager
        before, split = pp.replay_counts(), pp.split_steps
        assert _tokens(llm, prompts) == expected
        after = pp.replay_counts()
        assert all(b > a for a, b in zip(before, after)), (before, after)  # every stage replayed
        assert llm.stats()["num_preemptions"] > 0
        assert pp.split_steps > split  # steps ran in two parts
        _pool_whole(llm)
        # a batch of one decodes through both stages' replays too
        counts = pp.replay_counts()
        assert _tokens(llm, prompts[:1]) == expected[:1]
        assert all(b >= a + MAX_NEW - 1 for a, b in zip(counts, pp.replay_counts()))
        _pool_whole(llm)
    finally:
        pp.close()


def test_three_stages_replay_a_middle_stage_too(llama):
    """Three stages of one layer each: the middle one replays from the stream it receives and hands its
    result on; three parts a step by default."""
    path, prompts, _ = llama
    ref = LLM(model=str(path), dtype="bfloat16", enforce_eager=True, **KW)
    expected = _tokens(ref, prompts[:4])
    llm = LLM(model=str(path), dtype="bfloat16", pipeline_parallel_size=3, **KW)
    pp = llm.engine.tp
    try:
        assert llm.engine.model_info["cpu_decode_replay_stages"] == {0: "", 1: "", 2: ""}
        before = pp.replay_counts()
        assert _tokens(llm, prompts[:4]) == expected
        assert all(b > a for a, b in zip(before, pp.replay_counts()))
        _pool_whole(llm)
    finally:
        pp.close()


def test_a_failing_stage_turns_every_stage_eager(llama, monkeypatch):
    """A stage whose self-check fails (here stage 0: a later stage's fails the same way, over its pipe) makes
    every stage run eagerly, the reason naming the stage; the tokens stay the eager ones."""
    path, prompts, _ = llama

    def refuse(self):
        self.disable("refused for the test")
        return "refused for the test"

    monkeypatch.setattr(pp_replay.StagePlans, "self_check", refuse)  # rank 0's own (workers are spawned)
    llm = LLM(model=str(path), dtype="bfloat16", pipeline_parallel_size=2, **KW)
    pp = llm.engine.tp
    try:
        info = llm.engine.model_info
        assert info["cpu_decode_replay"] is False
        assert info["cpu_decode_replay_reason"] == "stage 0: refused for the test"
        assert info["cpu_decode_replay_stages"] == {0: "refused for the test", 1: ""}
        ref = LLM(model=str(path), dtype="bfloat16", enforce_eager=True, **KW)
        assert _tokens(llm, prompts[:3]) == _tokens(ref, prompts[:3])
        assert pp.replay_counts() == [0, 0]  # stage 1 passed its own check, and stays eager
        _pool_whole(llm)
    finally:
        pp.close()


def test_float32_stages_refuse_and_match_hf(llama):
    from tests.unit.engine.test_engine_vs_hf import hf_generate

    path, prompts, hf = llama
    llm = LLM(model=str(path), dtype="float32", pipeline_parallel_size=2, **KW)
    pp = llm.engine.tp
    try:
        info = llm.engine.model_info
        assert info["cpu_decode_replay"] is False
        for rank in (0, 1):  # each stage's own check names the operator its one-row step runs
            assert "outside our kernels" in info["cpu_decode_replay_stages"][rank]
        assert _tokens(llm, prompts[:3]) == hf_generate(hf, prompts[:3], MAX_NEW)
        assert pp.replay_counts() == [0, 0]
        _pool_whole(llm)
    finally:
        pp.close()


def test_hybrid_stages_replay_with_their_state_slots(tmp_path_factory, demo_dir):
    """Qwen3.5 (gated DeltaNet layers, then a gated attention layer): stage 0 holds two linear layers (state
    slots only), stage 1 a linear layer and the attention layer; replays step each row's slot on both."""
    out = tmp_path_factory.mktemp("pprh") / "qwen3_5"
    # value heads of 16: every product of the tiny model takes our bf16 kernel (as test_hybrid_replay's)
    path = build_family_checkpoint("qwen3_5", out, demo_dir, linear_value_head_dim=16)
    # two state slots; two sequences of 70 tokens do not fit 15 usable 8-token blocks: preemption
    kw = dict(block_size=8, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=4)
    longer = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = LLM(model=str(path), dtype="bfloat16", enforce_eager=True, **kw)
    expected = _tokens(ref, HYBRID_PROMPTS, longer)
    llm = LLM(model=str(path), dtype="bfloat16", pipeline_parallel_size=2, **kw)
    pp = llm.engine.tp
    try:
        _assert_replaying(llm)
        before = pp.replay_counts()
        assert _tokens(llm, HYBRID_PROMPTS, longer) == expected
        assert all(b > a for a, b in zip(before, pp.replay_counts()))
        assert llm.stats()["num_preemptions"] > 0
        _whole(llm)
    finally:
        pp.close()

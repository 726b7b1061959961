"""Decode graphs on every rank of a tensor-parallel group over NCCL (engine/tp_device.py), on two GPUs: every
rank passes its own self-check and captures the same padded buckets with their all-reduces inside, and the
group's greedy tokens equal the eager group's and HF float32's at every bucket; a refusal turns every rank off.
Pipeline stages (engine/pp_device.py) capture their own layers' graphs the same way."""

from __future__ import annotations

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.engine import self_check, tp_device
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy, make_prompts

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs two GPUs")

MAX_SEQS = 12  # padded buckets 1, 2, 4, 8, 12


def _llm(path, **kw) -> LLM:
    kw.setdefault("tensor_parallel_size", 1 if "pipeline_parallel_size" in kw else 2)
    return LLM(
        model=str(path),
        dtype="float32",
        device="cuda",
        max_num_seqs=MAX_SEQS,
        num_kv_blocks=128,
        **kw,
    )


def _greedy(llm, prompts, lens):
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lens])
    return [o.token_ids for o in outs]


def test_every_rank_captures_and_the_group_matches_eager_and_hf(tiny_models):
    path = tiny_models["qwen2"]  # two KV heads: one per rank
    graphs = _llm(path)
    eager = _llm(path, enforce_eager=True)
    try:
        tp, runner = graphs.engine.tp, graphs.engine.runner
        info = graphs.engine.model_info
        assert tp.backend == "nccl" and tp_device.capture_refusal(tp.comm, runner.device) is None
        assert "cuda_graphs" in info["fast_paths"], info["fast_path_fallbacks"]
        assert tp.device_checks == {0: {}, 1: {}}, tp.device_checks
        assert runner.graphs.captured == runner.buckets == [1, 2, 4, 8, 12]
        assert isinstance(runner.graphs, tp_device.RankZeroGraphs)
        assert eager.engine.model_info["fast_paths"] == [] and not eager.engine.runner.graphs.captured
        prompts = make_prompts(MAX_SEQS, 900, 3, 40, seed=5)
        lens = [2 + i for i in range(MAX_SEQS)]  # batches of 12 rows down to 1: every bucket replayed
        want = [r[:n] for r, n in zip(hf_greedy(path, prompts, max(lens)), lens)]
        assert _greedy(graphs, prompts, lens) == _greedy(eager, prompts, lens) == want
        assert_pool_whole(graphs)
        assert_pool_whole(eager)
    finally:
        graphs.engine.tp.close()
        eager.engine.tp.close()


def test_a_rank_that_refuses_capture_turns_every_rank_off(tiny_models, monkeypatch):
    """Rank 0 refuses the graphs here (a worker's refusal reaches it over its pipe the same way): no rank
    captures, each rank's reason kept, and the group still decodes through the other checked paths."""
    path = tiny_models["qwen2"]
    monkeypatch.setattr(tp_device, "capture_refusal", lambda comm, device: "refused for the test")
    llm = _llm(path)
    try:
        tp, runner = llm.engine.tp, llm.engine.runner
        reasons = llm.engine.model_info["fast_path_fallbacks"]
        assert reasons["cuda_graphs"] == "rank 0: refused for the test"
        assert (
            tp.device_checks[0]["cuda_graphs"] == "refused for the test"
            and "cuda_graphs" not in tp.device_checks[1]
        )
        assert not runner.graphs.captured and runner.buckets == list(range(1, MAX_SEQS + 1))
        assert set(self_check.default_paths(runner)) - {"cuda_graphs"} - set(reasons) <= set(
            runner.fast_paths.active()
        )
        prompts = make_prompts(4, 900, 3, 40, seed=6)
        lens = [3, 4, 5, 6]
        want = [r[:n] for r, n in zip(hf_greedy(path, prompts, max(lens)), lens)]
        assert _greedy(llm, prompts, lens) == want
        assert_pool_whole(llm)
    finally:
        llm.engine.tp.close()


def test_every_pipeline_stage_captures_its_own_graphs(tiny_models):
    """Two stages on two GPUs (engine/pp_device.py): each stage passes its own check over its layers and
    captures its graphs; decode parts replay them, micro-batches included: HF's and the eager pipeline's tokens."""
    path = tiny_models["llama"]
    kw = dict(pipeline_parallel_size=2, pipeline_micro_batches=2)
    staged = _llm(path, **kw)
    eager = _llm(path, enforce_eager=True, **kw)
    try:
        pp = staged.engine.tp
        info = staged.engine.model_info
        assert "cuda_graphs" in info["fast_paths"], info["fast_path_fallbacks"]
        assert pp.device_checks == {0: {}, 1: {}}, pp.device_checks
        assert pp.stage_graphs is not None and pp.stage_graphs.graphs.captured == [1, 2, 4, 8, 12]
        prompts = make_prompts(MAX_SEQS, 900, 3, 40, seed=7)
        lens = [2 + i for i in range(MAX_SEQS)]
        want = [r[:n] for r, n in zip(hf_greedy(path, prompts, max(lens)), lens)]
        assert _greedy(staged, prompts, lens) == _greedy(eager, prompts, lens) == want
        assert pp.split_steps > 0  # steps ran in two parts through both stages' graphs
        assert_pool_whole(staged)
    finally:
        staged.engine.tp.close()
        eager.engine.tp.close()

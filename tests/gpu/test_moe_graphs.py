"""Mixture-of-experts checkpoints on CUDA: the grouped expert GEMM (``moe`` path) survives the start-up
self-check with the decode graphs captured around it, and greedy float32 output equals the eager engine's and
HF transformers' token for token, batched and one request at a time."""

from __future__ import annotations

import pytest

from sidecar import LLM, SamplingParams
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy, make_prompts
from tests.unit.model.family_checkpoints import build_family_checkpoint

MAX_NEW = 8


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_moe_path_inside_decode_graphs_matches_eager_and_hf(kind, tmp_path, demo_dir):
    path = build_family_checkpoint(kind, tmp_path / kind, demo_dir)
    kw = dict(model=str(path), dtype="float32", device="cuda", max_num_seqs=8, num_kv_blocks=128)
    fast, eager = LLM(**kw), LLM(enforce_eager=True, **kw)
    info = fast.engine.model_info
    assert {"moe", "cuda_graphs"} <= set(info["fast_paths"]), info["fast_path_fallbacks"]
    assert fast.engine.runner.graphs.captured
    prompts = make_prompts(5, 900, 3, 40, seed=3)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    got = [o.token_ids for o in fast.generate(prompts, params)]
    assert got == [o.token_ids for o in eager.generate(prompts, params)]
    assert got == hf_greedy(path, prompts, MAX_NEW)
    assert [fast.generate([p], params)[0].token_ids for p in prompts[:2]] == got[:2]  # the batch-1 graph
    assert_pool_whole(fast)


def test_gpt_oss_mxfp4_codes_on_cuda_match_hf(tmp_path, demo_dir):
    """A checkpoint that ships MXFP4 experts keeps their codes on CUDA (the grouped kernel decodes them) and
    gives transformers' greedy tokens on the same directory, inside the decode graphs."""
    from sidecar.model import mxfp4
    from tests.unit.model.test_gpt_oss import to_mxfp4

    path = to_mxfp4(build_family_checkpoint("gpt_oss", tmp_path / "src", demo_dir), tmp_path / "mxfp4")
    llm = LLM(model=str(path), dtype="float32", device="cuda", max_num_seqs=8, num_kv_blocks=128)
    assert "moe" in llm.engine.model_info["fast_paths"], llm.engine.model_info["fast_path_fallbacks"]
    blocks = [layer.mlp for layer in llm.engine.runner.model.layers]
    assert all(isinstance(e.down_proj, mxfp4.Mxfp4Linear) for b in blocks for e in b.experts)
    assert all(b.stacked.mxfp4 and b.stacked.down.is_cuda for b in blocks)
    prompts = make_prompts(4, 900, 3, 40, seed=5)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == hf_greedy(path, prompts, MAX_NEW)
    assert_pool_whole(llm)

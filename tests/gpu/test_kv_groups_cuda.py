"""KV groups on CUDA: Gemma 3's sliding layers give back the blocks their window passed while the decode
graphs (captured over every group's tables) replay; greedy float32 equals the eager engine and HF
transformers token for token, with a tight pool."""

from __future__ import annotations

from sidecar import LLM, SamplingParams
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy
from tests.unit.model.family_checkpoints import build_family_checkpoint

NEW = 24
PROMPTS = [[5 + (11 * i + 5 * j) % 700 for j in range(n)] for i, n in enumerate([37, 52, 23, 9])]


def test_grouped_gemma3_in_decode_graphs_matches_eager_and_hf(tmp_path, demo_dir):
    path = build_family_checkpoint("gemma3", tmp_path / "gemma3", demo_dir)
    kw = dict(model=str(path), dtype="float32", device="cuda", block_size=8, num_kv_blocks=40)
    fast, eager = LLM(**kw), LLM(enforce_eager=True, **kw)
    assert fast.engine.kv.plan is not None and len(fast.engine.kv.groups) > 1
    info = fast.engine.model_info
    assert {"attention", "cuda_graphs"} <= set(info["fast_paths"]), info["fast_path_fallbacks"]
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    got = [o.token_ids for o in fast.generate(PROMPTS, params)]
    assert got == [o.token_ids for o in eager.generate(PROMPTS, params)]
    assert got == hf_greedy(path, PROMPTS, NEW)
    assert fast.engine.kv.num_released_blocks > 0
    assert_pool_whole(fast)

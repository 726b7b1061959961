"""The KV pool reads as zeros wherever a step can read before writing: the lazy prefix and the background
commit (engine/kv_zero.py) cover every block, and a pool full of NaN before use still gives HF's output."""

from __future__ import annotations

import torch

from sidecar import LLM, BeamSearchParams, SamplingParams
from sidecar.engine.kv_zero import PoolZeroing
from tests.unit.engine.test_beam_search import assert_same_ranking, hf_beams, load_hf
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy, make_prompts


def _nan_pool(num_blocks: int) -> list[tuple[torch.Tensor, ...]]:
    return [
        (torch.full((num_blocks, 4, 2, 8), float("nan")), torch.full((num_blocks, 4, 2, 8), float("nan")))
        for _ in range(3)
    ]


def test_background_commit_zeroes_every_block_but_written_ones():
    caches = _nan_pool(300)
    z = PoolZeroing(caches, 300, commit=True)
    z.through(5)  # a writer's blocks, possibly while the thread runs
    for k, v in caches:
        k[1:6] = 7.0
        v[1:6] = 7.0
    z.wait()
    assert z.committed()
    for k, v in caches:
        for t in (k, v):
            assert torch.equal(t[0], torch.zeros_like(t[0]))
            assert bool((t[1:6] == 7.0).all())
            assert torch.equal(t[6:], torch.zeros_like(t[6:]))


def test_lazy_zeroing_clears_only_blocks_in_use():
    caches = _nan_pool(20)
    z = PoolZeroing(caches, 20, commit=False)
    assert z.thread is None and not z.committed()
    z.through(4)
    for k, _ in caches:
        assert torch.equal(k[:5], torch.zeros_like(k[:5]))
        assert bool(k[5:].isnan().all())
    z.rezero(7, 8)
    assert bool((caches[0][0][7:9] == 0).all()) and bool(caches[0][0][9:].isnan().all())


def test_nan_pool_before_first_use_still_matches_hf(tiny_models):
    """Every block past the padding block holds NaN and is marked unzeroed, as an uninitialised pool is:
    greedy decoding and beam search (forks, copied blocks) still equal HF, so no step reads a slot as data
    before a write or the lazy zeroing reached it."""
    path = tiny_models["llama"]
    llm = LLM(model=str(path), dtype="float32", block_size=8, num_kv_blocks=64)
    z = llm.engine.runner.zeroing
    z.wait()
    for layer in llm.engine.runner.kv_caches:
        for t in layer:
            t[1:].fill_(float("nan"))
    z.upto, z.top = 0, z.num_blocks
    prompts = make_prompts(3, 900, 3, 20, seed=3)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 6)
    beam = llm.beam_search(prompts[:1], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))[0]
    assert_same_ranking(beam, hf_beams(load_hf(path), prompts[0], width=3, max_new=5))
    assert_pool_whole(llm)

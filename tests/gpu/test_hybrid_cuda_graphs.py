"""Decode graphs of a hybrid model on CUDA (Qwen3.5: gated DeltaNet layers with per-sequence state slots
among gated attention layers): the self-check keeps the graphs on and captures every bucket; greedy float32
with graphs equals the eager engine and HF over a shrinking batch (padded rows on the scratch state row) and
with a request cancelled while graph batches run; the state slots and the KV pool whole after."""

from __future__ import annotations

import pytest

from sidecar import LLM, SamplingParams
from tests.unit.engine.test_engine_vs_hf import hf_greedy
from tests.unit.model.family_checkpoints import assert_not_degenerate, build_family_checkpoint
from tests.unit.model.test_hybrid_vs_hf import PROMPTS, assert_slots_whole

MAX_NEW = 8
LENS = [8, 3, 6, 8, 5, 2]  # the batch shrinks as requests finish: buckets 8, 4, 2, 1, padded rows included


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory, demo_dir):
    path = build_family_checkpoint("qwen3_5", tmp_path_factory.mktemp("hybrid_graphs") / "qwen3_5", demo_dir)
    ref = hf_greedy(path, PROMPTS, MAX_NEW)
    assert_not_degenerate(ref)
    return path, ref


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", device="cuda", max_num_seqs=8, num_kv_blocks=128, **kw)


def test_hybrid_graphs_equal_eager_and_hf(qwen35):
    path, ref = qwen35
    graphs, eager = _llm(path), _llm(path, enforce_eager=True)
    info = graphs.engine.model_info
    assert "cuda_graphs" in info["fast_paths"], info["fast_path_fallbacks"]
    runner = graphs.engine.runner
    assert runner.graphs.captured == runner.buckets == [1, 2, 4, 8]
    assert eager.engine.model_info["fast_paths"] == [] and not eager.engine.runner.graphs.captured
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in LENS]
    got = [o.token_ids for o in graphs.generate(PROMPTS, params)]
    assert got == [o.token_ids for o in eager.generate(PROMPTS, params)]
    assert got == [r[:n] for r, n in zip(ref, LENS)]
    for llm in (graphs, eager):
        assert_slots_whole(llm)


def test_a_cancel_while_hybrid_graph_batches_run(qwen35):
    path, ref = qwen35
    llm = _llm(path)
    eng = llm.engine
    greedy = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    ids = [eng.add_request(None, p, greedy) for p in PROMPTS]
    done, steps = {}, 0
    while eng.has_unfinished_requests():
        steps += 1
        if steps == 4:  # mid-run, while the batch decodes in a padded bucket
            eng.abort(ids[1])
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert done[ids[1]].finish_reason == "abort"
    assert [done[i].token_ids for i in ids if i != ids[1]] == [r for j, r in enumerate(ref) if j != 1]
    # a request after the cancel takes a freed slot (zeroed) and decodes exactly
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], greedy)] == ref[:2]
    assert_slots_whole(llm)

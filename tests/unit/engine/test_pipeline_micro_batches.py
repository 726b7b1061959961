"""Pipeline micro-batches: a step's sequences cut in parts that flow down the stages one after another. Cuts
fall between sequences only; three stages with three parts in flight give HF float32's greedy tokens through
preemption, chunked prefill, prefix hits, requests that finish or are aborted while others run, and a middle
stage's death ends the requests instead of hanging."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.config import EngineConfig
from sidecar.engine.pp_micro import micro_batches, micro_meta
from sidecar.model.attention import AttentionMetadata, PrefillSegment
from tests.unit.engine.test_engine_vs_hf import hf_generate
from tests.unit.engine.test_pipeline_parallel import _checkpoint, _pool_whole, _prompts

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


def _meta(segments: list[int], decodes: int) -> AttentionMetadata:
    """Prompt segments of the given lengths, packed first, then ``decodes`` decode rows."""
    prefills, start = [], 0
    for n in segments:
        prefills.append(PrefillSegment(start, n, n + 3, torch.arange(4)))
        start += n
    meta = AttentionMetadata(slot_mapping=torch.arange(start + decodes), block_size=8, prefills=prefills)
    if decodes:
        meta.decode_block_tables = torch.arange(decodes * 2).view(decodes, 2)
        meta.decode_ctx_lens = torch.arange(decodes) + 10
    return meta


def test_cuts_fall_between_sequences_and_parts_keep_their_rows():
    meta = _meta([5, 2], 4)
    bounds = micro_batches(meta, 11, 3)
    assert bounds == [(0, 5), (5, 7), (7, 11)]
    first, second, third = (micro_meta(meta, a, b) for a, b in bounds)
    assert [(s.q_start, s.q_len, s.ctx_len) for s in first.prefills] == [(0, 5, 8)]
    assert first.decode_block_tables is None and first.slot_mapping.tolist() == [0, 1, 2, 3, 4]
    assert [(s.q_start, s.q_len) for s in second.prefills] == [(0, 2)] and second.decode_ctx_lens is None
    assert third.prefills == [] and third.slot_mapping.tolist() == [7, 8, 9, 10]
    assert third.decode_block_tables.tolist() == meta.decode_block_tables.tolist()
    # Decode rows alone split evenly; a part never straddles a prompt segment.
    assert micro_batches(_meta([], 4), 4, 2) == [(0, 2), (2, 4)]
    assert micro_meta(_meta([], 4), 2, 4).decode_ctx_lens.tolist() == [12, 13]
    assert micro_batches(_meta([9, 1], 1), 11, 4) == [(0, 9), (9, 10), (10, 11)]
    # One sequence, one part asked, or metadata that is not the plain layout: the whole step.
    assert micro_batches(_meta([12], 0), 12, 3) == [(0, 12)]
    assert micro_batches(meta, 11, 1) == [(0, 11)]
    grouped = _meta([5, 2], 4)
    grouped.layer_metas = [grouped]
    assert micro_batches(grouped, 11, 3) == [(0, 11)]
    # A hybrid model's state slots go with their sequences: each segment keeps its own, decode rows are cut.
    hybrid = _meta([5, 2], 4)
    hybrid.prefills[1].state_slot = 3
    hybrid.decode_state_slots = torch.tensor([6, 1, 0, 2])
    assert micro_batches(hybrid, 11, 3) == bounds
    parts = [micro_meta(hybrid, a, b) for a, b in [(0, 7), (7, 9), (9, 11)]]
    assert [s.state_slot for s in parts[0].prefills] == [0, 3] and parts[0].decode_state_slots is None
    assert [p.decode_state_slots.tolist() for p in parts[1:]] == [[6, 1], [0, 2]]


def test_micro_batch_setting_is_checked():
    with pytest.raises(ValueError, match=r"pipeline_micro_batches: must be an integer in \[1, 64\]"):
        EngineConfig(model="demo", pipeline_parallel_size=2, pipeline_micro_batches=0)
    with pytest.raises(ValueError, match="pipeline_micro_batches"):
        EngineConfig(model="demo", pipeline_parallel_size=2, pipeline_micro_batches=True)


@pytest.fixture(scope="module")
def three_stages(tmp_path_factory, demo_dir):
    path, hf = _checkpoint("llama", 3, tmp_path_factory.mktemp("ppmb") / "llama", demo_dir)
    prompts = _prompts(hf.config.vocab_size)
    llm = LLM(
        model=str(path),
        dtype="float32",
        pipeline_parallel_size=3,  # a middle stage receives and sends parts
        block_size=8,
        num_kv_blocks=16,  # preemption
        max_num_batched_tokens=16,  # chunked prompts
    )
    try:
        yield llm, prompts, hf_generate(hf, prompts, MAX_NEW)
    finally:
        llm.engine.tp.close()


def test_three_stages_with_parts_in_flight_match_hf(three_stages):
    llm, prompts, ref = three_stages
    pp = llm.engine.tp
    assert pp.micro_batches == 3
    before = pp.split_steps
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
    assert pp.split_steps > before  # steps did run in parts
    assert llm.stats()["num_preemptions"] > 0
    _pool_whole(llm)
    again = llm.generate(prompts[-2:], GREEDY)  # both hit the shared prefix, in parts of one step
    assert [o.token_ids for o in again] == ref[-2:]
    assert all(o.num_cached_tokens >= 24 for o in again)
    _pool_whole(llm)


def test_requests_finish_and_abort_while_others_run_in_parts(three_stages):
    llm, prompts, ref = three_stages
    eng = llm.engine
    lens = [2, MAX_NEW, 3, MAX_NEW, 5]
    ids = [
        eng.add_request(None, p, SamplingParams(max_tokens=n, ignore_eos=True))
        for p, n in zip(prompts[:5], lens)
    ]
    outs, steps = {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
        steps += 1
        if steps == 6:  # mid-generation, with other sequences in the same step's parts
            eng.abort(ids[3])
    assert outs[ids[3]].finish_reason == "abort"
    for i in (0, 1, 2, 4):
        assert outs[ids[i]].finish_reason == "length" and outs[ids[i]].token_ids == ref[i][: lens[i]]
    assert ref[3][: len(outs[ids[3]].token_ids)] == outs[ids[3]].token_ids
    _pool_whole(llm)


def test_killed_middle_stage_ends_requests_instead_of_hanging(three_stages):
    """Last in this module: it breaks the stages for good."""
    llm, prompts, _ = three_stages
    eng = llm.engine
    ids = [eng.add_request(None, p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in prompts[:4]]
    outs = {}
    for _ in range(4):
        for o in eng.step():
            outs[o.request_id] = o
    os.kill(eng.tp.pids()[1], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while eng.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine hung after its middle stage died"
        for o in eng.step():
            outs[o.request_id] = o
    for rid in ids:
        assert outs[rid].finish_reason == "abort"
        assert "pipeline-parallel worker rank 1" in outs[rid].abort_reason
    _pool_whole(llm)

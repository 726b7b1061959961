"""Beam search equals Hugging Face transformers' beam search (float32, one prompt per HF call), shares its
prefix's KV blocks, runs in the same batch as sampled requests, and returns every block."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from sidecar import LLM, BeamSearchParams, SamplingParams
from sidecar.config import EngineConfig
from sidecar.engine.engine import LLMEngine
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, hf_greedy, make_prompts

W = 4
MAX_NEW = 10


def hf_beams(hf, prompt, width=W, max_new=MAX_NEW, length_penalty=1.0, eos=None):
    """HF's ranked hypotheses for one prompt: [(generated ids, score)], best first."""
    with torch.no_grad():
        g = hf.generate(
            torch.tensor([prompt]),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            early_stopping=False,
            max_new_tokens=max_new,
            length_penalty=length_penalty,
            eos_token_id=eos,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    out = []
    for i in range(width):
        n = int((g.beam_indices[i] >= 0).sum())
        out.append((g.sequences[i, len(prompt) : len(prompt) + n].tolist(), float(g.sequences_scores[i])))
    return out


def load_hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


def assert_same_ranking(ours, ref, length_penalty=1.0):
    assert [s.token_ids for s in ours.sequences] == [ids for ids, _ in ref]
    for s, (ids, score) in zip(ours.sequences, ref):
        assert s.score == pytest.approx(score, rel=1e-5, abs=1e-5)
        assert s.cum_logprob == pytest.approx(score * len(ids) ** length_penalty, rel=1e-5, abs=1e-4)


PROMPTS = make_prompts(4, 900, 3, 40, seed=1)


@pytest.mark.parametrize(
    "kind,length_penalty", [("qwen2", 1.0), ("llama", 1.0), ("qwen2", 0.5), ("llama", 2.0)]
)
def test_beam_search_matches_hf_ranked_list(tiny_models, kind, length_penalty):
    hf = load_hf(tiny_models[kind])
    llm = LLM(model=str(tiny_models[kind]), dtype="float32", block_size=8)
    params = BeamSearchParams(
        beam_width=W, max_tokens=MAX_NEW, ignore_eos=True, length_penalty=length_penalty
    )
    outs = llm.beam_search(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt_token_ids == prompt
        assert len(out.sequences) == W
        assert_same_ranking(out, hf_beams(hf, prompt, length_penalty=length_penalty), length_penalty)
        assert all(s.finish_reason == "length" for s in out.sequences)
    assert_pool_whole(llm)


def test_beam_search_eos_ends_hypotheses_like_hf(tiny_models, tmp_path):
    """EOS is a token the beams choose (the checkpoint's eos is set to one): hypotheses end early, and
    the group ends by HF's early-stopping heuristic, with the same ranked list and scores."""
    src = tiny_models["qwen2"]
    hf = load_hf(src)
    prompt = PROMPTS[0]
    free = hf_beams(hf, prompt, max_new=12)
    eos = free[1][0][3]  # a token beams pick a few steps in
    d = tmp_path / "eos-model"
    shutil.copytree(src, d)
    for name in ("config.json", "generation_config.json"):
        if (d / name).exists():
            cfg = json.loads((d / name).read_text())
            cfg["eos_token_id"] = eos
            (d / name).write_text(json.dumps(cfg))
    llm = LLM(model=str(d), dtype="float32", block_size=8)
    eos_ids = list(llm.engine.eos_token_ids)  # the config's and the tokenizer's
    assert eos in eos_ids
    for lp in (1.0, 0.0):
        ref = hf_beams(hf, prompt, max_new=12, eos=eos_ids, length_penalty=lp)
        (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=W, max_tokens=12, length_penalty=lp))
        assert_same_ranking(out, ref, lp)
        assert any(s.token_ids[-1] == eos and s.finish_reason == "stop" for s in out.sequences)
        # ignore_eos: EOS is an ordinary token, as HF without an eos id
        (plain,) = llm.beam_search(
            [prompt], BeamSearchParams(beam_width=W, max_tokens=12, length_penalty=lp, ignore_eos=True)
        )
        assert_same_ranking(plain, hf_beams(hf, prompt, max_new=12, length_penalty=lp), lp)
    assert_pool_whole(llm)


def _blocks_of(eng, group):
    return [eng.kv.req_blocks[b.request_id] for b in group.beams if b.request_id in eng.kv.req_blocks]


def test_beams_share_prefix_blocks_exactly(tiny_models):
    """While a group runs, the pool holds exactly the distinct blocks of its beams' tables, each block's
    reference count is the number of beams using it, and the prompt's full blocks are held once for all
    beams: far fewer blocks than W unshared sequences."""
    eng = LLMEngine(
        EngineConfig(
            model=str(tiny_models["qwen2"]), dtype="float32", block_size=8, enable_prefix_caching=False
        )
    )
    prompt = make_prompts(1, 900, 37, 37, seed=5)[0]  # 4 full blocks + 5 tokens
    eng.add_request(
        "g", prompt, BeamSearchParams(beam_width=W, max_tokens=20, ignore_eos=True).sampling_params()
    )
    group = eng.beams.groups["g"]
    checked = 0
    while eng.has_unfinished_requests():
        eng.step()
        if "g" not in eng.beams.groups or len(group.beams) < W:
            continue
        tables = _blocks_of(eng, group)
        distinct = {b.block_id: b for t in tables for b in t}
        used = eng.kv.num_blocks - eng.kv.num_free_blocks()
        assert used == len(distinct)
        for bid, block in distinct.items():
            assert block.ref_cnt == sum(1 for t in tables for b in t if b.block_id == bid)
        for t in tables:
            assert [b.block_id for b in t[:4]] == [b.block_id for b in tables[0][:4]]
            assert all(b.ref_cnt == W for b in t[:4])
        unshared = sum(len(t) for t in tables)
        assert used <= unshared - 3 * 4  # the 4 prompt blocks are held once, not W times
        checked += 1
    assert checked >= 10
    assert eng.kv.num_cow_copies > 0
    assert eng.kv.num_free_blocks() == eng.kv.num_blocks and not eng.kv.req_blocks


def test_abort_returns_every_block(tiny_models):
    llm = LLM(model=str(tiny_models["qwen2"]), dtype="float32", block_size=8)
    eng = llm.engine
    params = BeamSearchParams(beam_width=W, max_tokens=30, ignore_eos=True).sampling_params()
    eng.add_request("g", PROMPTS[1], params)
    for _ in range(6):
        eng.step()
    assert len(eng.beams.groups["g"].beams) == W
    assert eng.kv.num_free_blocks() < eng.kv.num_blocks
    eng.abort("g")
    outs = eng.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("g", True, "abort")]
    assert not eng.has_unfinished_requests()
    assert_pool_whole(llm)


def test_mixed_batch_with_ordinary_requests(tiny_models):
    """Beam groups and greedy requests share steps; the greedy outputs equal HF greedy and the beams HF's
    beam search."""
    d = tiny_models["llama"]
    hf = load_hf(d)
    greedy_prompts = make_prompts(3, 900, 5, 30, seed=7)
    ref_greedy = hf_greedy(d, greedy_prompts)
    llm = LLM(model=str(d), dtype="float32", block_size=8)
    eng = llm.engine
    mixed_steps = 0
    schedule = eng.scheduler.schedule

    def traced():
        out = schedule()
        kinds = {s.request.beam_group is not None for s in out.scheduled}
        nonlocal mixed_steps
        mixed_steps += kinds == {True, False}
        return out

    eng.scheduler.schedule = traced
    beam = BeamSearchParams(beam_width=W, max_tokens=MAX_NEW, ignore_eos=True).sampling_params()
    for i, p in enumerate(PROMPTS[:2]):
        eng.add_request(f"b{i}", p, beam)
    for i, p in enumerate(greedy_prompts):
        eng.add_request(f"s{i}", p, SamplingParams(max_tokens=12, ignore_eos=True))
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert [done[f"s{i}"].token_ids for i in range(3)] == ref_greedy
    for i, p in enumerate(PROMPTS[:2]):
        o = done[f"b{i}"]
        ref = hf_beams(hf, p)
        assert [s.token_ids for s in o.beams] == [ids for ids, _ in ref]
        assert o.token_ids == ref[0][0]
    assert mixed_steps > 5
    assert_pool_whole(llm)


def test_preempted_groups_recompute_and_match_hf(tiny_models):
    """A pool too small for every group at once: groups are preempted whole and recomputed; results still
    equal HF and the pool ends whole."""
    d = tiny_models["qwen2"]
    hf = load_hf(d)
    llm = LLM(model=str(d), dtype="float32", block_size=8, num_kv_blocks=40)
    sched = llm.engine.scheduler
    schedule, whole = sched.schedule, []

    def checked():  # a preempted beam's group has no beam left running
        out = schedule()
        for r in out.preempted:
            if r.beam_group is not None:
                whole.append(not any(b in sched.running for b in r.beam_group.beams))
        return out

    sched.schedule = checked
    params = BeamSearchParams(beam_width=W, max_tokens=16, ignore_eos=True)
    outs = llm.beam_search(PROMPTS, params)
    assert llm.stats()["num_preemptions"] > 0
    assert whole and all(whole)
    for p, o in zip(PROMPTS, outs):
        assert_same_ranking(o, hf_beams(hf, p, max_new=16))
    assert_pool_whole(llm)


def test_stop_string_ends_a_hypothesis(tiny_models):
    llm = LLM(model=str(tiny_models["qwen2"]), dtype="float32", block_size=8)
    free = llm.beam_search([PROMPTS[2]], BeamSearchParams(beam_width=W, max_tokens=12, ignore_eos=True))[0]
    text = free.sequences[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop
    (out,) = llm.beam_search(
        [PROMPTS[2]], BeamSearchParams(beam_width=W, max_tokens=12, ignore_eos=True, stop=[stop])
    )
    assert out.sequences
    assert all(stop not in s.text for s in out.sequences)
    assert any(s.finish_reason == "stop" for s in out.sequences)
    assert_pool_whole(llm)


@pytest.mark.parametrize(
    "field,kw",
    [
        ("temperature", {"temperature": 0.7}),
        ("top_p", {"top_p": 0.9}),
        ("top_k", {"top_k": 5}),
        ("min_p", {"min_p": 0.1}),
        ("repetition_penalty", {"repetition_penalty": 1.2}),
        ("seed", {"seed": 3}),
        ("logprobs", {"logprobs": 2}),
        ("structured", {"structured": ["yes", "no"]}),
        ("beam_width", {"beam_width": 0}),
        ("length_penalty", {"length_penalty": "long"}),
    ],
)
def test_sampling_options_refused_with_beams(field, kw):
    args = {"beam_width": 2, **kw}
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**args)


def test_beam_requests_the_engine_cannot_hold_are_refused(tiny_models):
    llm = LLM(
        model=str(tiny_models["qwen2"]), dtype="float32", block_size=8, num_kv_blocks=20, max_num_seqs=8
    )
    with pytest.raises(ValueError, match="^beam_width:"):
        llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=16, max_tokens=4))
    with pytest.raises(ValueError, match="^beam_width:.*KV"):
        llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=8, max_tokens=100))
    with pytest.raises(ValueError, match="^max_tokens:"):
        BeamSearchParams(max_tokens=0)
    with pytest.raises(ValueError, match="^params:"):
        llm.beam_search([PROMPTS[0]], SamplingParams())
    assert_pool_whole(llm)

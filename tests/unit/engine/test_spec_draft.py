"""Speculative decoding with a draft model (``speculative="draft:<model>"``): exact greedy output, the target's
sampling distribution under rejection sampling with the draft's q, the draft's own KV pool returned whole,
and refusals naming ``speculative``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from sidecar import LLM, SamplingParams
from sidecar.engine.spec.draft import DraftProposer

from test_engine_vs_hf import assert_pool_whole, hf_greedy
from test_spec_engine import repetitive_prompts
from test_spec_exact import chi2_critical, chi2_statistic, target_joint

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def noisy_draft(demo_dir, tmp_path_factory) -> Path:
    """The demo model with every matrix perturbed: it shares the tokenizer and agrees with the target on
    part of its greedy choices, so verification both accepts and rejects."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("draft") / "noisy"
    shutil.copytree(demo_dir, out)
    sd = load_file(str(out / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    sd = {
        k: (v + 0.05 * v.float().std() * torch.randn(v.shape, generator=g)).to(v.dtype) if v.dim() > 1 else v
        for k, v in sd.items()
    }
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def make_llm(target: Path, draft: Path, **kw) -> LLM:
    kw.setdefault("block_size", 8)
    kw.setdefault("num_kv_blocks", 256)
    # token cost 0: speculate whenever acceptance is not hopeless, so every path is exercised
    return LLM(
        model=str(target),
        dtype="float32",
        speculative=f"draft:{draft}",
        speculative_token_cost=0.0,
        speculative_max_batch=kw.pop("max_batch", 1024),
        **kw,
    )


def draft_pool_whole(llm: LLM) -> None:
    assert_pool_whole(llm)
    prop = llm.engine.spec.proposer
    assert isinstance(prop, DraftProposer)
    assert not prop.shadows and not prop.kv.req_blocks
    assert prop.kv.num_free_blocks() == prop.kv.num_blocks


def test_greedy_identical_to_off_and_to_hf_64_prompts(demo_dir, noisy_draft):
    prompts = repetitive_prompts(64, seed=3)
    ref = [o.token_ids for o in LLM(model=str(demo_dir), dtype="float32").generate(prompts, GREEDY)]
    llm = make_llm(demo_dir, noisy_draft)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert ref[:8] == hf_greedy(demo_dir, prompts[:8], max_new=40)
    s = llm.stats()
    hist = s["spec_decode_acceptance_hist"]
    assert hist[0] > 0 and hist[-1] > 0  # rejected at the first token and accepted whole, both
    assert 0 < s["spec_decode_accepted_tokens"] < s["spec_decode_proposed_tokens"]
    assert s["spec_decode_draft_forwards"] > 0
    draft_pool_whole(llm)


def test_same_model_as_draft_accepts_everything(demo_dir):
    prompts = repetitive_prompts(8, seed=4)
    llm = make_llm(demo_dir, demo_dir)
    outs = llm.generate(prompts, GREEDY)
    ref = LLM(model=str(demo_dir), dtype="float32").generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    s = llm.stats()
    assert s["spec_decode_proposed_tokens"] > 100
    assert s["spec_decode_accepted_tokens"] == s["spec_decode_proposed_tokens"]
    draft_pool_whole(llm)


@pytest.mark.parametrize("budget,blocks", [(5, 256), (64, 24)])
def test_greedy_identical_under_small_budget_preemption_and_draft_eviction(
    demo_dir, noisy_draft, budget, blocks
):
    """A 5-token budget chunks the draft's catch-up of long prompts over several steps; 24 blocks make the
    target preempt and the draft pool (as large as the target's) drop shadows to make room."""
    prompts = repetitive_prompts(16, seed=5)
    ref = [o.token_ids for o in LLM(model=str(demo_dir), dtype="float32").generate(prompts, GREEDY)]
    llm = make_llm(demo_dir, noisy_draft, max_num_batched_tokens=budget, num_kv_blocks=blocks)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert llm.stats()["spec_decode_accepted_tokens"] > 0
    if blocks == 24:
        assert llm.stats()["num_preemptions"] > 0
    draft_pool_whole(llm)


def test_stop_strings_max_tokens_logprobs_and_abort(demo_dir, noisy_draft):
    prompts = repetitive_prompts(6, seed=6)
    off = LLM(model=str(demo_dir), dtype="float32")
    llm = make_llm(demo_dir, noisy_draft)
    for mt in (1, 2, 5, 17):
        p = SamplingParams(max_tokens=mt, ignore_eos=True, logprobs=2)
        a, b = off.generate(prompts, p), llm.generate(prompts, p)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        for x, y in zip(a, b):
            assert [lp.token_id for lp in x.logprobs] == [lp.token_id for lp in y.logprobs]
            assert [lp.logprob for lp in x.logprobs] == pytest.approx(
                [lp.logprob for lp in y.logprobs], abs=1e-4
            )
    text = off.generate(prompts[:1], GREEDY)[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    p = SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop])
    assert off.generate(prompts[:1], p)[0].text == llm.generate(prompts[:1], p)[0].text
    eng = llm.engine
    rid = eng.add_request(None, prompts[0], SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert eng.spec.proposer.shadows  # the draft holds KV for the running request
    eng.abort(rid)
    eng.step()
    draft_pool_whole(llm)


def test_draft_prefix_cache_serves_a_repeated_prompt(demo_dir, noisy_draft):
    llm = make_llm(demo_dir, noisy_draft)
    prompt = repetitive_prompts(1, seed=7)[0] * 3
    llm.generate([prompt], GREEDY)
    kv = llm.engine.spec.proposer.kv
    before = kv.prefix_hits
    llm.generate([prompt], GREEDY)
    assert kv.prefix_hits - before >= (len(prompt) - 1) // 8 * 8
    draft_pool_whole(llm)


def test_rejection_sampling_with_draft_distribution_preserves_target_distribution(demo_dir, noisy_draft):
    """Joint law of the first four tokens with a sampling draft equals the target's: proposals drawn from
    the draft's q are accepted with min(1, p/q), a rejection draws from norm(max(0, p - q)). (Verifying with
    a q other than the one the draft sampled from, e.g. at another temperature, fails it: chi2 ~140 at 3,000
    samples against a critical value of 125.)"""
    from transformers import AutoModelForCausalLM

    temperature, top_k, n_tok, n_samples = 2.0, 3, 4, 6000
    hf = AutoModelForCausalLM.from_pretrained(str(demo_dir), dtype=torch.float32)
    prompt = repetitive_prompts(1, seed=8)[0]
    llm = make_llm(demo_dir, noisy_draft, max_num_batched_tokens=1 << 16)
    params = SamplingParams(max_tokens=n_tok, ignore_eos=True, temperature=temperature, top_k=top_k)
    counts: dict[tuple, int] = {}
    for o in llm.generate([prompt] * n_samples, [params] * n_samples):
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    hist = llm.stats()["spec_decode_acceptance_hist"]
    assert hist[0] > 100 and sum(hist[1:]) > 100
    probs = target_joint(hf, prompt, n_tok, temperature, top_k)
    assert set(counts) <= set(probs)
    stat, dof = chi2_statistic(counts, probs, n_samples)
    assert dof >= 5
    assert stat < chi2_critical(dof), (stat, dof)
    draft_pool_whole(llm)


def test_draft_that_does_not_share_the_tokenizer_or_exist_is_refused(demo_dir, tiny_models):
    # The tiny llama checkpoint has the demo's vocabulary size but splits digits differently.
    with pytest.raises(ValueError, match="speculative: .*tokeniz"):
        make_llm(demo_dir, tiny_models["llama"])
    with pytest.raises(ValueError, match="speculative: draft model"):
        make_llm(demo_dir, Path("/nowhere/at/all"))


def test_failing_draft_forward_costs_speculation_not_requests(demo_dir, noisy_draft, monkeypatch):
    prompts = repetitive_prompts(4, seed=9)
    ref = [o.token_ids for o in LLM(model=str(demo_dir), dtype="float32").generate(prompts, GREEDY)]
    llm = make_llm(demo_dir, noisy_draft)
    prop = llm.engine.spec.proposer
    calls = {"n": 0}
    real = prop._forward

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("draft forward failed")
        return real(batch)

    monkeypatch.setattr(prop, "_forward", flaky)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert all(o.finish_reason == "length" for o in outs)
    assert calls["n"] >= 3 and llm.stats()["spec_decode_proposer_failures"] == calls["n"] // 3
    draft_pool_whole(llm)


def test_requests_past_the_drafts_context_decode_without_it(demo_dir, noisy_draft, tmp_path):
    import json

    short = tmp_path / "short"
    shutil.copytree(noisy_draft, short)
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = 48
    (short / "config.json").write_text(json.dumps(cfg))
    prompts = [p for p in repetitive_prompts(8, seed=10) if len(p) < 40]
    ref = [o.token_ids for o in LLM(model=str(demo_dir), dtype="float32").generate(prompts, GREEDY)]
    llm = make_llm(demo_dir, short)
    assert llm.engine.spec.proposer.max_len == 48
    outs = llm.generate(prompts, GREEDY)  # 40 new tokens: every request outgrows the draft's 48 positions
    assert [o.token_ids for o in outs] == ref
    s = llm.stats()
    assert s["spec_decode_proposed_tokens"] > 0 and s["spec_decode_proposer_failures"] == 0
    draft_pool_whole(llm)

"""Prompt attention on CUDA never takes cuDNN's fused SDPA kernel, which builds an execution plan for every new
sequence length (tens of milliseconds each on an H100): every prompt length, whole or chunked, attends through
flash or memory-efficient attention, and the process's own backend settings are left as they were."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sidecar import LLM, SamplingParams
from tests.unit.engine.test_engine_vs_hf import assert_pool_whole, make_prompts


def test_prompt_attention_avoids_cudnn_and_restores_the_flags(tiny_models, monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    # chunks of at most 24 tokens: the longer prompts' later chunks attend over the cache with a mask
    llm = LLM(
        model=str(tiny_models["qwen2"]),
        dtype="bfloat16",
        device="cuda",
        max_num_seqs=8,
        num_kv_blocks=128,
        max_num_batched_tokens=24,
    )
    calls.clear()
    prompts = make_prompts(8, 900, 3, 60, seed=3)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [4] * 8
    assert len(calls) >= 8 * llm.engine.model_info["num_layers"]
    assert all(c == (False, True) for c in calls), sorted(set(calls))
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    assert_pool_whole(llm)

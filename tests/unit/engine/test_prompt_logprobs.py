"""SamplingParams(prompt_logprobs=0): each prompt token's log-probability, equal to HF transformers'."""

from __future__ import annotations

import random

import pytest
import torch

from sidecar import LLM, SamplingParams


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[p, prompt[p + 1]].item() for p in range(len(prompt) - 1)]


@pytest.mark.parametrize("chunk", [2048, 16])
def test_prompt_logprobs_match_hf(tiny_models, chunk):
    rng = random.Random(4)
    prompt = [rng.randrange(3, 900) for _ in range(61)]
    want = hf_prompt_logprobs(tiny_models["llama"], prompt)
    llm = LLM(model=str(tiny_models["llama"]), dtype="float32", block_size=8, max_num_batched_tokens=chunk)
    # The first request fills the prefix cache; the second must still compute (and report) every row.
    for _ in range(2):
        out = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[1:] == pytest.approx(want, abs=1e-4)
    plain = llm.generate([prompt], SamplingParams(max_tokens=2))[0]
    assert plain.prompt_logprobs is None


def test_prompt_logprobs_values_are_checked():
    with pytest.raises(ValueError, match="^prompt_logprobs:"):
        SamplingParams(prompt_logprobs=3)

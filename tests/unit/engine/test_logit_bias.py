"""logit_bias in the batched sampler: +100 forces a token and -100 bans one, greedy and sampled, with
rows without a bias in the same batch sampling exactly as they would alone; validation names the field."""

from __future__ import annotations

import pytest
import torch

from sidecar.engine.request import MAX_LOGIT_BIAS, Request, SamplingParams
from sidecar.engine.sampler import Sampler

V = 64
CPU = torch.device("cpu")


def mk(params: SamplingParams, rid: str, prompt=(1, 2, 3)) -> Request:
    return Request(rid, list(prompt), params)


def logits_for(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_plus_100_forces_and_minus_100_bans_next_to_unbiased_rows(temperature):
    base = dict(temperature=temperature, seed=7)
    for step in range(40):
        logits = logits_for(4, step)
        top = int(logits[2].argmax())
        reqs = [
            mk(SamplingParams(**base), "plain-a"),
            mk(SamplingParams(**base, logit_bias={5: 100.0}), "forced"),
            mk(SamplingParams(temperature=0.0, logit_bias={top: -100.0}), "banned"),
            mk(SamplingParams(**base), "plain-b"),
        ]
        got, _ = Sampler(CPU, seed=3)(logits.clone(), reqs)
        assert got[1] == 5
        assert got[2] != top and got[2] == int(logits[2].topk(2).indices[1])
        # The unbiased rows sample exactly what they sample alone: no bias leaks across rows.
        alone, _ = Sampler(CPU, seed=3)(logits[[0, 3]].clone(), [mk(SamplingParams(**base), "x")] * 2)
        assert [got[0], got[3]] == alone


def test_a_banned_token_is_never_sampled_and_the_rest_keep_their_ratios():
    logits = torch.zeros(1, V)
    logits[0, :4] = 5.0  # four likely tokens; ban two of them
    counts = torch.zeros(V)
    s = Sampler(CPU, seed=11)
    for i in range(600):
        r = mk(SamplingParams(temperature=1.0, logit_bias={0: -100, 1: -100.0}), f"r{i}")
        (t,), _ = s(logits.clone(), [r])
        counts[t] += 1
    assert counts[0] == counts[1] == 0
    assert counts[2] > 200 and counts[3] > 200  # the two remaining likely tokens share the mass


def test_bias_applies_before_top_k_and_with_logprobs_of_the_raw_distribution():
    logits = logits_for(1, 5)
    low = int(logits[0].argmin())
    r = mk(SamplingParams(temperature=0.8, top_k=1, logprobs=1, logit_bias={low: 100}), "r")
    (t,), (lp,) = Sampler(CPU)(logits.clone(), [r])
    assert t == low  # top-k=1 keeps the biased token: the bias came first
    assert lp.logprob == pytest.approx(float(logits[0].log_softmax(-1)[low]), abs=1e-5)


@pytest.mark.parametrize(
    "bias, msg",
    [
        ({1: 100.5}, "logit_bias: bias of token 1 must be in [-100, 100]"),
        ({-1: 1.0}, "logit_bias: keys must be token ids"),
        ({"3": 1.0}, "logit_bias: keys must be token ids"),
        ({1: float("nan")}, "logit_bias: bias of token 1"),
        ({i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, f"logit_bias: at most {MAX_LOGIT_BIAS} entries"),
        ([1, 2], "logit_bias: must map token ids to biases"),
    ],
)
def test_invalid_logit_bias_names_the_field(bias, msg):
    with pytest.raises(ValueError) as e:
        SamplingParams(logit_bias=bias)
    assert str(e.value).startswith(msg)


def test_vocabulary_bound_is_checked_against_the_model():
    with pytest.raises(ValueError, match=r"logit_bias: token id 64 is outside the vocabulary \[0, 64\)"):
        SamplingParams(logit_bias={64: 1.0}).validate(V)
    assert SamplingParams(logit_bias={}).logit_bias is None


def test_engine_generation_follows_the_bias(demo_dir):
    from sidecar import LLM

    llm = LLM(model=str(demo_dir), seed=0, max_num_seqs=4)
    plain = llm.generate(["hello"], SamplingParams(max_tokens=6))[0].token_ids
    banned = plain[0]
    outs = llm.generate(
        ["hello", "hello", "hello"],
        [
            SamplingParams(max_tokens=6, logit_bias={17: 100.0}, ignore_eos=True),
            SamplingParams(max_tokens=6),
            SamplingParams(max_tokens=6, temperature=0.9, seed=1, logit_bias={banned: -100.0}),
        ],
    )
    assert outs[0].token_ids == [17] * 6
    assert outs[1].token_ids == plain  # batched with biased requests, the plain one is unchanged
    assert banned not in outs[2].token_ids

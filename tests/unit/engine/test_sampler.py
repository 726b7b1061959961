"""Sampler: greedy, filters, penalties, per-request seeds independent of the batch."""

from __future__ import annotations

import pytest
import torch

from sidecar.engine.request import Request, SamplingParams
from sidecar.engine.sampler import Sampler, filter_logits

V = 50


def mk(params: SamplingParams, prompt=(1, 2, 3), out=()) -> Request:
    r = Request("r", list(prompt), params)
    for t in out:
        r.append_token(t)
    return r


def test_greedy_is_argmax():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    ids, _ = Sampler(torch.device("cpu"))(logits.clone(), [mk(SamplingParams())] * 3)
    assert ids == logits.argmax(-1).tolist()


def test_top_k_keeps_k_tokens():
    logits = torch.arange(V, dtype=torch.float32)
    kept = torch.isfinite(filter_logits(logits, top_k=5, top_p=1.0, min_p=0.0)).nonzero().flatten().tolist()
    assert kept == list(range(V - 5, V))


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = torch.isfinite(filter_logits(probs.log(), 0, 0.8, 0.0))
    assert kept.tolist() == [True, True, False, False]
    kept = torch.isfinite(filter_logits(probs.log(), 0, 0.81, 0.0))
    assert kept.tolist() == [True, True, True, False]


def test_min_p_drops_unlikely_tokens():
    probs = torch.tensor([0.6, 0.3, 0.07, 0.03])
    kept = torch.isfinite(filter_logits(probs.log(), 0, 1.0, 0.1))
    assert kept.tolist() == [True, True, True, False]


def test_sampling_respects_filters():
    logits = torch.zeros(1, V)
    logits[0, 7] = 5.0
    logits[0, 9] = 5.0
    s = Sampler(torch.device("cpu"), seed=1)
    seen = {s(logits.clone(), [mk(SamplingParams(temperature=1.0, top_k=2))])[0][0] for _ in range(50)}
    assert seen == {7, 9}


def test_repetition_penalty_hf_semantics():
    logits = torch.zeros(1, V)
    logits[0, 1] = 2.0  # in prompt, positive: divided
    logits[0, 2] = -2.0  # in prompt, negative: multiplied
    logits[0, 4] = 1.5  # unseen
    ids, _ = Sampler(torch.device("cpu"))(logits, [mk(SamplingParams(repetition_penalty=2.0), prompt=(1, 2))])
    assert logits[0, 1].item() == 1.0 and logits[0, 2].item() == -4.0
    assert ids == [4]


def test_presence_and_frequency_penalties_use_output_only():
    logits = torch.zeros(1, V)
    logits[0, 5] = 3.0
    logits[0, 6] = 2.5
    r = mk(SamplingParams(frequency_penalty=0.5, presence_penalty=0.5), prompt=(6,), out=(5, 5))
    ids, _ = Sampler(torch.device("cpu"))(logits, [r])
    assert logits[0, 5].item() == pytest.approx(3.0 - 1.0 - 0.5)
    assert logits[0, 6].item() == 2.5  # prompt tokens are not penalised
    assert ids == [6]


def test_same_seed_same_tokens_whatever_the_batch():
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(8, V, generator=gen)
    params = SamplingParams(temperature=1.0, seed=1234)

    def run(batch_rows):
        s = Sampler(torch.device("cpu"), seed=99)
        target = mk(params)
        others = [mk(SamplingParams(temperature=0.8)) for _ in range(len(batch_rows) - 1)]
        seq = []
        for _ in range(20):
            logits = torch.stack([rows[0]] + [rows[i] for i in batch_rows[1:]])
            ids, _ = s(logits, [target] + others)
            seq.append(ids[0])
        return seq

    assert run([0]) == run([0, 1, 2, 3, 4, 5, 6]) == run([0, 7])


def test_logprobs_returned_for_sampled_token_and_top_n():
    logits = torch.log_softmax(torch.randn(1, V, generator=torch.Generator().manual_seed(0)), -1)
    ids, lps = Sampler(torch.device("cpu"))(logits.clone(), [mk(SamplingParams(logprobs=3))])
    lp = lps[0]
    assert lp.token_id == ids[0]
    assert lp.logprob == pytest.approx(logits[0, ids[0]].item(), abs=1e-5)
    assert [t for t, _ in lp.top] == torch.topk(logits[0], 3).indices.tolist()


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("max_tokens", 0),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("logprobs", 21),
        ("stop", [""]),
    ],
)
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})

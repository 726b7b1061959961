"""The batched sampler against the row-by-row sampler it replaced (kept here as the reference): greedy,
penalties and logprobs equal; sampled distributions by chi-square; seeded draws independent of the batch;
penalty state kept on the device across steps, rebuilt when it could be stale, returned on release."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from sidecar.engine.request import Request, SamplingParams
from sidecar.engine.sampler import Sampler
from sidecar.engine.structured import apply_bitmask

V = 64
CPU = torch.device("cpu")


# -- the previous row-wise implementation, the reference --------------------------------------------------
def ref_penalties(logits: torch.Tensor, req: Request) -> None:
    p = req.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long)
        vals = logits.index_select(0, seen)
        vals = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        logits.index_copy_(0, seen, vals)
    if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
        counts = torch.bincount(torch.tensor(req.output_token_ids), minlength=logits.shape[0]).to(
            logits.dtype
        )
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def ref_filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, idx, sorted_logits)
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


# -- helpers -----------------------------------------------------------------------------------------------
def mk(params: SamplingParams, prompt=(1, 2, 3), out=(), rid="r") -> Request:
    r = Request(rid, list(prompt), params)
    for t in out:
        r.append_token(t)
    return r


def random_requests(n: int, rng: random.Random, greedy: bool) -> list[Request]:
    reqs = []
    for i in range(n):
        p = SamplingParams(
            temperature=0.0 if greedy else rng.choice([0.0, 0.7, 1.3]),
            repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
            presence_penalty=rng.choice([0.0, 0.5, -0.4]),
            frequency_penalty=rng.choice([0.0, 0.3]),
            logprobs=rng.choice([None, 0, 3]),
            top_k=rng.choice([0, 5]),
            top_p=rng.choice([1.0, 0.9]),
        )
        reqs.append(
            mk(
                p,
                [rng.randrange(V) for _ in range(rng.randint(1, 12))],
                [rng.randrange(V) for _ in range(rng.randint(0, 12))],
                rid=f"r{i}",
            )
        )
    return reqs


def chi2_critical(dof: int, z: float = 3.09) -> float:
    """0.999 quantile of chi-square (Wilson-Hilferty): a correct sampler fails about 1 run in 1000."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the cells expected at least 5 times (the rest pooled) and its dof."""
    n = counts.sum().item()
    exp = probs * n
    big = exp >= 5
    obs_c, exp_c = counts[big].tolist(), exp[big].tolist()
    if (~big & (probs > 0)).any():
        obs_c.append(counts[~big].sum().item())
        exp_c.append(exp[~big].sum().item())
    return sum((o - e) ** 2 / e for o, e in zip(obs_c, exp_c)), len(obs_c) - 1


# -- greedy, penalties, masks, logprobs against the reference ----------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_with_penalties_and_masks_equals_reference(seed):
    rng = random.Random(seed)
    logits = torch.randn(9, V, generator=torch.Generator().manual_seed(seed)) * 3
    reqs = random_requests(9, rng, greedy=True)
    rows = [0, 3, 4, 8]
    bitmask = torch.randint(
        -(2**31),
        2**31 - 1,
        (len(rows), (V + 31) // 32),
        dtype=torch.int32,
        generator=torch.Generator().manual_seed(seed),
    )
    ref = logits.clone()
    for i, r in enumerate(reqs):
        ref_penalties(ref[i], r)
    apply_bitmask(ref, rows, bitmask)
    got = logits.clone()
    ids, _ = Sampler(CPU)(got, reqs, (rows, bitmask))
    assert torch.equal(got, ref)  # the penalised, masked logits bit for bit
    assert ids == ref.argmax(-1).tolist()


def test_logprobs_equal_reference_and_ignore_penalties_and_masks():
    rng = random.Random(5)
    logits = torch.randn(7, V, generator=torch.Generator().manual_seed(5))
    reqs = random_requests(7, rng, greedy=False)
    raw = logits.log_softmax(-1)
    bitmask = torch.zeros((1, (V + 31) // 32), dtype=torch.int32)
    bitmask[0, 0] = 0b1011  # row 2 may only take tokens 0, 1, 3
    ids, lps = Sampler(CPU, seed=3)(logits.clone(), reqs, ([2], bitmask))
    assert ids[2] in (0, 1, 3)
    for i, r in enumerate(reqs):
        if r.params.logprobs is None:
            assert lps[i] is None
            continue
        assert lps[i].token_id == ids[i]
        assert lps[i].logprob == raw[i, ids[i]].item()
        vals, idx = torch.topk(raw[i], r.params.logprobs)
        assert lps[i].top == list(zip(idx.tolist(), vals.tolist()))


def test_penalty_state_follows_the_tokens_across_steps():
    """Counts kept on the device, updated with each sampled token, equal a rebuild from the token lists at
    every step; a second draw at the same position (grammar re-draw) does not count the first token."""
    rng = random.Random(9)
    s = Sampler(CPU, seed=1, max_num_seqs=4)
    reqs = random_requests(6, rng, greedy=False)
    for r in reqs:
        r.params = dataclasses.replace(r.params, repetition_penalty=1.4, frequency_penalty=0.3)
        r.sampling = None
    gen = torch.Generator().manual_seed(2)
    for step in range(12):
        batch = rng.sample(reqs, rng.randint(1, 4))  # 6 requests take turns in 4 slots
        logits = torch.randn(len(batch), V, generator=gen) * 2
        ref = logits.clone()
        for i, r in enumerate(batch):
            ref_penalties(ref[i], r)
        if step % 4 == 3:  # a draw that is then replaced at the same position
            s(logits.clone(), batch)
        got = logits.clone()
        ids, _ = s(got, batch)
        assert torch.equal(got, ref), step
        for r, t in zip(batch, ids):
            r.append_token(t)
    assert s.tensors.slots_in_use() <= 4
    assert s.tensors.num_rebuilds > 6  # slots were taken over and stale counts rebuilt
    for r in reqs:
        s.release(r)
    assert s.tensors.slots_in_use() == 0


def test_penalty_state_is_built_once_then_updated_on_the_device():
    s = Sampler(CPU)
    r = mk(
        SamplingParams(temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.5, seed=3), prompt=(1, 2)
    )
    gen = torch.Generator().manual_seed(6)
    for _ in range(10):
        logits = torch.randn(1, V, generator=gen)
        ref = logits.clone()
        ref_penalties(ref[0], r)
        ids, _ = s(logits, [r])
        assert torch.equal(logits, ref)
        r.append_token(ids[0])
    assert s.tensors.num_rebuilds == 1
    assert s.tensors.seen[r.sampling.slot].nonzero().flatten().tolist() == sorted(set(r.all_token_ids))
    s.release(r)
    assert s.tensors.slots_in_use() == 0


# -- distributions -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [
        (1.0, 0, 1.0, 0.0),
        (0.6, 0, 1.0, 0.0),
        (1.5, 5, 1.0, 0.0),
        (1.0, 0, 0.8, 0.0),
        (1.0, 0, 1.0, 0.1),
        (1.2, 6, 0.9, 0.05),
    ],
)
def test_sampled_distribution_matches_the_filtered_softmax(temperature, top_k, top_p, min_p):
    n, v = 6000, 12
    row = torch.randn(v, generator=torch.Generator().manual_seed(7)) * 1.5
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    reqs = [mk(params) for _ in range(n)]  # unseeded: each request its own stream
    ids, _ = Sampler(CPU, seed=11, max_num_seqs=n)(row.expand(n, v).clone(), reqs)
    probs = ref_filter(row / temperature, top_k, top_p, min_p).softmax(-1).double()
    counts = torch.bincount(torch.tensor(ids), minlength=v).double()
    assert (counts[probs == 0] == 0).all()  # nothing outside the filtered support
    stat, dof = chi2(counts, probs)
    assert dof >= 2
    assert stat < chi2_critical(dof), (stat, dof)


def test_one_request_over_many_positions_follows_the_distribution():
    """A seeded request's successive draws (positions) are independent draws from its distribution."""
    v, steps = 10, 3000
    row = torch.randn(v, generator=torch.Generator().manual_seed(8))
    s = Sampler(CPU)
    r = mk(SamplingParams(temperature=1.0, seed=1234))
    counts = torch.zeros(v, dtype=torch.float64)
    for _ in range(steps):
        t = s(row.unsqueeze(0).clone(), [r])[0][0]
        counts[t] += 1
        r.all_token_ids.append(t)  # the position advances as in the engine
    stat, dof = chi2(counts, row.softmax(-1).double())
    assert stat < chi2_critical(dof), (stat, dof)


# -- reproducibility ---------------------------------------------------------------------------------------
def test_seeded_tokens_independent_of_batch_composition_size_and_row():
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(9, V, generator=gen)
    params = SamplingParams(
        temperature=0.9,
        top_k=20,
        top_p=0.95,
        min_p=0.02,
        repetition_penalty=1.2,
        presence_penalty=0.3,
        seed=77,
    )

    def run(
        others: list[int], at: int, other_params: SamplingParams, own: SamplingParams = params
    ) -> list[int]:
        s = Sampler(CPU, seed=99)
        target = mk(own, rid="target")
        batch_others = [mk(other_params, rid=f"o{i}") for i in others]
        seq = []
        for _ in range(15):
            logits = [rows[i] for i in others]
            logits.insert(at, rows[0])
            reqs = list(batch_others)
            reqs.insert(at, target)
            ids, _ = s(torch.stack(logits), reqs)
            seq.append(ids[at])
            target.append_token(ids[at])
            for r, t in zip(batch_others, ids[:at] + ids[at + 1 :]):
                r.append_token(t)
        return seq

    alone = run([], 0, params)
    assert alone == run([1, 2, 3], 0, SamplingParams(temperature=0.8))
    assert alone == run([4, 5, 6, 7, 8], 3, SamplingParams(temperature=1.0, top_k=3, seed=5))
    assert alone == run([2], 1, SamplingParams())  # beside a greedy row
    assert alone != run([], 0, params, SamplingParams(**{**params.__dict__, "seed": 78}))


def test_unseeded_requests_differ_from_each_other():
    row = torch.zeros(1, 1000)  # uniform: two streams agreeing 8 times by chance has probability 1e-24
    s = Sampler(CPU, seed=0)
    a, b = mk(SamplingParams(temperature=1.0)), mk(SamplingParams(temperature=1.0))
    seq_a = [s(row.clone(), [a])[0][0] for _ in range(8)]  # same position: a fixed draw per stream
    seq_b = [s(row.clone(), [b])[0][0] for _ in range(8)]
    assert len(set(seq_a)) == 1 and len(set(seq_b)) == 1 and seq_a != seq_b
    both, _ = Sampler(CPU, seed=0)(row.expand(2, -1).clone(), [mk(a.params), mk(b.params)])
    assert both == [seq_a[0], seq_b[0]]  # a fresh engine with the same seed numbers its requests alike


def test_sample_returns_device_ids_and_host_ids():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(4))
    reqs = [
        mk(SamplingParams(temperature=t, seed=i, logprobs=1)) for i, t in enumerate([0.0, 1.0, 0.0, 0.5, 2.0])
    ]
    out = Sampler(CPU).sample(logits.clone(), reqs)
    assert out.token_ids.dtype == torch.int64 and out.token_ids.device == logits.device
    assert out.token_ids.tolist() == out.ids
    assert out.ids[0] == logits[0].argmax().item() and out.ids[2] == logits[2].argmax().item()
    assert [lp.token_id for lp in out.logprobs] == out.ids

"""The counter-based generator: the hash on tensors equals its scalar form, draws are uniform, and every
(stream, position, salt) has draws of its own."""

from __future__ import annotations

import math

import torch

from sidecar.engine.sampling_rng import (
    NUM_SALTS,
    fmix_,
    fmix_int,
    gumbel,
    row_key_int,
    row_keys,
    stream_for,
    to_s64,
    uniform,
    unit_float,
)

from test_sampler_batched import chi2_critical


def test_tensor_hash_equals_scalar_hash():
    vals = [0, 1, -1, 2**63 - 1, -(2**63), 123456789, -987654321987]
    assert fmix_(torch.tensor(vals)).tolist() == [fmix_int(v) for v in vals]
    # splitmix64 reference value: the first output of the generator seeded with 0
    assert fmix_int(0x9E3779B97F4A7C15) == to_s64(0xE220A8397B1DCDAF)
    streams, positions = torch.tensor([5, -3, 2**40]), torch.tensor([0, 17, 4096])
    for salt in range(NUM_SALTS):
        assert row_keys(streams, positions, salt).tolist() == [
            row_key_int(s, p, salt) for s, p in zip(streams.tolist(), positions.tolist())
        ]


def test_uniforms_are_uniform_within_and_across_rows():
    buckets = 64
    within = uniform(torch.tensor([row_key_int(42, 0, 0)]), 200_000)[0]
    across = uniform(row_keys(torch.arange(200_000), torch.zeros(200_000, dtype=torch.int64), 0), 1)[:, 0]
    for u in (within, across):
        assert 0.0 < u.min().item() and u.max().item() < 1.0
        counts = torch.bincount((u * buckets).long(), minlength=buckets).double()
        exp = len(u) / buckets
        assert ((counts - exp) ** 2 / exp).sum().item() < chi2_critical(buckets - 1)
    # neighbouring draws are uncorrelated
    assert abs(torch.corrcoef(torch.stack([within[:-1], within[1:]]))[0, 1].item()) < 0.01


def test_distinct_stream_position_and_salt_give_distinct_draws():
    s = torch.arange(50).repeat_interleave(50 * NUM_SALTS)
    p = torch.arange(50).repeat_interleave(NUM_SALTS).repeat(50)
    keys = torch.cat([row_keys(s[i::NUM_SALTS], p[i::NUM_SALTS], i) for i in range(NUM_SALTS)])
    assert keys.unique().numel() == keys.numel() == 50 * 50 * NUM_SALTS
    draws = uniform(keys, 4)
    assert draws.unique(dim=0).shape[0] == draws.shape[0]


def test_gumbel_noise_has_the_gumbel_law():
    g = gumbel(torch.tensor([row_key_int(7, 3, 0)]), 200_000)[0].double()
    assert abs(g.mean().item() - 0.5772) < 0.01  # Euler-Mascheroni
    assert abs(g.var().item() - math.pi**2 / 6) < 0.03


def test_streams():
    assert stream_for(5, 0, 0) == stream_for(5, 1, 9) == 5  # a seed is its own stream, whatever the engine
    assert stream_for(2**64 - 1, 0, 0) == stream_for(-1, 0, 0) == -1  # same 64 bits, same stream
    unseeded = {stream_for(None, 0, i) for i in range(1000)}
    assert len(unseeded) == 1000
    assert stream_for(None, 0, 1) == stream_for(None, 0, 1) != stream_for(None, 1, 1)


def test_extreme_hashes_give_finite_noise():
    """The largest and smallest hash values map strictly inside (0, 1), so the exponential and Gumbel
    noise stay finite and a masked (-inf) token can never win a draw."""
    h = torch.tensor([0, -1, 2**63 - 1, -(2**63)])  # all-zero, all-one and the two sign-boundary patterns
    u = unit_float(h)
    assert (u > 0).all() and (u < 1).all()
    e = -u.log()
    assert (e > 0).all() and torch.isfinite(e).all()
    g = -e.log()
    assert torch.isfinite(g).all()
    assert u.max().item() == 1 - 2.0**-24 and u.min().item() == 2.0**-24

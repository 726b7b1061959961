"""logit_bias in the device sampler: on CUDA logits +100 forces and -100 bans a token, and rows without a
bias sample the same tokens as they do without biased neighbours."""

from __future__ import annotations

import torch

from sidecar.engine.request import Request, SamplingParams
from sidecar.engine.sampler import Sampler

V = 64
CUDA = torch.device("cuda")


def test_device_sampler_forces_and_bans_without_leaking_across_rows():
    plain = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=6)]
    for step in range(20):
        logits = torch.randn(4, V, generator=torch.Generator().manual_seed(step)).to(CUDA) * 3
        top = int(logits[2].argmax())
        params = [
            plain[0],
            SamplingParams(temperature=1.0, seed=5, logit_bias={9: 100.0}),
            SamplingParams(temperature=0.0, logit_bias={top: -100.0}),
            plain[1],
        ]
        reqs = [Request(f"r{i}", [1, 2, 3], p) for i, p in enumerate(params)]
        got = Sampler(CUDA, seed=2)(logits.clone(), reqs)[0]
        assert got[1] == 9 and got[2] == int(logits[2].topk(2).indices[1])
        alone = [Request(f"a{i}", [1, 2, 3], p) for i, p in enumerate(plain)]
        assert [got[0], got[3]] == Sampler(CUDA, seed=2)(logits[[0, 3]].clone(), alone)[0]

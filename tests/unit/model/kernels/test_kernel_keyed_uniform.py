"""The sampler's keyed uniforms in C: the same bits as the torch definition for any keys, row counts and
widths (one row split between threads included), and seeded draws that do not change with the kernel."""

import pytest
import torch

from sidecar.engine import sampling_rng
from sidecar.engine.request import Request, SamplingParams
from sidecar.engine.sampler import Sampler
from sidecar.engine.sampling_rng import row_key_int, row_keys, uniform, uniform_torch
from sidecar.model.kernels.cpu import cpu_build, keyed_uniform

EXTREMES = [0, 1, -1, 2**63 - 1, -(2**63), 123456789, -987654321987]


def test_kernel_builds_on_this_machine():
    assert keyed_uniform.available(), cpu_build.reason("keyed_uniform")


@pytest.mark.parametrize("rows,n", [(1, 1), (7, 7), (1, 4097), (3, 8193), (32, 151_936), (0, 5), (4, 0)])
def test_kernel_gives_the_torch_definitions_bits(rows, n):
    keys = torch.tensor(
        (EXTREMES + [row_key_int(s, s * 3, s % 4) for s in range(40)])[:rows], dtype=torch.int64
    )
    fast = keyed_uniform.uniform(keys, n)
    assert fast is not None and fast.shape == (rows, n) and fast.dtype == torch.float32
    assert torch.equal(fast, uniform_torch(keys, n))


def test_uniform_takes_the_kernel_on_cpu_and_the_torch_form_elsewhere(monkeypatch):
    keys = row_keys(torch.arange(5), torch.arange(5) * 11, 0)
    calls = []
    real = keyed_uniform.uniform
    monkeypatch.setattr(keyed_uniform, "uniform", lambda k, n: calls.append(n) or real(k, n))
    assert torch.equal(uniform(keys, 1000), uniform_torch(keys, 1000)) and calls == [1000]
    # a non-vector key tensor is not the kernel's: the wrapper declines and the torch form answers
    assert real(keys.view(5, 1), 3) is None and real(keys.int(), 3) is None


def _sample(temperature: float, rows: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    reqs = [
        Request(
            f"r{i}",
            list(range(5 + i)),
            SamplingParams(temperature=temperature, top_p=0.9 if i % 2 else 1.0, seed=100 + i, max_tokens=4),
        )
        for i in range(rows)
    ]
    return Sampler(torch.device("cpu"))(logits, reqs)[0]


def test_seeded_draws_are_the_same_with_and_without_the_kernel(monkeypatch):
    with_kernel = _sample(0.8, 6, 30_000)
    monkeypatch.setattr(sampling_rng.keyed_uniform, "uniform", lambda keys, n: None)
    assert _sample(0.8, 6, 30_000) == with_kernel

"""The sampler's greedy pick in C: the indices torch.argmax(-1) gives for float32 logits -- the first of the
largest value, a NaN winning, -0.0 equal to 0.0 -- for any row count and width (a row split between the threads
included), rows in place or strided; other tensors are left to torch."""

import pytest
import torch

from sidecar.engine.request import Request, SamplingParams
from sidecar.engine.sampler import Sampler
from sidecar.model.kernels.cpu import argmax as argmax_kernel, cpu_build
from sidecar.model.kernels.cpu.argmax import argmax, row_argmax

NAN, INF = float("nan"), float("inf")


def test_kernel_builds_on_this_machine():
    assert argmax_kernel.available(), cpu_build.reason("argmax")


def _cases():
    g = torch.Generator().manual_seed(0)
    yield torch.randn(32, 151_936, generator=g)
    yield torch.randn(1, 151_936, generator=g).bfloat16().float()  # many ties near the top
    for rows, n in ((3, 1), (2, 15), (5, 17), (4, 4096), (1, 8193), (2, 20_000), (0, 7)):
        yield torch.randn(rows, n, generator=g)
    yield torch.tensor([[1.0, NAN, 3.0, NAN], [NAN, 2.0, 1.0, 0.0], [1.0, 2.0, 3.0, NAN]])
    yield torch.tensor(
        [[-INF, -INF, -INF], [INF, 1.0, INF], [-0.0, 0.0, -1.0], [0.0, -0.0, -1.0], [2.0, 5.0, 5.0, 1.0][:3]]
    )
    yield torch.full((2, 9000), 1.0)
    yield torch.full((1, 50_000), -INF)
    for hot in ((100, 120_000), (120_000, 130_000), (75_000, 75_968), (151_935, 3)):
        x = torch.randn(1, 151_936, generator=g)
        x[0, hot[0]] = x[0, hot[1]] = 50.0  # a tie between the spans the threads take, and within one
        yield x
    x = torch.randn(2, 151_936, generator=g)
    x[0, 140_000], x[1, 7] = NAN, NAN  # a NaN in the second span, and in the first
    x[0, 3] = INF
    yield x
    yield torch.randn(4, 300, generator=g)[:, 10:200]  # strided rows
    yield torch.randn(6, 40_000, generator=g)[::2]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_gives_torchs_indices(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for x in _cases():
            fast = row_argmax(x)
            assert fast is not None and fast.dtype == torch.int64
            assert torch.equal(fast, x.argmax(-1)), x
    finally:
        torch.set_num_threads(before)


def test_other_tensors_are_left_to_torch():
    x = torch.randn(3, 50)
    for other in (x.double(), x.bfloat16(), x.t(), x[0], x.view(3, 5, 10), torch.randn(3, 0)):
        assert row_argmax(other) is None
    assert torch.equal(argmax(x.double()), x.double().argmax(-1)) and torch.equal(argmax(x), x.argmax(-1))


def test_greedy_and_sampled_steps_pick_through_it(monkeypatch):
    """The sampler's greedy rows and its Gumbel race take the kernel; the ids are torch's."""
    calls = []
    real = argmax_kernel.row_argmax
    monkeypatch.setattr(argmax_kernel, "row_argmax", lambda x: calls.append(tuple(x.shape)) or real(x))
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1)) * 3
    reqs = [
        Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0.8 if i == 1 else 0.0, max_tokens=4))
        for i in range(3)
    ]
    sampler = Sampler(torch.device("cpu"))
    ids, _ = sampler(logits.clone(), reqs)
    assert calls and all(shape[1] == 1000 for shape in calls)
    assert ids[0] == int(logits[0].argmax()) and ids[2] == int(logits[2].argmax())
    assert 0 <= ids[1] < 1000


@pytest.mark.parametrize("arch", ["-mavx2 -mfma", "-mtune=generic"])  # AVX2 only (as on Zen 2); plain x86-64
def test_other_instruction_sets_give_torchs_indices(arch, monkeypatch):
    monkeypatch.setenv("SIDECAR_CPU_ARCH_FLAGS", arch)
    monkeypatch.setattr(cpu_build, "_loaded", {})
    assert argmax_kernel.available(), cpu_build.reason("argmax")
    for x in _cases():
        assert torch.equal(row_argmax(x), x.argmax(-1)), x

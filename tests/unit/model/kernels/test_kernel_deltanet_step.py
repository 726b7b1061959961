"""The gated DeltaNet decode kernel (deltanet_step.c) against the torch reference of a decode step
(model/deltanet.py ``decode_reference``): the gated output, the convolution windows and the recurrent states
of the slots it advances, over several steps (each reading back the states the last one wrote), with other
slots untouched; and the arguments it refuses, with nothing touched."""

from __future__ import annotations

import pytest
import torch

from sidecar.model import deltanet
from sidecar.model.kernels.cpu import cpu_build, deltanet_step
from tests.unit.model.kernels.deltanet_cases import case as _case, inputs as _inputs

BF16_ULP = 2.0**-7


def test_kernel_builds_and_passes_its_self_check():
    assert deltanet_step.available(), cpu_build.reason("deltanet_step")
    assert deltanet._self_check() == ""
    assert deltanet.kernel_ready()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kernel,rows",
    [
        ((16, 16, 128, 128), 4, 1),  # Qwen3.5-0.8B's linear layers, batch 1
        ((2, 4, 8, 12), 4, 3),  # grouped key heads, head sizes off the vector width
        ((4, 8, 64, 64), 3, 5),
        ((1, 2, 20, 33), 2, 2),
    ],
)
def test_steps_match_the_torch_reference(heads, kernel, rows, dtype):
    m, conv, rec, slots, gen = _case(heads, kernel, dtype, rows, rows + 3, sum(heads) + rows)
    ours, theirs = (conv.clone(), rec.clone()), (conv.clone(), rec.clone())
    idle = torch.ones(rows + 3, dtype=torch.bool)
    idle[slots] = False
    for _ in range(4):
        proj, b, a = _inputs(m, rows, dtype, gen)
        got = deltanet.kernel_step(m, proj, b, a, ours, slots)
        want = deltanet.decode_reference(m, proj, b, a, theirs, slots)
        assert got is not None and got.dtype == dtype and got.shape == want.shape
        assert torch.isfinite(got).all()
        # the window holds the last inputs, copied: equal to the bit
        assert torch.equal(ours[0], theirs[0])
        # the decayed state and its update round as torch's; only the order of the sums S^T k differs
        scale = float(theirs[1].abs().max())
        assert float((ours[1] - theirs[1]).abs().max()) <= 1e-5 * scale
        if dtype == torch.float32:  # the sums' order (conv taps, S^T q, norms) and the exp differ
            assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
        else:  # rounded where torch rounds: equal but where a value in the chain o -> normed -> weighted sat
            # on a bf16 rounding edge (that one rounding flipped moves the output by up to two ulps)
            g, w = got.double(), want.double()
            off = (g - w).abs() > 2 * BF16_ULP * torch.maximum(g.abs(), w.abs())
            assert not off.any()
            assert float((got != want).float().mean()) < 0.01
    assert torch.equal(ours[0][idle], conv[idle]) and torch.equal(ours[1][idle], rec[idle])


def test_refused_arguments_touch_nothing():
    m, conv, rec, slots, gen = _case((2, 4, 8, 12), 4, torch.float32, 2, 4, 0)
    proj, b, a = _inputs(m, 2, torch.float32, gen)
    state = (conv.clone(), rec.clone())

    def untouched():
        return torch.equal(state[0], conv) and torch.equal(state[1], rec)

    # a slot past the state
    assert deltanet.kernel_step(m, proj, b, a, state, torch.tensor([1, 4])) is None and untouched()
    assert deltanet.kernel_step(m, proj, b, a, state, torch.tensor([-1, 0])) is None and untouched()
    # float16 activations: a dtype the kernel does not know
    half = deltanet.random_mixer((2, 4, 8, 12), 4, torch.float16, gen)
    s16 = (conv.half(), rec.clone())
    assert deltanet.kernel_step(half, proj.half(), b.half(), a.half(), s16, slots) is None
    assert torch.equal(s16[0], conv.half()) and torch.equal(s16[1], rec)
    # rows of another width, and int32 slots
    assert deltanet.kernel_step(m, proj[:, 1:], b, a, state, slots) is None and untouched()
    assert deltanet.kernel_step(m, proj, b, a, state, slots.int()) is None and untouched()
    # a head wider than the kernel's bound
    wide = deltanet.random_mixer((1, 1, deltanet_step.MAX_DIM + 1, 4), 2, torch.float32, gen)
    big = (torch.zeros(2, wide.conv_dim, 1), torch.zeros(2, 1, deltanet_step.MAX_DIM + 1, 4))
    p, bb, aa = _inputs(wide, 1, torch.float32, gen)
    assert deltanet.kernel_step(wide, p, bb, aa, big, torch.tensor([0])) is None

"""The gated DeltaNet decode kernel (deltanet_step.c) against the torch reference of a decode step
(model/deltanet.py ``decode_reference``): the gated output, the convolution windows and the recurrent states
of the slots it advances, over several steps (each reading back the states the last one wrote), with other
slots untouched; and the arguments it refuses, with nothing touched. Its prompt rule (the recurrence over a
sequence's chunk, deltanet_rule.py ``kernel_rule``) against HF's chunked rule, the same way."""

from __future__ import annotations

import pytest
import torch

from sidecar.model import deltanet, deltanet_rule
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


def _chunk(length, heads, gen):
    nk, nv, dk, dv = heads
    q, k = torch.randn(length, nk, dk, generator=gen), torch.randn(length, nk, dk, generator=gen)
    v = torch.randn(length, nv, dv, generator=gen)
    return q, k, v, -torch.rand(length, nv, generator=gen), torch.rand(length, nv, generator=gen)


@pytest.mark.parametrize("heads", [(2, 4, 20, 40), (1, 2, 8, 6), (2, 2, 16, 64)])
def test_prompt_rule_matches_hf_chunked_rule_across_calls(heads):
    # the C prompt rule (deltanet_rule.kernel_rule) against HF's torch chunked rule over 150 tokens; ours in
    # two calls, the state carried in place between them
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    assert deltanet_rule._rule_check() == "" and deltanet_rule.rule_ready()
    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta = _chunk(150, heads, gen)
    s0 = torch.randn(heads[1], heads[2], heads[3], generator=gen) * 0.3
    want_o, want_s = hf.torch_chunk_gated_delta_rule(
        *(x[None] for x in (q, k, v)), g=g[None], beta=beta[None], initial_state=s0[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    # as the mixer passes them: q, k, v views of one packed row per token (not contiguous)
    packed = torch.cat([x.flatten(1) for x in (q, k, v)], dim=1)
    q, k, v = (
        x.view(150, -1, y.shape[-1])
        for x, y in zip(packed.split([q[0].numel(), k[0].numel(), v[0].numel()], 1), (q, k, v))
    )
    assert not v.is_contiguous()
    state, cut = s0.clone(), 90
    o1 = deltanet_rule.kernel_rule(q[:cut], k[:cut], v[:cut], g[:cut], beta[:cut], state)
    o2 = deltanet_rule.kernel_rule(q[cut:], k[cut:], v[cut:], g[cut:], beta[cut:], state)
    torch.testing.assert_close(torch.cat((o1, o2)), want_o[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, want_s[0], rtol=1e-4, atol=1e-5)
    # bf16 inputs: float32 inside, the output rounded to bf16 once
    bf = [x.bfloat16() for x in (q, k, v)]
    got = deltanet_rule.kernel_rule(*bf, g, beta, s0.clone())
    want = deltanet_rule.chunked_rule(*(x[None] for x in bf), g[None], beta[None], s0[None])[0][0]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * BF16_ULP, atol=2 * BF16_ULP)


def test_prompt_rule_refuses_what_it_cannot_take_untouched():
    gen = torch.Generator().manual_seed(2)
    q, k, v, g, beta = _chunk(5, (2, 4, 8, 12), gen)
    state = torch.randn(4, 8, 12, generator=gen)
    before = state.clone()
    for args in (
        (q.double(), k, v, g, beta, state),  # not float32
        (q, k, v.transpose(0, 1), g, beta, state),  # not contiguous / shapes off
        (q, k, v, g[:4], beta, state),  # a gate row short
        (q, k, v, g, beta, state[:3]),  # a state head short
        (q[:, :1].repeat(1, 3, 1), k[:, :1].repeat(1, 3, 1), v, g, beta, state),  # 4 value heads, 3 key heads
    ):
        assert deltanet_step.rule(*args) is None
    wide = torch.zeros(1, 1, deltanet_step.MAX_DIM + 1)
    assert deltanet_step.rule(wide, wide, v[:, :1], g[:, :1], beta[:, :1], torch.zeros(1, 1025, 12)) is None
    assert torch.equal(state, before)

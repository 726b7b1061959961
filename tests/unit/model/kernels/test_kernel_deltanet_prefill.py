"""The C form of a gated DeltaNet prompt chunk (deltanet_prefill.c around deltanet_step.c's rule;
model/deltanet_prefill.py ``kernel_chunk``) against the torch form: the convolution's float32 sums equal to
torch's to the bit, the window it leaves equal to the bit, the gated rows and the state over chunks in a row
(each reading back what the last one left, a chunk shorter than the window among them), and the arguments it
refuses, with nothing touched."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from sidecar.model import deltanet_prefill as chunk
from sidecar.model.kernels.cpu import cpu_build, deltanet_prefill, deltanet_step
from tests.unit.model.kernels.deltanet_cases import case as _case

BF16_ULP = 2.0**-7


def test_kernels_build_and_pass_their_self_check():
    assert deltanet_prefill.available(), cpu_build.reason("deltanet_prefill")
    assert chunk._self_check() == ""
    assert chunk.kernel_ready()


def _rows(m, length, dtype, gen):
    """A chunk's in_proj rows (q, k, v channels, then z), g and beta of mixer ``m``."""
    proj = (torch.randn(length, m.conv_dim + m.nv * m.dv, generator=gen) * 2).to(dtype)
    g = -torch.rand(length, m.nv, generator=gen)
    beta = torch.rand(length, m.nv, generator=gen).to(dtype)
    return proj, g, beta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start", [True, False])
def test_convolution_sums_are_torchs_bits(dtype, start):
    # Qwen3.5-0.8B's channels (6144) and four taps; the rows are in_proj rows, z after the channels
    m, conv, _, _, gen = _case((16, 16, 128, 128), 4, dtype, 1, 1, 3)
    proj, _, _ = _rows(m, 21, dtype, gen)
    window = conv[0].clone()
    sums = deltanet_prefill.conv(proj, window, m.conv_weight, start, act=False)
    seq, w = proj[:, : m.conv_dim].t()[None].float(), m.conv_weight.unsqueeze(1).float()
    if start:
        want = F.conv1d(seq, w, None, padding=3, groups=m.conv_dim)[:, :, :21]
    else:
        want = F.conv1d(torch.cat((conv[0][None].float(), seq), -1), w, None, groups=m.conv_dim)
    assert torch.equal(sums, want[0].t())
    # the window left: the chunk's last three inputs, copied
    assert torch.equal(window, proj[-3:, : m.conv_dim].t())
    # with silu: the torch form's values (rounded where it rounds; silu's exp differs)
    act = deltanet_prefill.conv(proj, conv[0].clone(), m.conv_weight, start)
    ref = chunk.causal_conv(proj[:, : m.conv_dim].t()[None], m.conv_weight, None if start else conv[0][None])
    tol = BF16_ULP if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(act, ref[0].float(), rtol=tol, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kernel,lengths",
    [
        ((16, 16, 128, 128), 4, (40, 9)),  # Qwen3.5-0.8B's linear layers
        ((2, 4, 20, 12), 4, (70, 2, 5)),  # grouped key heads, head sizes off the vector width, a short chunk
        ((1, 2, 8, 33), 2, (3, 17)),
    ],
)
def test_chunks_in_a_row_match_the_torch_form(heads, kernel, lengths, dtype):
    m, conv, rec, _, gen = _case(heads, kernel, dtype, 1, 2, sum(heads) + kernel)
    ours, theirs = (conv[1].clone(), rec[1].clone()), (conv[1].clone(), rec[1].clone())
    for i, length in enumerate(lengths):
        proj, g, beta = _rows(m, length, dtype, gen)
        got = chunk.kernel_chunk(m, proj, g, beta, *ours, i == 0)
        o = chunk.torch_chunk(m, proj, g, beta, *theirs, i == 0)
        z = proj[:, m.conv_dim :].reshape(length, m.nv, m.dv)
        want = chunk.gated_norm(o, z, m.norm_weight, m.eps).reshape(length, -1)
        assert got is not None and got.dtype == dtype and got.shape == want.shape
        assert torch.equal(ours[0], theirs[0])  # the window: copied inputs
        # float32: the exp in silu and the order of the norms' sums differ; bf16: where those put a value on
        # the other side of a rounding edge, the input moves by an ulp and the rest follows it a little
        tol = 1e-4 if dtype == torch.float32 else 1e-2
        for x, y in ((got, want), (ours[1], theirs[1])):
            assert float((x.float() - y.float()).abs().max()) <= tol * (1 + float(y.float().abs().max()))
        if dtype == torch.bfloat16:
            assert float((got != want).float().mean()) < 0.1


def test_refused_arguments_touch_nothing():
    m, conv, rec, _, gen = _case((2, 4, 8, 12), 4, torch.float32, 1, 1, 5)
    proj, g, beta = _rows(m, 6, torch.float32, gen)
    window, state = conv[0].clone(), rec[0].clone()

    def untouched():
        return torch.equal(window, conv[0]) and torch.equal(state, rec[0])

    # float16 rows, a window of another dtype, a window not contiguous, rows too narrow
    assert chunk.kernel_chunk(m, proj.half(), g, beta, window, state, False) is None and untouched()
    assert deltanet_prefill.conv(proj, window.double(), m.conv_weight, False) is None and untouched()
    wt = conv[0].t().contiguous().t()
    assert deltanet_prefill.conv(proj, wt, m.conv_weight, False) is None and torch.equal(wt, conv[0])
    assert deltanet_prefill.conv(proj[:, :10], window, m.conv_weight, False) is None and untouched()
    # a rule the C kernel does not take (value heads not a multiple of key heads): the window put back
    odd = SimpleNamespace(nk=3, nv=4, dk=4, dv=12, kernel=4, conv_dim=m.conv_dim, eps=m.eps)
    odd.conv_weight, odd.norm_weight = m.conv_weight, m.norm_weight
    assert chunk.kernel_chunk(odd, proj, g, beta, window, state, False) is None and untouched()
    # the gated norm: o not float32, z rows of another count
    o = torch.randn(6, m.nv, m.dv, generator=gen)
    z = proj[:, m.conv_dim :]
    assert deltanet_prefill.gate(o.double(), z, m.norm_weight, m.eps) is None
    assert deltanet_prefill.gate(o, z[:5], m.norm_weight, m.eps) is None
    assert deltanet_prefill.gate(o, z, m.norm_weight[:-1], m.eps) is None


def test_rule_reads_rows_of_a_wider_tensor():
    # the q, k, v views of the convolved rows: one packed row per token, the rule reads them in place
    gen = torch.Generator().manual_seed(4)
    nk, nv, dk, dv, length = 2, 4, 8, 12, 9
    y = torch.randn(length, 2 * nk * dk + nv * dv + 5, generator=gen)[:, :-5]
    q, k = y[:, : nk * dk].view(length, nk, dk), y[:, nk * dk : 2 * nk * dk].view(length, nk, dk)
    v = y[:, 2 * nk * dk :].view(length, nv, dv)
    g, beta = -torch.rand(length, nv, generator=gen), torch.rand(length, nv, generator=gen)
    s0 = torch.randn(nv, dk, dv, generator=gen)
    a, b = s0.clone(), s0.clone()
    got = deltanet_step.rule(q, k, v, g, beta, a)
    want = deltanet_step.rule(q.contiguous(), k.contiguous(), v.contiguous(), g, beta, b)
    assert got is not None and torch.equal(got, want) and torch.equal(a, b)

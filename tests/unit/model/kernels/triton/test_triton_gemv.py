"""The one-row fused products (``triton_gemv``) against the torch steps they replace: the residual add + RMSNorm
before the qkv and gate/up products, silu * up before the down product, the plain o product."""

import pytest
import torch
import torch.nn.functional as F

from sidecar.model.kernels.cpu import norm_act
from sidecar.model.kernels.triton import gemv as triton_gemv

# The products' float32 sums run in another order than torch's; bf16 outputs may then round one step apart.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=8e-3)}
# (N, K): K within one step, K over several steps with a ragged end, N not a multiple of the program's outputs
SHAPES = [(40, 96), (37, 2500), (8, 64), (300, 1030)]


def _inputs(n, k, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    to = dict(dtype=dtype, device=device)
    return (
        torch.randn(1, k, generator=g).to(**to),
        torch.randn(1, k, generator=g).to(**to),
        (1 + 0.1 * torch.randn(k, generator=g)).to(**to),
        (torch.randn(n, k, generator=g) / k**0.5).to(**to),
        torch.randn(n, generator=g).to(**to),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("with_delta,with_bias", [(True, True), (False, False)])
def test_norm_matmul_matches_the_norm_then_the_product(n, k, with_delta, with_bias, dtype, device):
    h, delta, nw, w, b = _inputs(n, k, dtype, device, n + k)
    delta = delta if with_delta else None
    b = b if with_bias else None
    y, s = triton_gemv.norm_matmul(h, delta, nw, 1e-6, w, b)
    x, s_ref = norm_act.add_rms_norm(h, delta, nw, 1e-6)
    assert torch.equal(s, s_ref)  # the residual stream: the same rounded sum, bit for bit
    assert y.dtype == dtype and y.shape == (1, n)
    torch.testing.assert_close(y, F.linear(x, w, b), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_silu_matmul_and_matmul_match_torch(n, k, dtype, device):
    h, _, _, w, b = _inputs(n, k, dtype, device, 7 * n + k)
    gu = torch.randn(1, 2 * k, generator=torch.Generator().manual_seed(k)).to(dtype=dtype, device=device) * 3
    torch.testing.assert_close(
        triton_gemv.silu_matmul(gu, w), F.linear(norm_act.silu_mul(gu), w), **TOL[dtype]
    )
    torch.testing.assert_close(
        triton_gemv.silu_matmul(gu, w, b), F.linear(norm_act.silu_mul(gu), w, b), **TOL[dtype]
    )
    torch.testing.assert_close(triton_gemv.matmul(h, w, b), F.linear(h, w, b), **TOL[dtype])


def test_inputs_it_does_not_take_get_none(device):
    h, delta, nw, w, b = _inputs(16, 64, torch.float32, device, 0)
    two = torch.cat([h, h])
    assert triton_gemv.matmul(two, w) is None  # more rows than MAX_ROWS: the separate kernels
    assert triton_gemv.norm_matmul(two, torch.cat([delta, delta]), nw, 1e-6, w) is None
    assert triton_gemv.silu_matmul(torch.cat([two, two], 1), w) is None
    assert triton_gemv.matmul(h, w.bfloat16()) is None  # dtypes differ
    assert triton_gemv.matmul(h, w.t().contiguous().t()) is None  # not contiguous
    assert triton_gemv.matmul(h, w[:, :32]) is None  # K differs
    assert triton_gemv.matmul(h, w, b[:8]) is None  # bias of another width
    assert triton_gemv.norm_matmul(h, delta, nw[:32], 1e-6, w) is None  # norm weight of another width
    assert triton_gemv.norm_matmul(h, delta.bfloat16(), nw, 1e-6, w) is None
    assert triton_gemv.silu_matmul(h[:, :63], w) is None  # an odd gate/up width
    assert triton_gemv.silu_matmul(h, w) is None  # gate/up of 2 x 32 against a K of 64

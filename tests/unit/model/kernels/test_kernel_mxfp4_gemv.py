"""The MXFP4 kernel over the codes (gpt-oss's expert weights) against the dequantized reference: the weights it
forms are the dequantized ones to the bit, its sums differ in order only, in its AVX2 and plain-C builds."""

from __future__ import annotations

import pytest
import torch

from sidecar.model import mxfp4
from sidecar.model.kernels.cpu import cpu_build, mxfp4_gemv

pytestmark = pytest.mark.skipif(not mxfp4_gemv.available(), reason="needs a C compiler")


def _codes(n, k, seed, lo=110, hi=135):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, 16), generator=g).to(torch.uint8)
    scales = torch.randint(lo, hi, (n, k // 32), generator=g).to(torch.uint8)
    return blocks, scales


def _x(m, k, seed):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "m,n,k", [(1, 1, 32), (1, 37, 64), (2, 9, 96), (3, 100, 32), (4, 8, 160), (7, 53, 128)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_float32_matches_the_dequantized_reference(m, n, k, bias):
    blocks, scales = _codes(n, k, seed=n + k)
    x = _x(m, k, seed=m)
    b = torch.randn(n, generator=torch.Generator().manual_seed(5)) if bias else None
    y = mxfp4_gemv.mxfp4_matmul(x, blocks, scales, b)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    torch.testing.assert_close(y, mxfp4_gemv.reference(x, blocks, scales, b), atol=1e-5, rtol=1e-5)
    # and the float32 product over the weight dequantized, as transformers computes it: summation order apart
    w = mxfp4.dequantize(blocks, scales, torch.float32)
    torch.testing.assert_close(y, x @ w.T + (0 if b is None else b), atol=1e-5, rtol=1e-5)


def test_the_weights_it_forms_are_the_dequantized_ones_to_the_bit():
    """One-hot rows read single weights out: every code, and scales from 2^-127 to the largest that keeps
    6 * scale finite (a larger one overflows to infinity in the reference too)."""
    k = 64
    blocks, scales = _codes(48, k, seed=1, lo=0, hi=253)
    blocks[0] = torch.arange(256, dtype=torch.uint8)[:32].view(2, 16)
    scales[1:4] = torch.tensor([[0, 252]] * 3, dtype=torch.uint8)
    y = mxfp4_gemv.mxfp4_matmul(torch.eye(k), blocks, scales)
    assert torch.equal(y.T, mxfp4.dequantize(blocks, scales, torch.float32))


def test_bf16_rows_are_the_float32_sums_rounded_once():
    blocks, scales = _codes(29, 96, seed=2)
    x = _x(3, 96, seed=3).bfloat16()
    bias = torch.randn(29, generator=torch.Generator().manual_seed(4)).bfloat16()
    y = mxfp4_gemv.mxfp4_matmul(x, blocks, scales, bias)
    assert y.dtype == torch.bfloat16
    want = mxfp4_gemv.mxfp4_matmul(x.float(), blocks, scales, bias.float())
    assert torch.equal(y, want.bfloat16())


def test_a_rows_result_does_not_depend_on_its_batch():
    blocks, scales = _codes(45, 128, seed=6)
    x = _x(11, 128, seed=7)
    whole = mxfp4_gemv.mxfp4_matmul(x, blocks, scales)
    for lo, hi in ((0, 1), (4, 6), (3, 11), (10, 11)):
        assert torch.equal(mxfp4_gemv.mxfp4_matmul(x[lo:hi], blocks, scales), whole[lo:hi])


def test_refuses_what_it_cannot_read():
    blocks, scales = _codes(8, 64, seed=8)
    with pytest.raises(ValueError, match="mxfp4_matmul"):
        mxfp4_gemv.mxfp4_matmul(_x(1, 32, seed=0), blocks, scales)  # K differs
    with pytest.raises(ValueError, match="mxfp4_matmul"):
        mxfp4_gemv.mxfp4_matmul(_x(1, 64, seed=0), blocks, scales[:, :1])
    with pytest.raises(ValueError, match="mxfp4_matmul"):
        mxfp4_gemv.mxfp4_matmul(_x(1, 64, seed=0).half(), blocks, scales)
    with pytest.raises(ValueError, match="mxfp4_matmul"):
        mxfp4_gemv.mxfp4_matmul(_x(1, 64, seed=0), blocks, scales, torch.zeros(7))


def test_the_self_check_passes_here():
    assert mxfp4_gemv.ready(), mxfp4_gemv.reason()


def test_the_plain_c_build_matches_too(monkeypatch):
    """Built for a CPU without AVX2 (the plain-C loop): the same weights, sums in one lane."""
    monkeypatch.setenv("SIDECAR_CPU_ARCH_FLAGS", "-mno-avx2 -mno-fma")
    monkeypatch.setattr(cpu_build, "_loaded", {})
    assert mxfp4_gemv.vector_bits() == 0
    blocks, scales = _codes(21, 96, seed=9)
    x = _x(5, 96, seed=10)
    y = mxfp4_gemv.mxfp4_matmul(x, blocks, scales)
    torch.testing.assert_close(y, mxfp4_gemv.reference(x, blocks, scales), atol=1e-5, rtol=1e-5)
    assert torch.equal(
        mxfp4_gemv.mxfp4_matmul(torch.eye(96), blocks, scales).T,
        mxfp4.dequantize(blocks, scales, torch.float32),
    )


def test_the_layer_over_codes_matches_its_dequantized_linear():
    blocks, scales = _codes(40, 64, seed=11)
    layer = mxfp4.Mxfp4Linear(mxfp4.Codes(blocks, scales), bias=True)
    layer.bias = torch.nn.Parameter(torch.randn(40), requires_grad=False)
    w = layer.dense_weight()
    x = _x(6, 64, seed=12).view(2, 3, 64)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-2)):
        layer.bias.data = layer.bias.data.to(dtype)
        y = layer(x.to(dtype))
        assert y.dtype == dtype and y.shape == (2, 3, 40)
        ref = x.to(dtype).float() @ w.T + layer.bias.float()
        torch.testing.assert_close(y.float(), ref, atol=tol, rtol=tol)

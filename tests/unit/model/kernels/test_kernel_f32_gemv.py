"""The float32 kernel over a plain weight (a tied float32 head's table) against float64."""

from __future__ import annotations

import pytest
import torch

from sidecar.model.kernels.cpu import f32_gemv

pytestmark = pytest.mark.skipif(
    not f32_gemv.available(), reason="needs AVX2 + FMA or AVX-512 and a C compiler"
)


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "m,n,k", [(1, 4, 16), (1, 37, 64), (2, 9, 48), (3, 100, 96), (4, 8, 32), (7, 53, 144), (17, 21, 80)]
)  # ragged N (a last tile of single rows), M over a panel of 3
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64(m, n, k, bias):
    x, w = _rand(m, k, seed=m), _rand(n, k, seed=n + k)
    b = _rand(n, seed=5) if bias else None
    y = f32_gemv.f32_matmul(x, w, b)
    ref = f32_gemv.reference(x, w, b)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-5)


def test_a_rows_result_does_not_depend_on_its_batch():
    x, w = _rand(11, 128, seed=1), _rand(45, 128, seed=2)
    whole = f32_gemv.f32_matmul(x, w)
    for lo, hi in ((0, 1), (4, 6), (3, 11), (10, 11)):
        assert torch.equal(f32_gemv.f32_matmul(x[lo:hi], w), whole[lo:hi])


def test_refuses_what_it_cannot_read():
    w = _rand(8, 48, seed=3)
    assert f32_gemv.takes(w) and not f32_gemv.takes(w.bfloat16()) and not f32_gemv.takes(_rand(8, 40, seed=3))
    assert not f32_gemv.takes(w[:, :32]) and not f32_gemv.takes(None)
    with pytest.raises(ValueError, match="do not fit"):
        f32_gemv.f32_matmul(_rand(2, 32, seed=4), w)
    with pytest.raises(ValueError, match="do not fit"):
        f32_gemv.f32_matmul(_rand(2, 48, seed=4).double(), w)
    with pytest.raises(ValueError, match="do not fit"):
        f32_gemv.f32_matmul(_rand(2, 48, seed=4), w, torch.zeros(7))
    assert f32_gemv.f32_matmul(torch.zeros(0, 48), w).shape == (0, 8)

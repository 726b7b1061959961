"""Our CPU int8 decode kernel against its torch reference, and Int8Linear's use of it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from sidecar.model.kernels import cpu_build, int8_gemv
from sidecar.model.quant import Int8Linear, quantize_linear
from sidecar.model.quant_format import dequantize_int8, quantize_int8


def _case(m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, generator=g) * 0.01 + 1e-4
    return x, w, s


def test_kernel_builds_on_this_machine():
    assert int8_gemv.available(), cpu_build.reason("int8_gemv")


@pytest.mark.parametrize("m,n,k", [(1, 7, 13), (1, 896, 4864), (2, 50, 96), (3, 130, 200), (4, 33, 64),
                                   (1, 5, 31), (2, 9, 65), (5, 40, 96), (9, 17, 130), (32, 64, 896)])
def test_kernel_matches_reference(m, n, k):
    x, w, s = _case(m, n, k, seed=m * 7 + k)
    y = int8_gemv.int8_matmul(x, w, s)
    ref = int8_gemv.reference(x, w, s)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    # int16 activations: error relative to the largest output stays near 2^-15, far inside bf16's 2^-8.
    assert (y - ref).abs().max() <= 2e-4 * ref.abs().max()


def test_worst_case_sums_do_not_overflow():
    k = 20000  # every product at its maximum: lanes stay in int32, the dot product needs int64
    x = torch.full((1, k), 3.0)
    w = torch.full((2, k), 127, dtype=torch.int8)
    w[1] = -127
    y = int8_gemv.int8_matmul(x, w, torch.ones(2))
    assert torch.allclose(y, torch.tensor([[3.0 * 127 * k, -3.0 * 127 * k]]), rtol=1e-5)


def test_zero_and_non_finite_rows():
    x, w, s = _case(3, 6, 64)
    x[0] = 0.0
    x[1, 5] = float("nan")
    x[2, 9] = float("inf")
    y = int8_gemv.int8_matmul(x, w, s)
    assert torch.equal(y[0], torch.zeros(6))
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all()  # never a silently finite answer


def test_shape_mismatch_is_refused():
    x, w, s = _case(1, 4, 32)
    with pytest.raises(ValueError, match="do not fit"):
        int8_gemv.int8_matmul(x, w[:, :16], s)


@pytest.mark.parametrize("rows", [1, 3, int8_gemv.MAX_ROWS, int8_gemv.MAX_ROWS + 1, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_few_and_many_rows_match_the_dequantized_layer(rows, dtype, monkeypatch):
    calls = []
    real = int8_gemv.int8_matmul
    monkeypatch.setattr(int8_gemv, "int8_matmul", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(rows)
    lin = nn.Linear(200, 70, bias=True).to(dtype)  # 200 is padded to 224 columns
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    deq = dequantize_int8(*quantize_int8(w, w.dtype))
    qlin = quantize_linear(lin, "int8")
    x = torch.randn(rows, 200).to(dtype)
    y = qlin(x)
    assert y.dtype == dtype and y.shape == (rows, 70)
    assert bool(calls) == (rows <= int8_gemv.MAX_ROWS)  # decode-sized batches take our kernel
    ref = x.float() @ deq.float().T + b.float()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-2
    assert (y.float() - ref).abs().max() <= tol * ref.abs().max()


def test_switched_off_kernel_falls_back_to_torch(monkeypatch):
    monkeypatch.setenv("SIDECAR_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setattr(cpu_build, "_reasons", {})
    assert not int8_gemv.available()
    assert "SIDECAR_CPU_KERNELS" in cpu_build.reason("int8_gemv")
    lin = nn.Linear(64, 32)
    w = lin.weight.detach().clone()
    qlin = quantize_linear(lin, "int8")
    assert isinstance(qlin, Int8Linear)
    x = torch.randn(1, 64)
    ref = x @ dequantize_int8(*quantize_int8(w, w.dtype)).T + qlin.bias
    assert (qlin(x) - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_a_failing_compiler_is_reported_not_raised(monkeypatch, tmp_path):
    monkeypatch.setenv("SIDECAR_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setattr(cpu_build, "_reasons", {})
    assert cpu_build.load("int8_gemv") is None
    assert "no C compiler" in cpu_build.reason("int8_gemv")

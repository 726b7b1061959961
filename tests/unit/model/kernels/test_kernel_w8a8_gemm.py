"""The W8A8 kernel (w8a8_gemm.c) against torch: the per-token quantization bit for bit (and against
compressed-tensors' own dynamic quantization), the int32 products exactly, the scaled result bit for bit."""

from __future__ import annotations

import pytest
import torch

from sidecar.model.kernels.cpu import cpu_build, w8a8_gemm


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    assert w8a8_gemm.available(), cpu_build.reason("w8a8_gemm")


def test_build_names_its_instructions() -> None:
    flags = open("/proc/cpuinfo").read().split()
    vnni = "avx_vnni" in flags or ("avx512_vnni" in flags and "avx512vl" in flags)
    assert w8a8_gemm.isa() == ("VNNI" if vnni else "AVX2" if "avx2" in flags else "plain C")


def _operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
    x[0, k // 2] = -50.0  # a row whose maximum is negative: its code is -128
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    w[0] = -128  # a full row at the bottom of the range
    return x, w, torch.rand(n, generator=g) * 0.02 + 1e-3


@pytest.mark.parametrize(
    "m,n,k", [(1, 37, 45), (37, 100, 77), (37, 64, 64), (6, 16, 1), (49, 33, 130), (37, 200, 3001)]
)  # the last: several row blocks and panel chunks
def test_quantization_and_product_match_the_torch_reference(m: int, n: int, k: int) -> None:
    x, w, s = _operands(m, n, k, seed=m * 1000 + n + k)
    q, sx = w8a8_gemm.quantize_per_token(x)
    q_ref, sx_ref = w8a8_gemm.quantize_per_token_ref(x)
    assert torch.equal(q, q_ref) and torch.equal(sx, sx_ref)
    assert q[0, k // 2] == -128
    packed = w8a8_gemm.pack(w)
    assert torch.equal(w8a8_gemm.unpack(packed, n, k), w)
    bias = torch.randn(n)
    y = w8a8_gemm.w8a8_matmul(x, packed, w8a8_gemm.padded_scales(s), n, bias)
    assert torch.equal(y, w8a8_gemm.w8a8_matmul_ref(x, w, s, bias))
    # The dequantized reference: (codes * sx) @ (w * sw).T, equal up to float rounding (of its float32 sums).
    deq = (q_ref.float() * sx_ref[:, None]) @ (w.float() * s[:, None]).T + bias
    torch.testing.assert_close(y, deq, rtol=1e-5, atol=1e-6 * float(deq.abs().max()))


@pytest.mark.parametrize("m", [1, 37])
def test_bf16_activations_and_outputs(m: int) -> None:
    x, w, s = _operands(m, 40, 96, seed=m)
    xb, bias = x.bfloat16(), torch.randn(40).bfloat16()
    packed, ps = w8a8_gemm.pack(w), w8a8_gemm.padded_scales(s)
    y = w8a8_gemm.w8a8_matmul(xb, packed, ps, 40, bias, torch.bfloat16)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, w8a8_gemm.w8a8_matmul_ref(xb, w, s, bias, torch.bfloat16))


def test_sums_are_exact_where_float32_products_would_round() -> None:
    """K large enough that the int32 sums pass 2^24: float32 accumulation would round, int32 does not."""
    k = 4100
    x = torch.full((2, k), -3.0)
    x[1, ::2] = 3.0
    w = torch.full((3, k), -128, dtype=torch.int8)
    q, sx = w8a8_gemm.quantize_per_token(x)
    assert int(q.min()) == -128
    y = w8a8_gemm.w8a8_matmul(x, w8a8_gemm.pack(w), w8a8_gemm.padded_scales(torch.ones(3)), 3)
    sums = w8a8_gemm.int_matmul_ref(q, w)
    assert sums[0, 0] == 128 * 128 * k
    assert torch.equal(y, sums.float() * sx[:, None])


def test_zero_row_takes_epsilon_scale() -> None:
    x = torch.zeros(3, 32)
    x[1] = torch.linspace(-1, 1, 32)
    q, sx = w8a8_gemm.quantize_per_token(x)
    assert sx[0] == torch.finfo(torch.float32).eps and int(q[0].abs().max()) == 0
    assert torch.equal(q, w8a8_gemm.quantize_per_token_ref(x)[0])


def test_quantization_equals_compressed_tensors_dynamic_token_quantization() -> None:
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)
    x = torch.randn(2, 19, 70) * 3
    scale, zp = compute_dynamic_scales_and_zp(value=x, args=args, module=torch.nn.Linear(70, 1))
    codes = quantize(x, scale, zp, args, dtype=torch.int8)
    q, sx = w8a8_gemm.quantize_per_token(x.reshape(-1, 70))
    assert torch.equal(q, codes.reshape(-1, 70))
    assert torch.equal(sx, scale.reshape(-1))


def test_failed_self_check_leaves_layers_on_the_torch_path(monkeypatch) -> None:
    from sidecar.model.w8a8 import W8A8Linear

    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setattr(cpu_build, "_reasons", {})
    monkeypatch.setattr(w8a8_gemm, "_self_check", lambda: False)
    assert not w8a8_gemm.available()
    assert "self-check" in cpu_build.reason("w8a8_gemm")
    x, w, s = _operands(37, 24, 50, seed=3)
    layer = W8A8Linear(w, s, None)
    assert layer.packed is None and torch.equal(layer.codes(), w)
    assert torch.equal(layer(x), w8a8_gemm.w8a8_matmul_ref(x, w, s))


def test_layer_takes_the_kernel_when_it_passes() -> None:
    from sidecar.model.w8a8 import W8A8Linear

    x, w, s = _operands(37, 24, 50, seed=4)
    bias = torch.randn(24)
    layer = W8A8Linear(w, s, bias)
    assert layer.weight is None and torch.equal(layer.codes(), w)
    assert torch.equal(layer(x.view(1, 37, 50)), w8a8_gemm.w8a8_matmul_ref(x, w, s, bias).view(1, 37, 24))

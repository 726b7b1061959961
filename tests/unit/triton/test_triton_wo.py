"""The Triton weight-only int8 / int4 products against dequantize + matmul in float32."""
import pytest
import torch

from sidecar.model.kernels import triton_wo
from sidecar.model.quant_format import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=5e-2, rtol=2e-2)}


def _x(m, k, dtype, device, seed):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (17, 33, 64), (3, 128, 160)])  # M over one tile; N, K ragged
def test_int8_matches_dequantized_matmul(m, n, k, dtype, device):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
    q, s = quantize_int8(w, torch.float32)
    x = _x(m, k, dtype, device, seed=m)
    y = triton_wo.int8_matmul(x, q.to(device), s.to(device))
    assert y.dtype == dtype and y.shape == (m, n)
    ref = x.float().cpu() @ dequantize_int8(q, s).T
    torch.testing.assert_close(y.float().cpu(), ref, **TOL[dtype])


def _int4(n, k, group_size, seed):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    q, s, z = quantize_int4(w, group_size, torch.float32)
    sz = torch.stack((s, z), dim=-1).transpose(0, 1).contiguous()  # Int4Linear's [G, N, 2]
    return q, s, z, sz


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,gs", [(1, 48, 64, 32), (17, 20, 128, 64), (2, 70, 256, 256)])
def test_int4_matches_dequantized_matmul(m, n, k, gs, dtype, device):
    q, s, z, sz = _int4(n, k, gs, seed=k + n)
    x = _x(m, k, dtype, device, seed=m + 1)
    y = triton_wo.int4_matmul(x, q.to(device), sz.to(device), gs)
    assert y.dtype == dtype and y.shape == (m, n)
    ref = x.float().cpu() @ dequantize_int4(q, s, z, k).T
    torch.testing.assert_close(y.float().cpu(), ref, **TOL[dtype])


def test_refuses_what_the_caller_must_run_itself(device):
    q, _, _, sz = _int4(16, 64, 32, seed=0)
    q8, s8 = quantize_int8(torch.randn(16, 64), torch.float32)
    big = torch.randn(triton_wo.MAX_ROWS + 1, 64, device=device)  # a prefill-sized batch: the existing path
    assert triton_wo.int8_matmul(big, q8.to(device), s8.to(device)) is None
    assert triton_wo.int4_matmul(big, q.to(device), sz.to(device), 32) is None
    x = torch.randn(2, 64, device=device)
    assert triton_wo.int4_matmul(x, q.to(device), sz.to(device), 48) is None  # group not a multiple of 32
    assert triton_wo.int8_matmul(x.double(), q8.to(device), s8.to(device)) is None
    assert triton_wo.int8_matmul(x[:, :32], q8.to(device), s8.to(device)) is None  # K mismatch

"""The Triton weight-only int8 / int4 products against dequantize + matmul in float32."""

import pytest
import torch

from sidecar.model.kernels.triton import wo as triton_wo
from sidecar.model.quant_format import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=5e-2, rtol=2e-2)}


def _x(m, k, dtype, device, seed):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "m,n,k,split",
    [
        (1, 40, 96, None),
        (17, 33, 64, None),
        (3, 128, 160, None),
        (2, 40, 300, 1),
        (2, 40, 300, 2),
        (5, 70, 520, 3),
    ],
)  # ragged, split K
def test_int8_matches_dequantized_matmul(m, n, k, split, dtype, device):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
    q, s = quantize_int8(w, torch.float32)
    x = _x(m, k, dtype, device, seed=m)
    y = triton_wo.int8_matmul(x, q.to(device), s.to(device), split=split)
    assert y.dtype == dtype and y.shape == (m, n)
    ref = x.float().cpu() @ dequantize_int8(q, s).T
    torch.testing.assert_close(y.float().cpu(), ref, **TOL[dtype])


def _int4(n, k, group_size, seed):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    q, s, z = quantize_int4(w, group_size, torch.float32)
    sz = torch.stack((s, z), dim=-1).transpose(0, 1).contiguous()  # Int4Linear's [G, N, 2]
    return q, s, z, sz


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "m,n,k,gs,split",
    [
        (1, 48, 64, 32, None),
        (17, 20, 128, 64, None),
        (2, 70, 256, 256, None),
        (1, 36, 256, 32, 3),
        (3, 40, 512, 128, 1),
        (2, 24, 512, 256, 3),
    ],
)
def test_int4_matches_dequantized_matmul(m, n, k, gs, split, dtype, device):
    q, s, z, sz = _int4(n, k, gs, seed=k + n)
    x = _x(m, k, dtype, device, seed=m + 1)
    y = triton_wo.int4_matmul(x, q.to(device), sz.to(device), gs, split=split)
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


def test_splits_cover_k_and_fill_the_gpu():
    for n, k, bk, sms in [
        (896, 4864, 128, 132),
        (896, 896, 128, 132),
        (9728, 896, 128, 132),
        (40, 300, 128, 4),
        (151936, 896, 128, 132),
        (1152, 896, 32, 132),
    ]:
        parts, per = triton_wo.splits(n, k, triton_wo._block_n(n), bk, sms)
        assert per % bk == 0 and (parts - 1) * per < k <= parts * per  # every range non-empty, K covered
        tiles_n = -(-n // triton_wo._block_n(n))
        assert parts == 1 or tiles_n * (parts - 1) < triton_wo.PROGRAMS_PER_SM * sms  # no more than needed
    assert (
        triton_wo.splits(896, 4864, 32, 128, 132)[0] > 1 and triton_wo.splits(9728, 896, 64, 128, 132)[0] == 1
    )


def test_a_rows_result_does_not_depend_on_its_batch(device):
    q, s = quantize_int8(torch.randn(96, 640, generator=torch.Generator().manual_seed(3)), torch.float32)
    x = _x(40, 640, torch.float32, device, seed=9)
    whole = triton_wo.int8_matmul(x, q.to(device), s.to(device))
    for rows in (1, 7):
        assert torch.equal(triton_wo.int8_matmul(x[:rows], q.to(device), s.to(device)), whole[:rows])

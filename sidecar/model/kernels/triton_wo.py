"""Weight-only int8 / int4 matrix products in Triton for decode-sized batches (at most ``MAX_ROWS`` rows).

Both read the weights in the project's stored format (``quant_format.py``) without dequantizing them
to memory:
- ``int8_matmul(x, weight, scales)``: ``weight`` int8 [N, K], ``scales`` [N] (any float dtype);
  ``y = (x @ weight.T) * scales``.
- ``int4_matmul(x, qweight, scales_and_zeros, group_size)``: ``qweight`` uint8 [N, K / 2] (low nibble =
  even column), ``scales_and_zeros`` [K / group_size, N, 2] (``Int4Linear``'s buffer);
  ``w = (code - 8) * scale + zero``. Per group the kernel sums ``x . (code - 8)`` and ``x`` and applies
  the group's scale and zero to those sums, so the codes reach the tensor cores exactly.
``x`` is [M, K] bfloat16, float16 or float32; the result is [M, N] in ``x``'s dtype, accumulated in
float32 (float32 activations multiply at full precision). Each returns None for inputs it does not take
(more rows, a K the tiles do not divide, other dtypes); the caller then runs its existing path.
Imports Triton: import only where ``gpu_paths.triton_available()``.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from sidecar.model.kernels.triton_common import dot_in_f32, mma, narrow

MAX_ROWS = 64
BLOCK_M = 16  # tl.dot needs 16 rows; decode rows are padded up to it by masking
INT8_BLOCK_K = 64
INT4_BLOCK_K = 32  # divides every int4 group size (32..256), so a K tile never straddles two groups
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _block_n(n: int) -> int:
    # Small N: narrower tiles give more programs to fill the GPU at one row.
    return 32 if n <= 4096 else 64


@triton.jit
def _int8_mm(x_ptr, w_ptr, s_ptr, y_ptr, m, n, k, s_xm, s_wn, s_ym,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32: tl.constexpr,
             BF16: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < m
    n_ok = rn < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < k
        x = tl.load(x_ptr + rm[:, None] * s_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * s_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0)
        # Codes are exact in every float dtype. Through float32: the interpreter casts integers to bf16
        # as raw bits.
        acc += mma(x, tl.trans(w.to(tl.float32).to(x.dtype)), F32)
    s = tl.load(s_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    y = acc * s[None, :]
    tl.store(y_ptr + rm[:, None] * s_ym + rn[None, :], narrow(y, y_ptr, BF16), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _int4_mm(x_ptr, q_ptr, sz_ptr, y_ptr, m, n, k, s_xm, s_qn, s_ym, group_size,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32: tl.constexpr,
             BF16: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < m
    n_ok = rn < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < k
        x = tl.load(x_ptr + rm[:, None] * s_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # Column kk is nibble kk % 2 of byte kk // 2 (each byte is read for its two columns; cached).
        b = tl.load(q_ptr + rn[:, None].to(tl.int64) * s_qn + (kk // 2)[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0)
        code = ((b.to(tl.int32) >> ((kk & 1) * 4)[None, :]) & 0xF) - 8
        dot = mma(x, tl.trans(code.to(tl.float32).to(x.dtype)), F32)  # [BLOCK_M, BLOCK_N]: sum of x * (code - 8)
        xsum = tl.sum(x.to(tl.float32), 1)  # [BLOCK_M]
        g = k0 // group_size
        sz = sz_ptr + (g * n + rn) * 2
        scale = tl.load(sz, mask=n_ok, other=0.0).to(tl.float32)
        zero = tl.load(sz + 1, mask=n_ok, other=0.0).to(tl.float32)
        acc += dot * scale[None, :] + xsum[:, None] * zero[None, :]
    tl.store(y_ptr + rm[:, None] * s_ym + rn[None, :], narrow(acc, y_ptr, BF16), mask=m_ok[:, None] & n_ok[None, :])


def _takes(x: torch.Tensor) -> bool:
    return x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype in _DTYPES and x.stride(1) == 1


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> Optional[torch.Tensor]:
    if (not _takes(x) or weight.dtype != torch.int8 or weight.dim() != 2 or weight.stride(1) != 1
            or weight.shape[1] != x.shape[1] or scales.shape != (weight.shape[0],) or not scales.is_contiguous()):
        return None
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bn = _block_n(n)
    _int8_mm[(triton.cdiv(n, bn), triton.cdiv(m, BLOCK_M))](
        x, weight, scales, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=INT8_BLOCK_K, F32=dot_in_f32(x.dtype), BF16=x.dtype == torch.bfloat16)
    return y


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor,
                group_size: int) -> Optional[torch.Tensor]:
    if (not _takes(x) or qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.stride(1) != 1
            or qweight.shape[1] * 2 != x.shape[1] or group_size % INT4_BLOCK_K or x.shape[1] % group_size
            or scales_and_zeros.shape != (x.shape[1] // group_size, qweight.shape[0], 2)
            or not scales_and_zeros.is_contiguous()):
        return None
    (m, k), n = x.shape, qweight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bn = _block_n(n)
    _int4_mm[(triton.cdiv(n, bn), triton.cdiv(m, BLOCK_M))](
        x, qweight, scales_and_zeros, y, m, n, k, x.stride(0), qweight.stride(0), y.stride(0), group_size,
        BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=INT4_BLOCK_K, F32=dot_in_f32(x.dtype), BF16=x.dtype == torch.bfloat16)
    return y

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

A decode batch has few rows, so a layer's work is its weight read, and the grid must cover the GPU to
read at its bandwidth: columns alone give too few programs for the narrow layers (896 outputs are 28
tiles), so K is split too (``splits``): each program sums one K range of one column tile into a float32
partial, and a second kernel adds the partials in a fixed order, scales and rounds. The split depends on
N and K only, never on M: a row's result does not depend on its batch.
Imports Triton: import only where ``gpu_paths.triton_available()``.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from sidecar.model.kernels.triton.common import dot_in_f32, mma, narrow, sm_count

MAX_ROWS = 64
BLOCK_M = 16  # tl.dot needs 16 rows; decode rows are padded up to it by masking
INT8_BLOCK_K = 128
INT4_BLOCK_KS = (128, 64, 32)  # the largest that divides the group size: a K tile never straddles two groups
INT4_BLOCK_K = 32  # every group size is a multiple of it
PROGRAMS_PER_SM = 2  # programs the split aims for: enough loads in flight to stream the weight
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _block_n(n: int) -> int:
    # Small N: narrower tiles give more programs to fill the GPU at one row.
    return 32 if n <= 4096 else 64


def splits(n: int, k: int, block_n: int, block_k: int, sms: int) -> tuple[int, int]:
    """(number of K ranges, K per range, a multiple of ``block_k``) for an [N, K] weight. Column tiles that
    cover every multiprocessor need no split (a split costs a second launch); fewer get as many ranges as
    bring the programs to ``PROGRAMS_PER_SM`` per multiprocessor, none of them empty."""
    tiles_n, tiles_k = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    if tiles_n >= sms:
        return 1, tiles_k * block_k
    want = max(1, min(tiles_k, triton.cdiv(PROGRAMS_PER_SM * sms, tiles_n)))
    per = triton.cdiv(tiles_k, want) * block_k
    return triton.cdiv(k, per), per


@triton.jit
def _int8_mm(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    p_ptr,
    m,
    n,
    k,
    k_per,
    s_xm,
    s_wn,
    s_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    F32: tl.constexpr,
    BF16: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    part = tl.program_id(1)
    rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < m
    n_ok = rn < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = part * k_per
    for k0 in range(k_lo, tl.minimum(k_lo + k_per, k), BLOCK_K):
        kk = k0 + rk
        k_ok = kk < k
        x = tl.load(x_ptr + rm[:, None] * s_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(
            w_ptr + rn[:, None].to(tl.int64) * s_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0
        )
        # Codes are exact in every float dtype. Through float32: the interpreter casts integers to bf16
        # as raw bits.
        acc += mma(x, tl.trans(w.to(tl.float32).to(x.dtype)), F32)
    out_ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT == 1:
        s = tl.load(s_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + rm[:, None] * s_ym + rn[None, :], narrow(acc * s[None, :], y_ptr, BF16), mask=out_ok)
    else:
        tl.store(p_ptr + (part * m + rm[:, None]) * n + rn[None, :], acc, mask=out_ok)


@triton.jit
def _int4_mm(
    x_ptr,
    q_ptr,
    sz_ptr,
    y_ptr,
    p_ptr,
    m,
    n,
    k,
    k_per,
    s_xm,
    s_qn,
    s_ym,
    group_size,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    F32: tl.constexpr,
    BF16: tl.constexpr,
):
    HALF: tl.constexpr = BLOCK_K // 2
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    part = tl.program_id(1)
    rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    rb = tl.arange(0, HALF)  # byte j of a tile holds columns 2j (low nibble) and 2j + 1 (high)
    m_ok = rm < m
    n_ok = rn < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = part * k_per
    for k0 in range(k_lo, tl.minimum(k_lo + k_per, k), BLOCK_K):
        kb = k0 // 2 + rb
        b_ok = kb < k // 2
        x_row = x_ptr + rm[:, None] * s_xm + 2 * kb[None, :]
        x_mask = m_ok[:, None] & b_ok[None, :]
        xe = tl.load(x_row, mask=x_mask, other=0.0)
        xo = tl.load(x_row + 1, mask=x_mask, other=0.0)
        b = tl.load(
            q_ptr + rn[:, None].to(tl.int64) * s_qn + kb[None, :], mask=n_ok[:, None] & b_ok[None, :], other=0
        ).to(tl.int32)
        lo = ((b & 0xF) - 8).to(tl.float32).to(xe.dtype)
        hi = ((b >> 4) - 8).to(tl.float32).to(xe.dtype)
        # [BLOCK_M, BLOCK_N]: sum of x * (code - 8) over the tile, the codes exact in every dtype
        dot = mma(xe, tl.trans(lo), F32) + mma(xo, tl.trans(hi), F32)
        xsum = tl.sum(xe.to(tl.float32), 1) + tl.sum(xo.to(tl.float32), 1)
        sz = sz_ptr + ((k0 // group_size) * n + rn) * 2
        scale = tl.load(sz, mask=n_ok, other=0.0).to(tl.float32)
        zero = tl.load(sz + 1, mask=n_ok, other=0.0).to(tl.float32)
        acc += dot * scale[None, :] + xsum[:, None] * zero[None, :]
    out_ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT == 1:
        tl.store(y_ptr + rm[:, None] * s_ym + rn[None, :], narrow(acc, y_ptr, BF16), mask=out_ok)
    else:
        tl.store(p_ptr + (part * m + rm[:, None]) * n + rn[None, :], acc, mask=out_ok)


@triton.jit
def _sum_parts(
    p_ptr,
    s_ptr,
    y_ptr,
    m,
    n,
    s_ym,
    SPLIT: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    BF16: tl.constexpr,
):
    """y = (sum of the SPLIT partials, in order) [* scales per column], rounded to y's dtype."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < m * n
    acc = tl.zeros([BLOCK], tl.float32)
    for part in tl.static_range(SPLIT):
        acc += tl.load(p_ptr + part * m * n + i, mask=ok, other=0.0)
    row = i // n
    col = i % n
    if SCALE:
        acc = acc * tl.load(s_ptr + col, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * s_ym + col, narrow(acc, y_ptr, BF16), mask=ok)


def _launch(
    kernel,
    x: torch.Tensor,
    w: torch.Tensor,
    s: torch.Tensor,
    n: int,
    block_k: int,
    split: Optional[int],
    scaled_in_reduce: bool,
    *extra,
) -> torch.Tensor:
    (m, k) = x.shape
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bn = _block_n(n)
    parts, per = splits(n, k, bn, block_k, sm_count(x.device))
    if split is not None:  # tests: a given number of ranges
        per = triton.cdiv(triton.cdiv(k, block_k), split) * block_k
        parts = triton.cdiv(k, per)
    p = torch.empty(parts, m, n, dtype=torch.float32, device=x.device) if parts > 1 else y
    bf16 = x.dtype == torch.bfloat16
    kernel[(triton.cdiv(n, bn), parts, triton.cdiv(m, BLOCK_M))](
        x,
        w,
        s,
        y,
        p,
        m,
        n,
        k,
        per,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        *extra,
        BLOCK_M=BLOCK_M,
        BLOCK_N=bn,
        BLOCK_K=block_k,
        SPLIT=parts,
        F32=dot_in_f32(x.dtype),
        BF16=bf16,
        num_warps=4,
    )
    if parts > 1:
        block = 256
        _sum_parts[(triton.cdiv(m * n, block),)](
            p, s, y, m, n, y.stride(0), SPLIT=parts, SCALE=scaled_in_reduce, BLOCK=block, BF16=bf16
        )
    return y


def _takes(x: torch.Tensor) -> bool:
    return x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype in _DTYPES and x.stride(1) == 1


def int8_matmul(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, split: Optional[int] = None
) -> Optional[torch.Tensor]:
    if (
        not _takes(x)
        or weight.dtype != torch.int8
        or weight.dim() != 2
        or weight.stride(1) != 1
        or weight.shape[1] != x.shape[1]
        or scales.shape != (weight.shape[0],)
        or not scales.is_contiguous()
    ):
        return None
    return _launch(_int8_mm, x, weight, scales, weight.shape[0], INT8_BLOCK_K, split, True)


def int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    split: Optional[int] = None,
) -> Optional[torch.Tensor]:
    if (
        not _takes(x)
        or qweight.dtype != torch.uint8
        or qweight.dim() != 2
        or qweight.stride(1) != 1
        or qweight.shape[1] * 2 != x.shape[1]
        or group_size % INT4_BLOCK_K
        or x.shape[1] % group_size
        or scales_and_zeros.shape != (x.shape[1] // group_size, qweight.shape[0], 2)
        or not scales_and_zeros.is_contiguous()
    ):
        return None
    block_k = next(b for b in INT4_BLOCK_KS if group_size % b == 0)
    return _launch(
        _int4_mm, x, qweight, scales_and_zeros, qweight.shape[0], block_k, split, False, group_size
    )

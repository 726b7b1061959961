"""MXFP4 (OCP microscaling FP4) weights as gpt-oss checkpoints ship them, dequantized exactly.

A tensor ``W`` [..., rows, cols] is stored as ``<name>_blocks`` uint8 [..., rows, cols / 32, 16] and
``<name>_scales`` uint8 [..., rows, cols / 32]: each byte holds two e2m1 codes (the low nibble the even
column, the high nibble the odd one), each block of 32 columns shares one e8m0 scale ``2 ** (s - 127)``. An
e2m1 code is a sign bit over {0, 0.5, 1, 1.5, 2, 3, 4, 6}; times a power of two that is exact in bfloat16
and float32 (within their exponent range), so the dequantized weight is the quantized one to the bit.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values sharing one scale
# e2m1 code -> value; bit 3 is the sign
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``W`` [..., rows, cols] in ``dtype`` from its ``blocks`` [..., rows, cols / 32, 16] and ``scales``
    [..., rows, cols / 32] (both uint8). Raises ValueError when the shapes disagree."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"mxfp4: blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
            f"(blocks are [..., groups, {BLOCK // 2}], scales [..., groups])"
        )
    lut = torch.tensor(E2M1, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., groups, 16, 2]: even, odd
    values = lut[codes].flatten(-2)  # [..., groups, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    out = torch.ldexp(values, exponents.unsqueeze(-1).float())
    return out.flatten(-2).to(dtype)

"""MXFP4 (OCP microscaling FP4) weights as gpt-oss checkpoints ship them, dequantized exactly.

A tensor ``W`` [..., rows, cols] is stored as ``<name>_blocks`` uint8 [..., rows, cols / 32, 16] and
``<name>_scales`` uint8 [..., rows, cols / 32]: each byte holds two e2m1 codes (the low nibble the even
column, the high nibble the odd one), each block of 32 columns shares one e8m0 scale ``2 ** (s - 127)``. An
e2m1 code is a sign bit over {0, 0.5, 1, 1.5, 2, 3, 4, 6}; times a power of two that is exact in bfloat16
and float32 (within their exponent range), so the dequantized weight is the quantized one to the bit.

On the CPU the experts keep their codes (``Mxfp4Linear``, about 4.25 bits a weight): the MXFP4 kernel
(``kernels/cpu/mxfp4_gemv.c``) reads them in place. On CUDA they keep them too where Triton is installed: the
``moe`` path's grouped kernel decodes them tile by tile (``kernels/triton/moe.py``); with that path off an expert
dequantizes its weight for each call. Where neither holds (another device, a CPU kernel that did not build or
failed its start-up self-check, a quantize-on-load mode asked for, ``SIDECAR_MXFP4_CODES=0``) the loader
dequantizes them instead (``keeps_codes``).
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sidecar.model.kernels.cpu import mxfp4_gemv
from sidecar.model.kernels.gpu_paths import triton_available

log = logging.getLogger("sidecar.model")

BLOCK = 32  # values sharing one scale
# e2m1 code -> value; bit 3 is the sign
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
# Set to 0 / false / no / off: the loader dequantizes MXFP4 weights even where the kernel reads the codes (what
# another device holds; a benchmark's comparison)
CODES_ENV = "SIDECAR_MXFP4_CODES"
_logged: set[str] = set()


class Codes(NamedTuple):
    """One MXFP4 weight [rows, cols] as a checkpoint ships it: ``blocks`` [rows, cols / 32, 16] and ``scales``
    [rows, cols / 32], both uint8."""

    blocks: torch.Tensor
    scales: torch.Tensor


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
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., groups, 16, 2]: even, odd
    values = lut[codes].flatten(-2)  # [..., groups, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    out = torch.ldexp(values, exponents.unsqueeze(-1).float())
    return out.flatten(-2).to(dtype)


def keeps_codes(device: torch.device, quantization: Optional[str]) -> str:
    """'' when MXFP4 weights loaded onto ``device`` keep their codes (``Mxfp4Linear``), else why they are
    dequantized at load instead (logged once per reason)."""
    if os.environ.get(CODES_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        why = f"codes switched off ({CODES_ENV})"
    elif quantization is not None:
        why = f"quantization {quantization!r} asked for: they are dequantized, then quantized"
    elif device.type == "cuda":
        # the ``moe`` path's grouped kernel decodes the codes in registers (kernels/triton/moe.py)
        why = "" if triton_available() else "no Triton for the MXFP4 grouped-expert kernel"
    elif device.type != "cpu":
        why = f"no MXFP4 kernel on {device.type}"
    else:
        why = "" if mxfp4_gemv.ready() else f"the MXFP4 kernel is off: {mxfp4_gemv.reason()}"
    if why and why not in _logged:
        _logged.add(why)
        log.info("MXFP4 weights, where a checkpoint has them, are dequantized at load: %s", why)
    return why


class Mxfp4Linear(nn.Module):
    """A linear layer over MXFP4 codes: ``x @ w.T + bias`` with ``w`` never held wider than its codes. Buffers
    ``blocks`` uint8 [out, in / 32, 16] and ``scales`` uint8 [out, in / 32] (``Codes``); ``bias`` [out] a
    parameter (on the meta device until the loader sets it) or None. Float32 and bf16 CPU activations go through
    the MXFP4 kernel; others (float16) through a product over the weight dequantized for that call alone."""

    def __init__(self, codes: Codes, bias: bool) -> None:
        super().__init__()
        rows, groups = codes.scales.shape
        if tuple(codes.blocks.shape) != (rows, groups, BLOCK // 2):
            raise ValueError(
                f"mxfp4: blocks {tuple(codes.blocks.shape)} do not match scales ({rows}, {groups})"
            )
        self.in_features, self.out_features = groups * BLOCK, rows
        self.register_buffer("blocks", codes.blocks.contiguous())
        self.register_buffer("scales", codes.scales.contiguous())
        self.bias = nn.Parameter(torch.empty(rows, device="meta"), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)
        if mxfp4_gemv.takes(x2d) and self.blocks.device.type == "cpu" and mxfp4_gemv.available():
            y = mxfp4_gemv.mxfp4_matmul(x2d, self.blocks, self.scales, self.bias)
        else:
            y = F.linear(x2d, dequantize(self.blocks, self.scales, x.dtype), self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        """The weight dequantized, [out, in] float32 (a copy)."""
        return dequantize(self.blocks, self.scales, torch.float32)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )

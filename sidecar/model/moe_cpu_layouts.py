"""The expert weights the CPU grouped expert kernels read (``moe_cpu.py``), as their layers hold them."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from sidecar.model.kernels.cpu import bf16_gemv
from sidecar.model.linear import Linear


def operands(lin: nn.Module, cls: type, n: int, k: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(codes, scales) of an expert's projection [n, k] in the kernel's layout, or None."""
    if type(lin) is not cls or lin.bias is not None or lin.k_padded != k or lin.out_features != n:
        return None
    if cls.mode == "int8":
        w, s = lin.weight, lin.scales_f32
        ok = w.shape == (n, k) and s.dtype == torch.float32 and s.shape == (n,)
    else:
        w, s = lin.weight, lin.scales_and_zeros
        ok = w.shape == (n, k // 2) and s.dtype == torch.bfloat16 and lin.qweight_plain is None
        ok = ok and s.shape == (k // lin.group_size, n, 2)
    ok = ok and w.device.type == "cpu" and w.is_contiguous() and s.is_contiguous()
    return (w, s) if ok else None


def bf16_weight(lin: nn.Module, n: int, k: int):
    """(weight, tiled) of a bf16 expert's projection [n, k] as its layer's kernel reads it (``Linear.forward``:
    the tiled layout, or plain rows), or the reason the grouped kernel cannot read it."""
    if type(lin) is not Linear or lin.bias is not None or (lin.out_features, lin.in_features) != (n, k):
        return "experts with biases or of another width"
    if lin.amx is not None:
        return "bf16 experts in the AMX tile layout (the grouped kernel reads plain or tiled rows)"
    if lin.tiled is not None:
        w, tiled = lin.tiled, 1
    elif lin.weight is not None and lin.weight.dtype is torch.bfloat16:
        w, tiled = lin.weight, 0
    elif lin.packed is not None and lin.packed.dtype is torch.bfloat16:
        return "bf16 experts in oneDNN's packed layout"
    else:
        return "experts that are not int8 / int4 / bf16 layers"
    shape = (-(-n // bf16_gemv.TILE), k // 32, bf16_gemv.TILE, 32) if tiled else (n, k)
    if w.dtype != torch.bfloat16 or w.device.type != "cpu" or not w.is_contiguous() or w.shape != shape:
        return "bf16 experts in another layout"
    return w, tiled

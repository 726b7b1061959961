"""MXFP4 matmul over the codes (``mxfp4_gemv.c``), for a mixture's experts as gpt-oss checkpoints ship them.

``mxfp4_matmul(x, blocks, scales, bias)`` computes ``x @ w.T + bias`` for float32 or bf16 ``x`` [M, K], with ``w``
the weight ``mxfp4.dequantize(blocks, scales, float32)`` would give (``blocks`` uint8 [N, K / 32, 16], ``scales``
uint8 [N, K / 32]) but never formed: the kernel builds each weight from its code and scale in registers, the
dequantized value to the bit, and sums float32 FMAs (so the result differs from a product over the dequantized
weight in summation order only; bf16 results are the float32 sums rounded once). Results come in ``x``'s dtype.

``ready()`` is the gate the model's layers take: the kernel built here and its start-up self-check against the
dequantized reference (``reference``) passed, once per process; a failure is logged and the layers dequantize
at load instead (``mxfp4.keeps_codes``).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu.cpu_build import I
from sidecar.model.kernels.cpu.matmul_args import OUT_BF16, OUT_F32, MatmulArgs

log = logging.getLogger("sidecar.kernels")

BLOCK = 32  # columns sharing one scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # bit 3: sign
_KERNEL = cpu_build.Kernel(
    "mxfp4_gemv",
    {"sidecar_mxfp4_matmul": ([MatmulArgs], I), "sidecar_mxfp4_vector_bits": ([], I)},
)
_checked: dict[str, str] = {}  # "reason": why the kernel is not used ('' when it is), once checked


def available() -> bool:
    return _KERNEL.lib() is not None


def vector_bits() -> int:
    """256 where the AVX2 + FMA path is built, 0 for the plain-C loop (-1: not built)."""
    lib = _KERNEL.lib()
    return -1 if lib is None else int(lib.sidecar_mxfp4_vector_bits())


def takes(x: torch.Tensor) -> bool:
    """Whether the kernel takes activations like ``x``: float32 or bf16 on the CPU."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)


def mxfp4_matmul(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``x`` [M, K] (``takes(x)``) times the MXFP4 weight [N, K] of ``blocks`` / ``scales``, plus ``bias`` [N]
    (float32 or bf16) -> [M, N] in ``x.dtype``. Requires ``available()``; ValueError where operands disagree."""
    lib = _KERNEL.lib()
    assert lib is not None, "mxfp4_gemv kernel is not available"
    n, groups = scales.shape
    k = groups * BLOCK
    if (
        blocks.dtype != torch.uint8
        or scales.dtype != torch.uint8
        or tuple(blocks.shape) != (n, groups, BLOCK // 2)
        or x.dim() != 2
        or x.shape[1] != k
        or not takes(x)
        or (bias is not None and (bias.shape != (n,) or bias.dtype not in (torch.float32, torch.bfloat16)))
    ):
        raise ValueError(
            f"mxfp4_matmul: x {tuple(x.shape)} {x.dtype}, blocks {tuple(blocks.shape)} {blocks.dtype}, scales "
            f"{tuple(scales.shape)} {scales.dtype}"
            f"{'' if bias is None else f', bias {tuple(bias.shape)} {bias.dtype}'} do not fit"
        )
    x, blocks, scales = x.contiguous(), blocks.contiguous(), scales.contiguous()
    b = None if bias is None else bias.contiguous()
    y = torch.empty(x.shape[0], n, dtype=x.dtype)
    bf16 = x.dtype == torch.bfloat16
    args = MatmulArgs(
        x=x.data_ptr(),
        w=blocks.data_ptr(),
        scales=scales.data_ptr(),
        bias=None if b is None else b.data_ptr(),
        y=y.data_ptr(),
        M=x.shape[0],
        N=n,
        K=k,
        nthreads=torch.get_num_threads(),
        x_bf16=int(bf16),
        bias_bf16=int(b is not None and b.dtype == torch.bfloat16),
        out=OUT_BF16 if bf16 else OUT_F32,
    )
    rc = lib.sidecar_mxfp4_matmul(args)
    if rc == 2:
        raise MemoryError("mxfp4_matmul: no memory for the activations' float32 copy")
    assert rc == 0, "mxfp4_gemv refused arguments checked above"
    return y


def reference(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """float64 ``x @ w.T + bias`` over the weight dequantized in float64 (e2m1 value times ``2 ** (scale - 127)``),
    as float32: the oracle for tests and the self-check."""
    values = torch.tensor(E2M1, dtype=torch.float64)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [N, groups, 16, 2]: even, odd columns
    w = values[codes].flatten(-2) * torch.exp2(scales.double() - 127).unsqueeze(-1)
    y = x.double() @ w.flatten(-2).T
    return (y if bias is None else y + bias.double()).float()


def _self_check() -> str:
    """'' when the kernel's products match ``reference`` on random codes (every code, scales over a wide range,
    bias or none, float32 and bf16, 1 to 6 rows), else why not."""
    g = torch.Generator().manual_seed(0)
    n, groups = 37, 5
    blocks = torch.randint(0, 256, (n, groups, BLOCK // 2), generator=g).to(torch.uint8)
    blocks[0, 0] = torch.arange(16, dtype=torch.uint8) * 17
    scales = torch.randint(100, 140, (n, groups), generator=g).to(torch.uint8)
    bias = torch.randn(n, generator=g)
    for m in (1, 3, 6):
        x = torch.randn(m, groups * BLOCK, generator=g)
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            for b in (None, bias):
                ref = reference(x.to(dtype), blocks, scales, None if b is None else b.to(dtype))
                try:
                    y = mxfp4_matmul(x.to(dtype), blocks, scales, None if b is None else b.to(dtype)).float()
                except (ValueError, MemoryError) as exc:
                    return str(exc)
                err, bound = float((y - ref).abs().max()), tol * float(ref.abs().max()) + 1e-6
                if not err <= bound:
                    return f"{m} {dtype} rows off from the dequantized reference by {err:.3g} (bound {bound:.3g})"
    return ""


def ready() -> bool:
    """Built here and self-checked (once; a failure is logged, and MXFP4 weights are then dequantized)."""
    if "reason" not in _checked:
        why = "" if available() else f"not built ({cpu_build.reason('mxfp4_gemv')})"
        _checked["reason"] = why or _self_check()
        if _checked["reason"]:
            log.warning("MXFP4 kernel off, experts dequantized at load: %s", _checked["reason"])
    return not _checked["reason"]


def reason() -> str:
    """Why ``ready()`` is false ('' when it is true, or not yet asked)."""
    return _checked.get("reason", "")

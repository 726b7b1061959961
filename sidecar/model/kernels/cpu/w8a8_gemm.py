"""W8A8 int8 matmul with per-token dynamic activation quantization (``w8a8_gemm.c``), and its torch reference.

``quantize_per_token(x)`` is compressed-tensors' symmetric dynamic per-token int8 quantization: the scale of a
row is its absolute maximum over 127.5 (half the code range; float32's epsilon where the row is zero), the
codes ``clamp(round(x / scale), -128, 127)`` (a true division, rounded half to even). ``w8a8_matmul_ref`` is
the product the kernel computes, in torch: exact int32 sums of the codes, converted to float32, times the
row's activation scale, times the weight row's scale, plus the bias. ``w8a8_matmul`` runs the same steps in C
(int32 products with vpmaddwd on AVX2, vpdpwssd with VNNI); its float32 results equal the reference's bits.

The weight is held in the kernel's panel layout (``pack``), int8 like the checkpoint's codes; ``unpack``
gives the plain codes back."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu.cpu_build import I, P
from sidecar.model.kernels.cpu.matmul_args import OUT_BF16, OUT_F32, MatmulArgs

PANEL_ROWS = 16  # weight rows of a panel of the packed layout (two blocks of 8)
_EPS = torch.finfo(torch.float32).eps

_KERNEL = cpu_build.Kernel(
    "w8a8_gemm",
    {
        "sidecar_w8a8_matmul": ([MatmulArgs], I),
        "sidecar_w8a8_quantize": ([P, I, I, I, P, P], None),
        "sidecar_w8a8_isa": ([], I),
    },
    setup=lambda lib: setattr(lib, "_sidecar_isa", int(lib.sidecar_w8a8_isa())),
)
ISA_NAMES = {0: "plain C", 1: "VNNI", 2: "AVX2"}


def available() -> bool:
    """Whether the kernel built for this CPU and passed its self-check: a product with odd shapes and codes at
    both ends of the range equal to ``w8a8_matmul_ref`` bit for bit (checked once; ``cpu_build.reason``
    says why not)."""
    lib = _KERNEL.lib()
    if lib is None:
        return False
    if not hasattr(lib, "_sidecar_checked"):
        lib._sidecar_checked = _self_check()
        if not lib._sidecar_checked:
            cpu_build._reasons["w8a8_gemm"] = "self-check: the product differs from the torch reference"
            cpu_build.log.warning("CPU kernel w8a8_gemm not used (torch path instead): self-check failed")
    return lib._sidecar_checked


def _self_check() -> bool:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 45, generator=g)
    x[0, 3] = -9.0
    w = torch.randint(-128, 128, (19, 45), dtype=torch.int8, generator=g)
    w[1] = -128
    s, bias = torch.rand(19, generator=g), torch.randn(19, generator=g)
    y = w8a8_matmul(x, pack(w), padded_scales(s), 19, bias)
    return torch.equal(y, w8a8_matmul_ref(x, w, s, bias))


def isa() -> str:
    """The instructions the built kernel multiplies with: 'VNNI', 'AVX2' or 'plain C' ('' when not built)."""
    lib = _KERNEL.lib()
    return "" if lib is None else ISA_NAMES[lib._sidecar_isa]


def quantize_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [M, K], float32 scales [M]) of the rows of ``x`` [M, K], computed in float32."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / 127.5
    scale = torch.where(scale == 0, torch.full_like(scale, _EPS), scale)
    q = torch.round(torch.clamp(xf / scale[:, None], -128.0, 127.0)).to(torch.int8)
    return q, scale


def int_matmul_ref(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Exact int32 ``q @ w.T`` of int8 [M, K] and [N, K] (float64 sums: exact for any K below 2^39)."""
    return (q.double() @ w.double().T).to(torch.int32)


def w8a8_matmul_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The kernel's result in torch for plain int8 ``weight`` [N, K] and float32 ``scales`` [N]."""
    q, sx = quantize_per_token_ref(x)
    y = int_matmul_ref(q, weight).float() * sx[:, None] * scales.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """int8 ``weight`` [N, K] in the kernel's layout: a flat int8 tensor of Np * Kp codes (Np = N rounded
    up to ``PANEL_ROWS``, Kp = K rounded up to even, padded with zeros), blocks of 8 rows as [Kp /
    2][8][2]."""
    n, k = weight.shape
    kp, np_ = k + (k % 2), -(-n // PANEL_ROWS) * PANEL_ROWS
    w = F.pad(weight.to(torch.int8), (0, kp - k, 0, np_ - n))
    return w.view(np_ // 8, 8, kp // 2, 2).permute(0, 2, 1, 3).contiguous().view(-1)


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The plain int8 [n, k] codes of a ``pack``ed weight."""
    kp, np_ = k + (k % 2), -(-n // PANEL_ROWS) * PANEL_ROWS
    w = packed.view(np_ // 8, kp // 2, 8, 2).permute(0, 2, 1, 3).reshape(np_, kp)
    return w[:n, :k].contiguous()


def padded_scales(scales: torch.Tensor) -> torch.Tensor:
    """float32 weight scales [N] padded with zeros to the packed layout's Np rows."""
    n = scales.shape[0]
    return F.pad(scales.float().reshape(-1), (0, -(-n // PANEL_ROWS) * PANEL_ROWS - n)).contiguous()


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_per_token_ref`` in C (float32 or bf16 ``x`` [M, K]). Requires ``available()``."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"quantize_per_token: x {tuple(x.shape)} {x.dtype}")
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=torch.int8)
    s = torch.empty(x.shape[0], dtype=torch.float32)
    _KERNEL.lib().sidecar_w8a8_quantize(
        x.data_ptr(), int(x.dtype == torch.bfloat16), x.shape[0], x.shape[1], q.data_ptr(), s.data_ptr()
    )
    return q, s


def w8a8_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    n: int,
    bias: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``w8a8_matmul_ref`` over ``packed`` (``pack`` of an [n, K] weight) and ``scales`` (``padded_scales``):
    [M, n] in ``out_dtype`` (float32, or bf16 rounded once). ``x``: float32 or bf16 [M, K]. Requires
    ``available()``; the caller has checked the static operands."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"w8a8_matmul: x {tuple(x.shape)} {x.dtype}")
    x = x if x.is_contiguous() else x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=out_dtype)
    if x.shape[0] == 0:
        return y
    rc = _KERNEL.lib().sidecar_w8a8_matmul(
        MatmulArgs(
            x=x.data_ptr(),
            w=packed.data_ptr(),
            scales=scales.data_ptr(),
            bias=None if bias is None else bias.data_ptr(),
            y=y.data_ptr(),
            M=x.shape[0],
            N=n,
            K=x.shape[1],
            nthreads=torch.get_num_threads(),
            x_bf16=x.dtype == torch.bfloat16,
            bias_bf16=bias is not None and bias.dtype == torch.bfloat16,
            out=OUT_BF16 if out_dtype == torch.bfloat16 else OUT_F32,
        )
    )
    if rc != 0:
        raise MemoryError(f"w8a8_matmul: no memory for the int16 codes of {x.shape[0]} activation rows")
    return y

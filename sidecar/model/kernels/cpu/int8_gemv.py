"""Weight-only int8 matmul for decode-sized batches on CPU (``int8_gemv.c``) and its reference.

``int8_matmul(x, weight, scales)`` computes ``(x @ weight.T) * scales`` for float32 ``x``
[M, K], int8 ``weight`` [N, K] and float32 ``scales`` [N], returning float32 [M, N].
``reference`` is the same product in torch (float64 accumulation), the oracle for tests.
``int8_g32_matmul(x, weight, d)`` is the grouped form (llama.cpp's Q8_0 blocks): one float32 scale
per 32 columns, ``d`` [N, K/32], ``reference_g32`` its oracle. ``int8_linear`` is either form as a layer
runs it in a decode step: bf16 or float32 activations read as they are, the bias added and the output
rounded once to its dtype in the same call, the scratch inside it (no separate conversions, casts and
scratch tensors around the product).
The kernel rounds each activation row to int16 with its own scale (15 bits, where the
bf16 activations of torch's packed kernel keep 8); the products and sums are exact.
"""

from __future__ import annotations

from typing import Optional

import torch

from sidecar.model.kernels.cpu import amx_gemm, cpu_build, int8_gemm
from sidecar.model.kernels.cpu.cpu_build import I
from sidecar.model.kernels.cpu.matmul_args import MatmulArgs
from sidecar.model.kernels.cpu.moe_args import MoeArgs

# Rows (sequences in a decode step, tokens in a prefill chunk) up to which this kernel is used (it leads torch's
# packed kernel there); beyond that bf16 prefill chunks go to the tile-layout kernel over the widened codes
# (``amx_gemm.int8_matmul``) where it runs, to the AVX2 prefill path over the codes (``int8_gemm.int8_matmul_wide``)
# where that is built, else to torch's.
MAX_ROWS = 32
# With AMX, bf16 batches take the tile path from this many rows on: its products per widened code against this
# kernel's per row, with the weights coming from memory as in a decode step, where the first overtakes the second.
TILE_MIN_ROWS = 24


def takes(rows: int, dtype: Optional[torch.dtype] = None) -> bool:
    """Whether a layer of per-row scales (``Layer``) runs a batch of ``rows`` (activations of ``dtype``) itself:
    decode-sized batches, any batch where the wide path is built, and bf16 batches where the tile-layout one is."""
    return rows <= MAX_ROWS or int8_gemm.available() or dtype is torch.bfloat16 and amx_gemm.available()


_FLOATS = (torch.float32, torch.bfloat16)


_KERNEL = cpu_build.Kernel(
    "int8_gemv", {"sidecar_int8_linear": ([MatmulArgs], I), "sidecar_int8_moe": ([MoeArgs], I)}
)


available = _KERNEL.available


def _run(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, grouped: bool) -> torch.Tensor:
    """``int8_linear`` of float32 activations and scales, no bias, a float32 result."""
    assert _KERNEL.lib() is not None, "int8_gemv kernel is not available"
    x = x.contiguous() if x.dtype == torch.float32 else x.float().contiguous()
    scales = scales.contiguous() if scales.dtype == torch.float32 else scales.float().contiguous()
    return int8_linear(x, weight, scales, grouped=grouped)


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Requires ``available()``. All tensors on the CPU; ``x`` float32 [M, K] (any M; used up to MAX_ROWS)."""
    n, k = weight.shape[0], x.shape[1]
    if weight.shape[1] != k or weight.dtype != torch.int8 or scales.shape != (n,):
        raise ValueError(
            f"int8_matmul: x {tuple(x.shape)}, weight {tuple(weight.shape)} {weight.dtype}, "
            f"scales {tuple(scales.shape)} do not fit"
        )
    return _run(x, weight, scales, grouped=False)


def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.float32,
    grouped: bool = False,
) -> torch.Tensor:
    """A whole layer in one call, as a decode step runs it: ``int8_matmul`` (or with ``grouped``
    ``int8_g32_matmul``, ``scales`` then being ``d``) plus ``bias``, with ``x`` float32 or bf16 read as it is
    and the result in ``out_dtype`` (float32, or bf16: the float32 sum plus bias rounded once), with no
    conversions or scratch tensors around the kernel. Requires ``available()``; ``scales`` float32."""
    lib = _KERNEL.lib()
    assert lib is not None, "int8_gemv kernel is not available"
    m, k = x.shape
    n = weight.shape[0]
    if (
        weight.shape[1] != k
        or weight.dtype != torch.int8
        or x.dtype not in _FLOATS
        or out_dtype not in _FLOATS
        or scales.dtype != torch.float32
        or scales.shape != ((n, k // 32) if grouped else (n,))
        or (grouped and k % 32)
        or (bias is not None and (bias.shape != (n,) or bias.dtype not in _FLOATS))
    ):
        raise ValueError(
            f"int8_linear: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}, "
            f"scales {tuple(scales.shape)} {scales.dtype}"
            f"{'' if bias is None else f', bias {tuple(bias.shape)} {bias.dtype}'}, out {out_dtype}"
            f"{' (grouped)' if grouped else ''} do not fit"
        )
    x, weight, scales = x.contiguous(), weight.contiguous(), scales.contiguous()  # held for the call
    b = None if bias is None else bias.contiguous()
    y = torch.empty(m, n, dtype=out_dtype)
    rc = lib.sidecar_int8_linear(
        MatmulArgs(
            x=x.data_ptr(),
            w=weight.data_ptr(),
            scales=scales.data_ptr(),
            bias=None if b is None else b.data_ptr(),
            y=y.data_ptr(),
            M=m,
            N=n,
            K=k,
            nthreads=torch.get_num_threads(),
            x_bf16=x.dtype == torch.bfloat16,
            bias_bf16=b is not None and b.dtype == torch.bfloat16,
            out=out_dtype == torch.bfloat16,
            grouped=grouped,
        )
    )
    if rc == 2:
        raise MemoryError("int8_linear: out of memory for the activation scratch")
    return y


class Layer(cpu_build.LayerView):
    """A layer's static operands for ``int8_linear`` (``weight``, ``scales``, ``bias``, ``grouped``) checked once,
    so that a call checks only the activations: in a decode step the checks around the product cost about
    as much as a small layer's product. ``matches`` says whether it still holds these tensors. bf16 batches of
    ``TILE_MIN_ROWS`` rows or more go through AMX tile products over the widened codes where AMX runs."""

    __slots__ = (
        "weight",
        "scales",
        "bias",
        "grouped",
        "n",
        "k",
        "fn",
        "bias_bf16",
        "wide",
        "amx",
        "from_rows",
    )

    def __init__(
        self, weight: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor], grouped: bool = False
    ) -> None:
        lib = _KERNEL.lib()
        if lib is None:
            raise RuntimeError("int8_gemv kernel is not available")
        n, k = weight.shape
        int8_linear(torch.zeros(1, k), weight, scales, bias, grouped=grouped)  # the checks, once
        if not all(
            t.is_contiguous() and t.device.type == "cpu"
            for t in (weight, scales) + (() if bias is None else (bias,))
        ):
            raise ValueError("int8 layer: contiguous CPU operands")
        self.weight, self.scales, self.bias, self.grouped, self.n, self.k = (
            weight,
            scales,
            bias,
            grouped,
            n,
            k,
        )
        self.fn = lib.sidecar_int8_linear
        self.bias_bf16 = bias is not None and bias.dtype == torch.bfloat16
        # batches past MAX_ROWS: the AVX2 prefill path over the codes, for per-row scales
        self.wide = not grouped and k % 32 == 0 and int8_gemm.available()
        # ... and with AMX or AVX-512 BF16, bf16 batches past MAX_ROWS through the tile-layout kernel over the codes
        self.amx = not grouped and k % 32 == 0 and scales.dtype == torch.float32 and amx_gemm.available()
        # ... from TILE_MIN_ROWS where AMX multiplies (the dot products without it: past MAX_ROWS)
        self.from_rows = TILE_MIN_ROWS if amx_gemm.path() == "AMX" else MAX_ROWS + 1

    def matches(self, weight: torch.Tensor, scales: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
        return weight is self.weight and scales is self.scales and bias is self.bias

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``int8_linear`` for float32 or bf16 ``x`` [M, K] on the CPU; ``out_dtype`` float32 or bf16."""
        if (
            (x.dtype is not torch.bfloat16 and x.dtype is not torch.float32)
            or x.shape[1] != self.k
            or x.device.type != "cpu"
        ):
            raise ValueError(f"int8 layer: x {tuple(x.shape)} {x.dtype} for {self.k} float32 or bf16 inputs")
        if not x.is_contiguous():
            x = x.contiguous()
        m = x.shape[0]
        if m >= self.from_rows and self.amx and x.dtype is torch.bfloat16:
            y = amx_gemm.int8_matmul(x, self.weight, self.scales, self.bias, out_dtype)
            if y is not None:
                return y
        if m > MAX_ROWS and self.wide:
            return int8_gemm.int8_matmul_wide(x, self.weight, self.scales, self.bias, out_dtype)
        y = torch.empty(m, self.n, dtype=out_dtype)
        b = self.bias
        rc = self.fn(
            MatmulArgs(
                x=x.data_ptr(),
                w=self.weight.data_ptr(),
                scales=self.scales.data_ptr(),
                bias=None if b is None else b.data_ptr(),
                y=y.data_ptr(),
                M=m,
                N=self.n,
                K=self.k,
                nthreads=torch.get_num_threads(),
                x_bf16=x.dtype is torch.bfloat16,
                bias_bf16=self.bias_bf16,
                out=out_dtype is torch.bfloat16,
                grouped=self.grouped,
            )
        )
        if rc == 2:
            raise MemoryError("int8_linear: out of memory for the activation scratch")
        return y


def reference(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return ((x.double() @ weight.double().T) * scales.double()).float()


def int8_g32_matmul(x: torch.Tensor, weight: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Requires ``available()``. ``x`` float32 [M, K], ``weight`` int8 [N, K], ``d`` float32 [N, K/32]."""
    n, k = weight.shape[0], x.shape[1]
    if k % 32 or weight.shape[1] != k or weight.dtype != torch.int8 or d.shape != (n, k // 32):
        raise ValueError(
            f"int8_g32_matmul: x {tuple(x.shape)}, weight {tuple(weight.shape)} {weight.dtype}, "
            f"d {tuple(d.shape)} do not fit"
        )
    return _run(x, weight, d, grouped=True)


def dequantize_g32(weight: torch.Tensor, d: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n, k = weight.shape
    return (weight.view(n, k // 32, 32).to(torch.float32) * d.float()[:, :, None]).view(n, k).to(dtype)


def reference_g32(x: torch.Tensor, weight: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return (x.double() @ dequantize_g32(weight, d, torch.float64).T).float()

"""int8 weight-only matmul for prefill-sized batches on AVX2 CPUs (``int8_gemm.c``).

``int8_matmul_wide(x, weight, scales, bias, out_dtype)`` computes ``(x @ weight.T) * scales + bias`` for int8
codes with one float32 scale a row through the AVX2 outer products that ``bf16_gemv`` runs for bf16 prefill
(``outer_avx2.h``): the codes are converted to bf16 a block at a time (exactly), so a prefill over int8 weights
goes at bf16's pace. ``int8_gemv.Layer`` takes it for batches past ``int8_gemv.MAX_ROWS`` where ``available()``
(an AVX2 build: a CPU with AVX-512 BF16 takes ``amx_gemm.int8_matmul`` instead).
"""

from __future__ import annotations

from typing import Optional

import torch

from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu.cpu_build import I
from sidecar.model.kernels.cpu.matmul_args import MatmulArgs

# Whether the build has the path is asked of the library once: every int8 layer checks it.
_KERNEL = cpu_build.Kernel(
    "int8_gemm",
    {
        "sidecar_int8_matmul_wide": ([MatmulArgs], I),
        "sidecar_int8_gemm_supported": ([], I),
    },
    setup=lambda lib: setattr(lib, "_sidecar_int8_wide", int(lib.sidecar_int8_gemm_supported())),
)


def available() -> bool:
    """Whether ``int8_matmul_wide`` runs here: built for this CPU, on the AVX2 path (AVX2 + FMA without AVX-512
    BF16; an AVX-512 BF16 build has none)."""
    lib = _KERNEL.lib()
    return lib is not None and lib._sidecar_int8_wide != 0


def int8_matmul_wide(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(x @ weight.T) * scales + bias`` for int8 codes ``weight`` [N, K] (K a multiple of 32) with float32
    ``scales`` [N]: float32 sums of the products of ``x`` (bf16, or float32 read as it is) and the codes, each
    times its row's scale, then the bias; [M, N] in ``out_dtype`` (float32 or bf16, rounded once). Requires
    ``available()``; the caller has checked the static operands."""
    lib = _KERNEL.lib()
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32) or x.shape[1] != weight.shape[1]:
        raise ValueError(f"int8_matmul_wide: x {tuple(x.shape)} {x.dtype} for weight {tuple(weight.shape)}")
    x = x if x.is_contiguous() else x.contiguous()  # held for the call
    y = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype)
    rc = lib.sidecar_int8_matmul_wide(
        MatmulArgs(
            x=x.data_ptr(),
            w=weight.data_ptr(),
            scales=scales.data_ptr(),
            bias=None if bias is None else bias.data_ptr(),
            y=y.data_ptr(),
            M=x.shape[0],
            N=weight.shape[0],
            K=x.shape[1],
            nthreads=torch.get_num_threads(),
            x_bf16=x.dtype != torch.float32,
            bias_bf16=bias is not None and bias.dtype == torch.bfloat16,
            out=out_dtype == torch.bfloat16,
        )
    )
    if rc == 2:
        raise MemoryError(
            f"int8_matmul_wide: no memory for the working buffers of {x.shape[0]} activation rows"
        )
    if rc != 0:
        raise RuntimeError("int8_matmul_wide: no AVX2 path in this build, or K not a multiple of 32")
    return y

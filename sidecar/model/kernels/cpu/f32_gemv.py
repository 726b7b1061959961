"""float32 matmul over a plain weight (``f32_gemv.c``), for a tied float32 output head, and its reference.

``f32_matmul(x, weight, bias)`` computes ``x @ weight.T + bias`` for float32 ``x`` [M, K] and ``weight``
[N, K] (K a multiple of 16), float32 FMAs in one fixed order per output (they differ from ``F.linear`` in
summation order only; a row's result does not depend on its batch). A float32 model's tied head shares its
table with the embedding lookups, so ``linear_layout.pack_weights`` keeps the plain table beside the head's packed
copy; ``Linear`` takes this kernel on the plain table for batches of up to ``linear.F32_KERNEL_ROWS`` rows,
where it streams faster than oneDNN's packed float32 GEMM (see the C header), and the packed copy above.
"""

from __future__ import annotations

from typing import Optional

import torch

from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu.cpu_build import I, P

K_MULTIPLE = 16

_KERNEL = cpu_build.Kernel(
    "f32_gemv",
    {
        "sidecar_f32_matmul": ([P] * 4 + [I] * 4, I),
        "sidecar_f32_supported": ([], I),
    },
    setup=lambda lib: setattr(lib, "_sidecar_f32", int(lib.sidecar_f32_supported())),
)


def available() -> bool:
    """Built for this CPU, and the CPU has AVX2 + FMA or AVX-512."""
    lib = _KERNEL.lib()
    return lib is not None and lib._sidecar_f32 != 0


def takes(weight: Optional[torch.Tensor]) -> bool:
    """Whether the kernel reads this weight: a plain float32 [N, K] CPU tensor with K a multiple of 16."""
    return (
        weight is not None
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.shape[1] % K_MULTIPLE == 0
        and weight.is_contiguous()
        and available()
    )


def f32_matmul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Requires ``takes(weight)``; ``x`` float32 [M, K] on the CPU."""
    lib = _KERNEL.lib()
    assert lib is not None, "f32_gemv kernel is not available"
    n, k = weight.shape
    if (
        x.dim() != 2
        or x.shape[1] != k
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or k % K_MULTIPLE
        or (bias is not None and (bias.shape != (n,) or bias.dtype != torch.float32))
    ):
        raise ValueError(
            f"f32_matmul: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}"
            f"{'' if bias is None else f', bias {tuple(bias.shape)} {bias.dtype}'} do not fit"
        )
    x = x.contiguous()
    w = weight.contiguous()
    b = None if bias is None else bias.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    rc = lib.sidecar_f32_matmul(
        x.data_ptr(),
        w.data_ptr(),
        None if b is None else b.data_ptr(),
        y.data_ptr(),
        x.shape[0],
        n,
        k,
        torch.get_num_threads(),
    )
    assert rc == 0, "f32_gemv refused arguments checked above"
    return y


def reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float64 x @ weight.T + bias, as float32."""
    y = x.double() @ weight.double().T
    return (y if bias is None else y + bias.double()).float()

"""The sampler's greedy pick on the CPU (``argmax.c``): ``x.argmax(-1)`` of float32 logits [rows, vocabulary]
in one pass at the memory's speed, the same indices (first of the largest; a NaN wins). Where it cannot be
built, or the logits are not such a CPU tensor, the caller keeps torch's."""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu.cpu_build import I, P

_I64 = ctypes.c_int64
_KERNEL = cpu_build.Kernel("argmax", {"sidecar_row_argmax": ([P, _I64, _I64, _I64, P, I], I)})

available = _KERNEL.available


def row_argmax(x: torch.Tensor) -> Optional[torch.Tensor]:
    """int64 [rows]: ``x.argmax(-1)`` of float32 CPU ``x`` [rows, n] (rows in place: unit stride within a row),
    or None (another tensor, or no kernel)."""
    if (
        x.device.type != "cpu"
        or x.dtype is not torch.float32
        or x.dim() != 2
        or x.shape[1] < 1
        or x.stride(1) != 1
        or x.stride(0) < x.shape[1]
    ):
        return None
    lib = _KERNEL.lib()
    if lib is None:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if (
        lib.sidecar_row_argmax(
            x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), torch.get_num_threads()
        )
        != 0
    ):
        return None
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``, through the kernel where it takes ``x``."""
    fast = row_argmax(x)
    return fast if fast is not None else x.argmax(-1)

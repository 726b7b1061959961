"""The sampler's keyed uniforms on the CPU in one C pass (``keyed_uniform.c``).

``sampling_rng.uniform`` defines the values with torch integer operators, a dozen passes over the
[rows, n] block; this kernel computes the same bits in one. Where it cannot be built, or the keys are
not on the CPU, the caller keeps the torch form.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu.cpu_build import I, P

_KERNEL = cpu_build.Kernel(
    "keyed_uniform", {"sidecar_keyed_uniform": ([P, ctypes.c_int64, ctypes.c_int64, P, I], I)}
)

available = _KERNEL.available


def uniform(keys: torch.Tensor, n: int) -> Optional[torch.Tensor]:
    """float32 [B, n]: ``sampling_rng.uniform(keys, n)`` bit for bit, or None (keys not a CPU int64
    vector, or no kernel)."""
    if keys.device.type != "cpu" or keys.dtype != torch.int64 or keys.dim() != 1:
        return None
    lib = _KERNEL.lib()
    if lib is None:
        return None
    k = keys.contiguous()
    out = torch.empty((k.shape[0], n), dtype=torch.float32)
    if lib.sidecar_keyed_uniform(k.data_ptr(), k.shape[0], n, out.data_ptr(), torch.get_num_threads()) != 0:
        return None
    return out

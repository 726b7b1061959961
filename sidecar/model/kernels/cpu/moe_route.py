"""A softmax router's top-k in one kernel call (``moe_route.c``): from a sparse block's gate logits [T, E] to
each row's k expert ids (ascending) and their weights, the bits of torch's router (``SparseMoE.route_logits``
followed by the ascending sort ``SparseMoE.forward`` makes) -- softmax in float32, torch.topk's set with its
ties, the renormalisation where the family does it, the weights in float32 or bf16. ``route_picked`` does the
same for the routers that pick first and weigh the k picked after: gpt-oss's softmax over them, Llama 4's sigmoid.

The kernel repeats the softmax torch runs on this CPU's vectors (``lanes``: AVX2's 8, AVX-512's 16); on a CPU
torch serves with other vectors there is no kernel (``lanes`` None). Callers still compare it with torch's
router before they use it (``moe_cpu.self_check``).
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu.cpu_build import I, P

_I64 = ctypes.c_int64
_ARGS = [P, _I64, _I64, _I64, I, I, I, I, P, P]
_KERNEL = cpu_build.Kernel(
    "moe_route", {"sidecar_moe_route": (_ARGS, I), "sidecar_moe_route_picked": (_ARGS, I)}
)
_FLOATS = (torch.float32, torch.bfloat16)
MAX_K = 256  # experts per token the kernel takes (moe_route.c's MAX_K)
# route_picked's forms: the softmax of the k picked logits (gpt-oss), the sigmoid of each (Llama 4)
PICKED_SOFTMAX, PICKED_SIGMOID = 1, 2


def lanes() -> Optional[int]:
    """The float32 vector width of torch's CPU kernels here (8 or 16), or None where they are neither."""
    capability = torch.backends.cpu.get_cpu_capability()
    return {"AVX2": 8, "AVX512": 16}.get(capability)


def unavailable_reason() -> Optional[str]:
    """Why the kernel cannot route here (None when it can)."""
    if lanes() is None:
        return f"torch's CPU kernels run {torch.backends.cpu.get_cpu_capability()} vectors here"
    if _KERNEL.lib() is None:
        return f"the router kernel is not built: {cpu_build.reason('moe_route')}"
    return None


def route(
    logits: torch.Tensor, k: int, norm: bool, weights_dtype: torch.dtype
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(weights [T, k] in ``weights_dtype``, ids [T, k] int64, ascending in each row) of the logits [T, E]
    (float32 or bf16, rows contiguous), or None where the kernel does not take them."""
    return _call("sidecar_moe_route", logits, k, int(norm), weights_dtype)


def route_picked(
    logits: torch.Tensor, k: int, form: int, weights_dtype: torch.dtype
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``route`` for the routers that take the top-k of the logits first (``SparseMoE.route_logits``):
    ``form`` PICKED_SOFTMAX weighs the k picked by their softmax in the logits' dtype (gpt-oss),
    PICKED_SIGMOID each by its sigmoid in float32 (Llama 4); the weights then cast to ``weights_dtype``."""
    if form not in (PICKED_SOFTMAX, PICKED_SIGMOID):
        return None
    return _call("sidecar_moe_route_picked", logits, k, form, weights_dtype)


def _call(
    name: str, logits: torch.Tensor, k: int, flag: int, weights_dtype: torch.dtype
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    width = lanes()
    if (
        width is None
        or logits.device.type != "cpu"
        or logits.dim() != 2
        or logits.dtype not in _FLOATS
        or weights_dtype not in _FLOATS
        or not logits.is_contiguous()
        or not 1 <= k <= min(logits.shape[1], MAX_K)
    ):
        return None
    lib = _KERNEL.lib()
    if lib is None:
        return None
    t = logits.shape[0]
    ids = torch.empty(t, k, dtype=torch.int64)
    weights = torch.empty(t, k, dtype=weights_dtype)
    rc = getattr(lib, name)(
        logits.data_ptr(),
        t,
        logits.shape[1],
        k,
        logits.dtype is torch.bfloat16,
        flag,
        weights_dtype is torch.bfloat16,
        width,
        ids.data_ptr(),
        weights.data_ptr(),
    )
    if rc == 2:
        raise MemoryError("moe_route: out of memory for a row's probabilities")
    return (weights, ids) if rc == 0 else None

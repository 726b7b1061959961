"""Which device fast paths a loaded model may take: the switchboard between the model and the runner.

The model owns one ``FastPaths`` object and hands the same instance to every layer at construction, so
flipping a field takes effect everywhere at once. Every field starts off: a fast path is turned on only
by the runner, after its start-up self-check has compared it with the torch reference on this device
(``engine/self_check.py``), and turned back off with a logged reason when that check fails. So a broken
kernel costs speed, never a wrong answer.

A layer takes a Triton path when its field is on and the tensor is on CUDA, or, for tests on a machine
without a GPU, when Triton runs in its interpreter (``TRITON_INTERPRET=1``, which must be set before the
kernel modules are imported) on CPU tensors.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields
from typing import Callable, Optional

import torch

PATH_NAMES = (
    "attention",
    "rope_kv",
    "norm",
    "silu_mul",
    "gemv",
    "weight_only",
    "moe",
    "cuda_graphs",
    "device_sampler",
)


def triton_interpreted() -> bool:
    """True when Triton kernels run in the interpreter on CPU tensors (tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def triton_available() -> bool:
    try:
        import triton  # noqa: F401  (the GPU image and the dev venv both ship it; a CPU-only install may not)
    except Exception:
        return False
    return True


def triton_kernel_ready(
    checked: dict, key: str, device: torch.device, check: Callable[[], str], what: str
) -> bool:
    """Whether a Triton kernel is installed and passed ``check`` ('' when it agrees with its torch form, else why
    not) on ``device``, kept in ``checked[key]`` (once, before any graph capture: asked first while a graph is
    captured, it answers no, and the torch form is captured). A failure, a compile or launch error included, is
    logged with ``what`` (the kernel and where its work goes instead) and is never fatal."""
    if key not in checked:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False  # the check reads results back to the host, which a capture forbids
        try:
            checked[key] = check() if triton_available() else "triton is not installed"
        except Exception as exc:  # a kernel that fails to compile or launch is switched off, never fatal
            checked[key] = f"{type(exc).__name__}: {exc}"
        if checked[key]:
            logging.getLogger("sidecar.model").warning("%s: %s", what, checked[key])
    return not checked[key]


@dataclass
class FastPaths:
    attention: bool = False  # Triton paged decode attention (reads K/V in place through the block table)
    rope_kv: bool = False  # Triton rotary embedding + KV-cache write
    norm: bool = False  # Triton residual add + RMSNorm
    silu_mul: bool = False  # Triton silu(gate) * up
    gemv: bool = False  # a one-row step's layer products in Triton, the norms and silu * up fused in
    weight_only: bool = False  # Triton int8 / int4 weight-only GEMM
    moe: bool = False  # a mixture of experts' experts as one Triton grouped GEMM over rows sorted by expert
    cuda_graphs: bool = False  # decode steps replayed from captured graphs
    device_sampler: bool = False  # sampling of the whole batch on the device, one copy of the ids
    reasons: Optional[dict] = None  # path -> why it is off (filled by the self-check)

    def takes(self, name: str, t: torch.Tensor) -> bool:
        """Whether the Triton form of path ``name`` runs for tensor ``t``."""
        if not getattr(self, name):
            return False
        return t.is_cuda or (t.device.type == "cpu" and triton_interpreted())

    def active(self) -> list[str]:
        return [f.name for f in fields(self) if f.name in PATH_NAMES and getattr(self, f.name)]

    def disable(self, name: str, reason: str) -> None:
        setattr(self, name, False)
        if self.reasons is None:
            self.reasons = {}
        self.reasons[name] = reason

    def set_all(self, on: bool) -> None:
        for name in PATH_NAMES:
            setattr(self, name, on)

"""The decoder's elementwise steps in one pass each on CPU (``norm_act.c``), and their torch references.

``silu_mul(gu)`` is ``silu(gate) * up`` over the fused gate/up projection's output [T, 2I] -> [T, I];
``gelu_tanh_mul(gu)`` is ``gelu_tanh(gate) * up`` likewise (Gemma's GeGLU).
``add_rms_norm(h, delta, weight, eps)`` is the residual add and the RMSNorm that follows it:
``s = h + delta`` (``h`` itself without a delta), returns ``(weight * rms_norm(s), s)``.
``rms_norm_heads_(x, offset, heads, dim, weight, eps)`` norms ``heads`` rows of ``dim`` starting at column
``offset`` of each row of ``x`` in place (Qwen3's and Gemma 3's q and k heads inside the fused projection).

Both round where torch's unfused ops round (bf16 after silu, after the residual add and before the
weight), so they differ from the references only in the order of float32 sums and in the exp; the
references (``*_reference``) are what runs on other devices, other dtypes, without the kernel and with
``SIDECAR_CPU_KERNELS=0``, and what the tests hold the kernel to. Torch runs silu * up as two passes over
the strided halves of the projection and the norm as upcast, square, mean, scale, downcast, weight and
the add, each allocating its result.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch
import torch.nn.functional as F

from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu.cpu_build import I, P

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class AddRmsNormArgs(cpu_build.Args):
    """The mirror of norm_act.c's argument struct."""

    c_name = "sidecar_add_rms_norm_args"
    _fields_ = [
        ("h", ctypes.c_void_p),
        ("delta", ctypes.c_void_p),
        ("w", ctypes.c_void_p),
        ("hout", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("rows", ctypes.c_int),
        ("dim", ctypes.c_int),
        ("eps", ctypes.c_float),
        ("dtype", ctypes.c_int),
        ("nthreads", ctypes.c_int),
    ]


class RmsNormHeadsArgs(cpu_build.Args):
    """The mirror of norm_act.c's in-place per-head norm arguments."""

    c_name = "sidecar_rms_norm_heads_args"
    _fields_ = [
        ("x", ctypes.c_void_p),
        ("w", ctypes.c_void_p),
        ("tokens", ctypes.c_int),
        ("heads", ctypes.c_int),
        ("dim", ctypes.c_int),
        ("ld", ctypes.c_int),
        ("eps", ctypes.c_float),
        ("dtype", ctypes.c_int),
        ("nthreads", ctypes.c_int),
    ]


_KERNEL = cpu_build.Kernel(
    "norm_act",
    {
        "sidecar_silu_mul": ([P, P, I, I, I, I], None),
        "sidecar_gelu_tanh_mul": ([P, P, I, I, I, I], None),
        "sidecar_add_rms_norm": ([AddRmsNormArgs], None),
        "sidecar_add_bias": ([P, P, I, I, I], None),
        "sidecar_rms_norm_heads": ([RmsNormHeadsArgs], None),
        "sidecar_sigmoid_mul": ([P, P, P, ctypes.c_int64, I, I], None),
    },
)


available = _KERNEL.available


def _takes(*tensors: torch.Tensor) -> bool:
    t0 = tensors[0]
    return (
        t0.device.type == "cpu"
        and t0.dtype in _DTYPES
        and t0.dim() == 2
        and all(t.dtype == t0.dtype and t.device == t0.device and t.is_contiguous() for t in tensors)
    )


def silu_mul_reference(gu: torch.Tensor) -> torch.Tensor:
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    lib = _KERNEL.lib()
    if lib is None or not _takes(gu) or gu.shape[-1] % 2:
        return silu_mul_reference(gu)
    rows, inter = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gu.dtype)
    lib.sidecar_silu_mul(
        gu.data_ptr(), out.data_ptr(), rows, inter, _DTYPES[gu.dtype], torch.get_num_threads()
    )
    return out


def gelu_tanh_mul_reference(gu: torch.Tensor) -> torch.Tensor:
    gate, up = gu.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_mul(gu: torch.Tensor) -> torch.Tensor:
    lib = _KERNEL.lib()
    if lib is None or not _takes(gu) or gu.shape[-1] % 2:
        return gelu_tanh_mul_reference(gu)
    rows, inter = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gu.dtype)
    lib.sidecar_gelu_tanh_mul(
        gu.data_ptr(), out.data_ptr(), rows, inter, _DTYPES[gu.dtype], torch.get_num_threads()
    )
    return out


def add_rms_norm_reference(
    h: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    s = h if delta is None else h + delta
    # Normalise in float32, scale in the model dtype (as Hugging Face does), with torch's fused norm.
    return weight * F.rms_norm(s.float(), (s.shape[-1],), eps=eps).to(s.dtype), s


def add_rms_norm(
    h: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    lib = _KERNEL.lib()
    tensors = (h, weight) if delta is None else (h, weight, delta)
    if (
        lib is None
        or not _takes(*tensors)
        or weight.shape != (h.shape[1],)
        or (delta is not None and delta.shape != h.shape)
    ):
        return add_rms_norm_reference(h, delta, weight, eps)
    rows, dim = h.shape
    out = torch.empty_like(h)
    s = h if delta is None else torch.empty_like(h)
    lib.sidecar_add_rms_norm(
        AddRmsNormArgs(
            h=h.data_ptr(),
            delta=None if delta is None else delta.data_ptr(),
            w=weight.data_ptr(),
            hout=s.data_ptr(),
            out=out.data_ptr(),
            rows=rows,
            dim=dim,
            eps=float(eps),
            dtype=_DTYPES[h.dtype],
            nthreads=torch.get_num_threads(),
        )
    )
    return out, s


def add_bias(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``y + bias`` for a product's rows ``y`` [M, N] (float32 or bf16, the bias of its dtype): in place, in one
    pass, where the kernel takes them (the sum rounded to the dtype once, as torch's add does); else torch's
    add, a new tensor."""
    lib = _KERNEL.lib()
    if lib is None or not _takes(y, bias) or bias.shape != (y.shape[1],):
        return y + bias
    lib.sidecar_add_bias(y.data_ptr(), bias.data_ptr(), y.shape[0], y.shape[1], _DTYPES[y.dtype])
    return y


def sigmoid_mul(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(g)`` (same shape and dtype, float32 or bf16) in one pass, a new tensor; torch's two ops where
    the kernel does not take them."""
    lib = _KERNEL.lib()
    if lib is None or not _takes(x, g) or g.shape != x.shape:
        return x * torch.sigmoid(g)
    out = torch.empty_like(x)
    lib.sidecar_sigmoid_mul(
        x.data_ptr(), g.data_ptr(), out.data_ptr(), x.numel(), _DTYPES[x.dtype], torch.get_num_threads()
    )
    return out


def rms_norm_heads_(
    x: torch.Tensor, offset: int, heads: int, dim: int, weight: torch.Tensor, eps: float
) -> bool:
    """Norm in place the ``heads`` rows of ``dim`` at columns ``offset .. offset + heads * dim`` of every row of
    ``x`` [T, W] (contiguous), each as ``add_rms_norm`` without a delta norms a row. False, with ``x`` untouched,
    where the kernel does not take them (the caller then norms them with the reference)."""
    lib = _KERNEL.lib()
    if (
        lib is None
        or not _takes(x, weight)
        or weight.shape != (dim,)
        or offset < 0
        or offset + heads * dim > x.shape[1]
    ):
        return False
    lib.sidecar_rms_norm_heads(
        RmsNormHeadsArgs(
            x=x.data_ptr() + offset * x.element_size(),
            w=weight.data_ptr(),
            tokens=x.shape[0],
            heads=heads,
            dim=dim,
            ld=x.shape[1],
            eps=float(eps),
            dtype=_DTYPES[x.dtype],
            nthreads=torch.get_num_threads(),
        )
    )
    return True

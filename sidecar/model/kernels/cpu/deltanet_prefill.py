"""The parts of a gated DeltaNet prompt chunk around its recurrence on CPU (``deltanet_prefill.c``), each one
pass over the chunk where torch runs several, each allocating a float32 copy of the chunk:

``conv(...)``: the causal depthwise convolution of the chunk's q, k, v channels read in place from the
in_proj rows, silu, and (``norm_heads``) q and k L2-normed per head, into float32 rows the rule
(``deltanet_step.rule``) reads as they are; the sequence's window read and left holding the chunk's last
inputs. ``gate(...)``: the gated RMSNorm of the rule's float32 output with the output gate ``z`` read in
place from the in_proj rows, into the dtype.

Each returns None (nothing touched) where the kernel does not take the arguments: not built, another dtype
or device, a layout it does not know. The torch reference and the start-up self-check that decides whether
these run at all are in ``model/deltanet_prefill.py``.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from sidecar.model.kernels.cpu import cpu_build

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class ConvArgs(cpu_build.Args):
    """The mirror of deltanet_prefill.c's convolution argument struct."""

    c_name = "sidecar_deltanet_conv_args"
    _fields_ = [
        ("x", ctypes.c_void_p),
        ("window", ctypes.c_void_p),
        ("conv_w", ctypes.c_void_p),
        ("y", ctypes.c_void_p),
        ("L", ctypes.c_int),
        ("ld", ctypes.c_int),
        ("conv_dim", ctypes.c_int),
        ("kernel", ctypes.c_int),
        ("start", ctypes.c_int),
        ("act", ctypes.c_int),
        ("nk", ctypes.c_int),
        ("dk", ctypes.c_int),
        ("dtype", ctypes.c_int),
        ("nthreads", ctypes.c_int),
    ]


class GateArgs(cpu_build.Args):
    """The mirror of deltanet_prefill.c's gated-norm argument struct."""

    c_name = "sidecar_deltanet_gate_args"
    _fields_ = [
        ("o", ctypes.c_void_p),
        ("z", ctypes.c_void_p),
        ("norm_w", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("L", ctypes.c_int),
        ("ldz", ctypes.c_int),
        ("ldo", ctypes.c_int),
        ("nv", ctypes.c_int),
        ("dv", ctypes.c_int),
        ("eps", ctypes.c_float),
        ("dtype", ctypes.c_int),
        ("nthreads", ctypes.c_int),
    ]


_KERNEL = cpu_build.Kernel(
    "deltanet_prefill",
    {
        "sidecar_deltanet_conv": ([ConvArgs], ctypes.c_int),
        "sidecar_deltanet_gate": ([GateArgs], ctypes.c_int),
    },
)

available = _KERNEL.available


def _rows_of(t: torch.Tensor, dtype: torch.dtype, width: int) -> bool:
    """``t`` is a [L, >= width] matrix of ``dtype`` on CPU whose rows are packed (rows of a wider tensor)."""
    return (
        t.dtype == dtype
        and t.device.type == "cpu"
        and t.dim() == 2
        and t.shape[1] >= width
        and (t.stride(1) == 1 or t.shape[1] == 1)
        and t.stride(0) >= t.shape[1]
    )


def conv(
    x: torch.Tensor,
    window: torch.Tensor,
    weight: torch.Tensor,
    start: bool,
    norm_heads: Optional[tuple[int, int]] = None,
    act: bool = True,
) -> Optional[torch.Tensor]:
    """The float32 rows [L, conv_dim] of silu(the causal convolution of ``x``'s columns 0 .. conv_dim) (x:
    [L, >= conv_dim] in the dtype, rows of the in_proj output) after ``window`` [conv_dim, kernel - 1]
    (contiguous, the dtype; ``start``: zeros before the chunk instead), each value rounded where torch's
    bf16 ops round; ``window`` left holding the chunk's last kernel - 1 inputs. ``weight`` [conv_dim,
    kernel]. ``norm_heads`` (k_heads, k_dim): q and k heads (the first 2 k_heads k_dim channels) L2-normed,
    q divided by sqrt(k_dim). ``act`` False: the convolution's float32 sums alone (nothing rounded, no silu,
    no norms). None, with nothing touched, where the kernel does not take them."""
    lib = _KERNEL.lib()
    dtype = x.dtype
    if lib is None or dtype not in _DTYPES or weight.dim() != 2:
        return None
    (conv_dim, kernel), length = weight.shape, x.shape[0]
    nk, dk = norm_heads or (0, 0)
    if (
        not _rows_of(x, dtype, conv_dim)
        or weight.dtype != dtype
        or window.dtype != dtype
        or not (weight.is_contiguous() and window.is_contiguous())
        or weight.device.type != "cpu"
        or window.device.type != "cpu"
        or window.shape != (conv_dim, kernel - 1)
        or (norm_heads is not None and (nk < 1 or dk < 1 or 2 * nk * dk > conv_dim))
    ):
        return None
    y = torch.empty(length, conv_dim)
    rc = lib.sidecar_deltanet_conv(
        ConvArgs(
            x=x.data_ptr(),
            window=window.data_ptr(),
            conv_w=weight.data_ptr(),
            y=y.data_ptr(),
            L=length,
            ld=x.stride(0) if length > 1 else max(x.shape[1], 1),
            conv_dim=conv_dim,
            kernel=kernel,
            start=int(start),
            act=int(act),
            nk=nk if act else 0,
            dk=dk,
            dtype=_DTYPES[dtype],
            nthreads=torch.get_num_threads(),
        )
    )
    return y if rc == 0 else None


def gate(o: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> Optional[torch.Tensor]:
    """``norm_weight * rms_norm(o) * silu(z)`` per value head [L, v_heads * v_dim] in z's dtype: ``o`` [L,
    v_heads, v_dim] float32 contiguous (rounded to the dtype first, as the torch form receives it), ``z`` [L,
    >= v_heads * v_dim] rows of the in_proj output, ``norm_weight`` [v_dim]. None where the kernel does not
    take them."""
    lib = _KERNEL.lib()
    dtype = z.dtype
    if lib is None or dtype not in _DTYPES or o.dim() != 3:
        return None
    length, nv, dv = o.shape
    if (
        o.dtype != torch.float32
        or o.device.type != "cpu"
        or not o.is_contiguous()
        or not _rows_of(z, dtype, nv * dv)
        or z.shape[0] != length
        or norm_weight.shape != (dv,)
        or norm_weight.dtype != dtype
        or not norm_weight.is_contiguous()
        or norm_weight.device.type != "cpu"
    ):
        return None
    out = torch.empty(length, nv * dv, dtype=dtype)
    rc = lib.sidecar_deltanet_gate(
        GateArgs(
            o=o.data_ptr(),
            z=z.data_ptr(),
            norm_w=norm_weight.data_ptr(),
            out=out.data_ptr(),
            L=length,
            ldz=z.stride(0) if length > 1 else max(z.shape[1], 1),
            ldo=nv * dv,
            nv=nv,
            dv=dv,
            eps=float(eps),
            dtype=_DTYPES[dtype],
            nthreads=torch.get_num_threads(),
        )
    )
    return out if rc == 0 else None

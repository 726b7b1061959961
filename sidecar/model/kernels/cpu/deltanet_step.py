"""One decode step of a gated DeltaNet layer on CPU (``deltanet_step.c``): the convolution over each
sequence's window, the gates, the recurrent rule over its float32 state (in place) and the gated RMSNorm of
the readout, for a batch of sequences each one token, in one call (torch runs some twenty ops, and copies
every state out of its slot and back).

``rule(...)`` runs the recurrence alone over one sequence's prompt chunk (its inputs already convolved and
normed by torch), token by token with the state kept in cache, where the torch reference runs HF's chunked
form (some forty ops a 64-token block, and triangular solves).

``decode(...)`` returns the gated output rows, or None where the kernel does not take the arguments (not
built, another dtype or device, a layout it does not know, a slot outside the state); the caller then runs
the torch reference (``model/deltanet.py``), which also decides, through a start-up self-check there, whether
this kernel is used at all.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from sidecar.model.kernels.cpu import cpu_build

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_DIM = 1024  # the kernel's bound on a head's k_dim and v_dim


class DeltaNetArgs(cpu_build.Args):
    """The mirror of deltanet_step.c's argument struct."""

    c_name = "sidecar_deltanet_args"
    _fields_ = [
        ("proj", ctypes.c_void_p),
        ("b", ctypes.c_void_p),
        ("a", ctypes.c_void_p),
        ("conv_state", ctypes.c_void_p),
        ("conv_w", ctypes.c_void_p),
        ("A", ctypes.c_void_p),
        ("dt_bias", ctypes.c_void_p),
        ("norm_w", ctypes.c_void_p),
        ("state", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("n", ctypes.c_int),
        ("ld", ctypes.c_int),
        ("nk", ctypes.c_int),
        ("nv", ctypes.c_int),
        ("dk", ctypes.c_int),
        ("dv", ctypes.c_int),
        ("kernel", ctypes.c_int),
        ("nslots", ctypes.c_int),
        ("eps", ctypes.c_float),
        ("dtype", ctypes.c_int),
        ("nthreads", ctypes.c_int),
    ]


class RuleArgs(cpu_build.Args):
    """The mirror of deltanet_step.c's prompt-chunk rule argument struct."""

    c_name = "sidecar_deltanet_rule_args"
    _fields_ = [
        ("q", ctypes.c_void_p),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("g", ctypes.c_void_p),
        ("beta", ctypes.c_void_p),
        ("state", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("L", ctypes.c_int),
        ("nk", ctypes.c_int),
        ("nv", ctypes.c_int),
        ("dk", ctypes.c_int),
        ("dv", ctypes.c_int),
        ("ldq", ctypes.c_int),
        ("ldk", ctypes.c_int),
        ("ldv", ctypes.c_int),
        ("nthreads", ctypes.c_int),
    ]


def _rows(t: torch.Tensor) -> bool:
    """``t`` [L, heads, d] is float32 on CPU with each token's heads packed (tokens may be rows of a wider
    tensor, as the q, k, v views of one convolved row are)."""
    return (
        t.dtype == torch.float32
        and t.device.type == "cpu"
        and t.stride(2) == 1
        and t.stride(1) == t.shape[2]
        and t.stride(0) >= t.shape[1] * t.shape[2]
    )


_KERNEL = cpu_build.Kernel(
    "deltanet_step",
    {
        "sidecar_deltanet_decode": ([DeltaNetArgs], ctypes.c_int),
        "sidecar_deltanet_rule": ([RuleArgs], ctypes.c_int),
    },
)

available = _KERNEL.available


def decode(
    proj: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    A: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    rec_state: torch.Tensor,
    slots: torch.Tensor,
    heads: tuple[int, int, int, int],
) -> Optional[torch.Tensor]:
    """The gated output [n, v_heads * v_dim] of one decode step of n sequences (layouts: deltanet_step.c):
    ``proj`` [n, conv_dim + v_heads * v_dim] the in_proj rows (q, k, v channels then z), ``b``, ``a``
    [n, v_heads] the in_proj_b and in_proj_a rows, ``conv_state`` [slots, conv_dim, kernel - 1] and
    ``rec_state`` [slots, v_heads, k_dim, v_dim] (both advanced in place at the rows ``slots``, int64,
    distinct), ``heads`` (k_heads, v_heads, k_dim, v_dim). None, with nothing touched, where the kernel does
    not take them."""
    lib = _KERNEL.lib()
    nk, nv, dk, dv = heads
    dtype = proj.dtype
    if lib is None or dtype not in _DTYPES or proj.device.type != "cpu" or proj.dim() != 2:
        return None
    n, conv_dim = proj.shape[0], 2 * nk * dk + nv * dv
    kernel = conv_weight.shape[-1]
    same = (proj, b, a, conv_state, conv_weight, dt_bias, norm_weight)
    if (
        any(t.dtype != dtype or t.device != proj.device or not t.is_contiguous() for t in same)
        or not (
            rec_state.dtype == A.dtype == torch.float32 and rec_state.is_contiguous() and A.is_contiguous()
        )
        or slots.dtype != torch.int64
        or not slots.is_contiguous()
        or proj.shape[1] != conv_dim + nv * dv
        or b.shape != (n, nv)
        or a.shape != (n, nv)
        or conv_weight.shape != (conv_dim, kernel)
        or conv_state.shape[1:] != (conv_dim, kernel - 1)
        or rec_state.shape[1:] != (nv, dk, dv)
        or rec_state.shape[0] != conv_state.shape[0]
        or A.shape != (nv,)
        or dt_bias.shape != (nv,)
        or norm_weight.shape != (dv,)
        or slots.shape != (n,)
        or max(dk, dv) > MAX_DIM
        or nv % nk
    ):
        return None
    out = torch.empty(n, nv * dv, dtype=dtype)
    rc = lib.sidecar_deltanet_decode(
        DeltaNetArgs(
            proj=proj.data_ptr(),
            b=b.data_ptr(),
            a=a.data_ptr(),
            conv_state=conv_state.data_ptr(),
            conv_w=conv_weight.data_ptr(),
            A=A.data_ptr(),
            dt_bias=dt_bias.data_ptr(),
            norm_w=norm_weight.data_ptr(),
            state=rec_state.data_ptr(),
            slots=slots.data_ptr(),
            out=out.data_ptr(),
            n=n,
            ld=proj.shape[1],
            nk=nk,
            nv=nv,
            dk=dk,
            dv=dv,
            kernel=kernel,
            nslots=rec_state.shape[0],
            eps=float(eps),
            dtype=_DTYPES[dtype],
            nthreads=torch.get_num_threads(),
        )
    )
    return out if rc == 0 else None


def rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> Optional[torch.Tensor]:
    """The rule's output [L, v_heads, v_dim] float32 over one sequence's L tokens (layouts: deltanet_step.c's
    ``sidecar_deltanet_rule``): ``q``, ``k`` [L, k_heads, k_dim] L2-normed (q scaled), ``v`` [L, v_heads,
    v_dim], float32 on CPU, each token's heads packed (the tokens may be rows of a wider tensor); ``g`` (log
    decay), ``beta`` [L, v_heads] float32 contiguous on CPU; ``state`` [v_heads,
    k_dim, v_dim] float32, advanced in place. None, with nothing touched, where the kernel does not take
    them."""
    lib = _KERNEL.lib()
    if lib is None or q.dim() != 3 or v.dim() != 3:
        return None
    (length, nk, dk), nv, dv = q.shape, v.shape[1], v.shape[2]
    every = (q, k, v, g, beta, state)
    if (
        any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in every[3:])
        or not all(_rows(t) for t in every[:3])
        or k.shape != q.shape
        or v.shape[0] != length
        or g.shape != (length, nv)
        or beta.shape != (length, nv)
        or state.shape != (nv, dk, dv)
        or max(dk, dv) > MAX_DIM
        or nv % nk
    ):
        return None
    out = torch.empty(length, nv, dv)
    ptrs = {name: t.data_ptr() for name, t in zip(("q", "k", "v", "g", "beta", "state"), every)}
    rc = lib.sidecar_deltanet_rule(
        RuleArgs(
            **ptrs,
            out=out.data_ptr(),
            L=length,
            nk=nk,
            nv=nv,
            dk=dk,
            dv=dv,
            ldq=q.stride(0),
            ldk=k.stride(0),
            ldv=v.stride(0),
            nthreads=torch.get_num_threads(),
        )
    )
    return out if rc == 0 else None

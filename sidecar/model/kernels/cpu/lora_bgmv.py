"""LoRA's batched low-rank update on CPU (``lora_bgmv.c``, gather-style like Punica's BGMV) and a reference.

``lora_apply(x, at, bt, rows, slots, offs, out, n, rank)``: for each listed row ``t = rows[i]`` with its
adapter slot ``slots[i]``, adds each part ``j``'s ``B (A x[t])`` to ``out[t, offs[j]:offs[j+1]]`` in place,
in float32. ``at`` is [S, K, at_width(n, rank)] (A transposed, parts side by side, zero-padded), ``bt``
[S*n*rank, N] (B transposed, part j's rows nonzero only over its columns). Rows not listed (the base
model's) are left untouched, and each row costs its own adapter's products only: no masks, no columns of
other slots or parts.
"""

from __future__ import annotations

import ctypes

import torch

from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu.cpu_build import I


class LoraArgs(cpu_build.Args):
    """The mirror of lora_bgmv.c's argument struct."""

    c_name = "sidecar_lora_args"
    _fields_ = [
        ("x", ctypes.c_void_p),
        ("at", ctypes.c_void_p),
        ("bt", ctypes.c_void_p),
        ("rows", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("offs", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("nrows", ctypes.c_int),
        ("n", ctypes.c_int),
        ("R", ctypes.c_int),
        ("K", ctypes.c_int),
        ("N", ctypes.c_int),
        ("ldr", ctypes.c_int),
        ("nthreads", ctypes.c_int),
    ]


_KERNEL = cpu_build.Kernel("lora_bgmv", {"sidecar_lora_apply": ([LoraArgs], I)})

available = _KERNEL.available


def at_width(n: int, rank: int) -> int:
    """The padded width of ``at``'s rows: n*rank rounded up to whole 16-float vectors."""
    return -(-n * rank // 16) * 16


def lora_apply(
    x: torch.Tensor,
    at: torch.Tensor,
    bt: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    offs: torch.Tensor,
    out: torch.Tensor,
    n: int,
    rank: int,
) -> None:
    """Requires ``available()``; float32 contiguous CPU tensors, ``rows``/``slots`` int64, ``offs`` int32."""
    lib = _KERNEL.lib()
    t, k = x.shape
    if not (
        x.dtype == out.dtype == at.dtype == bt.dtype == torch.float32
        and x.is_contiguous()
        and out.is_contiguous()
        and out.shape[0] == t
        and at.shape[1:] == (k, at_width(n, rank))
        and bt.shape[1] == out.shape[1]
        and rows.dtype == slots.dtype == torch.int64
        and offs.dtype == torch.int32
        and offs.numel() == n + 1
    ):
        raise ValueError(
            f"lora_apply: x {tuple(x.shape)} {x.dtype}, at {tuple(at.shape)}, bt {tuple(bt.shape)}, "
            f"out {tuple(out.shape)} {out.dtype} do not fit"
        )
    rc = lib.sidecar_lora_apply(
        LoraArgs(
            x=x.data_ptr(),
            at=at.data_ptr(),
            bt=bt.data_ptr(),
            rows=rows.data_ptr(),
            slots=slots.data_ptr(),
            offs=offs.data_ptr(),
            out=out.data_ptr(),
            nrows=rows.numel(),
            n=n,
            R=rank,
            K=k,
            N=out.shape[1],
            ldr=at.shape[2],
            nthreads=torch.get_num_threads(),
        )
    )
    if rc != 0:
        raise ValueError(f"lora_apply: rank rows {n} x {rank} are more than the kernel takes")


def reference(
    x: torch.Tensor,
    at: torch.Tensor,
    bt: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    offs: torch.Tensor,
    out: torch.Tensor,
    n: int,
    rank: int,
) -> None:
    """The same update in float64 torch ops, rounded once into ``out``."""
    for t, s in zip(rows.tolist(), slots.tolist()):
        y = x[t].double() @ at[s].double()  # [at_width], the padding zero
        delta = torch.zeros(out.shape[1], dtype=torch.float64)
        for j in range(n):
            lo, hi = int(offs[j]), int(offs[j + 1])
            b = bt[(s * n + j) * rank : (s * n + j + 1) * rank, lo:hi].double()
            delta[lo:hi] = y[j * rank : (j + 1) * rank] @ b
        out[t] = (out[t].double() + delta).to(out.dtype)

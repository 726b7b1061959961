"""LoRA's batched low-rank update on CPU (``lora_bgmv.c``, gather-style like Punica's BGMV) and a reference.

``lora_apply(x, at, bt, rows, slots, offs, out, n, rank)``: for each listed row ``t = rows[i]`` with its
adapter slot ``slots[i]``, adds each part ``j``'s ``B (A x[t])`` to ``out[t, offs[j]:offs[j+1]]`` in place,
in float32. ``at`` is [S, K, at_width(n, rank)] (A transposed, parts side by side, zero-padded), ``bt``
[S*n*rank, N] (B transposed, part j's rows nonzero only over its columns). Rows not listed (the base
model's) are left untouched, and each row costs its own adapter's products only: no masks, no columns of
other slots or parts.
"""

from __future__ import annotations

import torch

from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu.cpu_build import I, P

_KERNEL = cpu_build.Kernel("lora_bgmv", {"sidecar_lora_apply": ([P] * 7 + [I] * 7, I)})

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
        x.data_ptr(),
        at.data_ptr(),
        bt.data_ptr(),
        rows.data_ptr(),
        slots.data_ptr(),
        offs.data_ptr(),
        out.data_ptr(),
        rows.numel(),
        n,
        rank,
        k,
        out.shape[1],
        at.shape[2],
        torch.get_num_threads(),
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

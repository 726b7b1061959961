"""Rotary embedding of q and k and the KV-cache write of a step's new tokens, in one pass on CPU
(``rope_kv.c``).

``rope_store_kv(qkv, cos, sin, slots, k_cache, v_cache, nh, nkv, hd, want_k)`` takes the fused qkv
projection [T, (nh + 2 nkv) hd], the step's rotary tables [T, hd] (rotate-half's sign folded into
``sin``) and the cache slot of each token; it writes rope(k) and v into the caches and returns
``(q, k, v)``: rope(q) [T, nh, hd], rope(k) [T, nkv, hd] when ``want_k`` (prompt rows attend to it;
None otherwise) and v as a view of ``qkv``. With ``kv_scales`` the caches are int8 (``sidecar.model.kv_quant``)
and the new rows are quantized on write, bit for bit as ``kv_quant.write`` stores them. It returns None when
the kernel cannot take the inputs;
the caller then runs the torch path (``layers.Attention`` + ``attention.write_kv``), which computes
the same bits: the kernel rounds where torch's ops round and uses no fused multiply-add. It replaces
a dozen small torch ops per layer (slices, two products, a roll, a sum, two index copies), which at
batch 1 cost more than the arithmetic.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from sidecar.model.kernels.cpu import cpu_build

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class RopeKvArgs(cpu_build.Args):
    """The mirror of rope_kv.c's argument struct."""

    c_name = "sidecar_rope_kv_args"
    _fields_ = [
        ("qkv", ctypes.c_void_p),
        ("cs", ctypes.c_void_p),
        ("sn", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("kc", ctypes.c_void_p),
        ("vc", ctypes.c_void_p),
        ("q_out", ctypes.c_void_p),
        ("k_out", ctypes.c_void_p),
        ("ks", ctypes.c_void_p),
        ("vs", ctypes.c_void_p),
        ("T", ctypes.c_int),
        ("nh", ctypes.c_int),
        ("nkv", ctypes.c_int),
        ("hd", ctypes.c_int),
        ("dtype", ctypes.c_int),
        ("nthreads", ctypes.c_int),
        ("rot", ctypes.c_int),
    ]


_KERNEL = cpu_build.Kernel("rope_kv", {"sidecar_rope_store_kv": ([RopeKvArgs], None)})


available = _KERNEL.available


def rope_store_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    nh: int,
    nkv: int,
    hd: int,
    want_k: bool,
    kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]]:
    dtype = qkv.dtype
    if (
        qkv.device.type != "cpu"
        or dtype not in _DTYPES
        or hd % 2
        or qkv.dim() != 2
        or qkv.shape[1] != (nh + 2 * nkv) * hd
        or not qkv.is_contiguous()
    ):
        return None
    t, rot = qkv.shape[0], cos.shape[-1]  # rotary channels: hd, or fewer (partial rotary)
    kv_dtype = dtype
    if kv_scales is not None:  # an int8 cache: codes and scales written as kv_quant.quantize makes them
        kv_dtype = torch.int8
        if hd > 256 or any(
            s.dtype != torch.float32 or not s.is_contiguous() or s.shape != k_cache.shape[:3]
            for s in kv_scales
        ):
            return None
    if (
        any(x.dtype != dtype or not x.is_contiguous() for x in (cos, sin))
        or any(x.dtype != kv_dtype or not x.is_contiguous() for x in (k_cache, v_cache))
        or rot % 2
        or not 0 < rot <= hd
        or cos.numel() != t * rot
        or sin.numel() != t * rot
        or slots.dtype != torch.long
        or slots.shape != (t,)
        or k_cache.shape[-2:] != (nkv, hd)
        or v_cache.shape[-2:] != (nkv, hd)
    ):
        return None
    lib = _KERNEL.lib()
    if lib is None:
        return None
    slots = slots.contiguous()
    q = torch.empty(t, nh, hd, dtype=dtype)
    k = torch.empty(t, nkv, hd, dtype=dtype) if want_k else None
    lib.sidecar_rope_store_kv(
        RopeKvArgs(
            qkv=qkv.data_ptr(),
            cs=cos.data_ptr(),
            sn=sin.data_ptr(),
            slots=slots.data_ptr(),
            kc=k_cache.data_ptr(),
            vc=v_cache.data_ptr(),
            q_out=q.data_ptr(),
            k_out=None if k is None else k.data_ptr(),
            ks=None if kv_scales is None else kv_scales[0].data_ptr(),
            vs=None if kv_scales is None else kv_scales[1].data_ptr(),
            T=t,
            nh=nh,
            nkv=nkv,
            hd=hd,
            dtype=_DTYPES[dtype],
            nthreads=torch.get_num_threads(),
            rot=rot,
        )
    )
    return q, k, qkv[:, (nh + nkv) * hd :].view(t, nkv, hd)

"""Causal attention for a prompt segment on CPU (``prefill_attention.c``).

``prefill_attention(q, k_cache, v_cache, block_table, ctx_len, scale, window)`` attends the segment's
rows ``q`` [L, H, D] (positions ``ctx_len - L`` .. ``ctx_len - 1`` of one sequence, whose K/V are already
in the cache) to their causal context, read in place from the paged cache [num_blocks, block_size, Hkv, D]
through ``block_table``. With ``kv_scales`` = (k_scale, v_scale) [num_blocks, block_size, Hkv] float32 the
caches hold int8 codes (``sidecar.model.kv_quant``). With ``softcap`` (Gemma 2) each scaled score ``x`` becomes
``softcap * tanh(x / softcap)`` before the softmax. With ``sinks`` [H] (gpt-oss) head h's logit ``sinks[h]``
joins each of its softmaxes' denominators, weighing no value (``attention_sinks.py`` is the torch form; sinks
take the float32 products on every CPU, not the tile products). It returns [L, H, D] in ``q``'s dtype, or None
when the kernel cannot take these inputs (not built, no AVX2/AVX-512, a head size it does not handle, a context
whose widened keys and values would pass 256 MiB); the caller then uses the torch path
(``sidecar.model.attention``), which is also the oracle the tests hold it to.

Why a kernel: torch's CPU SDPA runs prompt-sized causal attention far below the rate of the projections around it,
where the blocked float32 products here run several times faster; on CPUs with AMX, bf16 prompts over a bf16 cache
go through tile products, faster again (docs/perf/kernels-notes.md has the figures).
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu.cpu_build import I
from sidecar.model.kernels.cpu.paged_attention import cache_fits

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class PrefillAttentionArgs(cpu_build.Args):
    """The mirror of prefill_attention.c's argument struct."""

    c_name = "sidecar_prefill_attention_args"
    _fields_ = [
        ("q", ctypes.c_void_p),
        ("kc", ctypes.c_void_p),
        ("vc", ctypes.c_void_p),
        ("table", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("ks", ctypes.c_void_p),
        ("vs", ctypes.c_void_p),
        ("L", ctypes.c_int),
        ("ctx", ctypes.c_int),
        ("nh", ctypes.c_int),
        ("nkv", ctypes.c_int),
        ("hd", ctypes.c_int),
        ("bs", ctypes.c_int),
        ("window", ctypes.c_int),
        ("scale", ctypes.c_float),
        ("dtype", ctypes.c_int),
        ("nthreads", ctypes.c_int),
        ("softcap", ctypes.c_float),
        ("sinks", ctypes.c_void_p),
    ]


_KERNEL = cpu_build.Kernel(
    "prefill_attention",
    {
        "sidecar_prefill_attention": ([PrefillAttentionArgs], I),
        "sidecar_prefill_attention_supported": ([], I),
    },
    setup=lambda lib: setattr(lib, "_sidecar_ok", bool(lib.sidecar_prefill_attention_supported())),
)


def available() -> bool:
    """Built for this CPU, which has the vector instructions it needs (AVX2 + FMA or AVX-512)."""
    lib = _KERNEL.lib()
    return lib is not None and lib._sidecar_ok


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    ctx_len: int,
    scale: float,
    window: Optional[int] = None,
    kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    if sinks is not None:
        if sinks.shape != (q.shape[1],):
            raise ValueError(
                f"prefill_attention: sinks {tuple(sinks.shape)} must be one per head ({q.shape[1]})"
            )
        sinks = sinks.to(torch.float32).contiguous()  # held until the call returns
    if not cache_fits(q, k_cache, v_cache, kv_scales):
        return None
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or not available():
        return None
    lib = _KERNEL.lib()
    length, nh, hd = q.shape
    _, bs, nkv, _ = k_cache.shape
    table = block_table.contiguous()
    if table.dtype != torch.long:
        raise ValueError(f"prefill_attention: the block table is {table.dtype}, must be int64")
    if not length <= ctx_len <= table.shape[0] * bs:
        raise ValueError(
            f"prefill_attention: {length} rows with a context of {ctx_len} tokens do not fit "
            f"{table.shape[0]} blocks of {bs}"
        )
    q = q.contiguous()
    out = torch.empty_like(q)
    rc = lib.sidecar_prefill_attention(
        PrefillAttentionArgs(
            q=q.data_ptr(),
            kc=k_cache.data_ptr(),
            vc=v_cache.data_ptr(),
            table=table.data_ptr(),
            out=out.data_ptr(),
            ks=None if kv_scales is None else kv_scales[0].data_ptr(),
            vs=None if kv_scales is None else kv_scales[1].data_ptr(),
            L=length,
            ctx=ctx_len,
            nh=nh,
            nkv=nkv,
            hd=hd,
            bs=bs,
            window=window or 0,
            scale=scale,
            dtype=_DTYPES[q.dtype],
            nthreads=torch.get_num_threads(),
            softcap=softcap or 0.0,
            sinks=None if sinks is None else sinks.data_ptr(),
        )
    )
    if rc == 2:
        raise MemoryError("prefill_attention: out of memory for the kernel's scratch buffers")
    return out if rc == 0 else None

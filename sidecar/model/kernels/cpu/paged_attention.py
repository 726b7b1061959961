"""Paged decode attention on CPU (``paged_attention.c``).

``decode_attention(q, k_cache, v_cache, block_tables, ctx_lens, scale, window)`` attends each query row
of ``q`` [B, H, D] to positions ``[max(0, ctx - window), ctx)`` of its own sequence, read in place from
the paged cache [num_blocks, block_size, Hkv, D] through its row of ``block_tables`` [B, max_blocks].
With ``kv_scales`` = (k_scale, v_scale) [num_blocks, block_size, Hkv] float32 the caches hold int8 codes
(``sidecar.model.kv_quant``), read in place and scaled in registers. With ``softcap`` (Gemma 2) each scaled
score ``x`` becomes ``softcap * tanh(x / softcap)`` before the softmax, as in Hugging Face's eager attention.
With ``scores`` ([num_blocks * block_size] float32) each key's softmax weights, summed over heads, are added
to its slot there. With ``sinks`` [H] (gpt-oss) head h's logit ``sinks[h]`` joins each of its softmaxes'
denominators, weighing no value (``attention_sinks.py`` is the torch form).
It returns [B, H, D] in ``q``'s dtype (float32 or bfloat16), or None when the kernel cannot take these
inputs (not built, another dtype or device, a head size it does not handle); the caller then uses the
torch path (``sidecar.model.attention``), which is also the oracle the tests hold it to.

Why a kernel: torch's path gathers every row's blocks into a contiguous copy and calls SDPA with a
mask; with k speculative tokens that is k copies of the same context. Here nothing is copied, and the rows of
one sequence (consecutive rows whose contexts grow by one over the same blocks: verification rows) share one
pass over their context, each row's result still bit for bit what a call of that row alone gives;
``row_groups`` says which rows a call groups.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu.cpu_build import F, I, P

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class PagedAttentionArgs(cpu_build.Args):
    """The mirror of paged_attention.c's argument struct."""

    c_name = "sidecar_paged_attention_args"
    _fields_ = [
        ("q", ctypes.c_void_p),
        ("kc", ctypes.c_void_p),
        ("vc", ctypes.c_void_p),
        ("tables", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("ks", ctypes.c_void_p),
        ("vs", ctypes.c_void_p),
        ("B", ctypes.c_int),
        ("nh", ctypes.c_int),
        ("nkv", ctypes.c_int),
        ("hd", ctypes.c_int),
        ("bs", ctypes.c_int),
        ("max_blocks", ctypes.c_int),
        ("window", ctypes.c_int),
        ("scale", ctypes.c_float),
        ("dtype", ctypes.c_int),
        ("nthreads", ctypes.c_int),
        ("softcap", ctypes.c_float),
        ("scores", ctypes.c_void_p),
        ("sinks", ctypes.c_void_p),
    ]


_KERNEL = cpu_build.Kernel(
    "paged_attention",
    {
        "sidecar_paged_decode_attention": ([PagedAttentionArgs], I),
        "sidecar_paged_attention_groups": ([PagedAttentionArgs, P], I),
        "sidecar_paged_attention_vector_width": ([], I),
        "sidecar_softcap_rows": ([P, I, F, F], None),
    },
    setup=lambda lib: setattr(lib, "_sidecar_width", lib.sidecar_paged_attention_vector_width()),
)


available = _KERNEL.available


MAX_HEAD_DIM = 256  # paged_attention.c's MAX_HD: a larger head is declined


def vector_width() -> Optional[int]:
    """The multiple of which a head size must be for the decode kernel to take it (None: no kernel here)."""
    lib = _KERNEL.lib()
    return None if lib is None else lib._sidecar_width


def cache_fits(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]],
) -> bool:
    """Whether our CPU attention kernels read these: CPU queries of a float dtype they take over a cache of the same
    dtype, or an int8 cache with float32 scales [blocks, block_size, kv_heads] (see kv_quant)."""
    kv_dtype = q.dtype if kv_scales is None else torch.int8
    if (
        q.device.type != "cpu"
        or q.dtype not in _DTYPES
        or k_cache.dtype != kv_dtype
        or v_cache.dtype != kv_dtype
    ):
        return False
    return kv_scales is None or all(
        s.dtype == torch.float32 and s.is_contiguous() and s.shape == k_cache.shape[:3] for s in kv_scales
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    window: Optional[int] = None,
    kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    softcap: Optional[float] = None,
    scores: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    if not cache_fits(q, k_cache, v_cache, kv_scales):
        return None
    if sinks is not None:
        if sinks.shape != (q.shape[1],):
            raise ValueError(
                f"decode_attention: sinks {tuple(sinks.shape)} must be one per head ({q.shape[1]})"
            )
        sinks = sinks.to(torch.float32).contiguous()  # held until the call returns
    if scores is not None and not (
        scores.dtype == torch.float32
        and scores.is_contiguous()
        and scores.numel() == k_cache.shape[0] * k_cache.shape[1]
    ):
        return None
    lib = _KERNEL.lib()
    if lib is None:
        return None
    b, nh, hd = q.shape
    _, bs, nkv, _ = k_cache.shape
    if hd % lib._sidecar_width or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    q = q.contiguous()
    tables = block_tables.contiguous()
    ctx = ctx_lens.contiguous()
    if tables.dtype != torch.long or ctx.dtype != torch.long:
        raise ValueError(
            f"decode_attention: block tables {tables.dtype} and context lengths {ctx.dtype} must be int64"
        )
    out = torch.empty_like(q)
    rc = lib.sidecar_paged_decode_attention(
        PagedAttentionArgs(
            q=q.data_ptr(),
            kc=k_cache.data_ptr(),
            vc=v_cache.data_ptr(),
            tables=tables.data_ptr(),
            ctx=ctx.data_ptr(),
            out=out.data_ptr(),
            ks=None if kv_scales is None else kv_scales[0].data_ptr(),
            vs=None if kv_scales is None else kv_scales[1].data_ptr(),
            B=b,
            nh=nh,
            nkv=nkv,
            hd=hd,
            bs=bs,
            max_blocks=tables.shape[1],
            window=window or 0,
            scale=scale,
            dtype=_DTYPES[q.dtype],
            nthreads=torch.get_num_threads(),
            softcap=softcap or 0.0,
            scores=None if scores is None else scores.data_ptr(),
            sinks=None if sinks is None else sinks.data_ptr(),
        )
    )
    if rc == 2:
        raise MemoryError("decode_attention: out of memory for the kernel's scratch buffers")
    return out if rc == 0 else None


def softcap_(x: torch.Tensor, cap: float, scale: float = 1.0) -> Optional[torch.Tensor]:
    """``x`` (contiguous float32 on CPU) replaced in place by ``cap * tanh(x * scale / cap)`` through the
    kernels' vectorised tanh (what they apply to their scores); None when the kernel is not built."""
    lib = _KERNEL.lib()
    if lib is None:
        return None
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError("softcap_: x must be a contiguous float32 CPU tensor")
    lib.sidecar_softcap_rows(x.data_ptr(), x.numel(), scale / cap, cap)
    return x


def row_groups(
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    window: Optional[int] = None,
    threads: Optional[int] = None,
) -> Optional[list[tuple[int, int]]]:
    """The [start, end) row ranges whose rows ``decode_attention`` attends in one pass over their context (a
    row alone is a range of one), for these tables and context lengths with ``threads`` threads (None: torch's);
    None when the kernel is not built or would decline the shapes."""
    lib = _KERNEL.lib()
    if lib is None:
        return None
    tables = block_tables.contiguous()
    ctx = ctx_lens.contiguous()
    if tables.dtype != torch.long or ctx.dtype != torch.long:
        raise ValueError(
            f"row_groups: block tables {tables.dtype} and context lengths {ctx.dtype} must be int64"
        )
    starts = torch.empty(ctx.shape[0] + 1, dtype=torch.int32)
    n = lib.sidecar_paged_attention_groups(
        PagedAttentionArgs(
            tables=tables.data_ptr(),
            ctx=ctx.data_ptr(),
            B=ctx.shape[0],
            nh=num_heads,
            nkv=num_kv_heads,
            hd=lib._sidecar_width,
            bs=block_size,
            max_blocks=tables.shape[1],
            window=window or 0,
            dtype=0,
            nthreads=threads or torch.get_num_threads(),
        ),
        starts.data_ptr(),
    )
    if n < 0:
        return None
    bounds = starts[: n + 1].tolist()
    return list(zip(bounds[:-1], bounds[1:]))

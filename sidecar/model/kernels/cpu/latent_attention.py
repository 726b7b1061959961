"""Paged decode attention on the latents of multi-head latent attention, on CPU (``latent_attention.c``).

``decode_attention(q_lat, q_rope, latent_cache, rope_cache, block_tables, ctx_lens, scale)`` attends each
decode row's heads (``q_lat`` [B, H, R]: the no-rope queries folded through W_UK; ``q_rope`` [B, H, P]) to
positions ``[0, ctx)`` of its own sequence, read in place from the paged caches (``latent_cache``
[num_blocks, block_size, 1, R], ``rope_cache`` [num_blocks, block_size, 1, P], mla.py's layout) through its
row of ``block_tables`` [B, max_blocks]. It returns the probability-weighted latents [B, H, R] in ``q_lat``'s
dtype (the caller maps them through W_UV). With ``scores`` ([num_blocks * block_size] float32) each key's
softmax weights, summed over heads, are added to its slot there.

It returns None when the kernel cannot take these inputs (not built, another dtype or device, a latent width
not a multiple of the vector width): the caller keeps the torch path (``mla.LatentAttention._decode``), which
is also the oracle the tests hold it to; ``refusal`` says why.

Why a kernel: the torch path gathers every row's blocks of latents into a contiguous copy, then runs two
batched matmuls and a mask; here the latents are read in place, each tile once for a group of heads.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu.cpu_build import I

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class LatentAttentionArgs(cpu_build.Args):
    """The mirror of latent_attention.c's argument struct."""

    c_name = "sidecar_latent_attention_args"
    _fields_ = [
        ("ql", ctypes.c_void_p),
        ("qr", ctypes.c_void_p),
        ("lc", ctypes.c_void_p),
        ("rc", ctypes.c_void_p),
        ("tables", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("scores", ctypes.c_void_p),
        ("B", ctypes.c_int),
        ("nh", ctypes.c_int),
        ("R", ctypes.c_int),
        ("P", ctypes.c_int),
        ("bs", ctypes.c_int),
        ("max_blocks", ctypes.c_int),
        ("scale", ctypes.c_float),
        ("dtype", ctypes.c_int),
        ("nthreads", ctypes.c_int),
    ]


_KERNEL = cpu_build.Kernel(
    "latent_attention",
    {
        "sidecar_latent_decode_attention": ([LatentAttentionArgs], I),
        "sidecar_latent_attention_vector_width": ([], I),
    },
    setup=lambda lib: setattr(lib, "_sidecar_width", lib.sidecar_latent_attention_vector_width()),
)

available = _KERNEL.available
# float32 decode rows take the kernel up to this many heads; past it torch's batched GEMM over the gathered
# latents is the faster path (its register blocking across heads outweighs the kernel's saving of the
# gather). bf16 rows take the kernel at any head count: torch's bf16 GEMM on AVX2 CPUs is far slower.
F32_MAX_HEADS = 16


def slower_than_torch(dtype: torch.dtype, heads: int) -> Optional[str]:
    """Why the torch path is the faster choice for decode rows of ``heads`` heads in ``dtype`` (None where the
    kernel is): the default choice of ``mla.py``, separate from whether the kernel can take the inputs."""
    if dtype == torch.float32 and heads > F32_MAX_HEADS:
        return f"torch's batched GEMM is faster in float32 past {F32_MAX_HEADS} heads ({heads} here)"
    return None


def refusal(q_lat: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor) -> Optional[str]:
    """Why the kernel does not take these inputs (None: it does)."""
    lib = _KERNEL.lib()
    if lib is None:
        return f"latent attention kernel not built: {cpu_build.reason('latent_attention')}"
    if q_lat.device.type != "cpu" or q_lat.dtype not in _DTYPES:
        return (
            f"latent attention kernel takes float32 or bfloat16 CPU queries, not {q_lat.dtype} "
            f"on {q_lat.device}"
        )
    if latent_cache.dtype != q_lat.dtype or rope_cache.dtype != q_lat.dtype:
        return "latent attention kernel takes a cache of the queries' dtype"
    if not (latent_cache.is_contiguous() and rope_cache.is_contiguous()):
        return "latent attention kernel takes contiguous caches"
    if latent_cache.shape[-1] % lib._sidecar_width:
        return f"kv_lora_rank {latent_cache.shape[-1]} is not a multiple of the kernel's {lib._sidecar_width}"
    return None


def decode_attention(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    scores: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    if refusal(q_lat, latent_cache, rope_cache) is not None:
        return None
    if scores is not None and not (
        scores.dtype == torch.float32
        and scores.is_contiguous()
        and scores.numel() == latent_cache.shape[0] * latent_cache.shape[1]
    ):
        return None
    tables, ctx = block_tables.contiguous(), ctx_lens.contiguous()
    if tables.dtype != torch.long or ctx.dtype != torch.long:
        raise ValueError(
            f"decode_attention: block tables {tables.dtype} and context lengths {ctx.dtype} must be int64"
        )
    b, nh, r = q_lat.shape
    q_lat, q_rope = q_lat.contiguous(), q_rope.to(q_lat.dtype).contiguous()
    out = torch.empty_like(q_lat)
    rc = _KERNEL.lib().sidecar_latent_decode_attention(
        LatentAttentionArgs(
            ql=q_lat.data_ptr(),
            qr=q_rope.data_ptr(),
            lc=latent_cache.data_ptr(),
            rc=rope_cache.data_ptr(),
            tables=tables.data_ptr(),
            ctx=ctx.data_ptr(),
            out=out.data_ptr(),
            scores=None if scores is None else scores.data_ptr(),
            B=b,
            nh=nh,
            R=r,
            P=q_rope.shape[-1],
            bs=latent_cache.shape[1],
            max_blocks=tables.shape[1],
            scale=scale,
            dtype=_DTYPES[q_lat.dtype],
            nthreads=torch.get_num_threads(),
        )
    )
    if rc == 2:
        raise MemoryError("decode_attention: out of memory for the kernel's scratch buffers")
    return out if rc == 0 else None

"""Causal attention for a prompt segment on CPU (``prefill_attention.c``).

``prefill_attention(q, k_cache, v_cache, block_table, ctx_len, scale, window)`` attends the segment's
rows ``q`` [L, H, D] (positions ``ctx_len - L`` .. ``ctx_len - 1`` of one sequence, whose K/V are already
in the cache) to their causal context, read in place from the paged cache [num_blocks, block_size, Hkv, D]
through ``block_table``. With ``kv_scales`` = (k_scale, v_scale) [num_blocks, block_size, Hkv] float32 the
caches hold int8 codes (``sidecar.model.kv_quant``). It returns [L, H, D] in ``q``'s dtype, or None when the
kernel cannot take these inputs (not built, no AVX2/AVX-512, a head size it does not handle, a context
whose widened keys and values would pass 256 MiB); the caller then uses the torch path
(``sidecar.model.attention``), which is also the oracle the tests hold it to.

Why a kernel: torch's CPU SDPA runs prompt-sized causal attention at ~35 GFLOP/s (2 Zen 4 cores, bf16,
Qwen2-0.5B's heads, 64-256 rows), a tenth of a prefill step at 256-token prompts, where the blocked float32
products here run several times faster (see the C header and docs/PERFORMANCE.md); on CPUs with AMX, bf16 prompts
over a bf16 cache go through tile products, faster again (2.8x at 256 tokens, 3.8x at 1,024 on a 2-core Xeon).
"""

from __future__ import annotations

from typing import Optional

import torch

from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu.cpu_build import F, I, P
from sidecar.model.kernels.cpu.paged_attention import cache_fits

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_KERNEL = cpu_build.Kernel(
    "prefill_attention",
    {
        "sidecar_prefill_attention": ([P] * 5 + [I] * 7 + [F, I, I, P, P], I),
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
) -> Optional[torch.Tensor]:
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
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        table.data_ptr(),
        out.data_ptr(),
        length,
        ctx_len,
        nh,
        nkv,
        hd,
        bs,
        window or 0,
        scale,
        _DTYPES[q.dtype],
        torch.get_num_threads(),
        *((None, None) if kv_scales is None else (kv_scales[0].data_ptr(), kv_scales[1].data_ptr())),
    )
    if rc == 2:
        raise MemoryError("prefill_attention: out of memory for the kernel's scratch buffers")
    return out if rc == 0 else None

"""The attention each cached key received in a decode step, added up on the GPU (scored KV eviction).

``add_decode_scores`` runs after ``attention.paged_decode_attention`` has written each (row, head)'s log of
its softmax denominator (``lse`` [B, H] float32). One program per (row, KV head, context partition), as the
decode kernel: it recomputes the scaled (and soft-capped) scores of its key tiles for every query head of the
group, takes ``exp(score - lse)`` (the softmax weight the decode kernel gave that key), sums the group's heads
and adds the sum to ``scores[slot]`` with an atomic add (rows of different sequences may share a cached
block). Keys outside the window or past the context add nothing. This is what the torch reference
(``sidecar.model.attention_scores.decode_scored``) and the CPU decode kernel add to the same vector.

CUDA-graph safety: no host reads; the grid comes from tensor shapes only.
"""

import torch
import triton
import triton.language as tl

from sidecar.model.kernels.triton.common import key_scores


@triton.jit
def _decode_scores(
    q_ptr,
    k_ptr,
    ks_ptr,
    bt_ptr,
    ctx_ptr,
    lse_ptr,
    sc_ptr,
    scale,
    window,
    softcap,
    s_qb,
    s_qh,
    s_kb,
    s_ks,
    s_kh,
    s_sb,
    s_ss,
    s_bt,
    max_blocks,
    QUANT: tl.constexpr,
    FP8: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PART: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    F32: tl.constexpr,
    BF16: tl.constexpr,
):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    n = tl.arange(0, BLOCK_N)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + row * s_qb + heads[:, None] * s_qh + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0
    )
    # Padding heads read +inf: their weights come out 0.
    lse = tl.load(lse_ptr + row * GROUP * tl.num_programs(1) + heads, mask=g_ok, other=float("inf"))
    ctx = tl.load(ctx_ptr + row).to(tl.int32)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - window, 0)
    p_start = part * PART
    p_end = tl.minimum(p_start + PART, ctx)
    first = p_start + (tl.maximum(lo - p_start, 0) // BLOCK_N) * BLOCK_N
    for start in range(first, p_end, BLOCK_N):
        s, visible, blk, slot = key_scores(
            q, q_ptr, k_ptr, ks_ptr, bt_ptr, row, kvh, start + n, lo, p_end, d, d_ok, s_bt, s_kb, s_ks, s_kh,
            s_sb, s_ss, max_blocks, scale, softcap, QUANT, FP8, BLOCK_SIZE, SOFTCAP, F32, BF16,
        )  # fmt: skip
        w = tl.where(visible[None, :] & g_ok[:, None], tl.exp(s - lse[:, None]), 0.0)
        tl.atomic_add(sc_ptr + blk * BLOCK_SIZE + slot, tl.sum(w, 0), mask=visible)


def scores_fit(scores: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """A score vector the kernel can add to: float32, contiguous, one entry per cache slot."""
    return (
        scores.dtype == torch.float32
        and scores.is_contiguous()
        and scores.device == k_cache.device
        and scores.numel() == k_cache.shape[0] * k_cache.shape[1]
    )


def add_decode_scores(launch: dict, lse: torch.Tensor, scores: torch.Tensor) -> None:
    """Add the decode step's key weights to ``scores``; ``launch`` holds the decode kernel's operands and
    shapes (``attention.paged_decode_attention`` builds it), ``lse`` [B, H] what that kernel wrote."""
    q, k_cache, ks, tables = launch["q"], launch["k_cache"], launch["ks"], launch["tables"]
    quant = launch["quant"]
    _decode_scores[(q.shape[0], k_cache.shape[2], launch["n_parts"])](
        q,
        k_cache,
        ks,
        tables,
        launch["ctx"],
        lse,
        scores,
        launch["scale"],
        launch["window"],
        launch["softcap"],
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        ks.stride(0),
        ks.stride(1 if quant else 0),
        tables.stride(0),
        tables.shape[1],
        QUANT=quant,
        FP8=launch["fp8"],
        GROUP=launch["group"],
        G_PAD=launch["g_pad"],
        HEAD_DIM=q.shape[2],
        D_PAD=launch["d_pad"],
        BLOCK_SIZE=k_cache.shape[1],
        PART=launch["part"],
        BLOCK_N=launch["block_n"],
        HAS_WINDOW=launch["has_window"],
        SOFTCAP=launch["has_softcap"],
        F32=launch["f32"],
        BF16=q.dtype == torch.bfloat16,
    )

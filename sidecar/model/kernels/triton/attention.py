"""Paged decode attention in Triton: each query row reads its K/V in place through its block table.

``paged_decode_attention(q, k_cache, v_cache, block_tables, ctx_lens, scale, window, partition_size)``
attends every row of ``q`` [B, H, D] to keys ``[max(0, ctx - window), ctx)`` of its own sequence, held
in the paged cache [num_blocks, block_size, Hkv, D] at the blocks named by its row of ``block_tables``
[B, max_blocks] (int32 or int64); a quantized cache (int8 or fp8 e4m3 codes with a float32 scale per
token and KV head, ``kv_quant``) is read as codes and dequantized in registers. With ``softcap`` (Gemma 2)
each scaled score ``x`` becomes ``softcap * tanh(x / softcap)`` before the softmax (a constexpr branch: the
kernel compiled without it is the uncapped one, unchanged). With ``scores`` (scored KV eviction) each
(row, head)'s log-sum-exp is kept and ``attention_scores.add_decode_scores`` adds every key's softmax weight
to its slot. It returns [B, H, D] in
``q``'s dtype, or None when the inputs are not ones the kernel takes (the caller then runs the torch path
of ``sidecar.model.attention``, which is also the oracle the tests hold this kernel to).

Shape of the work:
- One program per (row, KV head, context partition). All H / Hkv query heads of a KV head are that
  program's query rows (padded to at least 16 for ``tl.dot``), so each K/V tile is loaded once per group.
- Split-KV (flash-decoding): the context is cut into partitions of ``partition_size`` tokens so a small
  batch still fills the GPU; each partition writes its running max, sum and unnormalised output, and a
  second kernel merges them. With one partition the first kernel writes the output itself.
- Softmax in float32 with a running max; empty partitions (outside the window or past the context) and
  rows with no visible key give zeros, never NaN.

CUDA-graph safety: no host reads; the grid and the partition count come from tensor shapes only
(``max_blocks * block_size`` bounds every row's context).
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from triton import next_power_of_2 as next_pow2

from sidecar.model.kernels.triton import attention_scores as triton_scores
from sidecar.model.kernels.triton.common import cache_codes, dot_in_f32, key_scores, mma, narrow

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_N = 32  # keys per tile; >= 16 so both dots have K >= 16 on a real GPU
# Split the context only when the grid would otherwise be small; the partition is a multiple of BLOCK_N.
SPLIT_PARTITION = 256
SPLIT_MAX_PROGRAMS = 256


@triton.jit
def _decode_partition(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    bt_ptr,
    ctx_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    lse_ptr,
    scale,
    window,
    softcap,
    s_qb,
    s_qh,
    s_kb,
    s_ks,
    s_kh,
    s_vb,
    s_vs,
    s_vh,
    s_sb,
    s_ss,
    s_bt,
    s_ob,
    s_oh,
    n_parts,
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
    DIRECT: tl.constexpr,
    LSE: tl.constexpr,
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
    ctx = tl.load(ctx_ptr + row).to(tl.int32)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - window, 0)
    p_start = part * PART
    p_end = tl.minimum(p_start + PART, ctx)
    # First tile that can hold a visible key; later tiles of the partition start BLOCK_N apart.
    first = p_start + (tl.maximum(lo - p_start, 0) // BLOCK_N) * BLOCK_N
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for start in range(first, p_end, BLOCK_N):
        s, visible, blk, slot = key_scores(
            q, q_ptr, k_ptr, ks_ptr, bt_ptr, row, kvh, start + n, lo, p_end, d, d_ok, s_bt, s_kb, s_ks, s_kh,
            s_sb, s_ss, max_blocks, scale, softcap, QUANT, FP8, BLOCK_SIZE, SOFTCAP, F32, BF16,
        )  # fmt: skip
        kv_mask = visible[:, None] & d_ok[None, :]
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at 0
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + blk[:, None] * s_vb + slot[:, None] * s_vs + kvh * s_vh + d[None, :],
            mask=kv_mask,
            other=0,
        )
        if QUANT:
            v_s = tl.load(vs_ptr + blk * s_sb + slot * s_ss + kvh, mask=visible, other=0.0)
            v = narrow(cache_codes(v, FP8) * v_s[:, None], q_ptr, BF16)
        acc = acc * alpha[:, None] + mma(narrow(p, q_ptr, BF16), v, F32)
        m_i = m_new
    out_mask = g_ok[:, None] & d_ok[None, :]
    if DIRECT:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + row * s_ob + heads[:, None] * s_oh + d[None, :], narrow(o, out_ptr, BF16), mask=out_mask
        )
        if LSE:  # log of each head's softmax denominator: -inf for a row that sees no key
            tl.store(lse_ptr + row * GROUP * tl.num_programs(1) + heads, m_i + tl.log(l_i), mask=g_ok)
    else:
        # Scratch layout: [B, H, n_parts] for m and l, [B, H, n_parts, D_PAD] for acc.
        base = (row * GROUP * tl.num_programs(1) + heads) * n_parts + part
        tl.store(m_ptr + base, m_i, mask=g_ok)
        tl.store(l_ptr + base, l_i, mask=g_ok)
        tl.store(acc_ptr + base[:, None] * D_PAD + d[None, :], acc, mask=g_ok[:, None])


@triton.jit
def _decode_reduce(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    lse_ptr,
    n_parts,
    s_ob,
    s_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    P_PAD: tl.constexpr,
    LSE: tl.constexpr,
    BF16: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.arange(0, P_PAD)
    d = tl.arange(0, D_PAD)
    p_ok = p < n_parts
    base = (row * tl.num_programs(1) + head) * n_parts
    m = tl.load(m_ptr + base + p, mask=p_ok, other=float("-inf"))
    l = tl.load(l_ptr + base + p, mask=p_ok, other=0.0)
    acc = tl.load(acc_ptr + (base + p)[:, None] * D_PAD + d[None, :], mask=p_ok[:, None], other=0.0)
    m_all = tl.max(m, 0)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp(m - m_safe)  # empty partitions have m = -inf and weigh 0
    total = tl.sum(l * w, 0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * s_ob + head * s_oh + d, narrow(o, out_ptr, BF16), mask=d < HEAD_DIM)
    if LSE:
        tl.store(lse_ptr + row * tl.num_programs(1) + head, m_safe + tl.log(total))


def _scales_fit(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales) -> bool:
    """Scales the kernel can index: float32 [num_blocks, block_size, Hkv], both of one layout, heads adjacent."""
    ks, vs = kv_scales
    return (
        ks.dtype == vs.dtype == torch.float32
        and ks.shape == vs.shape == k_cache.shape[:3]
        and ks.stride() == vs.stride()
        and ks.stride(2) == 1
    )


def num_partitions(max_len: int, programs: int, partition_size: Optional[int]) -> tuple[int, int]:
    """(partitions, tokens per partition) for a context bound ``max_len``; shapes only, no device reads.

    ``partition_size`` None picks: split only when the grid without it (``programs``) is small."""
    if partition_size is None:
        if programs >= SPLIT_MAX_PROGRAMS or max_len <= SPLIT_PARTITION:
            partition_size = max_len
        else:
            partition_size = SPLIT_PARTITION
    part = max(BLOCK_N, -(-partition_size // BLOCK_N) * BLOCK_N)
    return max(1, -(-max_len // part)), part


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    window: Optional[int] = None,
    partition_size: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    softcap: Optional[float] = None,
    scores: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """Decode attention of ``q`` [B, H, D] over the paged cache; see the module docstring.

    ``partition_size`` forces the split-KV partition (tokens, rounded up to a multiple of ``BLOCK_N``);
    ``out`` [B, H, D] receives the result when given (a persistent buffer of the runner). ``kv_scales``:
    the (k_scale, v_scale) [num_blocks, block_size, Hkv] float32 of a quantized cache (int8 or fp8 e4m3
    codes, ``kv_quant``), dequantized in registers as the tiles are loaded. ``softcap``: the scores soft-capped
    (Gemma 2), None for none."""
    if q.dim() != 3 or k_cache.dim() != 4 or q.dtype not in _DTYPES:
        return None
    b, nh, hd = q.shape
    _, bs, nkv, hd_k = k_cache.shape
    quant = kv_scales is not None
    if quant and not _scales_fit(k_cache, v_cache, kv_scales):
        return None
    if scores is not None and not triton_scores.scores_fit(scores, k_cache):
        return None
    want = (torch.int8, torch.float8_e4m3fn) if quant else (q.dtype,)
    if (
        k_cache.dtype not in want
        or v_cache.dtype != k_cache.dtype
        or v_cache.shape != k_cache.shape
        or hd_k != hd
        or nh % nkv
        or q.stride(2) != 1
        or k_cache.stride(3) != 1
        or v_cache.stride(3) != 1
    ):
        return None
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8:  # passed as bytes; the kernel bit-casts them
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    ks, vs = kv_scales if quant else (q, q)  # unused without QUANT
    if block_tables.dtype not in (torch.int32, torch.int64) or ctx_lens.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise ValueError(
            f"decode_block_tables / decode_ctx_lens: must be int32 or int64, got "
            f"{block_tables.dtype} / {ctx_lens.dtype}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != b or ctx_lens.shape != (b,):
        raise ValueError(
            f"decode_block_tables: shape {tuple(block_tables.shape)} and decode_ctx_lens "
            f"{tuple(ctx_lens.shape)} must cover the {b} query rows"
        )
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    group = nh // nkv
    tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    ctx = ctx_lens.contiguous()
    max_blocks = tables.shape[1]
    n_parts, part = num_partitions(max_blocks * bs, b * nkv, partition_size)
    d_pad = max(16, next_pow2(hd))
    direct = n_parts == 1
    lse = torch.empty(b, nh, dtype=torch.float32, device=q.device) if scores is not None else out
    if direct:
        m = l = acc = out  # unused by the kernel
    else:
        m = torch.empty(b, nh, n_parts, dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        acc = torch.empty(b, nh, n_parts, d_pad, dtype=torch.float32, device=q.device)
    _decode_partition[(b, nkv, n_parts)](
        q,
        k_cache,
        v_cache,
        ks,
        vs,
        tables,
        ctx,
        out,
        m,
        l,
        acc,
        lse,
        float(scale),
        int(window or 0),
        float(softcap or 1.0),  # unused without SOFTCAP
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        ks.stride(0),
        ks.stride(1 if quant else 0),
        tables.stride(0),
        out.stride(0),
        out.stride(1),
        n_parts,
        max_blocks,
        QUANT=quant,
        FP8=fp8,
        GROUP=group,
        G_PAD=max(16, next_pow2(group)),
        HEAD_DIM=hd,
        D_PAD=d_pad,
        BLOCK_SIZE=bs,
        PART=part,
        BLOCK_N=BLOCK_N,
        HAS_WINDOW=window is not None,
        SOFTCAP=softcap is not None,
        DIRECT=direct,
        LSE=scores is not None,
        F32=dot_in_f32(q.dtype),
        BF16=q.dtype == torch.bfloat16,
    )
    if not direct:
        _decode_reduce[(b, nh)](
            m,
            l,
            acc,
            out,
            lse,
            n_parts,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=hd,
            D_PAD=d_pad,
            P_PAD=next_pow2(n_parts),
            LSE=scores is not None,
            BF16=q.dtype == torch.bfloat16,
        )
    if scores is not None:
        launch = dict(q=q, k_cache=k_cache, ks=ks, tables=tables, ctx=ctx, quant=quant, fp8=fp8, group=group)
        launch.update(
            n_parts=n_parts, part=part, block_n=BLOCK_N, d_pad=d_pad, g_pad=max(16, next_pow2(group))
        )
        launch.update(scale=float(scale), window=int(window or 0), softcap=float(softcap or 1.0))
        launch.update(has_window=window is not None, has_softcap=softcap is not None, f32=dot_in_f32(q.dtype))
        triton_scores.add_decode_scores(launch, lse, scores)
    return out

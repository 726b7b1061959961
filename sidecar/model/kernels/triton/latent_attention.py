"""Paged decode attention on the latents of multi-head latent attention in Triton (the GPU form of
``kernels/cpu/latent_attention``; mla.py's absorbed decode): each decode row's heads attend to positions
``[0, ctx)`` of its own sequence, the latents [num_blocks, block_size, 1, R] and rotary keys [num_blocks,
block_size, 1, P] read in place through the row's block table; out: the probability-weighted latents
[B, H, R] (the caller maps them through W_UV).

One program per (row, group of ``BLOCK_H`` heads, context partition): every head reads
the same latent (the cache is one "KV head" of width R + P), so a group's scores are one product
``q_lat [BLOCK_H, R] . latent^T + q_rope [BLOCK_H, P] . rope^T`` per tile of ``BLOCK_N`` keys, and the
weighted sum ``p . latent`` reuses the tile just loaded. Each partition keeps an online softmax (running max
``m``, denominator ``l``, unnormalised sum ``acc``); partitions are merged by ``_merge`` (one program per
(row, head group)), so a long context spreads over many programs where rows and head groups alone leave
the multiprocessors idle. The partition count comes from the table's width, the batch and the device (never
from the contexts, which would need a host read); partitions past a row's context load nothing and leave
``m = -inf``, weight 0 in the merge. No host reads: the grid comes from tensor shapes
only, so a decode graph captures it. A row of context 0 (graph padding) comes out 0.

Numerics: float32 queries and caches multiply at full precision (``input_precision="ieee"``); bf16 ones on
the tensor cores as they are, the probabilities rounded to bf16 before they weigh the latents (the torch
form rounds them so), the sums in float32.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sidecar.model.kernels.triton.common import dot_in_f32, mma, narrow, sm_count

BLOCK_N = 32  # keys per tile
BLOCK_H = 16  # heads per program: a dot needs 16 rows (heads past the count are masked)
MIN_PART = (
    256  # context positions a partition covers at least (a shorter one costs more to merge than it saves)
)
MAX_RANK = 1024  # bound on R + P: a program holds a [BLOCK_H, R] float32 sum and a [BLOCK_N, R] tile


@triton.jit
def _partial(
    ql_ptr,
    qr_ptr,
    lc_ptr,
    rc_ptr,
    bt_ptr,
    ctx_ptr,
    acc_ptr,
    ml_ptr,
    scale,
    nh,
    R,
    P,
    s_bt,
    nparts,
    part_len,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    F32: tl.constexpr,
    BF16: tl.constexpr,
):
    row = tl.program_id(0)
    hb = tl.program_id(1)
    part = tl.program_id(2)
    hs = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    mh = hs < nh
    mr = r < R
    mp = p < P
    ql = tl.load(
        ql_ptr + (row * nh + hs[:, None]) * R + r[None, :], mask=mh[:, None] & mr[None, :], other=0.0
    )
    qr = tl.load(
        qr_ptr + (row * nh + hs[:, None]) * P + p[None, :], mask=mh[:, None] & mp[None, :], other=0.0
    )
    ctx = tl.load(ctx_ptr + row)
    n = tl.arange(0, BLOCK_N)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    end = tl.minimum(ctx, (part + 1) * part_len)
    for start in range(part * part_len, end, BLOCK_N):
        pos = start + n
        live = pos < end
        blk = tl.load(bt_ptr + row * s_bt + pos // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
        slot = blk * BLOCK_SIZE + pos % BLOCK_SIZE
        lat = tl.load(lc_ptr + slot[:, None] * R + r[None, :], mask=live[:, None] & mr[None, :], other=0.0)
        rope = tl.load(rc_ptr + slot[:, None] * P + p[None, :], mask=live[:, None] & mp[None, :], other=0.0)
        s = mma(ql, tl.trans(lat), F32) + mma(qr, tl.trans(rope), F32)
        s = tl.where(live[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        w = tl.exp(s - m_new[:, None])
        den = den * alpha + tl.sum(w, axis=1)
        acc = acc * alpha[:, None] + mma(narrow(w, lc_ptr, BF16), lat, F32)
        m = m_new
    base = (row * nh + hs) * nparts + part
    tl.store(acc_ptr + base[:, None] * R + r[None, :], acc, mask=mh[:, None] & mr[None, :])
    tl.store(ml_ptr + base * 2, m, mask=mh)
    tl.store(ml_ptr + base * 2 + 1, den, mask=mh)


@triton.jit
def _merge(
    acc_ptr,
    ml_ptr,
    out_ptr,
    nh,
    R,
    nparts,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BF16: tl.constexpr,
):
    row = tl.program_id(0)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)
    mh = hs < nh
    mr = r < R
    big = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for part in range(0, nparts):
        big = tl.maximum(big, tl.load(ml_ptr + ((row * nh + hs) * nparts + part) * 2, mask=mh, other=0.0))
    den = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for part in range(0, nparts):
        base = (row * nh + hs) * nparts + part
        m = tl.load(ml_ptr + base * 2, mask=mh, other=float("-inf"))
        # an empty partition weighs 0 (its m is -inf; so is big where every partition is empty)
        wt = tl.exp(m - tl.where(big > float("-inf"), big, 0.0))
        den += wt * tl.load(ml_ptr + base * 2 + 1, mask=mh, other=0.0)
        part_acc = tl.load(
            acc_ptr + base[:, None] * R + r[None, :], mask=mh[:, None] & mr[None, :], other=0.0
        )
        acc += wt[:, None] * part_acc
    o = acc / tl.where(den > 0.0, den, 1.0)[:, None]
    tl.store(
        out_ptr + (row * nh + hs[:, None]) * R + r[None, :],
        narrow(o, out_ptr, BF16),
        mask=mh[:, None] & mr[None, :],
    )


def decode_attention(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    parts: Optional[int] = None,
) -> Optional[torch.Tensor]:
    """The weighted latents [B, H, R] in ``q_lat``'s dtype (arguments as ``kernels/cpu/latent_attention``'s
    ``decode_attention``, without the scored-eviction sums), on the tensors' device. None, with nothing
    launched, where the kernel does not take them (another dtype or device, a layout it does not know,
    int32 tables, R + P past ``MAX_RANK``). ``parts``: how many context partitions (None: enough to
    fill the device's multiprocessors twice over, none shorter than ``MIN_PART``)."""
    dtype, dev = q_lat.dtype, q_lat.device
    if dtype not in (torch.float32, torch.bfloat16) or q_lat.dim() != 3 or latent_cache.dim() != 4:
        return None
    b, nh, rank = q_lat.shape
    nblocks, bs = latent_cache.shape[:2]
    rope = rope_cache.shape[-1]
    if (
        any(t.device != dev for t in (q_rope, latent_cache, rope_cache, block_tables, ctx_lens))
        or any(t.dtype != dtype or not t.is_contiguous() for t in (latent_cache, rope_cache))
        or q_rope.shape[:2] != (b, nh)
        or latent_cache.shape[2:] != (1, rank)
        or rope_cache.shape[:3] != (nblocks, bs, 1)
        or block_tables.dtype != torch.int64
        or ctx_lens.dtype != torch.int64
        or block_tables.dim() != 2
        or block_tables.shape[0] != b
        or ctx_lens.shape != (b,)
        or rank + rope > MAX_RANK
        or min(rank, rope, bs) < 1
        or (parts is not None and parts < 1)
    ):
        return None
    out = torch.empty(b, nh, rank, dtype=dtype, device=dev)
    if b == 0 or nh == 0:
        return out
    q_lat, q_rope = q_lat.contiguous(), q_rope.to(dtype).contiguous()
    tables, ctx = block_tables.contiguous(), ctx_lens.contiguous()
    heads = triton.cdiv(nh, BLOCK_H)
    positions = max(1, tables.shape[1] * bs)
    if parts is None:
        parts = min(triton.cdiv(positions, MIN_PART), triton.cdiv(2 * sm_count(dev), b * heads))
    nparts = max(1, min(parts, triton.cdiv(positions, BLOCK_N)))
    part_len = triton.cdiv(triton.cdiv(positions, nparts), BLOCK_N) * BLOCK_N  # whole tiles
    acc = torch.empty(b, nh, nparts, rank, dtype=torch.float32, device=dev)
    ml = torch.empty(b, nh, nparts, 2, dtype=torch.float32, device=dev)
    block_r, block_p = (max(16, triton.next_power_of_2(d)) for d in (rank, rope))
    bf16, f32 = dtype == torch.bfloat16, dot_in_f32(dtype)
    _partial[(b, heads, nparts)](
        q_lat, q_rope, latent_cache, rope_cache, tables, ctx, acc, ml, float(scale), nh, rank, rope,
        tables.stride(0), nparts, part_len,
        BLOCK_H=BLOCK_H, BLOCK_R=block_r, BLOCK_P=block_p, BLOCK_SIZE=bs, BLOCK_N=BLOCK_N,
        F32=f32, BF16=bf16, num_warps=8 if block_r >= 256 else 4,
    )  # fmt: skip
    _merge[(b, heads)](acc, ml, out, nh, rank, nparts, BLOCK_H=BLOCK_H, BLOCK_R=block_r, BF16=bf16)
    return out

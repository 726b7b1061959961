"""Attention with the weights each cached key receives added up (the torch reference of scored eviction).

``AttentionMetadata.kv_scores`` is a float32 vector with one entry per cache slot (``num_blocks * block_size``);
every attention call of a step adds to the slot of each key the softmax weight it received, summed over the
query rows and heads of that call, so after a step a slot holds what its token received over every layer. The
engine zeroes a slot when a token is written into it and sums a block's slots to rank it (engine/kv_evict.py).

Weights are computed as HF's eager attention computes them: ``(q @ k^T) * scale``, soft-capped where asked,
masked, a float32 softmax cast back to the dtype, times ``v``.
"""

from __future__ import annotations

from typing import Optional

import torch


def weighted(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: Optional[float],
    sinks: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, Hkv, R, D] (R query rows per KV head), k, v: [B, Hkv, L, D], mask broadcast to [B, Hkv, R, L]
    (True = attend). Returns (output [B, Hkv, R, D], key weights [B, L] float32: summed over heads and rows).
    ``sinks``: a logit per row, broadcast to [B, Hkv, R, 1], that joins the softmax's denominator and
    weighs no value (gpt-oss: HF's eager attention, max subtracted first, softmax in the logits' dtype)."""
    w = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    w = w.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        w = torch.cat((w, sinks.to(w.dtype).expand(*w.shape[:-1], 1)), dim=-1)
        w = torch.softmax(w - w.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1].float()
    else:
        w = torch.softmax(w, dim=-1, dtype=torch.float32)
    w = torch.nan_to_num(w)  # a fully masked (padding) row
    out = torch.matmul(w.to(q.dtype), v)
    return out, w.sum(dim=(1, 2))


def add_scores(scores: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> None:
    """scores[slots[i, j]] += weights[i, j] (padding keys carry weight 0 into the padding block 0)."""
    scores.index_add_(0, slots.reshape(-1), weights.reshape(-1))


def table_slots(block_tables: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """[B, length] slot of each key index of each row's table ([B, n_blocks])."""
    j = torch.arange(length, device=block_tables.device)
    return block_tables[:, j // block_size] * block_size + j % block_size


def decode_scored(
    qd: torch.Tensor,
    kd: torch.Tensor,
    vd: torch.Tensor,
    mask: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    scale: float,
    softcap: Optional[float],
    scores: torch.Tensor,
) -> torch.Tensor:
    """Decode rows (qd [B, H, D]) over their gathered keys (kd, vd [B, Hkv, L, D]); adds the weights to
    ``scores``; returns [B, H, D]."""
    b, nh, hd = qd.shape
    nkv = kd.shape[1]
    o, w = weighted(qd.reshape(b, nkv, nh // nkv, hd), kd, vd, mask, scale, softcap)
    add_scores(scores, table_slots(block_tables, block_size, kd.shape[2]), w)
    return o.reshape(b, nh, hd)


def segment_scored(
    qs: torch.Tensor,
    ks: torch.Tensor,
    vs: torch.Tensor,
    mask: torch.Tensor,
    key_slots: torch.Tensor,
    scale: float,
    softcap: Optional[float],
    scores: torch.Tensor,
) -> torch.Tensor:
    """A prompt segment (qs [1, H, Lq, D]) over its keys (ks, vs [1, Hkv, Lk, D], mask [Lq, Lk]) whose slots are
    ``key_slots`` [Lk]; adds the weights to ``scores``; returns [1, H, Lq, D]."""
    _, nh, lq, hd = qs.shape
    nkv = ks.shape[1]
    rep = nh // nkv
    # Heads sharing a KV head become that head's query rows: [1, Hkv, rep * Lq, D].
    qg = qs.reshape(1, nkv, rep * lq, hd)
    m = mask[None, None].expand(1, 1, lq, mask.shape[-1]).repeat(1, 1, rep, 1)
    o, w = weighted(qg, ks, vs, m, scale, softcap)
    add_scores(scores, key_slots, w[0])
    return o.reshape(1, nh, lq, hd)

"""Llama 4's attention: interleaved rope, q/k L2 norms after rope, attention temperature on the NoPE layers,
and chunked local attention.

Chunked attention: on a chunked layer a token at position ``p`` attends to the keys ``[p // chunk * chunk,
p]``, the keys of its own chunk up to itself (HF's ``chunked_overlay`` on the causal mask). When the chunk is a
whole number of KV blocks (every published chunk is: 8192 tokens) a chunk starts on a block, and attention
within a chunk is plain causal attention over a slice of the block table: ``local_metadata`` rewrites the
step's metadata so that each decode row reads the table from its chunk's first block with its context
counted from there, and each prompt segment is split at chunk edges into segments of the same form. Every
attention path (torch, the CPU decode and prefill kernels, the Triton decode kernel) then computes chunked
attention as it computes full attention, with no mask of its own. A chunk that is not a whole number of
blocks has no such form: those layers attend on the torch reference path (``reference``: the chunk mask
over each row's gathered keys), which the start-up log names.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Optional

import torch
import torch.nn.functional as F

from sidecar.model import attention_scores, kv_quant
from sidecar.model.attention import AttentionMetadata, paged_attention, write_kv

log = logging.getLogger(__name__)
_refusals_logged: set[tuple[int, int]] = set()


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's complex rope of ``x`` [T, heads, hd]: channel pair (2i, 2i + 1) rotated by frequency i, from our
    rotate-half tables (``cos``, ``sin`` [T, 1, hd]: frequency i in column i, sin's second half positive).
    As HF's ``apply_rotary_emb``: the product in float32 (the tables are, ``CausalLM.init_rope``), rounded
    once to ``x``'s dtype."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half].float(), sin[..., half:].float()
    a, b = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head of ``x`` over its root mean square, in float32 as HF's ``Llama4TextL2Norm`` (no weight)."""
    f = x.float()
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def token_positions(meta: AttentionMetadata, t: int, device: torch.device) -> torch.Tensor:
    """[T] long: the position of each of the step's tokens in its sequence (prompt segments first, then the
    decode rows, each at its context length minus one)."""
    pos = torch.zeros(t, dtype=torch.long, device=device)
    for seg in meta.prefills:
        pos[seg.q_start : seg.q_start + seg.q_len] = torch.arange(
            seg.ctx_len - seg.q_len, seg.ctx_len, device=device
        )
    if meta.decode_block_tables is not None:
        b = meta.decode_block_tables.shape[0]
        pos[t - b :] = meta.decode_ctx_lens.to(device) - 1
    return pos


def temperature(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """[T] float32: HF's query scale ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def local_metadata(meta: AttentionMetadata, chunk: int) -> AttentionMetadata:
    """``meta`` with every row's context cut to its own chunk (see the module's docstring); ``chunk`` a
    multiple of ``meta.block_size``. Decode rows are rewritten with tensor operations only (no host reads),
    so a captured decode step stays valid."""
    bs = meta.block_size
    per = chunk // bs
    prefills = []
    for seg in meta.prefills:
        start = seg.ctx_len - seg.q_len
        p = start
        while p < seg.ctx_len:
            c0 = p // chunk * chunk
            end = min(seg.ctx_len, c0 + chunk)
            first = c0 // bs
            table = seg.block_table[first : first + (end - c0 + bs - 1) // bs]
            prefills.append(
                replace(
                    seg, q_start=seg.q_start + p - start, q_len=end - p, ctx_len=end - c0, block_table=table
                )
            )
            p = end
    local = replace(meta, prefills=prefills, _decode_masks={})
    if meta.decode_block_tables is not None:
        bt, ctx = meta.decode_block_tables, meta.decode_ctx_lens
        first = (ctx - 1).clamp(min=0) // chunk * per  # the block each row's chunk starts on
        width = min(bt.shape[1], per)
        cols = (first[:, None] + torch.arange(width, device=bt.device)).clamp(max=bt.shape[1] - 1)
        local.decode_block_tables = bt.gather(1, cols.to(bt.device))
        local.decode_ctx_lens = ctx - first * bs
        if meta.decode_block_tables_i32 is not None:
            local.decode_block_tables_i32 = local.decode_block_tables.to(torch.int32)
    return local


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    chunk: int,
    paths: Any = None,
    kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """Chunked attention of ``q`` [T, H, D] (the new tokens' ``k``, ``v`` [T, Hkv, D] already in the cache):
    through ``paged_attention`` on chunk-local metadata, or on ``reference`` where the chunk is not a whole
    number of blocks."""
    if chunk % meta.block_size:
        key = (chunk, meta.block_size)
        if key not in _refusals_logged:
            _refusals_logged.add(key)
            log.info(
                "chunked attention: chunk %d is not a multiple of the KV block size %d; the chunked layers "
                "attend on the torch reference path (our kernels read chunks as block-table slices)",
                *key,
            )
        return reference(q, k_cache, v_cache, meta, scale, chunk, kv_scales)
    local = local_metadata(meta, chunk)
    return paged_attention(q, k, v, k_cache, v_cache, local, scale, None, True, paths, kv_scales)


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    chunk: int,
    kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """Chunked attention over the cache (which holds every new token already) under an explicit mask: each
    prompt segment over its keys [0, ctx), each decode row over its padded table; key ``j`` is visible to the
    query at ``p`` iff ``j <= p`` and ``j // chunk == p // chunk``. Adds to ``meta.kv_scores`` when set."""
    ks, vs = kv_scales if kv_scales is not None else (None, None)
    rep = q.shape[1] // k_cache.shape[-2]
    out = torch.empty_like(q)
    bs, scores = meta.block_size, meta.kv_scores

    def rows_over(qs, tables, mask, length):  # qs [B, H, R, D]; mask [B, 1, R, L]
        kd = kv_quant.gather_heads(k_cache, ks, tables, q.dtype)[:, :, :length]
        vd = kv_quant.gather_heads(v_cache, vs, tables, q.dtype)[:, :, :length]
        if scores is None:
            return F.scaled_dot_product_attention(qs, kd, vd, attn_mask=mask, scale=scale, enable_gqa=rep > 1)
        kd, vd = kd.repeat_interleave(rep, dim=1), vd.repeat_interleave(rep, dim=1)
        o, w = attention_scores.weighted(qs, kd, vd, mask, scale, None)
        attention_scores.add_scores(scores, attention_scores.table_slots(tables, bs, length), w)
        return o

    for seg in meta.prefills:
        qpos = torch.arange(seg.ctx_len - seg.q_len, seg.ctx_len, device=q.device)[:, None]
        kpos = torch.arange(seg.ctx_len, device=q.device)[None, :]
        mask = (kpos <= qpos) & (kpos // chunk == qpos // chunk)
        rows = q[seg.q_start : seg.q_start + seg.q_len].transpose(0, 1)[None]
        o = rows_over(rows, seg.block_table[None], mask[None, None], seg.ctx_len)
        out[seg.q_start : seg.q_start + seg.q_len] = o[0].transpose(0, 1)
    if meta.decode_block_tables is not None:
        tables, ctx = meta.decode_block_tables, meta.decode_ctx_lens
        b, length = tables.shape[0], tables.shape[1] * bs
        kpos = torch.arange(length, device=q.device)[None, :]
        last = (ctx - 1)[:, None].to(q.device)
        mask = (kpos <= last) & (kpos >= last // chunk * chunk)
        o = rows_over(q[q.shape[0] - b :][:, :, None], tables, mask[:, None, None, :], length)
        out[q.shape[0] - b :] = o[:, :, 0]
    return out


def attend(
    attn: Any, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: tuple, meta
) -> torch.Tensor:
    """Llama 4's rope, norms, temperature, KV write and (chunked) attention over the fused projection ``qkv``
    [T, (H + 2 Hkv) * D] of the layer ``attn`` (layers.Attention: its ``use_rope``, ``l2_eps``,
    ``temperature`` and ``chunk``); returns [T, H * D]. Rope, norms and temperature follow HF's order."""
    t, nh, nkv, hd = qkv.shape[0], attn.nh, attn.nkv, attn.hd
    q = qkv[:, : nh * hd].view(t, nh, hd)
    k = qkv[:, nh * hd : (nh + nkv) * hd].view(t, nkv, hd)
    v = qkv[:, (nh + nkv) * hd :].view(t, nkv, hd)
    if attn.use_rope:
        c, s = cos[attn.rope_kind], sin[attn.rope_kind]
        q, k = rotate_interleaved(q, c, s), rotate_interleaved(k, c, s)
    if attn.l2_eps is not None:
        q, k = l2_norm(q, attn.l2_eps), l2_norm(k, attn.l2_eps)
    if attn.temperature is not None:
        scales = temperature(token_positions(meta, t, q.device), *attn.temperature)
        q = (q * scales[:, None, None]).to(q.dtype)
    kv_scales = kv[2:] if len(kv) == 4 else None
    if attn.chunk is None:
        o = paged_attention(
            q, k, v, kv[0], kv[1], meta, attn.scale, None, paths=attn.fast_paths, kv_scales=kv_scales
        )
        return o.reshape(t, nh * hd)
    if kv_scales is not None:
        kv_quant.write((kv[0], kv[1], *kv_scales), k, v, meta.slot_mapping)
    else:
        write_kv(kv[0], kv[1], k, v, meta.slot_mapping)
    o = chunked_attention(q, k, v, kv[0], kv[1], meta, attn.scale, attn.chunk, attn.fast_paths, kv_scales)
    return o.reshape(t, nh * hd)

"""Paged attention with a learned sink logit per head (gpt-oss), the torch reference path.

A sink is one more logit in each head's softmax, for no value: it takes a share of the attention weight away
from the keys (HF's eager attention: the logits and the sink concatenated, their maximum subtracted, softmaxed,
the sink's column dropped). ``paged_attention`` sends every row of such a layer here: decode rows go
through the CPU decode kernel and prompt segments through the CPU prefill kernel, which both take sinks
(``kernels/cpu/paged_attention.c``, ``kernels/cpu/prefill_attention.c``), where they run and no attention
scores are kept (H2O); the rows a kernel declines are attended by torch. The Triton decode kernel does not take
sinks.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from sidecar.model import attention_scores, kv_quant
from sidecar.model.kernels.cpu import paged_attention as cpu_kernel
from sidecar.model.kernels.cpu import prefill_attention as prefill_kernel


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: Any,
    scale: float,
    sliding_window: Optional[int],
    kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]],
    softcap: Optional[float],
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Attention with a sink logit per head (``attention_scores.weighted``, HF's eager form, each KV head
    repeated for its query heads) over the cache, which holds every new token already: each prompt segment
    over its keys [0, ctx) under the causal (and window) mask, the decode rows together over their padded
    tables under ``decode_mask`` (through the CPU prefill and decode kernels where they run,
    ``meta.use_cpu_kernel`` and no ``kv_scores``).
    ``meta``: the step's ``attention.AttentionMetadata``; adds to its ``kv_scores`` when they are set."""
    ks, vs = kv_scales if kv_scales is not None else (None, None)
    rep = q.shape[1] // k_cache.shape[-2]
    sink_rows = sinks.view(1, -1, 1, 1)
    out = torch.empty_like(q)
    bs, scores = meta.block_size, meta.kv_scores

    def rows_over(qs, tables, mask, length):  # qs [B, H, R, D]; mask [B, 1, R, L]
        kd = kv_quant.gather_heads(k_cache, ks, tables, q.dtype)[:, :, :length].repeat_interleave(rep, dim=1)
        vd = kv_quant.gather_heads(v_cache, vs, tables, q.dtype)[:, :, :length].repeat_interleave(rep, dim=1)
        o, w = attention_scores.weighted(qs, kd, vd, mask, scale, softcap, sink_rows)
        if scores is not None:
            attention_scores.add_scores(scores, attention_scores.table_slots(tables, bs, length), w)
        return o

    for seg in meta.prefills:
        if meta.use_cpu_kernel and scores is None:
            rows = prefill_kernel.prefill_attention(
                q[seg.q_start : seg.q_start + seg.q_len],
                k_cache,
                v_cache,
                seg.block_table,
                seg.ctx_len,
                scale,
                sliding_window,
                kv_scales,
                softcap,
                sinks,
            )
            if rows is not None:
                out[seg.q_start : seg.q_start + seg.q_len] = rows
                continue
        start = seg.ctx_len - seg.q_len
        qpos = torch.arange(start, seg.ctx_len, device=q.device)[:, None]
        kpos = torch.arange(seg.ctx_len, device=q.device)[None, :]
        mask = kpos <= qpos
        if sliding_window is not None:
            mask &= kpos > qpos - sliding_window
        rows = q[seg.q_start : seg.q_start + seg.q_len].transpose(0, 1)[None]
        o = rows_over(rows, seg.block_table[None], mask[None, None], seg.ctx_len)
        out[seg.q_start : seg.q_start + seg.q_len] = o[0].transpose(0, 1)
    if meta.decode_block_tables is not None:
        b = meta.decode_block_tables.shape[0]
        if meta.use_cpu_kernel:
            tables, ctx = meta.decode_block_tables, meta.decode_ctx_lens
            args = (scale, sliding_window, kv_scales, softcap)
            o = cpu_kernel.decode_attention(
                q[q.shape[0] - b :], k_cache, v_cache, tables, ctx, *args, scores, sinks
            )
            if o is not None:
                out[q.shape[0] - b :] = o
                return out
        rows = q[q.shape[0] - b :][:, :, None]
        length = meta.decode_block_tables.shape[1] * bs
        o = rows_over(rows, meta.decode_block_tables, meta.decode_mask(sliding_window), length)
        out[q.shape[0] - b :] = o[:, :, 0]
    return out

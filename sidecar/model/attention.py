"""Paged attention over packed variable-length batches.

KV cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A token at position ``p`` of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

The torch reference path (CPU and any device) gathers each request's blocks and
calls ``scaled_dot_product_attention``. Decode tokens of a step are attended in
one batched call (padded to the longest context, masked); prefill chunks are
attended per request. On CPU the decode rows go through our kernel instead
(``kernels/cpu/paged_attention.c``: reads the blocks in place, no copy, no mask), and
so do bf16 prompt segments (``kernels/cpu/prefill_attention.c``: blocked float32 products,
several times torch's CPU SDPA at prompt sizes), with the torch path as fallback and
test oracle; float32 prompts keep SDPA, the exact path the Hugging Face comparisons use. When the model's
``FastPaths.attention`` is on and the
tensors are on CUDA (or Triton runs in its interpreter), the decode rows go through the Triton kernel
(``kernels/triton/attention.py``) instead; prefill segments keep the torch path.

Quantized caches (``kv_quant.py``: int8 / fp8 codes with per-token, per-KV-head scales, passed as
``kv_scales``) are written through ``kv_quant.write``; the CPU kernel reads the codes in place and scales in
registers, the torch path dequantizes the gathered blocks, and so does the Triton decode kernel (int8, and
fp8 e4m3 on CUDA sm89+). Every query attends through the cache when it is quantized
(a whole prompt too), so a token sees the same dequantized keys however its prompt was chunked, cached or
recomputed.

Soft-capped logits (Gemma 2: ``softcap * tanh(scaled score / softcap)`` before the softmax) are computed by
every path: both CPU kernels and the Triton kernel cap their scores as the torch path (``_softcapped``, their
oracle) does.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sidecar.model import attention_scores, attention_sinks, kv_quant
from sidecar.model.kernels.cpu import paged_attention as cpu_kernel
from sidecar.model.kernels.cpu import prefill_attention as prefill_kernel
from sidecar.model.kernels.gpu_paths import FastPaths


@dataclass
class PrefillSegment:
    """A request contributing ``q_len`` > 1 tokens (or a chunk) to this step."""

    q_start: int  # offset of its first query token in the packed batch
    q_len: int
    ctx_len: int  # tokens in its context after this step (cached + new)
    block_table: torch.Tensor  # [n_blocks] long, covering ctx_len
    state_slot: int = 0  # the sequence's linear-attention state slot (hybrid models; deltanet.py)
    state_start: bool = False  # the segment starts its sequence (the state before it is zero)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot for every new token
    block_size: int
    prefills: list[PrefillSegment] = field(default_factory=list)
    # Batched decode: single query rows, each with its own context length (a plain decode token, or one
    # of the tokens a request verifies in speculative decoding). Their tokens are the last Bd of the
    # packed batch (the runner places prefill segments first).
    decode_block_tables: Optional[torch.Tensor] = None  # [Bd, max_blocks] long (padded with 0)
    decode_ctx_lens: Optional[torch.Tensor] = None  # [Bd] long: keys [0, ctx) are the row's context
    # The same tables as int32, for device kernels indexing with 32-bit ids; set by the runner's persistent
    # decode buffers when the attention fast path is on, None otherwise.
    decode_block_tables_i32: Optional[torch.Tensor] = None
    use_cpu_kernel: bool = True  # False: the torch path even where the CPU kernel could run (tests, benches)
    # [num_blocks * block_size] float32: each key's received attention is added at its slot
    # (attention_scores.py); None: not accounted. The decode kernels (CPU and Triton) account; prompt rows
    # then take the torch path.
    kv_scores: Optional[torch.Tensor] = None
    # Hybrid models: [Bd] long, the linear-attention state slot of each decode row (deltanet.py)
    decode_state_slots: Optional[torch.Tensor] = None
    # [T] long: each new token's position, set by CausalLM.forward (Mistral 4's position-scaled queries, mla.py)
    positions: Optional[torch.Tensor] = None
    # A model with KV groups (engine/kv_groups.py): per layer, the metadata over its group's block tables
    # (slots, prompt segments' tables, decode tables); None: every layer reads this one.
    layer_metas: Optional[list["AttentionMetadata"]] = None
    _decode_masks: dict = field(default_factory=dict)

    def for_layer(self, layer: int) -> "AttentionMetadata":
        """The metadata layer ``layer`` attends and writes with."""
        return self if self.layer_metas is None else self.layer_metas[layer]

    def decode_mask(self, sliding_window: Optional[int]) -> torch.Tensor:
        """[Bd, 1, 1, max_blocks * block_size] bool, True = attend; built once per step and window (layers may
        differ in their windows), on first use."""
        mask = self._decode_masks.get(sliding_window)
        if mask is None:
            mask = self._decode_masks[sliding_window] = build_decode_mask(
                self.decode_ctx_lens, self.decode_block_tables.shape[1], self.block_size, sliding_window
            )
        return mask


def build_decode_mask(
    ctx_lens: torch.Tensor, max_blocks: int, block_size: int, sliding_window: Optional[int]
) -> torch.Tensor:
    """Mask of shape [B, 1, 1, max_blocks*block_size]: key j visible iff j < ctx_len (and in window)."""
    pos = torch.arange(max_blocks * block_size, device=ctx_lens.device)
    mask = pos[None, :] < ctx_lens[:, None]
    if sliding_window is not None:
        mask &= pos[None, :] >= (ctx_lens[:, None] - sliding_window)
    return mask[:, None, None, :]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    nkv, hd = k_cache.shape[-2], k_cache.shape[-1]
    k_cache.view(-1, nkv, hd).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, nkv, hd).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    nkv, hd = cache.shape[-2], cache.shape[-1]
    return cache.index_select(0, block_table).view(-1, nkv, hd)[:length]


# On CUDA, torch may send bf16 / fp16 attention to cuDNN's fused kernel, which builds an execution plan for every
# new shape, far slower the first time a sequence length is seen than once built. A server's prompts come in
# every length, so its first minutes of prefill stalled on plan builds. Flash and memory-efficient attention have
# no per-shape build; the model's forward runs with these backends alone (``sdpa_backends``).
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """The attention backends the model's forward allows on ``device``: on CUDA all but cuDNN's."""
    return sdpa_kernel(CUDA_SDPA_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    causal: bool,
    scale: float,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """q: [B, H, Lq, D]; k, v: [B, Hkv, Lk, D]. Expands KV heads for grouped-query attention."""
    rep = q.shape[1] // k.shape[1]
    if softcap is not None:
        if causal:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()[None, None]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return _softcapped(q, k, v, mask, scale, softcap)
    if rep > 1 and mask is not None and not causal and q.shape[0] == 1:
        # Grouped-query heads folded into query rows ([1, Hkv, rep * Lq, D] against [1, Hkv, Lk, D]): the
        # keys and values are read as they are instead of copied rep times.
        _, h, lq, d = q.shape
        qg = q.reshape(1, k.shape[1], rep * lq, d)
        m = mask.expand(1, 1, lq, mask.shape[-1]).repeat(1, 1, rep, 1)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=m, scale=scale)
        return o.reshape(1, h, lq, d)
    # Grouped-query heads are read in place (enable_gqa: the same bits as repeating K/V, without the copies;
    # no measurable change in a 4,774-token prefill on Qwen2-0.5B's heads, bf16, 2 threads: 9.45-9.71 s
    # against 9.46-9.48 s).
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=rep > 1
    )


def _softcapped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """Attention with soft-capped logits, as HF's eager attention computes it: ``(q @ k^T) * scale``, capped
    (``softcap * tanh(. / softcap)``), masked, softmax in float32 back to the dtype, times ``v``. q: [B, H, Lq, D];
    k, v: [B, H, Lk, D] (heads already matched); mask broadcast to [B, H, Lq, Lk], True = attend."""
    w = torch.matmul(q, k.transpose(-1, -2)) * scale
    w = torch.tanh(w / softcap) * softcap
    w = w.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)


# A prefill segment of at most KERNEL_PREFILL_ROWS query rows after at least KERNEL_PREFILL_MIN_CACHED
# tokens of context (the question after a long cached document) goes through the decode kernel, one row per
# query with its causal context length: it reads the blocks in place, where the torch path copies the whole
# context before an SDPA that is mostly that copy for a few rows. Longer segments keep SDPA, whose blocked
# matrix products win once the rows are many; so do shorter contexts, where the copy is cheap. Either way
# the rows' sums run in another order than in an uncached run of the prompt, as they always did after a
# prefix hit, so on a near-tie a greedy token may differ.
KERNEL_PREFILL_ROWS = 32
KERNEL_PREFILL_MIN_CACHED = 1024


def _segment_through_kernel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg: PrefillSegment,
    scale: float,
    sliding_window: Optional[int],
    kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]],
    softcap: Optional[float],
    scores: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """The segment's rows as decode rows (row i sees keys [0, start + i]) through the CPU kernel; None
    when the kernel does not take these inputs."""
    start = seg.ctx_len - seg.q_len
    tables = seg.block_table[None].expand(seg.q_len, -1)
    ctx = torch.arange(start + 1, seg.ctx_len + 1, dtype=torch.long, device=q.device)
    return cpu_kernel.decode_attention(
        q[seg.q_start : seg.q_start + seg.q_len],
        k_cache,
        v_cache,
        tables,
        ctx,
        scale,
        sliding_window,
        kv_scales,
        softcap,
        scores=scores,
    )


def paged_attention(
    q: torch.Tensor,
    k: Optional[torch.Tensor],
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: Optional[int] = None,
    kv_written: bool = False,
    paths: Optional[FastPaths] = None,
    kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] for the new tokens. Returns [T, H, D].

    Writes the new K/V into the cache first (unless ``kv_written``: the caller did, and then ``k`` may be
    None in a step without prompt rows), so every query sees its own token. ``paths``: the model's
    switchboard; its ``attention`` field sends the decode rows to the Triton kernel. ``kv_scales``: the
    (k_scale, v_scale) of a quantized cache (None: the cache holds plain values). ``softcap``: attention
    logits become ``softcap * tanh(logits / softcap)`` (Gemma 2), in our kernels as in the torch path
    (``_softcapped``, their oracle), which takes the rows a kernel declines. ``sinks`` [H]: a logit per head
    in every softmax's denominator (gpt-oss); our kernels do not take it, the torch path
    (``attention_sinks.py``) attends every row.
    """
    quant = kv_scales is not None
    if not kv_written:
        if quant:
            kv_quant.write((k_cache, v_cache, *kv_scales), k, v, meta.slot_mapping)
        else:
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    if sinks is not None:
        return attention_sinks.attend(
            q, k_cache, v_cache, meta, scale, sliding_window, kv_scales, softcap, sinks
        )
    decoded = None  # the decode rows' result from one of our kernels
    scores = meta.kv_scores  # our decode kernels add up received attention; the prompt paths do in torch
    if meta.decode_block_tables is not None and paths is not None and paths.takes("attention", q):
        from sidecar.model.kernels.triton import attention as triton_attention

        b = meta.decode_block_tables.shape[0]
        decoded = triton_attention.paged_decode_attention(
            q[q.shape[0] - b :],
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_ctx_lens,
            scale,
            sliding_window,
            kv_scales=kv_scales,
            softcap=softcap,
            scores=scores,
        )
        if decoded is not None and not meta.prefills:
            return decoded
    if decoded is None and meta.decode_block_tables is not None and meta.use_cpu_kernel:
        b = meta.decode_block_tables.shape[0]
        decoded = cpu_kernel.decode_attention(
            q[q.shape[0] - b :],
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_ctx_lens,
            scale,
            sliding_window,
            kv_scales,
            softcap,
            scores=scores,
        )
        if decoded is not None and not meta.prefills:  # every row is a decode row
            return decoded
    out = torch.empty_like(q)
    for seg in meta.prefills:
        start = seg.ctx_len - seg.q_len
        cpu = meta.use_cpu_kernel
        if start >= KERNEL_PREFILL_MIN_CACHED and cpu and seg.q_len <= KERNEL_PREFILL_ROWS:
            rows = _segment_through_kernel(
                q, k_cache, v_cache, seg, scale, sliding_window, kv_scales, softcap, scores=scores
            )
            if rows is not None:
                out[seg.q_start : seg.q_start + seg.q_len] = rows
                continue
        if cpu and q.dtype == torch.bfloat16 and scores is None:
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
            )
            if rows is not None:
                out[seg.q_start : seg.q_start + seg.q_len] = rows
                continue
        qs = q[seg.q_start : seg.q_start + seg.q_len].transpose(0, 1)[None]
        if start == 0 and sliding_window is None and not quant and scores is not None:
            ks = k[seg.q_start : seg.q_start + seg.q_len].transpose(0, 1)[None]
            vs = v[seg.q_start : seg.q_start + seg.q_len].transpose(0, 1)[None]
            causal = torch.ones(seg.q_len, seg.q_len, dtype=torch.bool, device=q.device).tril()
            key_slots = meta.slot_mapping[seg.q_start : seg.q_start + seg.q_len]
            o = attention_scores.segment_scored(qs, ks, vs, causal, key_slots, scale, softcap, scores)
        elif start == 0 and sliding_window is None and not quant:
            # Whole prompt in this step: attend to the fresh K/V, plain causal mask.
            ks = k[seg.q_start : seg.q_start + seg.q_len].transpose(0, 1)[None]
            vs = v[seg.q_start : seg.q_start + seg.q_len].transpose(0, 1)[None]
            o = _sdpa(qs, ks, vs, None, True, scale, softcap)
        else:
            if quant:
                ks = kv_quant.gather(k_cache, kv_scales[0], seg.block_table, seg.ctx_len, q.dtype)
                vs = kv_quant.gather(v_cache, kv_scales[1], seg.block_table, seg.ctx_len, q.dtype)
            else:
                ks = _gather(k_cache, seg.block_table, seg.ctx_len)
                vs = _gather(v_cache, seg.block_table, seg.ctx_len)
            ks, vs = ks.transpose(0, 1)[None], vs.transpose(0, 1)[None]
            qpos = torch.arange(start, seg.ctx_len, device=q.device)[:, None]
            kpos = torch.arange(seg.ctx_len, device=q.device)[None, :]
            mask = kpos <= qpos
            if sliding_window is not None:
                mask &= kpos > qpos - sliding_window
            if scores is not None:
                key_slots = attention_scores.table_slots(seg.block_table[None], meta.block_size, seg.ctx_len)[
                    0
                ]
                o = attention_scores.segment_scored(qs, ks, vs, mask, key_slots, scale, softcap, scores)
            else:
                o = _sdpa(qs, ks, vs, mask[None, None], False, scale, softcap)
        out[seg.q_start : seg.q_start + seg.q_len] = o[0].transpose(0, 1)
    if meta.decode_block_tables is not None:
        bt = meta.decode_block_tables
        b = bt.shape[0]
        if decoded is not None:
            out[q.shape[0] - b :] = decoded
            return out
        qd = q[q.shape[0] - b :]
        nkv, hd = k_cache.shape[-2], k_cache.shape[-1]
        bs = k_cache.shape[1]
        k_scale, v_scale = kv_scales if quant else (None, None)
        kd = kv_quant.gather_heads(k_cache, k_scale, bt, q.dtype)
        vd = kv_quant.gather_heads(v_cache, v_scale, bt, q.dtype)
        # Grouped-query decode without copying K/V: the query heads sharing a KV head
        # become that head's query rows ([B, Hkv, rep, D] against [B, Hkv, L, D]).
        nh = qd.shape[1]
        qg = qd.reshape(b, nkv, nh // nkv, hd)
        mask = meta.decode_mask(sliding_window)
        if scores is not None:
            out[q.shape[0] - b :] = attention_scores.decode_scored(
                qd, kd, vd, mask, bt, bs, scale, softcap, scores
            )
            return out
        if softcap is not None:
            o = _softcapped(qg, kd, vd, mask, scale, softcap)
        else:
            o = F.scaled_dot_product_attention(qg, kd, vd, attn_mask=mask, scale=scale)
        o = o.reshape(b, nh, hd)
        out[q.shape[0] - b :] = o
    return out

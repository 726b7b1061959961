"""Prefill segments that attend to a cached context (a prompt's tail after a prefix hit, a later chunk):
the rows that go through the CPU decode kernel and the torch path (with grouped-query heads folded into
query rows) both agree with a float64 reference, with windows, GQA and int8 caches, and a segment's
result does not depend on which path took it."""

from __future__ import annotations

import pytest
import torch

from sidecar.model import attention, kv_quant
from sidecar.model.attention import AttentionMetadata, PrefillSegment, paged_attention

BS = 16


def _pool(ctx_len, nkv, hd, seed, quant=False):
    g = torch.Generator().manual_seed(seed)
    n = -(-ctx_len // BS)
    blocks = n + 4
    ids = (torch.randperm(blocks - 1, generator=g) + 1)[:n]
    k = torch.randn(blocks, BS, nkv, hd, generator=g)
    v = torch.randn(blocks, BS, nkv, hd, generator=g)
    if not quant:
        return (k, v), None, ids, (k, v)
    cache = kv_quant.allocate(blocks, BS, nkv, hd, torch.int8, torch.device("cpu"))
    slots = torch.arange(blocks * BS)
    kv_quant.write(cache, k.view(-1, nkv, hd), v.view(-1, nkv, hd), slots)
    deq = tuple(
        kv_quant.dequantize(c, s, torch.float32) for c, s in ((cache[0], cache[2]), (cache[1], cache[3]))
    )
    return cache[:2], cache[2:], ids, deq


def _reference(q, kd, vd, ids, ctx_len, scale, window):
    """float64, one query row at a time: row i of the segment is token ctx_len - q_len + i."""
    nkv, hd = kd.shape[2], kd.shape[3]
    keys = kd.double()[ids].reshape(-1, nkv, hd)[:ctx_len]
    vals = vd.double()[ids].reshape(-1, nkv, hd)[:ctx_len]
    t, nh, _ = q.shape
    rep = nh // nkv
    out = torch.empty(t, nh, hd, dtype=torch.float64)
    for i in range(t):
        pos = ctx_len - t + i
        lo = max(0, pos + 1 - window) if window else 0
        for h in range(nh):
            s = keys[lo : pos + 1, h // rep] @ q[i, h].double() * scale
            out[i, h] = torch.softmax(s, 0) @ vals[lo : pos + 1, h // rep]
    return out


def _run(q, caches, scales, ids, ctx_len, scale, window, use_kernel):
    seg = PrefillSegment(q_start=0, q_len=q.shape[0], ctx_len=ctx_len, block_table=ids)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(q.shape[0], dtype=torch.long),
        block_size=BS,
        prefills=[seg],
        use_cpu_kernel=use_kernel,
    )
    return paged_attention(
        q, None, None, caches[0], caches[1], meta, scale, window, kv_written=True, kv_scales=scales
    )


@pytest.mark.parametrize(
    "q_len,ctx_len,nh,nkv,window,quant",
    [
        (1, 17, 9, 3, None, False),  # one row just past a block edge
        (5, 400, 9, 3, None, False),  # SmolLM2-135M's heads, a short question after a cached document
        (16, 1040, 14, 2, None, False),  # 7 query heads per KV head
        (attention.KERNEL_PREFILL_ROWS, 300, 8, 2, None, False),  # the longest segment the kernel takes
        (attention.KERNEL_PREFILL_ROWS + 1, 300, 8, 2, None, False),  # the shortest the torch path takes
        (40, 200, 4, 2, 48, False),  # sliding window
        (7, 129, 9, 3, None, True),  # int8 cache
        (70, 160, 9, 3, 64, True),  # int8 cache, window, through the torch path
    ],
)
def test_both_paths_match_float64(q_len, ctx_len, nh, nkv, window, quant, monkeypatch):
    monkeypatch.setattr(attention, "KERNEL_PREFILL_MIN_CACHED", 1)  # small contexts through the kernel too
    hd = 64
    caches, scales, ids, deq = _pool(ctx_len, nkv, hd, seed=q_len + ctx_len, quant=quant)
    q = torch.randn(q_len, nh, hd, generator=torch.Generator().manual_seed(1))
    ref = _reference(q, *deq, ids, ctx_len, hd**-0.5, window)
    for use_kernel in (True, False):
        out = _run(q, caches, scales, ids, ctx_len, hd**-0.5, window, use_kernel)
        assert (out.double() - ref).abs().max() < 2e-5, use_kernel


def test_short_segments_after_a_long_context_take_the_kernel_and_the_rest_sdpa(monkeypatch):
    calls = []
    real = attention.cpu_kernel.decode_attention
    monkeypatch.setattr(
        attention.cpu_kernel, "decode_attention", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k)
    )
    rows = attention.KERNEL_PREFILL_ROWS
    ctx = attention.KERNEL_PREFILL_MIN_CACHED + rows + 1
    caches, scales, ids, _ = _pool(ctx, 2, 64, seed=3)
    for q_len in (3, rows, rows + 1):
        _run(torch.randn(q_len, 8, 64), caches, scales, ids, ctx, 0.125, None, True)
    assert calls == [3, rows]
    # less context than that: SDPA (bit for bit what an uncached run gives); nothing cached: plain causal SDPA
    _run(
        torch.randn(3, 8, 64), caches, scales, ids, attention.KERNEL_PREFILL_MIN_CACHED + 2, 0.125, None, True
    )
    k = torch.randn(10, 2, 64)
    seg = PrefillSegment(q_start=0, q_len=10, ctx_len=10, block_table=ids[:1])
    meta = AttentionMetadata(slot_mapping=ids[0] * BS + torch.arange(10), block_size=BS, prefills=[seg])
    paged_attention(torch.randn(10, 8, 64), k, k.clone(), caches[0], caches[1], meta, 0.125)
    assert calls == [3, rows]


def test_folded_grouped_heads_equal_repeated_heads():
    g = torch.Generator().manual_seed(4)
    q, k, v = (
        torch.randn(1, 12, 20, 32, generator=g),
        torch.randn(1, 3, 50, 32, generator=g),
        torch.randn(1, 3, 50, 32, generator=g),
    )
    mask = torch.rand(20, 50, generator=g) > 0.3
    mask[:, 0] = True
    folded = attention._sdpa(q, k, v, mask[None, None], False, 0.2)
    repeated = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=mask[None, None], scale=0.2
    )
    assert folded.shape == q.shape and (folded - repeated).abs().max() < 1e-5

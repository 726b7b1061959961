"""Received-attention accounting (scored KV eviction): the CPU decode kernel's score output against the
torch reference (model/attention_scores.py), and the reference against its definition."""

from __future__ import annotations

import pytest
import torch

from sidecar.model.attention import AttentionMetadata, paged_attention
from sidecar.model.kernels.cpu import paged_attention as kernel
from test_kernel_paged_attention import _case


def _reference(q, kc, vc, tables, ctx, scale, window, kv_scales=None):
    """The torch path with scores: output and per-slot received attention."""
    bs = kc.shape[1]
    scores = torch.zeros(kc.shape[0] * bs)
    last = ctx - 1
    slots = tables.gather(1, (last // bs)[:, None])[:, 0] * bs + last % bs
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_size=bs,
        decode_block_tables=tables,
        decode_ctx_lens=ctx,
        use_cpu_kernel=False,
        kv_scores=scores,
    )
    out = paged_attention(q, None, None, kc, vc, meta, scale, window, kv_written=True, kv_scales=kv_scales)
    return out, scores


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("ctx_lens,nh,nkv", [([17, 400, 33, 5], 9, 3), ([70, 2], 6, 6)])
def test_kernel_scores_match_the_torch_reference(ctx_lens, nh, nkv, window):
    q, kc, vc, tables, ctx = _case(ctx_lens, nh, nkv, 64, seed=nh)
    ref_out, ref_scores = _reference(q, kc, vc, tables, ctx, 0.125, window)
    scores = torch.zeros_like(ref_scores)
    out = kernel.decode_attention(q, kc, vc, tables, ctx, 0.125, window, scores=scores)
    assert out is not None
    assert (out - ref_out).abs().max() <= 2e-6
    assert torch.allclose(scores, ref_scores, atol=1e-5)
    # Every query head spreads a weight of one over its keys: nh per row in all.
    assert scores.sum().item() == pytest.approx(nh * len(ctx_lens), rel=1e-5)
    # Slots outside every row's visible keys received nothing (the padding block 0 included).
    visible = torch.zeros_like(scores, dtype=torch.bool)
    bs = kc.shape[1]
    for b, c in enumerate(ctx.tolist()):
        lo = max(0, c - window) if window else 0
        for p in range(lo, c):
            visible[tables[b, p // bs] * bs + p % bs] = True
    assert (scores[~visible] == 0).all() and (scores[visible] > 0).all()


def test_reference_scores_are_the_softmax_weights():
    q, kc, vc, tables, ctx = _case([21], 4, 2, 64, seed=3)
    _, scores = _reference(q, kc, vc, tables, ctx, 0.125, None)
    keys = kc[tables[0, :2]].reshape(-1, 2, 64)[:21]  # [21, nkv, D]
    w = torch.softmax(torch.einsum("hd,jhd->hj", q[0], keys.repeat_interleave(2, dim=1)) * 0.125, dim=-1)
    slots = [tables[0, p // 16].item() * 16 + p % 16 for p in range(21)]
    assert torch.allclose(scores[slots], w.sum(0), atol=1e-6)


def test_kernel_accumulates_onto_existing_scores():
    q, kc, vc, tables, ctx = _case([50], 4, 2, 64, seed=9)
    scores = torch.zeros(kc.shape[0] * kc.shape[1])
    kernel.decode_attention(q, kc, vc, tables, ctx, 0.125, scores=scores)
    once = scores.clone()
    kernel.decode_attention(q, kc, vc, tables, ctx, 0.125, scores=scores)
    assert torch.allclose(scores, 2 * once, atol=1e-6)


def test_kernel_scores_are_the_same_bits_on_every_call():
    """Rows sharing blocks (beams, verification rows) and the KV heads of a row add to the same slots: the
    kernel adds them in one order on every call, whatever its threads do, so a replayed step leaves the
    scores an eager one leaves."""
    q, kc, vc, tables, ctx = _case([300, 300, 300, 41], 12, 4, 64, seed=3)
    tables[1:3] = tables[0]  # three rows over one sequence's blocks
    ctx[1:3] = torch.tensor([299, 298])
    start = torch.rand(kc.shape[0] * kc.shape[1], generator=torch.Generator().manual_seed(0))
    first = start.clone()
    kernel.decode_attention(q, kc, vc, tables, ctx, 0.125, scores=first)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3, 3):
            torch.set_num_threads(n)
            again = start.clone()
            kernel.decode_attention(q, kc, vc, tables, ctx, 0.125, scores=again)
            assert torch.equal(again, first)
    finally:
        torch.set_num_threads(threads)

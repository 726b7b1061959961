"""Attention sinks (gpt-oss: a logit per head in each softmax's denominator) in the CPU decode and prefill kernels,
against the torch path (``attention_sinks.py``, HF's eager form): float32 and bf16 caches, grouped heads,
windows, sinks above and below the scores, prompts whole and after a cached context, and the received attention
the decode kernel adds up for scored eviction."""

from __future__ import annotations

import pytest
import torch

from sidecar.model import attention_sinks
from sidecar.model.attention import AttentionMetadata, PrefillSegment
from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu import paged_attention as decode_kernel
from sidecar.model.kernels.cpu import prefill_attention as prefill_kernel

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _meta(tables, ctx, bs, scores, kernel):
    slots = torch.zeros(len(ctx), dtype=torch.long)
    return AttentionMetadata(
        slots, bs, decode_block_tables=tables, decode_ctx_lens=ctx, use_cpu_kernel=kernel, kv_scores=scores
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "nh,nkv,hd,window", [(4, 2, 16, None), (8, 2, 64, 5), (6, 6, 32, None), (16, 2, 64, 9)]
)
def test_the_decode_kernel_takes_sinks_as_the_torch_path_does(dtype, nh, nkv, hd, window):
    assert decode_kernel.available(), cpu_build.reason("paged_attention")
    g = torch.Generator().manual_seed(nh * hd)
    bs, nblocks = 4, 12
    kc = torch.randn(nblocks, bs, nkv, hd, generator=g).to(dtype)
    vc = torch.randn(nblocks, bs, nkv, hd, generator=g).to(dtype)
    ctx = torch.tensor([1, 7, 13, 20])
    tables = torch.randperm(nblocks, generator=g)[:10].view(2, 5).repeat(2, 1)
    q = torch.randn(4, nh, hd, generator=g).to(dtype) * 2
    sinks = torch.randn(nh, generator=g) * 3  # some heads' sink dominates, others' barely counts
    sinks[0] = 40.0  # takes nearly all of head 0's weight: its output is close to zero
    outs, scores = [], []
    for kernel in (False, True):
        s = torch.zeros(nblocks * bs)
        outs.append(
            attention_sinks.attend(
                q, kc, vc, _meta(tables, ctx, bs, s, kernel), hd**-0.5, window, None, None, sinks
            )
        )
        scores.append(s)
    ref, got = outs[0].float(), outs[1].float()
    assert (got - ref).abs().max() <= TOL[dtype] * ref.abs().max()
    assert ref[:, 0].abs().max() < 1e-6 * ref.abs().max()
    assert torch.allclose(scores[1], scores[0], rtol=TOL[dtype], atol=1e-6)
    # without the sinks the rows differ: the kernel did not drop them
    plain = decode_kernel.decode_attention(q, kc, vc, tables, ctx, hd**-0.5, window)
    assert (plain.float() - got).abs().max() > 0.1


def test_the_decode_kernel_refuses_sinks_that_are_not_one_per_head():
    q = torch.randn(1, 4, 16)
    kc = torch.randn(2, 4, 2, 16)
    with pytest.raises(ValueError, match="sinks"):
        decode_kernel.decode_attention(
            q,
            kc,
            kc,
            torch.zeros(1, 1, dtype=torch.long),
            torch.ones(1, dtype=torch.long),
            1.0,
            sinks=torch.zeros(2),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "nh,nkv,hd,window", [(4, 2, 16, None), (8, 2, 64, 5), (6, 6, 32, None), (16, 2, 64, 9), (8, 1, 128, None)]
)
def test_the_prefill_kernel_takes_sinks_as_the_torch_path_does(dtype, nh, nkv, hd, window):
    """Two segments in one step: a whole prompt, and a chunk after 11 cached tokens, through the prefill kernel
    (the torch path's own loop when the kernel is off), both with sinks."""
    assert prefill_kernel.available(), cpu_build.reason("prefill_attention")
    g = torch.Generator().manual_seed(nh * hd + 1)
    bs, nblocks = 4, 16
    kc = torch.randn(nblocks, bs, nkv, hd, generator=g).to(dtype)
    vc = torch.randn(nblocks, bs, nkv, hd, generator=g).to(dtype)
    tables = torch.randperm(nblocks, generator=g)[:12].view(2, 6)
    segs = [PrefillSegment(0, 19, 19, tables[0]), PrefillSegment(19, 9, 20, tables[1])]
    q = torch.randn(28, nh, hd, generator=g).to(dtype) * 2
    sinks = torch.randn(nh, generator=g) * 3
    sinks[0] = 40.0  # takes nearly all of head 0's weight
    outs = []
    for kernel in (False, True):
        meta = AttentionMetadata(torch.zeros(28, dtype=torch.long), bs, prefills=segs, use_cpu_kernel=kernel)
        outs.append(attention_sinks.attend(q, kc, vc, meta, hd**-0.5, window, None, None, sinks))
    ref, got = outs[0].float(), outs[1].float()
    assert (got - ref).abs().max() <= TOL[dtype] * ref.abs().max()
    assert ref[:, 0].abs().max() < 1e-6 * ref.abs().max()
    # the kernel ran (and took the sinks): without them its rows differ
    for seg in segs:
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        args = (q[rows], kc, vc, seg.block_table, seg.ctx_len, hd**-0.5, window)
        with_sinks = prefill_kernel.prefill_attention(*args, sinks=sinks)
        assert with_sinks is not None and torch.equal(with_sinks, outs[1][rows])
        assert (prefill_kernel.prefill_attention(*args).float() - got[rows]).abs().max() > 0.1


def test_the_prefill_kernel_refuses_sinks_that_are_not_one_per_head():
    kc = torch.randn(2, 4, 2, 16)
    with pytest.raises(ValueError, match="sinks"):
        prefill_kernel.prefill_attention(
            torch.randn(3, 4, 16), kc, kc, torch.zeros(1, dtype=torch.long), 3, 1.0, sinks=torch.zeros(2)
        )

"""The CPU latent-attention decode kernel (kernels/cpu/latent_attention.c) against mla.py's torch form:
context lengths across block edges, head counts below, at and past a task's head group, float32 and bf16
caches, the scored-eviction sums per slot, and the inputs it refuses by reason."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sidecar.model.attention import AttentionMetadata
from sidecar.model.kernels.cpu import latent_attention as kernel
from sidecar.model.mla import LatentAttention

BS, NB = 8, 24
CTX = [1, 7, 8, 9, 31, 64, 100]  # a block's edges, several blocks, a table of 13 blocks


def _case(heads: int, rank: int, rope: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lc = torch.randn(NB, BS, 1, rank, generator=g).to(dtype)
    rc = torch.randn(NB, BS, 1, rope, generator=g).to(dtype)
    b = len(CTX)
    ql = (torch.randn(b, heads, rank, generator=g) * 0.3).to(dtype)
    qr = (torch.randn(b, heads, rope, generator=g) * 0.3).to(dtype)
    nb = -(-max(CTX) // BS)
    tables = torch.stack([torch.randperm(NB, generator=g)[:nb] for _ in range(b)])
    return ql, qr, (lc, rc), tables, torch.tensor(CTX)


def _torch(ql, qr, kv, tables, ctx, scale, scores=None):
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        block_size=BS,
        decode_block_tables=tables,
        decode_ctx_lens=ctx,
        kv_scores=scores,
    )
    spec = SimpleNamespace(kv_lora_rank=ql.shape[-1], rope_dim=qr.shape[-1])
    return LatentAttention._decode_torch(SimpleNamespace(spec=spec, scale=scale), ql, qr, kv, meta)


@pytest.mark.parametrize("heads", [1, 3, 16, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_torch_path(heads, dtype):
    ql, qr, kv, tables, ctx = _case(heads, 64, 16, dtype, seed=heads)
    want_scores, got_scores = torch.zeros(NB * BS), torch.zeros(NB * BS)
    want = _torch(ql, qr, kv, tables, ctx, 0.125, want_scores)
    got = kernel.decode_attention(ql, qr, kv[0], kv[1], tables, ctx, 0.125, got_scores)
    assert got is not None and got.dtype == dtype and got.shape == want.shape
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_scores, want_scores, **tol)
    # every head's weights sum to one per row
    assert abs(got_scores.sum().item() - heads * len(CTX)) < 1e-3 * heads * len(CTX)


def test_kernel_without_scores_and_with_a_rope_part_off_the_vector_width():
    ql, qr, kv, tables, ctx = _case(5, 32, 4, torch.float32)
    got = kernel.decode_attention(ql, qr, kv[0], kv[1], tables, ctx, 0.3)
    torch.testing.assert_close(got, _torch(ql, qr, kv, tables, ctx, 0.3), atol=1e-5, rtol=1e-5)


def test_inputs_it_cannot_take_are_refused_by_reason():
    ql, qr, kv, tables, ctx = _case(2, 12, 4, torch.float32)  # a rank of no whole vectors
    width = kernel._KERNEL.lib()._sidecar_width
    if 12 % width:
        assert "kv_lora_rank 12" in kernel.refusal(ql, *kv)
        assert kernel.decode_attention(ql, qr, kv[0], kv[1], tables, ctx, 0.3) is None
    ql, qr, kv, tables, ctx = _case(2, 64, 8, torch.float16)
    assert "float16" in kernel.refusal(ql, *kv)
    assert kernel.decode_attention(ql, qr, kv[0], kv[1], tables, ctx, 0.3) is None
    ql, qr, kv, tables, ctx = _case(2, 64, 8, torch.float32)
    assert "dtype" in kernel.refusal(ql, kv[0].bfloat16(), kv[1])


@pytest.mark.parametrize(
    "heads,dtype,on_kernel",
    [
        (16, torch.float32, True),
        (20, torch.float32, False),
        (20, torch.bfloat16, True),
        (128, torch.bfloat16, True),
    ],
)
def test_decode_rows_take_the_faster_path_per_dtype_and_heads(heads, dtype, on_kernel):
    # mla.py's choice: the kernel in bf16, in float32 only up to F32_MAX_HEADS heads (past that torch's
    # batched GEMM); the kernel takes these inputs either way, and both paths give the same rows
    from sidecar.model import mla

    ql, qr, kv, tables, ctx = _case(heads, 64, 16, dtype, seed=heads)
    assert kernel.refusal(ql, *kv) is None
    why = kernel.slower_than_torch(dtype, heads)
    assert (why is None) == on_kernel and (on_kernel or f"past {kernel.F32_MAX_HEADS} heads" in why)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        block_size=BS,
        decode_block_tables=tables,
        decode_ctx_lens=ctx,
    )
    got = mla._kernel_decode(ql, qr, kv, meta, 0.125)
    assert (got is not None) == on_kernel
    if on_kernel:
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(got, _torch(ql, qr, kv, tables, ctx, 0.125), **tol)


def test_kernel_scores_are_the_same_bits_on_every_call():
    """A row's head groups and rows sharing blocks add to the same slots: the kernel adds the tasks' parts in
    one order on every call with the same rows and threads, so a replayed step leaves the scores an eager one
    leaves."""
    ql, qr, kv, tables, ctx = _case(20, 64, 16, torch.float32, seed=5)
    tables[1:3] = tables[-1]  # three rows over one sequence's blocks
    ctx[1:3] = torch.tensor([99, 98])
    start = torch.rand(NB * BS, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            first = start.clone()
            assert kernel.decode_attention(ql, qr, kv[0], kv[1], tables, ctx, 0.125, first) is not None
            for _ in range(3):
                again = start.clone()
                kernel.decode_attention(ql, qr, kv[0], kv[1], tables, ctx, 0.125, again)
                assert torch.equal(again, first), n
    finally:
        torch.set_num_threads(threads)

"""Our CPU paged decode-attention kernel against the torch path (gather + SDPA), its oracle."""

from __future__ import annotations

import pytest
import torch

from sidecar.model import attention
from sidecar.model.attention import AttentionMetadata, paged_attention
from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu import paged_attention as kernel


def _case(ctx_lens, nh, nkv, hd, bs=16, dtype=torch.float32, seed=0):
    """A pool with blocks handed out in a shuffled order, and decode rows over it."""
    g = torch.Generator().manual_seed(seed)
    per_row = [-(-c // bs) for c in ctx_lens]
    width = max(per_row)
    num_blocks = sum(per_row) + 3
    k_cache = torch.randn(num_blocks, bs, nkv, hd, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, nkv, hd, generator=g).to(dtype)
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = []
    for n in per_row:
        tables.append(ids[:n] + [0] * (width - n))
        ids = ids[n:]
    q = torch.randn(len(ctx_lens), nh, hd, generator=g).to(dtype)
    return q, k_cache, v_cache, torch.tensor(tables), torch.tensor(ctx_lens)


def _torch_path(q, k_cache, v_cache, tables, ctx, scale, window):
    # The new rows' K/V are already in the cache: write them back unchanged through paged_attention.
    bs = k_cache.shape[1]
    last = ctx - 1
    slots = tables.gather(1, (last // bs)[:, None])[:, 0] * bs + last % bs
    nkv, hd = k_cache.shape[2], k_cache.shape[3]
    k_new = k_cache.view(-1, nkv, hd)[slots].clone()
    v_new = v_cache.view(-1, nkv, hd)[slots].clone()
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_size=bs,
        decode_block_tables=tables,
        decode_ctx_lens=ctx,
        use_cpu_kernel=False,
    )
    return paged_attention(q, k_new, v_new, k_cache, v_cache, meta, scale, window)


def test_kernel_builds_on_this_machine():
    assert kernel.available(), cpu_build.reason("paged_attention")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "ctx_lens,nh,nkv,hd",
    [
        ([1], 4, 4, 64),  # a context of one key
        ([17, 400, 33, 5], 9, 3, 64),  # SmolLM2-135M's heads; lengths across block edges
        ([300] * 6 + [129], 14, 2, 64),  # Qwen2-0.5B's heads (7 queries per KV head)
        ([1000, 1001, 1002, 1003, 1004], 8, 2, 128),  # verification rows of one sequence, Llama's head size
        ([70, 2], 6, 6, 32),  # no grouping; a head size only one vector wide on AVX-512
    ],
)
def test_kernel_matches_torch_path(ctx_lens, nh, nkv, hd, dtype):
    q, kc, vc, tables, ctx = _case(ctx_lens, nh, nkv, hd, dtype=dtype, seed=len(ctx_lens) + hd)
    scale = hd**-0.5
    out = kernel.decode_attention(q, kc, vc, tables, ctx, scale)
    ref = _torch_path(q, kc, vc, tables, ctx, scale, None)
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    assert (out.float() - ref.float()).abs().max() <= tol


@pytest.mark.parametrize("window", [1, 16, 50, 4096])
def test_sliding_window(window):
    q, kc, vc, tables, ctx = _case([5, 49, 50, 51, 200], 4, 2, 64, seed=window)
    out = kernel.decode_attention(q, kc, vc, tables, ctx, 0.125, window)
    ref = _torch_path(q, kc, vc, tables, ctx, 0.125, window)
    assert (out - ref).abs().max() <= 2e-6


def test_a_row_does_not_depend_on_the_other_rows():
    """Verification rows of one sequence give bit for bit what separate single-row calls give: speculative
    decoding then reproduces plain decoding's numerics."""
    q, kc, vc, tables, ctx = _case([300, 301, 302, 303, 304], 9, 3, 64, seed=5)
    tables = tables[:1].expand(5, -1).contiguous()  # one sequence: the same blocks for every row
    together = kernel.decode_attention(q, kc, vc, tables, ctx, 0.125)
    for i in range(5):
        alone = kernel.decode_attention(q[i : i + 1], kc, vc, tables[i : i + 1], ctx[i : i + 1], 0.125)
        assert torch.equal(together[i : i + 1], alone)


def test_extreme_scores_stay_finite_and_exact_where_one_key_dominates():
    q, kc, vc, tables, ctx = _case([40, 40], 2, 1, 64, seed=9)
    kc.mul_(100.0)  # scores in the thousands: the softmax must subtract the maximum
    out = kernel.decode_attention(q, kc, vc, tables, ctx, 1.0)
    ref = _torch_path(q, kc, vc, tables, ctx, 1.0, None)
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pos", [0, 7, 15, 16, 31, 32, 47, 48, 52])
def test_the_softmax_finds_the_largest_score_wherever_it_is(pos, dtype):
    # 53 keys: whole vectors of scores and a tail; one key's score ~hundreds above the rest, so a maximum that
    # missed it would overflow the exp
    q, kc, vc, tables, ctx = _case([53], 2, 1, 64, dtype=dtype, seed=pos)
    slot = tables[0, pos // 16] * 16 + pos % 16
    kc.view(-1, 1, 64)[slot, 0] = (q[0, 0].float() * 12.0).to(dtype)
    out = kernel.decode_attention(q, kc, vc, tables, ctx, 1.0)
    ref = _torch_path(q, kc, vc, tables, ctx, 1.0, None)
    assert torch.isfinite(out).all()
    # float32: within 1e-5 of the output's scale (the kernel's exp is a polynomial, torch's libm's)
    tol = 1e-5 * max(1.0, ref.float().abs().max().item()) if dtype is torch.float32 else 2e-2
    assert (out.float() - ref.float()).abs().max() <= tol
    assert torch.allclose(
        out[0, 0].float(), vc.view(-1, 1, 64)[slot, 0].float(), atol=1e-2
    )  # that key's value


def test_inputs_it_does_not_take_fall_back_to_torch(monkeypatch):
    q, kc, vc, tables, ctx = _case([20, 30], 4, 2, 64)
    assert kernel.decode_attention(q.half(), kc.half(), vc.half(), tables, ctx, 0.125) is None
    assert (
        kernel.decode_attention(
            q[:, :, :36], kc[..., :36].contiguous(), vc[..., :36].contiguous(), tables, ctx, 0.125
        )
        is None
    )  # head size not a multiple of the vector width
    with pytest.raises(ValueError, match="int64"):
        kernel.decode_attention(q, kc, vc, tables.int(), ctx, 0.125)
    # paged_attention takes the torch path for them, and for every input when the kernel is switched off.
    calls = []
    monkeypatch.setattr(attention.cpu_kernel, "decode_attention", lambda *a, **k: calls.append(1))
    out = paged_attention(
        q,
        kc[1, :2].clone(),
        vc[1, :2].clone(),
        kc,
        vc,
        AttentionMetadata(
            slot_mapping=torch.tensor([16, 17]),
            block_size=16,
            decode_block_tables=tables,
            decode_ctx_lens=ctx,
        ),
        0.125,
    )
    assert calls == [1] and torch.isfinite(out).all()


@pytest.mark.parametrize("arch", ["-mavx2 -mfma", "-mtune=generic"])  # AVX2 only (as on Zen 2); plain x86-64
def test_other_instruction_sets_match_torch_path(arch, monkeypatch):
    monkeypatch.setenv("SIDECAR_CPU_ARCH_FLAGS", arch)
    monkeypatch.setattr(cpu_build, "_loaded", {})
    assert kernel.available(), cpu_build.reason("paged_attention")
    for dtype in (torch.float32, torch.bfloat16):
        for ctx_lens, nh, nkv, hd, window in [
            ([17, 400, 33], 9, 3, 64, None),
            ([90, 91], 8, 2, 128, 40),
            ([3, 64], 2, 2, 24, None),
            ([2100, 1500], 9, 3, 64, None),  # long contexts: the AVX2 build sums their values in chunks
            ([1300, 1301], 8, 2, 128, 1100),
        ]:
            q, kc, vc, tables, ctx = _case(ctx_lens, nh, nkv, hd, dtype=dtype, seed=hd)
            out = kernel.decode_attention(q, kc, vc, tables, ctx, 0.1, window)
            ref = _torch_path(q, kc, vc, tables, ctx, 0.1, window)
            assert (out.float() - ref.float()).abs().max() <= (2e-6 if dtype == torch.float32 else 2e-2)

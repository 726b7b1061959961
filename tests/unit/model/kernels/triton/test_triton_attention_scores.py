"""The Triton decode kernel's received-attention accounting (scored KV eviction) against the torch path of
attention.py, which is the reference the CPU decode kernel is held to as well."""

import pytest
import torch

from sidecar.model.attention import AttentionMetadata, paged_attention
from sidecar.model.kernels.gpu_paths import FastPaths
from sidecar.model.kernels.triton import attention as ta
from tests.unit.model.kernels.triton.test_triton_attention import _case, _quant_case


def _decode(q, kc, vc, tables, ctx, window, softcap, on, kv_scales=None):
    """The decode rows through paged_attention with the kernel ``on`` or off; returns (out, scores)."""
    scores = torch.zeros(kc.shape[0] * kc.shape[1], dtype=torch.float32, device=q.device)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long, device=q.device),
        block_size=kc.shape[1],
        decode_block_tables=tables,
        decode_ctx_lens=ctx,
        use_cpu_kernel=False,
    )
    meta.kv_scores = scores
    hd = q.shape[-1]
    out = paged_attention(
        q,
        None,
        None,
        kc,
        vc,
        meta,
        hd**-0.5,
        window,
        kv_written=True,
        paths=FastPaths(attention=on),
        kv_scales=kv_scales,
        softcap=softcap,
    )
    return out, scores


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "ctx_lens,nh,nkv,hd,bs,window,softcap,part",
    [
        (
            [17, 16, 15, 33],
            4,
            2,
            32,
            16,
            None,
            None,
            None,
        ),  # one partition per row: the lse of the first kernel
        ([100, 3, 64, 65], 8, 2, 16, 8, None, None, 32),  # split: the lse of the merge; GQA 4
        ([100, 9, 64], 4, 1, 24, 16, 20, None, 32),  # sliding window: keys before it add nothing
        ([70, 40], 6, 3, 16, 4, None, 5.0, None),  # soft-capped scores
    ],
)
def test_scores_match_the_torch_path(
    ctx_lens, nh, nkv, hd, bs, window, softcap, part, dtype, device, monkeypatch
):
    q, kc, vc, tables, ctx = _case(ctx_lens, nh, nkv, hd, bs, dtype, device, seed=hd + bs)
    if part is not None:  # force the split so both kernels' lse are exercised
        real = ta.paged_decode_attention
        monkeypatch.setattr(
            ta, "paged_decode_attention", lambda *a, **k: real(*a, **{**k, "partition_size": part})
        )
    ref_out, ref = _decode(q, kc, vc, tables, ctx, window, softcap, on=False)
    out, got = _decode(q, kc, vc, tables, ctx, window, softcap, on=True)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got, ref, atol=tol * nh, rtol=tol)
    # Each row gives each head a softmax's worth (1) in all; no slot outside the rows' tables gets any.
    assert abs(float(got.sum()) - len(ctx_lens) * nh) < 1e-3 * len(ctx_lens) * nh
    used = set()
    for r, n in enumerate(ctx.tolist()):
        lo = 0 if window is None else max(0, n - window)
        used |= {int(tables[r, j // bs]) * bs + j % bs for j in range(lo, n)}
    unused = torch.ones_like(got, dtype=torch.bool)
    unused[sorted(used)] = False
    assert torch.all(got[unused] == 0)


def test_rows_sharing_a_block_add_both_their_weights(device):
    # Two rows over the very same table (a shared prefix): every slot gets both rows' weights.
    q, kc, vc, tables, ctx = _case([40], 4, 2, 16, 8, torch.float32, device, seed=3)
    q2 = torch.cat([q, q.flip(1)])
    t2, c2 = tables.repeat(2, 1), ctx.repeat(2)
    _, ref = _decode(q2, kc, vc, t2, c2, None, None, on=False)
    _, got = _decode(q2, kc, vc, t2, c2, None, None, on=True)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=2e-5)
    assert abs(float(got.sum()) - 2 * 4) < 1e-4


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_scores_over_a_quantized_cache(kv_dtype, device):
    q, cache, tables, ctx = _quant_case([40, 3, 29], 4, 2, 16, 8, torch.float32, kv_dtype, device, seed=5)
    ref_out, ref = _decode(q, cache[0], cache[1], tables, ctx, None, None, on=False, kv_scales=cache[2:])
    out, got = _decode(q, cache[0], cache[1], tables, ctx, None, None, on=True, kv_scales=cache[2:])
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=2e-5)


def test_a_score_vector_the_kernel_cannot_index_is_refused(device):
    q, kc, vc, tables, ctx = _case([20], 2, 2, 16, 16, torch.float32, device)
    short = torch.zeros(kc.shape[0] * kc.shape[1] - 1, device=device)
    assert ta.paged_decode_attention(q, kc, vc, tables, ctx, 0.25, scores=short) is None
    wrong = torch.zeros(kc.shape[0] * kc.shape[1], dtype=torch.float64, device=device)
    assert ta.paged_decode_attention(q, kc, vc, tables, ctx, 0.25, scores=wrong) is None

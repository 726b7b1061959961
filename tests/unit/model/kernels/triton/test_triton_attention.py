"""The Triton paged decode-attention kernel against a plain float32 reference, and through attention.py."""

import pytest
import torch

from sidecar.model.attention import AttentionMetadata, paged_attention
from sidecar.model.kernels.triton import attention as ta
from sidecar.model.kernels.gpu_paths import FastPaths


def _case(ctx_lens, nh, nkv, hd, bs, dtype, device, seed=0, scale_q=1.0):
    """A pool with blocks in shuffled order; rows padded with block 0 past their context."""
    g = torch.Generator().manual_seed(seed)
    per_row = [max(1, -(-c // bs)) for c in ctx_lens]
    width = max(per_row) + 1  # one spare column of padding in every row
    num_blocks = sum(per_row) + 2
    kc = torch.randn(num_blocks, bs, nkv, hd, generator=g)
    vc = torch.randn(num_blocks, bs, nkv, hd, generator=g)
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = []
    for n in per_row:
        tables.append(ids[:n] + [0] * (width - n))
        ids = ids[n:]
    q = torch.randn(len(ctx_lens), nh, hd, generator=g) * scale_q
    to = dict(dtype=dtype, device=device)
    return (
        q.to(**to),
        kc.to(**to),
        vc.to(**to),
        torch.tensor(tables, device=device),
        torch.tensor(ctx_lens, device=device),
    )


def _reference(q, kc, vc, tables, ctx, scale, window, softcap=None):
    """Row by row in float32: gather the context, softmax over the visible keys (their scaled scores
    soft-capped, ``softcap * tanh(s / softcap)``, when ``softcap``)."""
    b, nh, hd = q.shape
    bs, nkv = kc.shape[1], kc.shape[2]
    out = torch.zeros(b, nh, hd)
    for r in range(b):
        n = int(ctx[r])
        lo = 0 if window is None else max(0, n - window)
        blocks = tables[r, : -(-n // bs)].long().cpu()
        k = kc.cpu().float()[blocks].reshape(-1, nkv, hd)[lo:n]
        v = vc.cpu().float()[blocks].reshape(-1, nkv, hd)[lo:n]
        rep = nh // nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("hd,nhd->hn", q[r].cpu().float(), k) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        out[r] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out


TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "ctx_lens,nh,nkv,hd,bs,window,part",
    [
        ([1], 2, 2, 16, 16, None, None),  # one key; GQA ratio 1
        ([17, 16, 15, 33], 4, 2, 32, 16, None, None),  # block_size + 1, block edges; GQA 2
        ([17, 16, 15, 33], 4, 2, 32, 16, None, 32),  # the same split into 32-token partitions
        ([100, 3, 64, 65], 8, 2, 16, 8, None, 32),  # GQA 4, several partitions, some rows in one
        ([100, 9, 64], 4, 1, 24, 16, 20, 32),  # sliding window; head size not a power of two
        ([100, 9, 64], 4, 1, 24, 16, 20, None),  # the window without a split
        ([70, 40], 6, 3, 16, 4, 33, 32),  # window across a partition boundary; blocks smaller than a tile
    ],
)
def test_kernel_matches_reference(ctx_lens, nh, nkv, hd, bs, window, part, dtype, device):
    q, kc, vc, tables, ctx = _case(ctx_lens, nh, nkv, hd, bs, dtype, device, seed=len(ctx_lens) + hd)
    out = ta.paged_decode_attention(q, kc, vc, tables.to(torch.int32), ctx, hd**-0.5, window, part)
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    ref = _reference(q, kc, vc, tables, ctx, hd**-0.5, window)
    torch.testing.assert_close(out.float().cpu(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_int64_and_int32_tables_agree_and_split_equals_unsplit(device):
    q, kc, vc, tables, ctx = _case([90, 31, 1], 4, 2, 16, 16, torch.float32, device, seed=3)
    a = ta.paged_decode_attention(q, kc, vc, tables, ctx, 0.25, None, None)
    b = ta.paged_decode_attention(q, kc, vc, tables.int(), ctx.int(), 0.25, None, None)
    c = ta.paged_decode_attention(q, kc, vc, tables, ctx, 0.25, None, 32)
    assert torch.equal(a, b)
    torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-6)


def test_extreme_logits_stay_finite_and_exact(device):
    # Scores of magnitude ~1e4: exp without the running max would overflow to inf / NaN.
    q, kc, vc, tables, ctx = _case([50, 7], 4, 2, 16, 16, torch.float32, device, seed=5, scale_q=3000.0)
    for part in (None, 16):
        out = ta.paged_decode_attention(q, kc, vc, tables, ctx, 1.0, None, part)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(
            out.cpu(), _reference(q, kc, vc, tables, ctx, 1.0, None), atol=1e-5, rtol=1e-5
        )


def test_padded_rows_read_block_zero_and_stay_finite(device):
    # A padded row of a fixed-size batch: all-zero block table, context 1 (the runner's filler).
    q, kc, vc, tables, ctx = _case([40, 1], 4, 2, 16, 16, torch.float32, device, seed=7)
    tables[1].zero_()
    out = ta.paged_decode_attention(q, kc, vc, tables, ctx, 0.25, None, 16)
    torch.testing.assert_close(out[1].cpu(), vc[0, 0].cpu().repeat_interleave(2, 0))
    torch.testing.assert_close(
        out[0].cpu(), _reference(q, kc, vc, tables, ctx, 0.25, None)[0], atol=2e-5, rtol=0
    )


def test_writes_into_given_buffer_and_refuses_bad_tables(device):
    q, kc, vc, tables, ctx = _case([20], 2, 2, 16, 16, torch.float32, device)
    buf = torch.full_like(q, float("nan"))
    assert ta.paged_decode_attention(q, kc, vc, tables, ctx, 0.25, out=buf) is buf
    assert torch.isfinite(buf).all()
    with pytest.raises(ValueError, match="decode_block_tables"):
        ta.paged_decode_attention(q, kc, vc, tables.float(), ctx, 0.25)
    assert (
        ta.paged_decode_attention(q, kc.half(), vc.half(), tables, ctx, 0.25) is None
    )  # mixed dtypes: torch path


@pytest.mark.parametrize("window", [None, 12])
def test_attention_module_takes_kernel_for_decode_rows_only(window, device, monkeypatch):
    # One prefill segment and two decode rows in one step; fast path on vs the torch path.
    bs, nh, nkv, hd = 8, 4, 2, 16
    g = torch.Generator().manual_seed(11)
    kc = torch.randn(12, bs, nkv, hd, generator=g).to(device)
    vc = torch.randn(12, bs, nkv, hd, generator=g).to(device)
    from sidecar.model.attention import PrefillSegment

    seg = PrefillSegment(q_start=0, q_len=5, ctx_len=13, block_table=torch.tensor([3, 4], device=device))
    tables = torch.tensor([[5, 6, 7], [8, 0, 0]], device=device)
    ctx = torch.tensor([20, 2], device=device)
    slots = torch.tensor([4 * bs + i for i in range(0, 5)] + [7 * bs + 3, 8 * bs + 1], device=device)
    q = torch.randn(7, nh, hd, generator=g).to(device)
    k = torch.randn(7, nkv, hd, generator=g).to(device)
    v = torch.randn(7, nkv, hd, generator=g).to(device)
    calls = []
    real = ta.paged_decode_attention
    monkeypatch.setattr(
        ta, "paged_decode_attention", lambda qd, *a, **k: calls.append(qd.shape[0]) or real(qd, *a, **k)
    )
    outs = []
    for on in (False, True):
        paths = FastPaths(attention=on)
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_size=bs,
            prefills=[seg],
            decode_block_tables=tables,
            decode_ctx_lens=ctx,
            use_cpu_kernel=False,
        )
        outs.append(paged_attention(q, k, v, kc.clone(), vc.clone(), meta, hd**-0.5, window, paths=paths))
    assert calls == [2]  # once, for the two decode rows, and only with the path on
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)


def _quant_case(ctx_lens, nh, nkv, hd, bs, qdtype, kv_dtype, device, seed=0):
    """A quantized pool (codes + float32 scales per token and KV head, written by kv_quant) in shuffled blocks."""
    from sidecar.model import kv_quant

    q, kc, vc, tables, ctx = _case(ctx_lens, nh, nkv, hd, bs, torch.float32, torch.device("cpu"), seed=seed)
    cache = kv_quant.allocate(kc.shape[0], bs, nkv, hd, kv_dtype, torch.device("cpu"))
    kv_quant.write(cache, kc.view(-1, nkv, hd) * 3, vc.view(-1, nkv, hd), torch.arange(kc.shape[0] * bs))
    return q.to(qdtype).to(device), tuple(t.to(device) for t in cache), tables.to(device), ctx.to(device)


def _torch_decode(q, cache, tables, ctx, scale, window, softcap=None):
    """The torch path of attention.py over the quantized cache (it dequantizes to q's dtype, as the kernel)."""
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long, device=q.device),
        block_size=cache[0].shape[1],
        decode_block_tables=tables.long(),
        decode_ctx_lens=ctx,
        use_cpu_kernel=False,
    )
    return paged_attention(
        q,
        None,
        None,
        cache[0],
        cache[1],
        meta,
        scale,
        window,
        kv_written=True,
        kv_scales=cache[2:],
        softcap=softcap,
    )


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "ctx_lens,nh,nkv,hd,bs,window,part",
    [
        ([1], 2, 2, 16, 16, None, None),  # one key
        ([17, 16, 15, 33], 4, 2, 32, 16, None, 32),  # block edges, split into partitions; GQA 2
        ([100, 9, 64], 8, 2, 24, 8, 20, 32),  # GQA 4, sliding window, head size not a power of two
        ([70, 40], 6, 3, 16, 4, 33, None),  # window; blocks smaller than a tile
    ],
)
def test_kernel_reads_quantized_blocks_like_the_torch_path(
    ctx_lens, nh, nkv, hd, bs, window, part, qdtype, kv_dtype, device
):
    q, cache, tables, ctx = _quant_case(ctx_lens, nh, nkv, hd, bs, qdtype, kv_dtype, device, seed=hd + bs)
    out = ta.paged_decode_attention(
        q, cache[0], cache[1], tables.int(), ctx, hd**-0.5, window, part, kv_scales=cache[2:]
    )
    assert out is not None and out.dtype == qdtype and out.shape == q.shape
    ref = _torch_decode(q, cache, tables, ctx, hd**-0.5, window)
    tol = TOL[qdtype] * (3 if qdtype == torch.bfloat16 else 1)  # values up to ~3x the plain case's
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=tol, rtol=tol)


def test_quantized_cache_needs_its_scales_of_the_pool_layout(device):
    q, cache, tables, ctx = _quant_case([20], 2, 2, 16, 16, torch.float32, torch.int8, device)
    assert ta.paged_decode_attention(q, cache[0], cache[1], tables, ctx, 0.25) is None  # codes without scales
    bad = (cache[2][:, :8], cache[3][:, :8])
    assert ta.paged_decode_attention(q, cache[0], cache[1], tables, ctx, 0.25, kv_scales=bad) is None


def test_attention_module_sends_quantized_decode_rows_to_the_kernel(device, monkeypatch):
    q, cache, tables, ctx = _quant_case([40, 3], 4, 2, 16, 8, torch.float32, torch.int8, device, seed=2)
    calls = []
    real = ta.paged_decode_attention
    monkeypatch.setattr(
        ta,
        "paged_decode_attention",
        lambda qd, *a, **k: calls.append(k.get("kv_scales") is not None) or real(qd, *a, **k),
    )
    outs = []
    for on in (False, True):
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(0, dtype=torch.long, device=device),
            block_size=8,
            decode_block_tables=tables,
            decode_ctx_lens=ctx,
            use_cpu_kernel=False,
        )
        outs.append(
            paged_attention(
                q,
                None,
                None,
                cache[0],
                cache[1],
                meta,
                0.25,
                None,
                kv_written=True,
                paths=FastPaths(attention=on),
                kv_scales=cache[2:],
            )
        )
    assert calls == [True]
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)


def test_self_check_keeps_the_kernel_on_an_int8_cache(tiny_models, monkeypatch):
    """The start-up self-check probes the runner's own (int8) cache, so the path it turns on is the kernel
    reading codes and scales; greedy tokens are those of the torch path."""
    from sidecar import LLM, SamplingParams
    from sidecar.engine import self_check

    llm = LLM(model=str(tiny_models["llama"]), dtype="float32", kv_cache_dtype="int8", num_kv_blocks=40)
    runner = llm.engine.runner
    assert len(runner.kv_caches[0]) == 4  # codes and scales
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [[5, 9, 100, 7, 3] * 4, [11, 12, 13]]
    ref = [o.token_ids for o in llm.generate(prompts, params)]
    seen = []
    real = ta.paged_decode_attention
    monkeypatch.setattr(
        ta,
        "paged_decode_attention",
        lambda qd, *a, **k: seen.append(k.get("kv_scales") is not None) or real(qd, *a, **k),
    )
    assert self_check.run(runner, ["attention"]) == {}
    assert runner.fast_paths.attention and seen and all(seen)
    seen.clear()
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    assert seen and all(seen)


SOFTCAP_CASES = [
    # ctx_lens, nh, nkv, hd, bs, window, part
    ([1, 33], 2, 2, 16, 16, None, None),  # one key; no grouping
    ([17, 16, 15, 33], 4, 2, 32, 16, None, 32),  # block edges, split into partitions; GQA 2
    ([100, 9, 64], 8, 2, 24, 8, 20, 32),  # GQA 4, a window shorter than the context, head size 24
    ([70, 40], 8, 1, 64, 4, 33, None),  # all heads on one KV head, a window, blocks smaller than a tile
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ctx_lens,nh,nkv,hd,bs,window,part", SOFTCAP_CASES)
def test_softcap_matches_reference(ctx_lens, nh, nkv, hd, bs, window, part, dtype, device):
    """Gemma 2's capped scores: the kernel against the float32 reference, with scores well past the cap (the
    uncapped answer is far from it)."""
    q, kc, vc, tables, ctx = _case(ctx_lens, nh, nkv, hd, bs, dtype, device, seed=hd + bs, scale_q=4.0)
    out = ta.paged_decode_attention(q, kc, vc, tables.int(), ctx, hd**-0.5, window, part, softcap=5.0)
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    ref = _reference(q, kc, vc, tables, ctx, hd**-0.5, window, softcap=5.0)
    torch.testing.assert_close(out.float().cpu(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert (_reference(q, kc, vc, tables, ctx, hd**-0.5, window) - ref).abs().max() > 0.05


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
def test_softcap_over_a_quantized_cache_matches_the_torch_path(qdtype, kv_dtype, device):
    q, cache, tables, ctx = _quant_case([100, 9, 64], 8, 2, 32, 8, qdtype, kv_dtype, device, seed=4)
    q = q * 4
    out = ta.paged_decode_attention(
        q, cache[0], cache[1], tables.int(), ctx, 32**-0.5, 20, 32, kv_scales=cache[2:], softcap=3.0
    )
    ref = _torch_decode(q, cache, tables, ctx, 32**-0.5, 20, softcap=3.0)
    tol = TOL[qdtype] * (3 if qdtype == torch.bfloat16 else 1)
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=tol, rtol=tol)


def test_attention_module_sends_capped_decode_rows_to_the_kernel(device, monkeypatch):
    """A soft-capped layer's decode rows take the kernel with the cap, and agree with the torch path."""
    q, kc, vc, tables, ctx = _case([40, 3, 17], 4, 2, 16, 8, torch.float32, device, seed=9, scale_q=4.0)
    caps = []
    real = ta.paged_decode_attention
    monkeypatch.setattr(
        ta, "paged_decode_attention", lambda qd, *a, **k: caps.append(k.get("softcap")) or real(qd, *a, **k)
    )
    outs = []
    for on in (False, True):
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(0, dtype=torch.long, device=device),
            block_size=8,
            decode_block_tables=tables,
            decode_ctx_lens=ctx,
            use_cpu_kernel=False,
        )
        outs.append(
            paged_attention(
                q,
                None,
                None,
                kc,
                vc,
                meta,
                0.25,
                10,
                kv_written=True,
                paths=FastPaths(attention=on),
                softcap=4.0,
            )
        )
    assert caps == [4.0]
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)

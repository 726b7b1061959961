"""Our CPU prompt-attention kernel against the torch path (gather + masked SDPA in float32), its oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sidecar.model import attention, kv_quant
from sidecar.model.attention import AttentionMetadata, PrefillSegment, paged_attention
from sidecar.model.kernels.cpu import cpu_build
from sidecar.model.kernels.cpu import prefill_attention as kernel


def _case(rows, ctx, nh, nkv, hd, bs=16, dtype=torch.float32, seed=0):
    """One sequence's blocks handed out in a shuffled order from a pool, and its last ``rows`` queries."""
    g = torch.Generator().manual_seed(seed)
    n = -(-ctx // bs)
    num_blocks = n + 5
    k_cache = torch.randn(num_blocks, bs, nkv, hd, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, nkv, hd, generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[:n]
    q = torch.randn(rows, nh, hd, generator=g).to(dtype)
    return q, k_cache, v_cache, table


def _reference(q, k_cache, v_cache, table, ctx, scale, window=None, kv_scales=None):
    """Float32 attention of rows at positions ctx - rows .. ctx - 1 over the gathered keys."""
    rows, nh, hd = q.shape
    nkv = k_cache.shape[2]
    if kv_scales is None:
        k = k_cache.index_select(0, table).reshape(-1, nkv, hd)[:ctx].float()
        v = v_cache.index_select(0, table).reshape(-1, nkv, hd)[:ctx].float()
    else:
        k = kv_quant.gather(k_cache, kv_scales[0], table, ctx, torch.float32)
        v = kv_quant.gather(v_cache, kv_scales[1], table, ctx, torch.float32)
    qpos = torch.arange(ctx - rows, ctx)[:, None]
    kpos = torch.arange(ctx)[None, :]
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    rep = nh // nkv
    o = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        k.transpose(0, 1).repeat_interleave(rep, 0)[None],
        v.transpose(0, 1).repeat_interleave(rep, 0)[None],
        attn_mask=mask[None, None],
        scale=scale,
    )
    return o[0].transpose(0, 1)


def test_kernel_builds_on_this_machine():
    assert kernel.available(), cpu_build.reason("prefill_attention")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows,ctx,nh,nkv,hd,bs",
    [
        (1, 1, 4, 4, 64, 16),  # a one-token prompt
        (
            37,
            37,
            14,
            2,
            64,
            16,
        ),  # a whole prompt, Qwen2-0.5B's heads (7 queries per KV head), blocks part-filled
        (5, 70, 9, 3, 64, 16),  # a chunk after 65 cached tokens, SmolLM2-135M's heads
        (100, 300, 8, 8, 128, 16),  # no grouping, Llama's head size
        (64, 64, 32, 1, 64, 32),  # 32 query heads on one KV head: one row per task
        (20, 90, 6, 2, 48, 8),  # a head size of three AVX-512 vectors, small blocks
        (257, 257, 2, 1, 32, 16),  # more rows than a block of keys, a head size of two vectors
        (9, 40, 40, 1, 64, 16),  # 40 query heads on one KV head: a task's queries in blocks of 32 and 8
        (300, 1100, 14, 2, 64, 16),  # a long context after a cached part: rows of scores wider than a page
        (33, 90, 8, 2, 256, 8),  # Gemma's head size 256 (on AVX2 the values in two slices of dimensions)
    ],
)
def test_kernel_matches_reference(rows, ctx, nh, nkv, hd, bs, dtype):
    q, kc, vc, table = _case(rows, ctx, nh, nkv, hd, bs, dtype, seed=rows + hd)
    scale = hd**-0.5
    out = kernel.prefill_attention(q, kc, vc, table, ctx, scale)
    ref = _reference(q, kc, vc, table, ctx, scale)
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    # float32: only the order of the sums differs; bf16: the output's one rounding (half an ulp, <= 2^-8 relative),
    # and on CPUs with AMX the softmax weights rounded to bf16 before the value product, as torch's bf16 SDPA does
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    assert (out.float() - ref).abs().max() <= tol


@pytest.mark.parametrize(
    "rows,ctx,window", [(40, 40, 5), (64, 200, 50), (33, 33, 7), (10, 500, 1), (16, 80, 4096)]
)
def test_sliding_window(rows, ctx, window):
    q, kc, vc, table = _case(rows, ctx, 4, 2, 64, seed=window)
    out = kernel.prefill_attention(q, kc, vc, table, ctx, 0.125, window)
    assert (out - _reference(q, kc, vc, table, ctx, 0.125, window)).abs().max() <= 2e-6


def test_int8_cache_is_read_in_place_with_its_scales():
    q, kc, vc, table = _case(50, 120, 6, 2, 64, seed=3)
    k8, v8 = torch.empty_like(kc, dtype=torch.int8), torch.empty_like(vc, dtype=torch.int8)
    ks, vs = torch.empty(kc.shape[:3]), torch.empty(vc.shape[:3])
    slots = torch.arange(kc.shape[0] * kc.shape[1])
    kv_quant.write((k8, v8, ks, vs), kc.view(-1, 2, 64), vc.view(-1, 2, 64), slots)
    for dtype in (torch.float32, torch.bfloat16):
        out = kernel.prefill_attention(q.to(dtype), k8, v8, table, 120, 0.125, None, (ks, vs))
        ref = _reference(q.to(dtype), k8, v8, table, 120, 0.125, None, (ks, vs))
        assert (out.float() - ref).abs().max() <= (2e-6 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("window", [None, 10])
def test_a_row_does_not_depend_on_how_the_prompt_was_split(window):
    """A row's result is the same bits whether its prompt came in one segment or in chunks (each row's sums
    run over its own keys in one order; on CPUs with AMX, in tiles of keys counted from a multiple of 32 whatever
    the first key a segment sees), so chunked prefill reproduces an unchunked run."""
    q, kc, vc, table = _case(90, 90, 14, 2, 64, dtype=torch.bfloat16, seed=11)
    whole = kernel.prefill_attention(q, kc, vc, table, 90, 0.125, window)
    parts = [
        kernel.prefill_attention(q[a:b], kc, vc, table, b, 0.125, window)
        for a, b in ((0, 13), (13, 50), (50, 90))
    ]
    assert torch.equal(whole, torch.cat(parts))
    assert (whole.float() - _reference(q, kc, vc, table, 90, 0.125, window)).abs().max() <= 2e-2


def test_extreme_scores_stay_finite():
    q, kc, vc, table = _case(30, 40, 2, 1, 64, seed=9)
    kc.mul_(100.0)  # scores in the thousands: the softmax must subtract each row's maximum
    out = kernel.prefill_attention(q, kc, vc, table, 40, 1.0)
    assert torch.isfinite(out).all()
    assert (out - _reference(q, kc, vc, table, 40, 1.0)).abs().max() <= 1e-5


def test_inputs_it_does_not_take():
    q, kc, vc, table = _case(8, 20, 4, 2, 64)
    assert kernel.prefill_attention(q.half(), kc.half(), vc.half(), table, 20, 0.125) is None
    assert (
        kernel.prefill_attention(
            q[..., :36], kc[..., :36].contiguous(), vc[..., :36].contiguous(), table, 20, 0.125
        )
        is None
    )  # head size not a multiple of the vector width
    with pytest.raises(ValueError, match="int64"):
        kernel.prefill_attention(q, kc, vc, table.int(), 20, 0.125)
    with pytest.raises(ValueError, match="do not fit"):
        kernel.prefill_attention(q, kc, vc, table, 40, 0.125)  # more context than the table holds


def _segments_meta(lens, cached, bs=16, seed=0):
    """A packed prefill step of several prompts (each after ``cached`` tokens) over a shared pool."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // bs) for n, c in zip(lens, cached)]
    ids = (torch.randperm(sum(need) + 2, generator=g) + 1).tolist()
    segs, slots, start = [], [], 0
    for n, c, k in zip(lens, cached, need):
        table = torch.tensor(ids[:k])
        ids = ids[k:]
        segs.append(PrefillSegment(q_start=start, q_len=n, ctx_len=c + n, block_table=table))
        pos = torch.arange(c, c + n)
        slots.append(table[pos // bs] * bs + pos % bs)
        start += n
    return segs, torch.cat(slots), sum(need) + 3


def test_paged_attention_sends_bf16_prompts_through_the_kernel(monkeypatch):
    lens, cached = [37, 5, 120], [0, 60, 0]
    segs, slots, nblocks = _segments_meta(lens, cached)
    g = torch.Generator().manual_seed(1)
    nh, nkv, hd = 14, 2, 64
    kc = torch.randn(nblocks, 16, nkv, hd, generator=g).bfloat16()
    vc = torch.randn(nblocks, 16, nkv, hd, generator=g).bfloat16()
    t = sum(lens)
    q = torch.randn(t, nh, hd, generator=g).bfloat16()
    k = torch.randn(t, nkv, hd, generator=g).bfloat16()
    v = torch.randn(t, nkv, hd, generator=g).bfloat16()

    def run(use_kernel):
        caches = kc.clone(), vc.clone()
        meta = AttentionMetadata(slot_mapping=slots, block_size=16, prefills=segs, use_cpu_kernel=use_kernel)
        return paged_attention(q, k, v, *caches, meta, hd**-0.5)

    calls = []
    original = kernel.prefill_attention
    monkeypatch.setattr(
        attention.prefill_kernel, "prefill_attention", lambda *a: calls.append(1) or original(*a)
    )
    fast, torch_path = run(True), run(False)
    assert len(calls) == len(lens)
    # the torch path rounds its softmax weights to bf16; the kernel keeps them float32
    assert (fast.float() - torch_path.float()).abs().max() <= 3e-2
    # float32 prompts keep torch's SDPA: the exact oracle the Hugging Face comparisons run on
    calls.clear()
    caches = kc.float(), vc.float()
    meta = AttentionMetadata(slot_mapping=slots, block_size=16, prefills=segs)
    paged_attention(q.float(), k.float(), v.float(), *caches, meta, hd**-0.5)
    assert calls == []


@pytest.mark.parametrize("arch", ["-mavx2 -mfma", "-mtune=generic"])  # AVX2 only (as on Zen 2); plain x86-64
def test_other_instruction_sets(arch, monkeypatch):
    monkeypatch.setenv("SIDECAR_CPU_ARCH_FLAGS", arch)
    monkeypatch.setattr(cpu_build, "_loaded", {})
    q, kc, vc, table = _case(40, 100, 8, 2, 64, seed=4)
    out = kernel.prefill_attention(q, kc, vc, table, 100, 0.125, 30)
    if arch == "-mtune=generic":  # no vector path to take: the caller's torch path runs
        assert out is None and not kernel.available()
    else:
        assert kernel.available()
        assert (out - _reference(q, kc, vc, table, 100, 0.125, 30)).abs().max() <= 2e-6


def test_bf16_prompts_without_amx(monkeypatch):
    """The build without AMX (an AVX-512 BF16 CPU such as a Zen 4 takes bf16 prompts through dot products over the
    tile layout; without AVX-512 BF16, the float32 path): the reference within bf16's tolerance, every query block
    of a task (40 heads on one KV head: 32 and 8), and a row's bits whatever the split of its prompt."""
    monkeypatch.setenv("SIDECAR_CPU_ARCH_FLAGS", "-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
    monkeypatch.setattr(cpu_build, "_loaded", {})
    assert kernel.available(), cpu_build.reason("prefill_attention")
    for rows, ctx, nh, nkv, hd in (
        (37, 37, 14, 2, 64),
        (100, 300, 8, 8, 128),
        (9, 40, 40, 1, 64),
        (300, 1100, 14, 2, 64),
    ):
        q, kc, vc, table = _case(rows, ctx, nh, nkv, hd, dtype=torch.bfloat16, seed=rows)
        out = kernel.prefill_attention(q, kc, vc, table, ctx, hd**-0.5)
        assert (out.float() - _reference(q, kc, vc, table, ctx, hd**-0.5)).abs().max() <= 2e-2
    q, kc, vc, table = _case(90, 90, 14, 2, 64, dtype=torch.bfloat16, seed=11)
    for window in (None, 10):
        whole = kernel.prefill_attention(q, kc, vc, table, 90, 0.125, window)
        parts = [
            kernel.prefill_attention(q[a:b], kc, vc, table, b, 0.125, window)
            for a, b in ((0, 13), (13, 50), (50, 90))
        ]
        assert torch.equal(whole, torch.cat(parts))
        assert (whole.float() - _reference(q, kc, vc, table, 90, 0.125, window)).abs().max() <= 2e-2
